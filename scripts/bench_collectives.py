"""Collective bandwidth and latency, nccl-tests style, beside the raw call in the same run.

    tessera-run -n 2 scripts/bench_collectives.py [--min 8] [--max 64M] [--ops all_reduce,all_gather]

For each collective and size: time per call (median over repetitions of the slowest rank),
algbw = size / time and busbw = algbw * nccl-tests' factor (2(n-1)/n for all_reduce,
(n-1)/n for reduce_scatter, all_gather and all_to_all, 1 for broadcast).  "size" follows
nccl-tests: the input of all_reduce, reduce_scatter and broadcast, the output of all_gather,
the per-rank buffer of all_to_all.  The peer is the raw mpi4py call (NCCL on GPU) on the
same buffers, with its output allocated once; tessera_rt allocates its output each call
(from its pool), as a user's out-of-place call does; with ``--out`` it writes into a
persistent ``out=`` buffer of its own (same kind of memory as the peer's), as the peer does.  ratio = peer time / tessera_rt time
(>= 1 means tessera_rt is as fast); +us = tessera_rt time - peer time, the per-call cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tessera_rt as ts
from tessera_rt import dist
from tessera_rt.backend import mapped_empty


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


class Peer:
    """The raw library calls on the same buffers: mpi4py on CPU, the NCCL communicator on GPU."""

    def __init__(self, group, backend):
        self.g, self.backend = group, backend
        self.comm = group.comm
        self.gpu = backend.is_gpu and self.comm.kind == "nccl"

    def run(self, op, x, out):
        if self.gpu:
            s = ts.runtime.stream("tp_collective")
            if op == "all_to_all":
                n = self.g.size
                counts = [x.size // n] * n
                self.comm.all_to_all(x, out, counts, counts, stream=s)
            else:
                raw, p, o, stream = self.comm.raw, x.data.ptr, out.data.ptr, s.ptr
                if op == "all_reduce":
                    raw.allReduce(p, o, x.size, 7, 0, stream)
                elif op == "reduce_scatter":
                    raw.reduceScatter(p, o, out.size, 7, 0, stream)
                elif op == "all_gather":
                    raw.allGather(p, o, x.size, 7, stream)
                elif op == "broadcast":
                    raw.broadcast(p, p, x.size, 7, 0, stream)
            return          # queued, like tessera's calls: the loop's one sync() waits for both
        mpi = self.comm.mpi
        if op == "all_reduce":
            mpi.Allreduce(x, out)
        elif op == "reduce_scatter":
            mpi.Reduce_scatter_block(x, out)
        elif op == "all_gather":
            mpi.Allgather(x, out)
        elif op == "all_to_all":
            mpi.Alltoall(x, out)
        elif op == "broadcast":
            mpi.Bcast(x, root=0)


def ours(op, x, mesh, out=None):
    if op == "all_reduce":
        return dist.all_reduce(x, "x", mesh=mesh, out=out)
    if op == "reduce_scatter":
        return dist.reduce_scatter(x, "x", mesh=mesh, out=out)
    if op == "all_gather":
        return dist.all_gather(x, "x", mesh=mesh, out=out)
    if op == "all_to_all":
        return dist.all_to_all(x, "x", mesh=mesh, out=out)
    return dist.broadcast(x, "x", root=0, mesh=mesh)


def buffers(op, nbytes, n, xp):
    """(input, peer output, size in nccl-tests' sense) for ``nbytes`` of float32.  On CPU the
    peer's output is on the kind of memory tessera's pool gives large outputs (a fresh mapping
    with huge pages: ``backend.mapped_empty``), so the ratio measures the call, not page sizes."""
    empty = xp.empty if xp is not np else mapped_empty
    count = max(n, nbytes // 4 // n * n)       # divisible by n for the split collectives
    if op == "all_gather":
        per = max(1, count // n)
        x = xp.ones(per, np.float32)
        return x, empty(per * n, np.float32), per * n * 4
    x = xp.ones(count, np.float32)
    out_len = count // n if op == "reduce_scatter" else count
    return x, empty(out_len, np.float32), count * 4


def timed(fn, iters, sync, mpi):
    """Seconds per call of the slowest rank: ``iters`` calls queued, then one ``sync()`` (the
    same for tessera_rt and the peer: on the GPU it waits for every role's stream)."""
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    dt = (time.perf_counter() - t0) / iters
    return mpi.allreduce(dt, op=__import__("mpi4py").MPI.MAX)     # the slowest rank sets the pace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min", default="8")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    ap.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,all_to_all,broadcast")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per size (median taken)")
    ap.add_argument("--budget-ms", type=float, default=40.0, help="time per repetition and side")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    ap.add_argument("--out", action="store_true", help="tessera_rt writes into a persistent out= buffer of its "
                    "own, as the peer does (broadcast is in place either way)")
    args = ap.parse_args()

    w = dist.init()
    backend = ts.get_backend()
    xp = backend.xp
    mesh = dist.Mesh(axes=["x"], shape=(w.size,))
    group = mesh.group("x")
    peer = Peer(group, backend)
    sync = (lambda: ts.runtime.synchronize()) if backend.is_gpu else (lambda: None)
    sizes, s = [], parse_size(args.min)
    while s <= parse_size(args.max):
        sizes.append(s)
        s *= args.factor
    if w.rank == 0:
        print(f"# tessera_rt {ts.__version__} collectives on {backend.name}, {w.size} ranks, "
              f"communicator {group.comm.kind}; peer: {'NCCL (cupy)' if peer.gpu else 'mpi4py'}; "
              f"float32; median of {args.reps}; tessera_rt output: {'out=' if args.out else 'allocated per call'}")
        head = ["op", "size", "time us", "algbw GB/s", "busbw GB/s", "peer us", "peer busbw", "ratio",
                "+us"]
        if args.markdown:
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
        else:
            print(f"{'op':>15} {'size':>10} {'time us':>10} {'algbw':>9} {'busbw':>9} "
                  f"{'peer us':>10} {'peer bus':>9} {'ratio':>6} {'+us':>7}")
    for op in args.ops.split(","):
        factor = dist.bus_factor(op, w.size)
        for nbytes in sizes:
            x, out, size = buffers(op, nbytes, w.size, xp)
            backend.synchronize()       # x is filled on compute; the peer's stream does not wait for it
            mine = (mapped_empty if xp is np else xp.empty)(out.shape, out.dtype) if args.out else None
            ours(op, x, mesh, mine), peer.run(op, x, out)    # warm up both paths and the pool
            # calibrate iterations so each repetition takes about budget_ms
            probe = timed(lambda: ours(op, x, mesh, mine), 3, sync, w.mpi)
            iters = max(3, min(20000, int(args.budget_ms / 1e3 / max(probe, 1e-7))))
            iters = w.mpi.bcast(iters, root=0)
            t_ours, t_peer = [], []
            for _ in range(args.reps):                       # interleaved: same noise for both
                t_ours.append(timed(lambda: ours(op, x, mesh, mine), iters, sync, w.mpi))
                t_peer.append(timed(lambda: peer.run(op, x, out), iters, sync, w.mpi))
            t, tp = statistics.median(t_ours), statistics.median(t_peer)
            alg, palg = size / t / 1e9, size / tp / 1e9
            if w.rank == 0:
                row = [op, human(size), f"{t * 1e6:.2f}", f"{alg:.3f}", f"{alg * factor:.3f}",
                       f"{tp * 1e6:.2f}", f"{palg * factor:.3f}", f"{tp / t:.2f}", f"{(t - tp) * 1e6:+.2f}"]
                if args.markdown:
                    print("| " + " | ".join(row) + " |", flush=True)
                else:
                    print(f"{row[0]:>15} {row[1]:>10} {row[2]:>10} {row[3]:>9} {row[4]:>9} "
                          f"{row[5]:>10} {row[6]:>9} {row[7]:>6} {row[8]:>7}", flush=True)


if __name__ == "__main__":
    main()
