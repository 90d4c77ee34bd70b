"""Tessera against the PyTorch tool a user would pick instead: the same training step on the
same model and weights, the same cores, in one command.

    .venv/bin/python scripts/bench_vs_torch.py              # the table (several minutes on 2 cores)
    .venv/bin/python scripts/bench_vs_torch.py --markdown   # as a Markdown table (BENCHMARKS.md)
    .venv/bin/python scripts/bench_vs_torch.py --quick      # a smoke run on a tiny model (~1 min)

Rows (a step is forward, backward, global-norm clip 1.0 and AdamW on a decoder-only
transformer: d_model 256, 4 heads, 4 layers, seq 128, batch 8, vocab 256, f32):

* 1 rank vs torch eager;
* dp=2 vs DistributedDataParallel (gloo);
* tp=2 vs torch DTensor ``parallelize_module`` (Colwise q/k/v/w1/w3, Rowwise o/w2; gloo);
* pp=2 1F1B, 8 micro-batches vs ``torch.distributed.pipelining`` Schedule1F1B (gloo);
* Llama decode (hidden 1024, 8 layers) vs transformers ``generate``, ms/token, and the
  prompt of 32 + first token (``scripts/bench_decode.py`` at 1 rank, whose figures these are).

Fairness: each row is one MPI job whose ranks run both sides in the same processes, one
thread each (BLAS, OpenMP, torch); before timing, both sides take two steps from the same
initial weights on the same batch and their losses must agree to 1e-5 (else the row stops
and says so); then the sides alternate step by step (torch, tessera, torch, ...) so a
change in the machine's load hits both, and the medians are reported.  Ratio = torch time /
tessera time: above 1 means tessera is faster.  Without torch the script says so and times
tessera only.  The machine's load is printed beside the table: compare ratios from one run.
"""
from __future__ import annotations

import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"          # one core per rank on both sides (before NumPy or torch load)

import argparse
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TRAIN_ROWS = {"1rank": 1, "dp2": 2, "tp2": 2, "pp2": 2}
LABELS = {"1rank": "1 rank vs torch eager", "dp2": "dp=2 vs DDP (gloo)",
          "tp2": "tp=2 vs torch DTensor `parallelize_module` (gloo)",
          "pp2": "pp=2 1F1B, 8 micro-batches vs `torch.distributed.pipelining` Schedule1F1B (gloo)"}
FULL = dict(vocab=256, d=256, heads=4, layers=4, seq=128, batch=8, microbatches=8)
QUICK = dict(vocab=64, d=32, heads=4, layers=2, seq=16, batch=8, microbatches=4)
DECODE = ["--hidden", "1024", "--layers", "8", "--heads", "8", "--kv-heads", "4", "--ffn", "2816",
          "--vocab", "16000", "--prompt", "32", "--new", "16", "--batches", "1"]
DECODE_QUICK = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                "--vocab", "256", "--prompt", "64", "--new", "4", "--batches", "1", "--repeats", "1"]
LR, WD, CLIP, TOL = 1e-3, 0.01, 1.0, 1e-5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, one timed repeat: a smoke run")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--rows", default="1rank,dp2,tp2,pp2,decode", help="which rows, comma-separated")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per side (after two warm-up steps)")
    p.add_argument("--no-torch", action="store_true", help="time tessera only")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)     # one row, inside its MPI job
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the torch model

def torch_model(cfg, params):
    """The same transformer in torch (nn.Linear weights are tessera's (in, out) matrices
    transposed), loaded with tessera's global initial parameters."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    def lin(w):
        m = tnn.Linear(w.shape[0], w.shape[1], bias=False)
        m.weight.data = torch.from_numpy(np.ascontiguousarray(w.T))
        return m

    class RMSNorm(tnn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = tnn.Parameter(torch.from_numpy(w.copy()))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Attn(tnn.Module):
        def __init__(self, p):
            super().__init__()
            self.q, self.k, self.v, self.o = (lin(p[n]["w"]) for n in "qkvo")

        def forward(self, x):
            b, s, _ = x.shape
            hd = cfg["d"] // cfg["heads"]
            # -1 heads: under tensor parallelism each rank holds its share of them
            q, k, v = (f(x).view(b, s, -1, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, -1))

    class MLP(tnn.Module):
        def __init__(self, p):
            super().__init__()
            self.w1, self.w3, self.w2 = lin(p["w1"]["w"]), lin(p["w3"]["w"]), lin(p["w2"]["w"])

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(tnn.Module):
        def __init__(self, p):
            super().__init__()
            self.norm1, self.attn = RMSNorm(p["norm1"]["w"]), Attn(p["attn"])
            self.norm2, self.mlp = RMSNorm(p["norm2"]["w"]), MLP(p["mlp"])

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Embed(tnn.Module):
        def __init__(self):
            super().__init__()
            self.tok = tnn.Embedding(cfg["vocab"], cfg["d"])
            self.tok.weight.data = torch.from_numpy(params["embed"]["w"].copy())
            self.pos = tnn.Parameter(torch.from_numpy(params["pos"].copy()))

        def forward(self, ids):
            return self.tok(ids) + self.pos

    class Head(tnn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.out = RMSNorm(params["norm"]["w"]), lin(params["head"]["w"])

        def forward(self, x):
            return self.out(self.norm(x))

    class LM(tnn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embed()
            self.blocks = tnn.ModuleList(Block(p) for p in params["blocks"])
            self.head = Head()

        def forward(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)
    return LM()


def torch_loss(logits, targets):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- one row (an MPI job)

def _batch(cfg):
    tok = np.random.default_rng(1).integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _clip(optim, grads, norm=None):
    try:
        return optim.clip_grad_norm(grads, CLIP, norm=norm, in_place=True)[0]
    except TypeError:                # a tessera from before in_place= (timing the base)
        return optim.clip_grad_norm(grads, CLIP, norm=norm)[0]


def tessera_side(row, cfg, comm):
    """(step() -> loss) for tessera on this row's mesh."""
    import tessera_rt as ts
    from tessera_rt import dist, nn, optim
    dist.init()
    x, y = _batch(cfg)
    kw = dict(vocab=cfg["vocab"], d_model=cfg["d"], n_heads=cfg["heads"], n_layers=cfg["layers"],
              seq_len=cfg["seq"])
    if row == "pp2":
        mesh = dist.Mesh(axes=["pp", "dp", "tp"], shape={"pp": 2, "dp": 1, "tp": 1})
    else:
        n = comm.size
        mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": n if row == "dp2" else 1, "tp": n if row == "tp2" else 1})
    model = nn.Transformer(mesh=mesh, **kw)
    state = {"params": model.init(0)}
    opt = optim.AdamW(state["params"], lr=LR, weight_decay=WD)
    if row == "pp2":
        pipe = dist.Pipeline(model, mesh=mesh, microbatches=cfg["microbatches"], schedule="1f1b")

        def step():
            loss, grads = pipe.value_and_grad(state["params"], x, y)
            grads = _clip(optim, grads, pipe.grad_norm(grads))
            state["params"] = opt.step(state["params"], grads)
            return float(loss)
        return step
    fn = ts.value_and_grad(model.loss)
    xb, yb = model.batch(x), model.batch(y)

    def step():
        loss, grads = fn(state["params"], xb, yb)
        grads = _clip(optim, grads)
        state["params"] = opt.step(state["params"], grads)
        return float(loss.full_tensor())
    return step


def torch_side(row, cfg, comm, port):
    """(step() -> loss) for the torch tool of this row, on the same initial weights."""
    import torch
    import torch.distributed as tdist

    from tessera_rt import nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = nn.Transformer(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"]).init(0)
    model = torch_model(cfg, params)
    x, y = (torch.from_numpy(a.astype(np.int64)) for a in _batch(cfg))
    rank, n = comm.rank, comm.size
    if n > 1:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=LR, weight_decay=WD, eps=1e-8, betas=(0.9, 0.999))
    if row in ("1rank", "dp2"):
        if row == "dp2":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model)
            rows = cfg["batch"] // n
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        opt = adamw(model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = torch_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            loss = loss.detach()
            if n > 1:                    # the global batch's mean loss, for the equality check
                tdist.all_reduce(loss)
                loss /= n
            return float(loss)
        return step
    if row == "tp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (n,))
        plan = {}
        for i in range(cfg["layers"]):
            plan.update({f"blocks.{i}.attn.{m}": ColwiseParallel() for m in "qkv"})
            plan.update({f"blocks.{i}.mlp.{m}": ColwiseParallel() for m in ("w1", "w3")})
            plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
            plan[f"blocks.{i}.mlp.w2"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        opt = adamw(model.parameters())
        # clip_grad_norm_ refuses a mix of DTensor and plain parameters: the norm of each kind,
        # then each kind clipped with the total (torch's own helpers)
        kinds = [[q for q in model.parameters() if isinstance(q, DTensor) == dt] for dt in (True, False)]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = torch_loss(model(x), y)
            loss.backward()
            sharded, plain = (torch.nn.utils.get_total_norm([q.grad for q in k]) for k in kinds)
            total = torch.sqrt(sharded.full_tensor() ** 2 + plain ** 2)
            for k in kinds:
                torch.nn.utils.clip_grads_with_norm_(k, CLIP, total)
            opt.step()
            return float(loss)
        return step
    # pp2: stage 0 = embedding + the first half of the blocks, stage 1 = the rest + head
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    half = cfg["layers"] // 2

    class Stage(torch.nn.Module):
        def __init__(self, first):
            super().__init__()
            self.first = first
            self.embed = model.embed if first else None
            self.blocks = torch.nn.ModuleList(model.blocks[:half] if first else model.blocks[half:])
            self.head = None if first else model.head

        def forward(self, h):
            if self.first:
                h = self.embed(h)
            for b in self.blocks:
                h = b(h)
            return h if self.first else self.head(h)
    sub = Stage(rank == 0)
    stage = PipelineStage(sub, rank, n, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=cfg["microbatches"], loss_fn=torch_loss)
    opt = adamw(sub.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        # the global norm over both stages' gradients (clip_grad_norm_ sees one stage only)
        grads = [p.grad for p in sub.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1)
        tdist.all_reduce(sq)
        scale = min(1.0, CLIP / (float(sq.sqrt()) + 1e-6))
        torch._foreach_mul_(grads, scale)
        opt.step()
        loss = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0])
        tdist.broadcast(loss, src=n - 1)
        return float(loss)
    return step


def _sleepy_barrier(comm):
    req = comm.Ibarrier()            # MPICH's Barrier busy-polls a core the peer side needs
    while not req.Test():
        time.sleep(0.0005)


def worker(args) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = QUICK if args.quick else FULL
    ts_step = tessera_side(args.worker, cfg, comm)
    th_step, note = None, None
    if not args.no_torch:
        try:
            th_step = torch_side(args.worker, cfg, comm, args.port)
        except ImportError as e:
            note = f"torch unavailable ({e}): tessera only"
    res = {"row": args.worker, "ranks": comm.size, "note": note}
    # equality: two steps from the same weights on the same batch (the second loss checks the
    # gradients, the clip and AdamW of the first)
    if th_step is not None:
        pairs = [(ts_step(), th_step()) for _ in range(2)]
        res["losses"] = pairs
        bad = [(a, b) for a, b in pairs if not abs(a - b) <= TOL * max(1.0, abs(b))]
        if bad:
            res["error"] = f"losses differ beyond {TOL}: tessera/torch {pairs}"
            if comm.rank == 0:
                print("RESULT " + json.dumps(res), flush=True)
            return 1
    else:
        ts_step(), ts_step()
    times: dict = {"tessera": [], "torch": []}
    for _ in range(args.repeats):
        for side, fn in (("torch", th_step), ("tessera", ts_step)):
            if fn is None:
                continue
            _sleepy_barrier(comm)
            t = time.perf_counter()
            fn()
            _sleepy_barrier(comm)
            times[side].append(time.perf_counter() - t)
    res.update({k: float(np.median(v)) * 1e3 if v else None for k, v in times.items()})
    if comm.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    if th_step is not None and comm.size > 1:
        import torch.distributed as tdist
        tdist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the launcher

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def run_train_row(row, args) -> dict:
    cmd = [_mpiexec(), "-n", str(TRAIN_ROWS[row]), sys.executable, str(Path(__file__).resolve()), "--worker", row,
           "--port", str(_free_port()), "--repeats", str(args.repeats)] + \
          (["--quick"] if args.quick else []) + (["--no-torch"] if args.no_torch else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"row": row, "error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-2000:]}"}


def run_decode(args) -> list[dict]:
    """scripts/bench_decode.py at 1 rank (transformers 1 thread, tessera 1 thread): its batch-1
    row gives the decode ms/token and the prompt + first token time."""
    flags = DECODE_QUICK if args.quick else DECODE + ["--repeats", str(max(3, args.repeats // 2))]
    prompt = int(flags[flags.index("--prompt") + 1])
    size = "quick size" if args.quick else "hidden 1024, 8 layers"
    label = f"Llama decode ({size}) vs transformers `generate`, ms/token"
    label_p = f"same model, prompt of {prompt} + first token"
    if args.no_torch:
        return [{"row": "decode", "label": label, "error": "needs transformers (--no-torch)"}]
    p = subprocess.run([sys.executable, str(HERE / "bench_decode.py")] + flags, capture_output=True, text=True,
                       timeout=1800)
    for line in p.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 5 and cols[0] == "1" and re.fullmatch(r"[\d.]+", cols[1]):
            tok_s, hf_tok_s, d, hd = float(cols[1]), float(cols[2]), float(cols[3]), float(cols[4])
            return [{"row": "decode", "label": label, "tessera": d, "torch": hd},
                    {"row": "prefill", "label": label_p, "tessera": prompt / tok_s * 1e3,
                     "torch": prompt / hf_tok_s * 1e3}]
    why = "transformers unavailable" if "No module named" in p.stderr else f"exit {p.returncode}"
    return [{"row": "decode", "label": label, "error": f"{why}: {p.stderr[-1500:]}"}]


def table(results, markdown: bool) -> str:
    head = ("workload", "tessera ms", "torch ms", "ratio")
    rows = []
    for r in results:
        label = r.get("label") or LABELS.get(r["row"], r["row"])
        if r.get("error"):
            rows.append((label, "error", "", r["error"].strip().splitlines()[-1][:120]))
            continue
        t, p = r.get("tessera"), r.get("torch")
        rows.append((label, f"{t:.1f}" if t else "n/a", f"{p:.1f}" if p else "n/a (no torch)",
                     f"{p / t:.2f}" if t and p else ""))
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    w = max(len(r[0]) for r in rows + [head])
    return "\n".join(f"{r[0]:<{w}}  {r[1]:>10}  {r[2]:>14}  {r[3]:>6}" for r in [head] + rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if args.worker:
        return worker(args)
    if not args.no_torch:
        try:
            import torch  # noqa: F401  (can torch be imported? find_spec would miss a broken install)
        except ImportError:
            print("bench_vs_torch: torch is not installed: timing tessera only (pip install torch for the peer)")
            args.no_torch = True
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in TRAIN_ROWS and r != "decode"]
    if unknown:
        raise SystemExit(f"bench_vs_torch: unknown rows {unknown}; pick from {list(TRAIN_ROWS) + ['decode']}")
    cfg = QUICK if args.quick else FULL
    results = []
    for row in wanted:
        results += run_decode(args) if row == "decode" else [run_train_row(row, args)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# bench_vs_torch{' --quick' if args.quick else ''}: transformer d_model {cfg['d']}, {cfg['heads']} heads, "
          f"{cfg['layers']} layers, seq {cfg['seq']}, batch {cfg['batch']}, vocab {cfg['vocab']}, f32; step = "
          f"forward, backward, clip {CLIP}, AdamW; 1 thread per rank on both sides, alternating, median of "
          f"{args.repeats}; losses checked equal to {TOL} before timing; ratio = torch / tessera; "
          f"{os.cpu_count()} cores, load average {load:.2f} at the end")
    print(table(results, args.markdown))
    for r in results:
        if r.get("losses"):
            diff = max(abs(a - b) for a, b in r["losses"])
            print(f"# {r['row']}: the same weights on both sides: losses of two steps agree (max |diff| {diff:.1e}): "
                  + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in r["losses"]))
    return 1 if any(r.get("error") for r in results if r["row"] != "decode") else 0


if __name__ == "__main__":
    sys.exit(main())
