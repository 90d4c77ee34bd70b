"""Fixed cost per call of each collective against the raw mpi4py call.

    python scripts/bench_callcost.py [case ...]          # one rank: tessera_rt's own work
    tessera-run -n 2 scripts/bench_callcost.py [case ...] # 2 ranks: what a job sees

At one rank the communication is nearly free, so what shows is tessera_rt's work per call
(plan lookup, output allocation, the agreement check; a group of one has nothing to check).
Repeat calls take the collectives' C path (dist/comm/_hot.c); ``TESSERA_HOT=0`` measures the
Python functions instead.  The ``_out`` cases pass a
persistent ``out=`` (as the raw calls do), so no output is allocated.  Each case: 5000 warm-up calls,
then the minimum over 25 x 2000 calls of each side, interleaved, and the median of the 25
paired differences.  1 KiB float32.  Each call comes from a lambda, a new Python frame per
call: the agreement check reads its caller's frame, which CPython then materializes per
call (~0.05-0.1 us); a loop in a user's function pays that once.
"""
import argparse
import statistics
import timeit

import numpy as np

from tessera_rt import dist

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("cases", nargs="*", help="which cases (default: all; an unknown name lists them)")
args = ap.parse_args()
w = dist.init()
mesh = dist.Mesh(axes=["x"], shape=(w.size,))
mpi = mesh.group("x").comm.mpi
n = w.size
x = np.ones(256 * n, np.float32)
o, o2 = np.empty_like(x), np.empty(256, np.float32)
xg, og = np.ones(256, np.float32), np.empty(256 * n, np.float32)
x2 = np.ones((4, 64 * n), np.float32)
CASES = {
    "all_reduce": (lambda: dist.all_reduce(x, "x", mesh=mesh), lambda: mpi.Allreduce(x, o)),
    "all_reduce_out": (lambda: dist.all_reduce(x, "x", mesh=mesh, out=o), lambda: mpi.Allreduce(x, o)),
    "reduce_scatter": (lambda: dist.reduce_scatter(x, "x", mesh=mesh), lambda: mpi.Reduce_scatter_block(x, o2)),
    "reduce_scatter_d1": (lambda: dist.reduce_scatter(x2, "x", mesh=mesh, dim=1),
                          lambda: mpi.Reduce_scatter_block(x, o2)),
    "reduce_scatter_out": (lambda: dist.reduce_scatter(x, "x", mesh=mesh, out=o2),
                           lambda: mpi.Reduce_scatter_block(x, o2)),
    "all_gather": (lambda: dist.all_gather(xg, "x", mesh=mesh), lambda: mpi.Allgather(xg, og)),
    "all_gather_out": (lambda: dist.all_gather(xg, "x", mesh=mesh, out=og), lambda: mpi.Allgather(xg, og)),
    "all_to_all": (lambda: dist.all_to_all(x, "x", mesh=mesh), lambda: mpi.Alltoall(x, o)),
    "all_to_all_out": (lambda: dist.all_to_all(x, "x", mesh=mesh, out=o), lambda: mpi.Alltoall(x, o)),
    "broadcast": (lambda: dist.broadcast(x, "x", mesh=mesh), lambda: mpi.Bcast(x, 0)),
}

unknown = [c for c in args.cases if c not in CASES]
if unknown:
    ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
for name in args.cases or list(CASES):
    ours, raw = CASES[name]
    for _ in range(5000):
        ours(), raw()
    t_ours, t_raw = [], []
    for _ in range(25):
        t_ours.append(timeit.timeit(ours, number=2000) / 2000 * 1e6)
        t_raw.append(timeit.timeit(raw, number=2000) / 2000 * 1e6)
    if w.rank == 0:
        a, b = min(t_ours), min(t_raw)
        d = statistics.median(o - r for o, r in zip(t_ours, t_raw))
        print(f"{name:20s} tessera_rt {a:6.2f} us  raw mpi4py {b:6.2f} us  +{a - b:5.2f}  (median of pairs +{d:5.2f})",
              flush=True)
