"""The training step on one GPU against torch on the same GPU: the same model and weights,
in f32 and in bf16, gradients checked against float64 before anything is timed.

    python scripts/bench_train_gpu.py                 # the table (a GPU: a few minutes)
    python scripts/bench_train_gpu.py --json OUT.json  # also the figures as JSON (gpu_check.sh)
    python scripts/bench_train_gpu.py --quick         # a tiny model (the stand-in, the suite)

The model is scripts/bench_vs_torch.py's decoder-only transformer at GPU size: d_model
1024, 16 heads, 8 layers, seq 1024, batch 8, vocab 8192 (152M parameters).  A step is
forward, backward, global-norm clip 1.0, AdamW and the loss read on the host (the one sync).

* gradients: the same batch through a 2-layer model in f32 and in float64 on each side;
  the largest error of any parameter's gradient relative to that gradient's largest entry
  (the issue's target: 1e-4 for f32);
* f32 step: tessera f32 against torch eager f32, TF32 off on both sides;
* bf16 step: tessera with bf16 parameters and f32 masters in AdamW against torch autocast
  (bf16) with f32 parameters.

Before timing, the two sides' losses of the first step must agree (f32: 1e-4, bf16: 2e-2
relative) or the row stops and says so.  The sides then alternate step by step and the
medians are reported; ratio = torch time / tessera time (above 1: tessera faster).  Without a
GPU (the CuPy stand-in) torch runs on the CPU and the times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FULL = dict(vocab=8192, d=1024, heads=16, layers=8, seq=1024, batch=8)
QUICK = dict(vocab=128, d=128, heads=2, layers=2, seq=64, batch=2)
LR, WD, CLIP = 1e-3, 0.01, 1.0
AGREE = {"float32": 1e-4, "bf16": 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one timed repeat")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per side (after two warm-ups)")
    p.add_argument("--dtypes", default="float32,bf16", help="the step rows, comma-separated")
    p.add_argument("--no-torch", action="store_true", help="time tessera only")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _batch(cfg, seed=1):
    tok = np.random.default_rng(seed).integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _kw(cfg):
    return dict(vocab=cfg["vocab"], d_model=cfg["d"], n_heads=cfg["heads"], n_layers=cfg["layers"], seq_len=cfg["seq"])


# --------------------------------------------------------------------------- tessera

def tessera_step(cfg, dtype):
    """(step() -> loss) for tessera on the backend's device (mesh=None: plain arrays)."""
    import tessera_rt as ts
    from tessera_rt import nn, optim
    model = nn.Transformer(**_kw(cfg), dtype=dtype)
    state = {"params": model.init(0)}
    opt = optim.AdamW(state["params"], lr=LR, weight_decay=WD)
    x, y = _batch(cfg)
    xb, yb = model.batch(x), model.batch(y)
    fn = ts.value_and_grad(model.loss)

    def step():
        loss, grads = fn(state["params"], xb, yb)
        grads, _ = optim.clip_grad_norm(grads, CLIP, in_place=True)
        state["params"] = opt.step(state["params"], grads)
        return float(loss)
    return step


def tessera_grads(cfg, dtype):
    import tessera_rt as ts
    from tessera_rt import nn
    from tessera_rt.autodiff.engine import tree_flatten
    from tessera_rt.backend import get_backend
    model = nn.Transformer(**_kw(cfg), dtype=dtype)
    x, y = _batch(cfg)
    loss, grads = ts.value_and_grad(model.loss)(model.init(0), model.batch(x), model.batch(y))
    leaves, paths, _ = tree_flatten(grads)
    return float(loss), {p: get_backend().to_host(g).astype(np.float64) for p, g in zip(paths, leaves)}


# --------------------------------------------------------------------------- torch

def _torch_device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _torch_model(cfg, dtype=None):
    import torch
    sys.path.insert(0, str(HERE))
    from tessera_rt import nn

    from bench_vs_torch import torch_model
    params = nn.Transformer(**_kw(cfg)).init(0)
    model = torch_model(cfg, _to_host(params)).to(_torch_device())
    return model.to(torch.float64) if dtype == "float64" else model


def _to_host(tree):
    from tessera_rt.backend import get_backend
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_host(v) for v in tree]
    return get_backend().to_host(tree)


def torch_step(cfg, dtype):
    import torch
    import torch.nn.functional as F
    dev = _torch_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = _torch_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=1e-8, betas=(0.9, 0.999))
    x, y = (torch.from_numpy(a.astype(np.int64)).to(dev) for a in _batch(cfg))
    autocast = dtype == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return float(loss)
    return step


def torch_grads(cfg, dtype):
    import torch
    import torch.nn.functional as F
    dev = _torch_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _torch_model(cfg, dtype)
    x, y = (torch.from_numpy(a.astype(np.int64)).to(dev) for a in _batch(cfg))
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().cpu().double().numpy() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the rows

def worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest error of a gradient relative to that gradient's largest entry, and where."""
    errs = {k: float(np.max(np.abs(got[k] - want[k])) / max(float(np.max(np.abs(want[k]))), 1e-30)) for k in want}
    k = max(errs, key=errs.get)
    return errs[k], k


def grad_rows(cfg, use_torch: bool) -> list[dict]:
    small = dict(cfg, layers=2)
    rows = []
    sides = [("tessera", tessera_grads)] + ([("torch", torch_grads)] if use_torch else [])
    for name, fn in sides:
        l64, g64 = fn(small, "float64")
        l32, g32 = fn(small, "float32")
        err, where = worst(g32, g64)
        rows.append(dict(row="f32 gradients vs float64 (2 layers)", side=name, value=err, where=where,
                         loss_rel=abs(l32 - l64) / abs(l64), ok=err <= 1e-4))
    return rows


def step_row(cfg, dtype, repeats: int, use_torch: bool) -> dict:
    ts_step = tessera_step(cfg, dtype)
    th_step = torch_step(cfg, dtype) if use_torch else None
    first = ts_step()
    res = dict(row=f"{dtype} step", dtype=dtype)
    if th_step is not None:
        other = th_step()
        rel = abs(first - other) / abs(other)
        res["first_loss"] = dict(tessera=first, torch=other, rel=rel)
        if rel > AGREE[dtype]:
            res["error"] = f"first-step losses differ: tessera {first:.6f}, torch {other:.6f} (rel {rel:.1e})"
            return res
        th_step()
    ts_step()
    times = {"tessera": [], "torch": []}
    for _ in range(repeats):
        for name, fn in (("torch", th_step), ("tessera", ts_step)):
            if fn is None:
                continue
            t = time.perf_counter()
            fn()                                   # the loss on the host: the step is done
            times[name].append(time.perf_counter() - t)
    res["tessera_ms"] = float(np.median(times["tessera"])) * 1e3
    if times["torch"]:
        res["torch_ms"] = float(np.median(times["torch"])) * 1e3
        res["ratio"] = res["torch_ms"] / res["tessera_ms"]
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    from tessera_rt.backend import get_backend
    be = get_backend()
    emulated = bool(getattr(be.xp, "__tessera_standin__", False)) or not be.is_gpu
    cfg = QUICK if args.quick else FULL
    repeats = 1 if args.quick else args.repeats
    use_torch = not args.no_torch
    if use_torch:
        try:
            import torch  # noqa: F401  (can torch be imported? find_spec would miss a broken install)
        except ImportError:
            print("torch is not installed: timing tessera only")
            use_torch = False
    where = ("the CuPy stand-in (no GPU): times say nothing about a GPU" if emulated else
             be.xp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    print(f"bench_train_gpu on {where}; model d_model {cfg['d']}, {cfg['heads']} heads, {cfg['layers']} layers, "
          f"seq {cfg['seq']}, batch {cfg['batch']}, vocab {cfg['vocab']}", flush=True)
    out = dict(where=where, emulated=emulated, config=cfg, grads=grad_rows(cfg, use_torch), steps=[])
    for g in out["grads"]:
        print(f"f32 gradients vs float64, {g['side']}: max relative error {g['value']:.1e} ({g['where']}), "
              f"loss rel {g['loss_rel']:.1e} {'ok' if g['ok'] else 'ABOVE 1e-4'}", flush=True)
    for dtype in args.dtypes.split(","):
        r = step_row(cfg, dtype, repeats, use_torch)
        out["steps"].append(r)
        if "error" in r:
            print(f"{dtype} step: {r['error']}", flush=True)
        else:
            peer = f", torch {r['torch_ms']:.1f} ms, ratio {r['ratio']:.2f}" if "ratio" in r else ""
            print(f"{dtype} step: tessera {r['tessera_ms']:.1f} ms{peer}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = [g for g in out["grads"] if not g["ok"] and g["side"] == "tessera"] + [r for r in out["steps"] if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
