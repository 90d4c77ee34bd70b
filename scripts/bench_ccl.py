"""dist.ccl against the plain collectives, nccl-tests style, in the same run on the same buffers.

    tessera-run -n 2 scripts/bench_ccl.py [--min 8] [--max 64M] [--ops all_reduce,reduce_scatter,all_gather]
    tessera-run -n 4 scripts/bench_ccl.py --attention --seq 2048,8192

Part 1, for each op and size: the plain collective (``dist.all_reduce`` etc., its output
allocated per call from the pool, as a user's call does) and the ccl op by each algorithm
(``library``, ``ring``, ``line``) with a persistent ``buffer_key`` (nothing allocated per
call).  time = median over repetitions of the slowest rank; busbw = size / time * nccl-tests'
factor; ratio = plain time / ccl time (>= 1: the ccl op is as fast); allocs = arrays ccl
allocated per call after warm-up (ccl.allocations()).

Part 2 (``--attention``): ring attention against gather-then-attend (all-gather K and V,
then flash attention of the local queries over the whole sequence), causal, contiguous
layout for the peer (its mask is one kernel call), striped for the ring; the time and the
peak bytes NumPy allocated on this rank during the call (tracemalloc; CPU only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tessera_rt as ts
from tessera_rt import dist, op
from tessera_rt.dist import ccl

from bench_collectives import human, parse_size, timed

ALGOS = ("library", "ring", "line")


def plain(name, x, mesh):
    if name == "all_reduce":
        return dist.all_reduce(x, "x", mesh=mesh)
    if name == "reduce_scatter":
        return dist.reduce_scatter(x, "x", mesh=mesh)
    return dist.all_gather(x, "x", mesh=mesh)


def line(name, x, mesh, algo, key):
    if name == "all_reduce":
        return ccl.line_all_reduce(x, 0, mesh=mesh, algo=algo, buffer_key=key)
    if name == "reduce_scatter":
        return ccl.line_reduce_scatter(x, 0, 0, mesh=mesh, algo=algo, buffer_key=key)
    return ccl.line_all_gather(x, 0, 0, mesh=mesh, algo=algo, buffer_key=key)


def emit(row, markdown, widths):
    if markdown:
        print("| " + " | ".join(row) + " |", flush=True)
    else:
        print(" ".join(f"{c:>{w}}" for c, w in zip(row, widths)), flush=True)


def bench_ops(args, w, mesh, xp, sync):
    algos = tuple(args.algos.split(","))
    sizes, s = [], parse_size(args.min)
    while s <= parse_size(args.max):
        sizes.append(s)
        s *= args.factor
    if sizes[-1] != parse_size(args.max):
        sizes.append(parse_size(args.max))                          # always end at --max
    head = ["op", "size", "plain us", "plain busbw"] + [f"{a} {c}" for a in algos for c in ("us", "ratio")] + ["allocs"]
    widths = [15, 10, 10, 11] + [9, 7] * len(algos) + [6]
    if w.rank == 0:
        if args.markdown:
            print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        else:
            emit(head, False, widths)
    for name in args.ops.split(","):
        factor = dist.bus_factor(name, w.size)
        for nbytes in sizes:
            count = max(w.size, nbytes // 4 // w.size * w.size)
            x = xp.ones(count // w.size if name == "all_gather" else count, np.float32)
            size = count * 4
            fns = {"plain": lambda: plain(name, x, mesh)}
            for a in algos:
                fns[a] = (lambda a=a, key=f"{name}/{a}/{x.size}": line(name, x, mesh, a, key))   # a constant key, as a user passes
            for f in fns.values():
                f()                                                 # warm up, make the persistent sets
            probe = timed(fns["plain"], 3, sync, w.mpi)
            iters = w.mpi.bcast(max(2, min(5000, int(args.budget_ms / 1e3 / max(probe, 1e-7)))), root=0)
            a0 = ccl.allocations()
            times = {k: [] for k in fns}
            for _ in range(args.reps):                              # interleaved: the same noise for all
                for k, f in fns.items():
                    times[k].append(timed(f, iters, sync, w.mpi))
            allocs = (ccl.allocations() - a0) / (args.reps * iters * len(algos))
            med = {k: statistics.median(v) for k, v in times.items()}
            if w.rank == 0:
                row = [name, human(size), f"{med['plain'] * 1e6:.1f}", f"{size / med['plain'] / 1e9 * factor:.3f}"]
                for a in algos:
                    row += [f"{med[a] * 1e6:.1f}", f"{med['plain'] / med[a]:.2f}"]
                emit(row + [f"{allocs:g}"], args.markdown, widths)
            ccl.clear_persistent_buffers()


def bench_attention(args, w, mesh, xp, sync):
    n, me = w.size, mesh.group("x").index
    head = ["seq", "ring ms", "gather ms", "ratio", "ring MiB/rank", "gather MiB/rank"]
    widths = [8, 9, 10, 6, 14, 16]
    if w.rank == 0:
        print(f"\n# ring attention vs gather-then-attend: B=1 H={args.heads} D={args.head_dim}, causal, "
              f"float32, {n} ranks")
        if args.markdown:
            print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        else:
            emit(head, False, widths)
    for seq in (int(s) for s in args.seq.split(",")):
        rng = np.random.default_rng(me)
        shape = (1, args.heads, seq // n, args.head_dim)
        q, k, v = (xp.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(3))
        off = me * (seq // n)

        def ring():
            return ccl.ring_attention(q, k, v, axis="x", mesh=mesh, causal=True)

        def gather():
            kk = dist.all_gather(k, "x", dim=2, mesh=mesh)[:, :, :off + seq // n]
            vv = dist.all_gather(v, "x", dim=2, mesh=mesh)[:, :, :off + seq // n]
            return op.flash_attention(q, xp.ascontiguousarray(kk), xp.ascontiguousarray(vv), causal=True)

        res = {}
        for label, f in (("ring", ring), ("gather", gather)):
            f()
            tracemalloc.start()
            f()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            peak = w.mpi.allreduce(peak, op=__import__("mpi4py").MPI.MAX)
            t = statistics.median(timed(f, 1, sync, w.mpi) for _ in range(args.reps))
            res[label] = (t, peak)
        if w.rank == 0:
            (tr, mr), (tg, mg) = res["ring"], res["gather"]
            emit([str(seq), f"{tr * 1e3:.1f}", f"{tg * 1e3:.1f}", f"{tg / tr:.2f}", f"{mr / 2**20:.1f}",
                  f"{mg / 2**20:.1f}"], args.markdown, widths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min", default="8")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    ap.add_argument("--ops", default="reduce_scatter,all_gather,all_reduce")
    ap.add_argument("--algos", default=",".join(ALGOS), help="ccl algorithms to run (default: all three)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median taken)")
    ap.add_argument("--budget-ms", type=float, default=20.0, help="time per repetition and side")
    ap.add_argument("--attention", action="store_true", help="ring attention vs gather-then-attend only")
    ap.add_argument("--seq", default="1024,4096")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--markdown", action="store_true", help="Markdown tables (for BENCHMARKS.md)")
    args = ap.parse_args()

    w = dist.init()
    backend = ts.get_backend()
    mesh = dist.Mesh(axes=["x"], shape=(w.size,))
    sync = (lambda: ts.runtime.synchronize()) if backend.is_gpu else (lambda: None)
    if w.rank == 0:
        print(f"# tessera_rt {ts.__version__} dist.ccl on {backend.name}, {w.size} ranks, communicator "
              f"{mesh.group('x').comm.kind}; float32; median of {args.reps}; ratio = plain / ccl")
    if args.attention:
        bench_attention(args, w, mesh, backend.xp, sync)
    else:
        bench_ops(args, w, mesh, backend.xp, sync)


if __name__ == "__main__":
    main()
