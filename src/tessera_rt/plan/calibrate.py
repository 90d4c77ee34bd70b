"""Calibration: measure this machine with the project's own kernels and collectives, and
save the result as the `local` cluster (``tessera-plan --calibrate``).

Inside an MPI job (every rank calls the same functions at once, so the numbers include
the ranks' contention for the cores):

* ``measure_compute()``: FLOP/s of ``op.matmul`` at the GEMM shapes of a small
  transformer, of ``op.flash_attention``, bytes/s of elementwise ``op.add``, and the fixed
  cost of one op on a DTensor (the eager dispatch);
* ``measure_collectives(mesh, axes)``: time per call of ``dist.all_reduce`` over each
  axis at sizes from 64 B to 1 MiB, fitted to ``alpha + beta x size`` (least squares on
  relative error), beside the raw mpi4py ``Allreduce`` on the same buffers (the peer).

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

__all__ = ["measure_compute", "measure_collectives", "fit_alpha_beta", "calibrate", "cluster_from", "SIZES"]

SIZES = (64, 4096, 65536, 262144, 1 << 20)


def _mean_wall(fn, reps: int) -> float:
    """Mean wall time per call: a step pays every call's delay, not the median's."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


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


def measure_compute(reps: int = 10, mesh=None) -> dict:
    """Rates on this rank, in CPU time: {"gemm", "gemm_bwd", "attention", "attention_bwd":
    FLOP/s, "hbm_bw": bytes/s of elementwise ops, "op_overhead_s": one traced op on a
    DTensor}, and "share": the share of a core it gets (measure_share).
    The backward rates are measured as the backward runs them: dgrad ``g @ W.T`` and wgrad
    ``X.T @ g`` on transposed views (NumPy copies them), attention through ts.vjp."""
    from .. import op
    from ..autodiff import value_and_grad
    from ..dist import dtensor
    rng = np.random.default_rng(0)
    f32 = np.float32
    shapes = [(512, 64, 64), (512, 64, 256), (512, 256, 64), (512, 64, 111)]
    share = measure_share()
    flops = t_f = t_b = 0.0
    for m, k, n in shapes:
        a, b = rng.standard_normal((m, k)).astype(f32), rng.standard_normal((k, n)).astype(f32)
        g = rng.standard_normal((m, n)).astype(f32)
        t_f += _cpu_time(lambda: op.matmul(a, b), reps)
        t_b += _cpu_time(lambda: (op.matmul(g, b.T), op.matmul(a.T, g)), reps)
        flops += 2 * m * k * n
    q, k_, v = (rng.standard_normal((8, 4, 64, 16)).astype(f32) for _ in range(3))
    att = lambda q, k, v: op.flash_attention(q, k, v, causal=True)          # noqa: E731
    t_att = _cpu_time(lambda: att(q, k_, v), reps)
    both = value_and_grad(lambda q, k, v: op.sum(att(q, k, v)), argnums=(0, 1, 2))
    t_att_b = max(_cpu_time(lambda: both(q, k_, v), reps) - t_att, 1e-9)
    att_flops = 4 * 8 * 4 * 64 * 64 * 16 * 0.5
    x, y = rng.standard_normal((512, 64)).astype(f32), rng.standard_normal((512, 64)).astype(f32)
    t_add = _cpu_time(lambda: op.add(x, y), reps * 5)
    out = {"gemm": flops / t_f, "gemm_bwd": 2 * flops / t_b, "attention": att_flops / t_att,
           "attention_bwd": 2 * att_flops / t_att_b, "hbm_bw": 3 * x.nbytes / t_add, "share": share}
    if mesh is not None:
        # K tiny ops differentiated: K forward + about K backward ops (one each), all traced
        tiny = dtensor.distribute(np.ones((2, 2), f32), layout=None, mesh=mesh)
        k_ops = 40

        def chain(z):
            for i in range(k_ops // 2):
                z = op.exp(op.mul(z, 0.01))
            return op.sum(z)
        t = _cpu_time(lambda: value_and_grad(chain)(tiny), reps)
        out["op_overhead_s"] = t / (2 * k_ops + 2)
    out["hbm_bw"] = _elementwise_bw(out, reps)
    out["share"] = (share + measure_share()) / 2
    return out


def _elementwise_bw(rates: dict, reps: int) -> float:
    """The effective bandwidth of everything in a block that is not a GEMM, attention or a
    fixed per-op cost (norms, activations, residual adds, reshapes, their backward, and the
    temporaries NumPy allocates for them): one nn.TransformerBlock (d 64, 4 heads, hidden
    256, 4 x 64 tokens) is timed forward + backward on plain arrays, the time the model
    gives the GEMMs, attention and op costs is taken off, and the rest is divided by the
    model's elementwise bytes.  Falls back to op.add's bandwidth if the rest is negative."""
    import dataclasses

    from .. import nn, op
    from ..autodiff import value_and_grad
    from .memory import Layout
    from .specs import MODELS, Cluster
    from .timing import _mlp_ops, _roofline, compute_ops
    block = nn.TransformerBlock(64, 4, 256)
    params = block.init(0)
    x = np.random.default_rng(2).standard_normal((4, 64, 64)).astype(np.float32)
    t = _cpu_time(lambda: value_and_grad(lambda p: op.sum(block(p, x)))(params), reps)
    ref = dataclasses.replace(MODELS["char"], n_layers=1)
    probe = Cluster("probe", n_gpus=1, hbm_bytes=1.0, hbm_bw=1e30, flops={"f32": rates["gemm"]}, link_bw=1.0,
                    alpha=0.0, topology="host", op_rates={k: rates[k] for k in ("gemm", "gemm_bwd", "attention",
                                                                                 "attention_bwd")})
    ops = compute_ops(ref, Layout(), 256, 64, causal=0.5) + _mlp_ops(ref, Layout(), 256, False)
    math_ops = [o for o in ops if o[0] != "elementwise"]
    modeled = (_roofline(probe, math_ops, "f32", 1.0) + _roofline(probe, math_ops, "f32", 1.0, bwd=True)
               + (ref.ops_per_layer + ref.bwd_ops_per_layer) * rates.get("op_overhead_s", 0.0))
    elem_bytes = 3 * sum(o[2] for o in ops if o[0] == "elementwise")     # forward + twice for the backward
    rest = t - modeled
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
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            buf = np.empty_like(x)
            world.Barrier()
            mine.append(_mean_wall(lambda: dist.all_reduce(x, axis=axis, mesh=mesh), reps))
            world.Barrier()
            peer.append(_mean_wall(lambda: raw.Allreduce(x, buf), reps))
        mine, peer = np.array(mine), np.array(peer)
        world.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        world.Allreduce(MPI.IN_PLACE, peer, op=MPI.MAX)
        key = str(n)
        fits = [fit_alpha_beta(sizes, mine)]
        if key in out["all_reduce"]:                      # two axes of the same size: average
            fits.append(tuple(out["all_reduce"][key]))
        out["all_reduce"][key] = [float(np.mean([f[0] for f in fits])), float(np.mean([f[1] for f in fits]))]
        out["peer"][key] = list(fit_alpha_beta(sizes, peer))
        out["points"][f"{axis}:{n}"] = {"sizes": list(sizes), "tessera_s": mine.tolist(), "peer_s": peer.tolist()}
    return out


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
    from .specs import GB, Cluster
    ar = collectives.get("all_reduce", {})
    alpha = float(np.median([v[0] for v in ar.values()])) if ar else 30e-6
    beta = float(np.median([v[1] for v in ar.values()])) if ar else 1 / (2 * GB)
    return Cluster(name, n_gpus=n_gpus, hbm_bytes=24 * GB, hbm_bw=compute["hbm_bw"], share=compute.get("share", 1.0),
                   flops={"f32": compute["gemm"], "bf16": compute["gemm"] / 8},
                   link_bw=1.0 / beta if beta > 0 else 10 * GB, alpha=alpha, topology="host",
                   op_overhead_s=compute.get("op_overhead_s", 20e-6), cores=cores, overlap=0.0, dp_overlap=1.0,
                   bw_efficiency=1.0, op_rates={k: compute[k] for k in ("gemm", "gemm_bwd", "attention", "attention_bwd")
                             if k in compute},
                   measured={"all_reduce": ar}, calibrated=True,
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
    from .specs import local_cluster_path
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
    d["measured"]["peer_all_reduce"] = peer
    target = Path(path) if path else local_cluster_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(d, indent=1))
    return str(target)


if __name__ == "__main__":
    _worker(sys.argv[1])
