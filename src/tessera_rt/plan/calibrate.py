"""Calibration: measure this machine with the project's own kernels and collectives, and
save the result as the `local` cluster (``tessera-plan --calibrate``).

Inside an MPI job (every rank calls the same functions at once, so the numbers include
the ranks' contention for the cores):

* ``measure_compute()``: FLOP/s of ``op.matmul`` at the GEMM shapes of a small
  transformer, of ``op.flash_attention``, the elementwise bytes/s of a transformer block,
  and, given a mesh, the fixed cost per op of a step's op mix on DTensors
  (``measure_op_cost``), the share of a core each rank gets (``measure_share``) and the
  share it gets when the ranks meet every few ms (``measure_lockstep_share``);
* ``measure_collectives(mesh, axes)``: time per call of ``dist.all_reduce`` over each
  axis at sizes from 64 B to 1 MiB, fitted to ``alpha + beta x size`` (least squares on
  relative error), beside the raw mpi4py ``Allreduce`` on the same buffers (the peer).
  Each call is timed as a step meets it: after a run of ops (``GAP_OPS``), so the ranks
  arrive skewed as they do in a step, and on CPU ranks sharing cores, after the scheduler
  has moved them; a tight loop of collectives keeps the ranks in lockstep and measured
  2-3x less (20 us against 45-65 us per 256 B all_reduce at 2 ranks, a loaded VM).

``calibrate(ranks)`` launches one job per group size with ``tessera-run`` and writes the
`local` cluster JSON (``plan.local_cluster_path()``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["measure_compute", "measure_collectives", "measure_op_cost", "measure_lockstep_share", "fit_alpha_beta", "calibrate", "cluster_from", "SIZES", "timed_rounds", "elementwise_bw"]

SIZES = (64, 4096, 65536, 262144, 1 << 20)


GAP_OPS = 30          # ops between two blocking collectives of train.py's step (~650 ops, ~20 collectives)


def _trimmed_mean(x, cut: float = 0.1) -> float:
    """Mean without the top and bottom ``cut`` (a step pays every call's delay, so a mean,
    not a median; trimmed so that one preemption on a shared machine does not set it)."""
    x = np.sort(np.asarray(x, float))
    k = int(len(x) * cut)
    return float(x[k:len(x) - k].mean()) if len(x) > 2 * k else float(x.mean())


def _after_gap(fn, gap, reps: int) -> float:
    """Wall time per call of ``fn`` when each call follows ``gap()`` (ops, as in a step)."""
    gap()
    fn()
    ts = []
    for _ in range(reps):
        gap()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return _trimmed_mean(ts)


def _cpu_time(fn, reps: int) -> float:
    """CPU seconds per call of this process: the work, without the time the scheduler gave
    to other processes (the share is measured apart, by measure_share)."""
    fn()
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def measure_share(seconds: float = 0.3) -> float:
    """The share of a core this rank gets now: CPU time / wall time of a busy loop (1.0 on
    an idle machine, below 1 when other processes compete for the cores)."""
    a = np.random.default_rng(1).standard_normal((256, 256))
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < seconds:
        a = np.tanh(a @ a * 1e-3)
    return min(1.0, (time.process_time() - c0) / (time.perf_counter() - w0))


def measure_lockstep_share(seconds: float = 0.3, segment_s: float = 2e-3) -> float:
    """The share of a core each rank's work gets when every rank must meet the others every
    ``segment_s`` of CPU work (train.py's step: ~20 blocking collectives in ~40 ms of work):
    work CPU seconds / wall seconds of [busy work; a 4-byte Allreduce over the world].  A
    rank that waits holds its core (MPI spins), so a rank that was descheduled stalls every
    rank at the next meeting: on a loaded 2-core VM with 2 ranks this measured 0.40-0.45
    where a free-running busy loop (measure_share) measured 0.65; with more ranks than cores
    it prices the oversubscription as the ranks really share the cores.  Collective on the
    world; 1.0-ish on an idle machine with a core per rank."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    a = np.random.default_rng(1).standard_normal((64, 64))
    c0 = time.process_time()
    iters = 0
    while time.process_time() - c0 < 0.02:            # size one segment of work
        a = np.tanh(a @ a * 1e-3)
        iters += 1
    per_seg = max(1, int(iters * segment_s / (time.process_time() - c0)))
    one, buf = np.ones(1, np.float32), np.empty(1, np.float32)
    stop = np.zeros(1, np.int32)
    world.Barrier()
    w0, work = time.perf_counter(), 0.0
    while not stop[0]:
        c0 = time.process_time()
        for _ in range(per_seg):
            a = np.tanh(a @ a * 1e-3)
        work += time.process_time() - c0
        world.Allreduce(one, buf)
        stop[0] = time.perf_counter() - w0 > seconds
        world.Bcast(stop, root=0)                     # every rank stops after the same meeting
    share = work / (time.perf_counter() - w0)
    return float(min(1.0, world.allreduce(share, op=MPI.SUM) / world.Get_size()))


def timed_rounds(fns: dict, rounds: int, calls: int = 2) -> dict:
    """{name: [CPU seconds per call, one per round]}: every function timed once per round, in
    turn, so that quantities derived from several of them (a difference, a rate and the
    time it models) come from the same state of the machine.  This VM's cores change speed
    by ~1.8x over seconds; measured apart, one rate caught in a slow phase set another's
    residual off by up to 8x."""
    out: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k].append(_cpu_time(fn, calls))
    return out


def measure_compute(reps: int = 10, mesh=None) -> dict:
    """Rates on this rank, in CPU time: {"gemm", "gemm_bwd", "attention", "attention_bwd":
    FLOP/s, "hbm_bw": bytes/s of elementwise ops, "op_overhead_s": one traced op on a
    DTensor}, and "share": the share of a core it gets (measure_share).  The backward rates
    are measured as the backward runs them: dgrad ``g @ W.T`` and wgrad ``X.T @ g`` on
    transposed views (NumPy copies them), attention through ts.vjp.  The elementwise
    bandwidth is what a block's time leaves (``elementwise_bw``); all of it is timed in
    rounds (``timed_rounds``) and each round's rates price that round's block."""
    from .. import op
    from ..autodiff import value_and_grad
    rng = np.random.default_rng(0)
    f32 = np.float32
    shapes = [(512, 64, 64), (512, 64, 256), (512, 256, 64), (512, 64, 111)]
    share = measure_share()
    mats = []
    for m, k, n in shapes:
        a, b = rng.standard_normal((m, k)).astype(f32), rng.standard_normal((k, n)).astype(f32)
        mats.append((a, b, rng.standard_normal((m, n)).astype(f32)))
    flops = sum(2 * m * k * n for m, k, n in shapes)
    q, k_, v = (rng.standard_normal((8, 4, 64, 16)).astype(f32) for _ in range(3))
    att = lambda q, k, v: op.flash_attention(q, k, v, causal=True)
    both = value_and_grad(lambda q, k, v: op.sum(att(q, k, v)), argnums=(0, 1, 2))
    att_flops = 4 * 8 * 4 * 64 * 64 * 16 * 0.5
    x, y = rng.standard_normal((512, 64)).astype(f32), rng.standard_normal((512, 64)).astype(f32)
    ref, ref_params, _ = _block_step(mesh, 64, 256, (4, 64))
    toy, toy_params, _ = _block_step(mesh, 16, 32, (2, 8))
    t = timed_rounds({"mm": lambda: [op.matmul(a, b) for a, b, _ in mats],
                 "mm_bwd": lambda: [(op.matmul(g, b.T), op.matmul(a.T, g)) for a, b, g in mats],
                 "att": lambda: att(q, k_, v), "att_both": lambda: both(q, k_, v),
                 "add": lambda: [op.add(x, y) for _ in range(5)],
                 "ref": lambda: ref(ref_params), "toy": lambda: toy(toy_params)}, max(reps, 5))
    per_round = []
    for r in range(len(t["mm"])):
        rates = {"gemm": flops / t["mm"][r], "gemm_bwd": 2 * flops / t["mm_bwd"][r],
                 "attention": att_flops / t["att"][r],
                 "attention_bwd": 2 * att_flops / max(t["att_both"][r] - t["att"][r], 1e-9),
                 "hbm_bw": 5 * 3 * x.nbytes / t["add"][r]}
        rates["elementwise"] = elementwise_bw(rates, t["ref"][r] - t["toy"][r])
        per_round.append(rates)
    out = {k: float(np.median([pr[k] for pr in per_round])) for k in per_round[0]}
    out["hbm_bw"] = out.pop("elementwise")
    if mesh is not None:
        out["op_overhead_s"], _ = measure_op_cost(mesh, reps)
    out["share"] = (share + measure_share()) / 2
    if mesh is not None:
        out["lockstep_share"] = measure_lockstep_share()
    return out


def _block_step(mesh, d: int, hidden: int, tokens: tuple):
    """(step, params, ops): forward + backward of one nn.TransformerBlock (4 heads) on
    DTensors replicated over ``mesh`` (plain arrays without one), and its op count (the
    profiler's: forward, backward and the tape's own ops)."""
    from .. import nn, op
    from ..autodiff import value_and_grad
    from ..dist.tensor import dtensor
    from .measure import profiled_counts
    block = nn.TransformerBlock(d, 4, hidden, mesh=mesh, tp_axis="__replicated__")
    params = block.init(0)
    x = np.random.default_rng(3).standard_normal((*tokens, d)).astype(np.float32)
    if mesh is not None:
        x = dtensor.distribute(x, layout=None, mesh=mesh)
    step = value_and_grad(lambda p: op.sum(block(p, x)))
    step(params)
    return step, params, profiled_counts(step, params)[0] if mesh is not None else 0


def _median_cpu(fn, reps: int) -> float:
    return float(np.median([_cpu_time(fn, max(2, reps // 3)) for _ in range(3)]))


def measure_op_cost(mesh, reps: int = 10) -> tuple[float, float]:
    """(CPU seconds per op of a step's op mix without its arithmetic, CPU seconds of the toy
    block): one nn.TransformerBlock at toy size (d 16, hidden 32, 2 x 8 tokens: its GEMMs,
    attention and bytes cost under 1% of its time) forward + backward on DTensors
    replicated over ``mesh``, over the ops the profiler counts in it.  A chain of one cheap
    op (mul, exp on 2x2) measured 7 us an op; the block's mix of reshapes, GEMMs, norms and
    softmax costs 15-20 us, and that is what a step pays."""
    step, params, n_ops = _block_step(mesh, 16, 32, (2, 8))
    t = _median_cpu(lambda: step(params), reps)
    return t / max(n_ops, 1), t


def elementwise_bw(rates: dict, block_s: float) -> float:
    """The effective bandwidth of everything in a block that is not a GEMM, attention or a
    fixed per-op cost (norms, activations, residual adds, reshapes, their backward, and the
    temporaries NumPy allocates for them), from ``block_s``: the CPU time of one
    nn.TransformerBlock (d 64, 4 heads, hidden 256, 4 x 64 tokens) forward + backward less
    that of the same block at toy size (the same ops: their fixed cost cancels, which a
    residual after a modeled per-op cost did not: it swung the rate 10x between runs).  The
    model's GEMM and attention time at ``rates`` are taken off and the rest is divided by the
    model's elementwise bytes; op.add's bandwidth (``rates["hbm_bw"]``) if nothing is left."""
    import dataclasses

    from .cluster import Cluster
    from .memory import ParallelConfig
    from .specs import MODELS
    from .timing import _mlp_ops, _roofline, compute_ops
    ref = dataclasses.replace(MODELS["char"], n_layers=1)
    probe = Cluster("probe", n_gpus=1, hbm_bytes=1.0, hbm_bw=1e30, flops={"f32": rates["gemm"]}, link_bw=1.0,
                    alpha=0.0, topology="host", op_rates={k: rates[k] for k in ("gemm", "gemm_bwd", "attention",
                                                                                 "attention_bwd")})
    ops = compute_ops(ref, ParallelConfig(), 256, 64, causal=0.5) + _mlp_ops(ref, ParallelConfig(), 256, False)
    math_ops = [o for o in ops if o[0] != "elementwise"]
    modeled = _roofline(probe, math_ops, "f32", 1.0) + _roofline(probe, math_ops, "f32", 1.0, bwd=True)
    elem_bytes = 3 * sum(o[2] for o in ops if o[0] == "elementwise")     # forward + twice for the backward
    rest = block_s - modeled
    return elem_bytes / rest if rest > 0 else rates["hbm_bw"]


def fit_alpha_beta(sizes, times) -> tuple[float, float]:
    """alpha + beta x size through the points, least squares on relative error, both >= 0."""
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    a_mat = np.stack([1.0 / t, s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)
    if beta < 0:
        alpha, beta = float(np.median(t)), 0.0
    if alpha < 0:
        alpha, beta = 0.0, float(np.median(t / s))
    return float(alpha), float(beta)


def measure_collectives(mesh, axes, reps: int = 20, sizes=SIZES) -> dict:
    """{"all_reduce": {n: [alpha, beta]}, "peer": {n: [alpha, beta]}, "points": ...} for each
    axis (a name or a tuple of names) of ``mesh``; the slowest rank's median per call."""
    from mpi4py import MPI

    from .. import dist
    out: dict = {"all_reduce": {}, "peer": {}, "points": {}}
    world = MPI.COMM_WORLD
    for axis in axes:
        n = int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
        if n < 2:
            continue
        raw = _raw_comm(mesh, axis)
        mine, peer = [], []
        gap = _op_chain(mesh, GAP_OPS)
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            buf = np.empty_like(x)
            world.Barrier()
            mine.append(_after_gap(lambda: dist.all_reduce(x, axis=axis, mesh=mesh), gap, reps))
            world.Barrier()
            peer.append(_after_gap(lambda: raw.Allreduce(x, buf), gap, reps))
        mine_s, peer_s = np.array(mine), np.array(peer)
        world.Allreduce(MPI.IN_PLACE, mine_s, op=MPI.MAX)
        world.Allreduce(MPI.IN_PLACE, peer_s, op=MPI.MAX)
        key = str(n)
        fits = [fit_alpha_beta(sizes, mine_s)]
        if key in out["all_reduce"]:                      # two axes of the same size: average
            fits.append(tuple(out["all_reduce"][key]))
        out["all_reduce"][key] = [float(np.mean([f[0] for f in fits])), float(np.mean([f[1] for f in fits]))]
        out["peer"][key] = list(fit_alpha_beta(sizes, peer_s))
        out["points"][f"{axis}:{n}"] = {"sizes": list(sizes), "tessera_s": mine_s.tolist(), "peer_s": peer_s.tolist()}
    return out


def _op_chain(mesh, k: int):
    """k tiny ops on a replicated DTensor: the work a step does between two collectives."""
    from .. import op
    from ..dist.tensor import dtensor
    z = dtensor.distribute(np.ones((2, 2), np.float32), layout=None, mesh=mesh)

    def run():
        y = z
        for _ in range(k):
            y = op.mul(y, 1.0)
        return y
    return run


def _raw_comm(mesh, axis):
    """The mpi4py communicator of this rank's group along ``axis`` (the peer's handle)."""
    from mpi4py import MPI
    names = axis if isinstance(axis, tuple) else (axis,)
    coords = mesh.coords
    color = 0
    for a in mesh.axes:                       # ranks that agree on every other axis share a group
        if a not in names:
            color = color * mesh.shape[a] + coords[a]
    return MPI.COMM_WORLD.Split(color, MPI.COMM_WORLD.Get_rank())


def cluster_from(compute: dict, collectives: dict, *, n_gpus: int, cores: int, name: str = "local"):
    """A Cluster from measured rates (see the module doc)."""
    from .cluster import GB, Cluster
    ar = collectives.get("all_reduce", {})
    # per algorithm step and per link: a ring all_reduce over n takes 2(n-1) steps and moves
    # 2(n-1)/n of its bytes over each link, so a send (pipeline p2p, priced analytically)
    # costs one step, not a whole all_reduce (which over-priced pp=2's sends 2x)
    alpha = float(np.median([v[0] / (2 * (int(n) - 1)) for n, v in ar.items()])) if ar else 30e-6
    beta = float(np.median([v[1] * int(n) / (2 * (int(n) - 1)) for n, v in ar.items()])) if ar else 1 / (2 * GB)
    return Cluster(name, n_gpus=n_gpus, devices_per_node=n_gpus, hbm_bytes=24 * GB, hbm_bw=compute["hbm_bw"], share=compute.get("share", 1.0),
                   flops={"f32": compute["gemm"], "bf16": compute["gemm"] / 8},
                   link_bw=1.0 / beta if beta > 0 else 10 * GB, alpha=alpha, topology="host",
                   op_overhead_s=compute.get("op_overhead_s", 20e-6), cores=cores, overlap=0.0, dp_overlap=1.0,
                   bw_efficiency=1.0, op_rates={k: compute[k] for k in ("gemm", "gemm_bwd", "attention", "attention_bwd")
                             if k in compute},
                   measured={"all_reduce": ar, "lockstep_share": {str(n_gpus): compute["lockstep_share"]}
                             if "lockstep_share" in compute else {}}, calibrated=True,
                   notes=f"measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores")


def _worker(out_path: str) -> None:
    from .. import dist
    w = dist.init()
    mesh = dist.Mesh(axes=["x"], shape={"x": w.size})
    comp = measure_compute(mesh=mesh)
    coll = measure_collectives(mesh, ["x"])
    if w.rank == 0:
        Path(out_path).write_text(json.dumps({"compute": comp, "collectives": coll, "n": w.size}))


def calibrate(ranks=(2, 3, 4), path: str | None = None) -> str:
    """Measure one job per group size in ``ranks`` (and the compute rates on one rank) and
    save the `local` cluster; returns the path written."""
    from .cluster import local_cluster_path
    exe = Path(sys.executable).parent / "tessera-run"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(set([1, *ranks])):
            out = os.path.join(tmp, f"cal{n}.json")
            cmd = [str(exe), "-n", str(n), "-m", "tessera_rt.plan.calibrate", out]
            # one BLAS/OpenMP thread per rank, as scripts/train.py runs (CPU time of spinning
            # helper threads would otherwise count as work)
            env = dict(os.environ, **{v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                        "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")})
            subprocess.run(cmd, check=True, timeout=600, env=env)
            results.append(json.loads(Path(out).read_text()))
    one = next(r for r in results if r["n"] == 1)
    ar, peer = {}, {}
    for r in results:
        ar.update(r["collectives"]["all_reduce"])
        peer.update(r["collectives"]["peer"])
    c = cluster_from(one["compute"], {"all_reduce": ar}, n_gpus=max(ranks), cores=os.cpu_count() or 1)
    d = c.to_dict()
    d["measured"]["lockstep_share"] = {str(r["n"]): r["compute"]["lockstep_share"] for r in results}
    d["measured"]["peer_all_reduce"] = peer
    target = Path(path) if path else local_cluster_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(d, indent=1))
    return str(target)


if __name__ == "__main__":
    _worker(sys.argv[1])
