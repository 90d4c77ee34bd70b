"""Per-call cost of the reliability hooks on a small collective, beside the raw mpi4py call.

    tessera-run -n 2 scripts/bench_debug.py [--iters 20000] [--reps 7]

Modes (each measured in the same run, interleaved, median of reps, slowest rank):
raw mpi4py Allreduce; tessera_rt all_reduce as it runs by default (the cross-rank signature
check of ``dist.checks.consistency`` on; the watchdog thread samples and costs the call nothing);
the same with the check off (TESSERA_CHECK=0); the check alone, no MPI call; the flight
recorder; desync checks
(TESSERA_DEBUG=collectives); the profiler; NVTX ranges only; deterministic (fixed-order)
all_reduce.  Also a DTensor op (x + y) with and without the profiler.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from tessera_rt import dist


def per_call(fn, iters: int) -> float:
    comm = MPI.COMM_WORLD
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t) / iters
    return comm.allreduce(dt, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--n", type=int, default=2, help="elements of the float32 message")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="over reps (min resists noise)")
    args = ap.parse_args()
    w = dist.init()
    x = np.ones(args.n, np.float32)
    out = np.empty_like(x)
    mpi = MPI.COMM_WORLD
    has = hasattr(dist, "debug")
    modes = {"raw mpi4py Allreduce": (None, lambda: mpi.Allreduce(x, out))}
    from tessera_rt.dist.checks import consistency
    from tessera_rt.dist.comm.work import world_group
    g = world_group()
    modes["tessera all_reduce, default"] = ("off", lambda: dist.all_reduce(x))
    modes["tessera all_reduce, check off"] = ("nocheck", lambda: dist.all_reduce(x))
    modes["default check alone (no MPI)"] = ("off", lambda: consistency.check("all_reduce", g, x.dtype, x.shape, "sum"))
    if has:
        from tessera_rt import profiler
        modes["flight recorder"] = ("flight", lambda: dist.all_reduce(x))
        modes["desync check (collectives)"] = ("collectives", lambda: dist.all_reduce(x))
        modes["profiler"] = ("profile", lambda: dist.all_reduce(x))
        modes["NVTX ranges only"] = ("nvtx", lambda: dist.all_reduce(x))
        modes["deterministic all_reduce"] = ("det", lambda: dist.all_reduce(x))
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    A = dist.distribute(np.ones((8, 8), np.float32), layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)),
                        mesh=mesh)
    modes["DTensor add, hooks off"] = ("off", lambda: A + A)
    if has:
        modes["DTensor add, profiler"] = ("profile", lambda: A + A)
    times = {k: [] for k in modes}
    for _ in range(args.reps):
        for name, (mode, fn) in modes.items():
            prof = None
            if mode == "nocheck":
                consistency.configure(False)
            elif mode == "flight":
                dist.init(debug="flight")
            elif mode == "collectives":
                dist.init(debug="collectives")
            elif mode == "profile":
                prof = profiler.Profile(print_table=False, nvtx=False).__enter__()
            elif mode == "nvtx":
                profiler.enable_nvtx(True)
            elif mode == "det":
                dist.set_deterministic(True)
            times[name].append(per_call(fn, args.iters if mode != "collectives" else args.iters // 10))
            if mode == "nocheck":
                consistency.configure(True)
            elif mode in ("flight", "collectives"):
                dist.init(debug=False)
            elif prof is not None:
                prof.events.clear()
                prof.__exit__(None, None, None)
            elif mode == "nvtx":
                profiler.enable_nvtx(False)
            elif mode == "det":
                dist.set_deterministic(False)
    if w.rank == 0:
        pick = min if args.stat == "min" else statistics.median
        raw = pick(times["raw mpi4py Allreduce"])
        print(f"# {w.size} ranks, float32[{args.n}], {args.iters} calls x {args.reps} reps, {args.stat} of the slowest rank")
        print(f"{'mode':<32} {'us/call':>9} {'+us vs raw':>11}")
        for name, ts in times.items():
            t = min(ts) if args.stat == "min" else statistics.median(ts)
            print(f"{name:<32} {t * 1e6:>9.2f} {(t - raw) * 1e6:>+11.2f}")


if __name__ == "__main__":
    main()
