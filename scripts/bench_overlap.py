"""Overlap of collectives with compute, beside the in-order streams in the same run.

    tessera-run -n 2 scripts/bench_overlap.py [--mib 4] [--reps 15] [--steps 4] [--caps 0,default,0.25]

1. A 4 MiB all_reduce (async, on the ``tp_collective`` stream) issued just before a matmul
   sized to take as long as the all_reduce alone.  Reported: the all_reduce alone, the matmul
   alone, the two together (issue, matmul, wait) and ``step / max(alone)``: 1.0 is perfect
   overlap, 2.0 none (the issue asks for <= 1.2).  Times are the slowest rank's, median over
   repetitions.
2. The data-parallel training step of scripts/train.py (its model and batches, dp = world
   size, tp = 1): the profiler's overlap ratio (the gradient all-reduces issued during the
   backward, counted over the time the worker really ran them, under the DTensor ops' own
   intervals: the autodiff engine's Python between ops is not compute to it), the hidden
   fraction (1 - the time the caller spent in ``wait()`` / the collectives' time: what the
   step did not wait for), both min over ranks, and the step time.

   Each step is run with one all-reduce per parameter (cap 0, the path before gradient
   buckets) and with gradient buckets (``autodiff.buckets``; the caps given by ``--caps``,
   ``default`` being the default rule's); the table also gives the all-reduces per step.
3. The physics on CPU ranks: the CPU time each rank spends in the all_reduce and in the
   matmul alone (process CPU seconds / wall seconds: 1.0 = a core busy throughout).  A CPU
   all_reduce is shared-memory copies and the sum, done by the ranks' own cores; when the
   ranks already use every core for the matmul, the step cannot be shorter than the total CPU
   work / cores, whatever the streams do.  The bench prints that floor for section 1, and
   measures on rank 0 alone (the other ranks sleeping, so a core is free) a reduce of the
   matmul's length (z = x + y over the all_reduce's bytes, repeated) on a worker stream under
   the matmul: what a free core per worker gives.

Each is measured twice in one job: with worker-thread CPU streams (``TESSERA_CPU_STREAMS=threads``)
and with the in-order streams (the CPU default), each the other's peer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import backend, dist, graph, profiler, runtime as rt
from tessera_rt.autodiff.buckets import grad_bucket_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as train_script  # scripts/train.py: its model, data and batches


def slowest(w, seconds: float) -> float:
    return w.mpi.allreduce(seconds, op=MPI.MAX)


def timed(w, fn, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn()``, ranks started together."""
    out = []
    for _ in range(reps):
        w.mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        out.append(slowest(w, time.perf_counter() - t0))
    return statistics.median(out)


def matmul_size(w, target: float) -> int:
    """The square float32 matmul size whose time is closest to ``target`` (same on all ranks)."""
    n, best = 64, 64
    while n <= 4096:
        a = np.ones((n, n), np.float32)
        t = timed(w, lambda: a @ a, 3)
        best = n
        if t >= target:
            break
        n = int(n * 1.08) + 1               # ~1.26x the time per step: sizes within 13% of the target
    return best


def micro(w, mib: int, reps: int, n: int | None) -> dict:
    """``n``: the matmul size (None: sized here to the all_reduce's time)."""
    x = np.ones((mib << 20) // 4, np.float32)
    ar = lambda: dist.all_reduce(x, async_op=True).wait()
    ar()
    t_ar, c_ar = timed_cpu(w, ar, reps)
    n = n or matmul_size(w, t_ar)
    a = np.ones((n, n), np.float32)
    t_mm, c_mm = timed_cpu(w, lambda: a @ a, reps)

    def both():
        work = dist.all_reduce(x, async_op=True)
        a @ a
        work.wait()
    both()
    t_both = timed(w, both, reps)
    longer = max(t_ar, t_mm)
    # The step cannot beat every rank's CPU work spread over every core.  In CPU seconds (what
    # each needs, whatever else loads the machine): alone, each takes its CPU seconds of a core.
    s_ar, s_mm = c_ar * t_ar, c_mm * t_mm
    floor = max(1.0, w.size * (s_ar + s_mm) / (os.cpu_count() or 1) / max(s_ar, s_mm))
    return {"n": n, "ar": t_ar, "mm": t_mm, "both": t_both, "ratio": t_both / longer,
            "cpu_ar": c_ar, "cpu_mm": c_mm, "floor": floor}


def timed_cpu(w, fn, reps: int) -> tuple[float, float]:
    """(median slowest-rank wall time, mean over ranks of CPU seconds / wall seconds) of ``fn()``:
    the CPU time is the whole process's (every thread: the caller, a stream's worker, MPI's)."""
    walls, loads = [], []
    for _ in range(reps):
        w.mpi.Barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        walls.append(slowest(w, t))
        loads.append(w.mpi.allreduce(c / t, op=MPI.SUM) / w.size)
    return statistics.median(walls), statistics.median(loads)


def free_core(w, n: int, mib: int, reps: int) -> dict | None:
    """Rank 0 alone (the others sleep, leaving a core free): a reduce of ``mib`` MiB (z = x + y,
    repeated to last about as long as the matmul: the arithmetic and memory traffic of an
    all_reduce's sum, with no peer) on the ``io`` worker stream, under the ``n``-sized matmul
    on the caller.  Needs worker streams.  Returns rank 0's medians (None elsewhere)."""
    if w.rank != 0:
        req = w.mpi.Ibarrier()              # sleep-poll: a blocking barrier would spin on a core
        while not req.Test():
            time.sleep(1e-3)
        return None
    xs = [np.ones((mib << 20) // 4, np.float32) for _ in range(3)]
    a = np.ones((n, n), np.float32)
    t_mm = statistics.median(_wall(lambda: a @ a) for _ in range(reps))
    one = statistics.median(_wall(lambda: np.add(xs[0], xs[1], out=xs[2])) for _ in range(reps))
    k = max(1, round(t_mm / max(one, 1e-6)))

    def red():
        for _ in range(k):
            np.add(xs[0], xs[1], out=xs[2])
    io = rt.stream("io")
    t_red = statistics.median(_wall(red) for _ in range(reps))

    def both():
        io.submit(red)
        a @ a
        io.synchronize()
    both()
    t_both = statistics.median(_wall(both) for _ in range(reps))
    w.mpi.Ibarrier().Wait()
    return {"red": t_red, "mm": t_mm, "both": t_both, "ratio": t_both / max(t_red, t_mm)}


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dp_step(w, steps: int, bucket_mb: float | None) -> dict:
    """``bucket_mb``: the gradient bucket cap (0: one all-reduce per parameter; None: the default)."""
    args = train_script.parse_args(["--quiet", "--no-plot", "--no-checkpoint"])
    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": w.size, "tp": 1})
    text = train_script.load_text(args.data)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.fromiter((stoi[c] for c in text), dtype=np.int32, count=len(text))
    model = ts.nn.Transformer(len(chars), args.d_model, args.heads, args.layers, args.seq, mesh=mesh)
    params = model.init(0)
    leaves = ts.autodiff.tree_flatten(params)[0]
    cap = grad_bucket_bytes(bucket_mb, sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in leaves))
    step_fn = ts.value_and_grad(model.loss, bucket_mb=bucket_mb)
    batches = [train_script.get_batch(data, s, args.batch, args.seq, 0) for s in range(steps + 1)]
    xb, yb = batches[0]
    step_fn(params, model.batch(xb), model.batch(yb))                # warm-up: streams, comms, caches
    ratios, times, hidden, calls, fill = [], [], [], [], []
    for xb, yb in batches[1:]:
        w.mpi.Barrier()
        t0 = time.perf_counter()
        with graph.profile(print_table=False) as prof, _WaitClock() as waits:
            step_fn(params, model.batch(xb), model.batch(yb))
        times.append(slowest(w, time.perf_counter() - t0))
        ratios.append(min(o for o in (prof.rank_overlaps or [0.0]) if o is not None) if w.rank == 0 else 0.0)
        grads = [e for e in prof.events if e["cat"] == "collective" and e["async"]]
        calls.append(len(grads))
        # how much of the window the gradient all-reduces span (first issue to last end) the
        # DTensor ops fill: the rest is the engine's Python, which the ratio does not count
        window = [(min(e["t0"] for e in grads), max(e["t1"] for e in grads))] if grads else []
        fill.append(w.mpi.allreduce(profiler.overlap_ratio(window, prof.compute) or 0.0, op=MPI.MIN))
        coll = sum(e["t1"] - e["t0"] for e in grads)
        mine = 1.0 - min(waits.seconds, coll) / coll if coll > 0 else 0.0
        hidden.append(w.mpi.allreduce(mine, op=MPI.MIN))
    return {"ratio": statistics.median(ratios), "step": statistics.median(times),
            "hidden": statistics.median(hidden), "calls": statistics.median(calls), "cap": cap,
            "fill": statistics.median(fill)}


class _WaitClock:
    """Time the caller spends in ``Work.wait()`` (the exposed part of async collectives)."""

    def __enter__(self):
        from tessera_rt.dist.comm.work import Work
        self.seconds, self._orig, clock = 0.0, Work.wait, self

        def wait(work):
            t = time.perf_counter()
            try:
                return clock._orig(work)
            finally:
                clock.seconds += time.perf_counter() - t
        Work.wait = wait
        return self

    def __exit__(self, *exc):
        from tessera_rt.dist.comm.work import Work
        Work.wait = self._orig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=4, help="all_reduce size (MiB)")
    p.add_argument("--reps", type=int, default=15, help="repetitions per timing (median)")
    p.add_argument("--steps", type=int, default=4, help="profiled training steps (median)")
    p.add_argument("--caps", default="0,default",
                   help="gradient bucket caps in MiB for section 2 (0: one all-reduce per parameter; default: "
                        "the default cap, TESSERA_GRAD_BUCKET_MB or autodiff.buckets' rule)")
    a = p.parse_args()
    caps = [None if c.strip() == "default" else float(c) for c in a.caps.split(",")]
    for c in caps:
        grad_bucket_bytes(c)                  # a bad cap fails before any collective
    w = dist.init()
    if w.size < 2:
        raise SystemExit("bench_overlap.py: run with 2 or more ranks (tessera-run -n 2 scripts/bench_overlap.py)")
    results, n, spare = {}, None, None
    was = backend.cpu_workers()
    for mode, workers in (("workers", True), ("in-order", False)):
        backend.set_cpu_workers(workers)
        rt.reset()
        m = micro(w, a.mib, a.reps, n)
        n = m["n"]                                # the peer runs the same matmul
        results[mode] = (m, {c: dp_step(w, a.steps, c) for c in caps})
        if workers:
            spare = free_core(w, n, a.mib, a.reps)
    backend.set_cpu_workers(was)
    rt.reset()
    if w.rank == 0:
        report(w, a, results, spare)
    return 0


def report(w, a, results: dict, spare: dict) -> None:
    print(f"# {w.size} ranks, {os.cpu_count()} cores, backend {w.backend.name}; times: slowest rank, median; "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"# 1. {a.mib} MiB all_reduce issued before a matmul of about its length (step / max(alone): "
          "1.0 = hidden, 2.0 = serial); cpu: process CPU s / wall s while it runs alone (mean over ranks; "
          "below 1.0 on a loaded machine); floor: the least ratio the cores allow (every rank's CPU seconds "
          "for both / cores / CPU seconds of the longer)")
    print(f"{'streams':>9} {'matmul n':>8} {'allreduce ms':>12} {'matmul ms':>9} {'step ms':>8} {'ratio':>6} "
          f"{'ar cpu':>6} {'mm cpu':>6} {'floor':>6}")
    for mode, (m, _) in results.items():
        print(f"{mode:>9} {m['n']:>8} {m['ar'] * 1e3:>12.2f} {m['mm'] * 1e3:>9.2f} {m['both'] * 1e3:>8.2f} "
              f"{m['ratio']:>6.2f} {m['cpu_ar']:>6.2f} {m['cpu_mm']:>6.2f} {m['floor']:>6.2f}")
    if spare is not None:
        print(f"# with a free core (rank 0 alone, the others asleep): a {a.mib} MiB reduce of the matmul's length on "
              f"the io worker stream under the matmul: reduce {spare['red'] * 1e3:.2f} ms, matmul "
              f"{spare['mm'] * 1e3:.2f} ms, both {spare['both'] * 1e3:.2f} ms, ratio {spare['ratio']:.2f}")
    print("# 2. data-parallel step of scripts/train.py (defaults, dp = world size): the profiler's overlap ratio "
          "(collective time under DTensor ops), the hidden fraction (1 - time in wait() / collective time), "
          "both min over ranks, the gradient all-reduces per step, the step time, and how much of the window "
          "the all-reduces span (first issue to last end) the DTensor ops fill (ops fill: the ratio's ceiling "
          "for collectives spread over that window)")
    print(f"{'streams':>9} {'buckets':>17} {'calls':>5} {'overlap':>8} {'hidden':>7} {'step ms':>8} {'ops fill':>8}")
    for mode, (_, steps) in results.items():
        for cap, d in steps.items():
            label = "per-param" if cap == 0 else f"{'default' if cap is None else 'cap'} {d['cap'] / 1024:g} KiB"
            print(f"{mode:>9} {label:>17} {d['calls']:>5.0f} {d['ratio']:>8.2f} {d['hidden']:>7.2f} "
                  f"{d['step'] * 1e3:>8.1f} {d['fill']:>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
