"""all_reduce at one size (default 8 MiB), five ways in one job, interleaved: where the output
comes from (allocated once, a pooled block per call, a fresh np.empty per call, tessera_rt's
pooled output, tessera_rt with out=).  The fresh-allocation case runs last: a case timed right
after it pays for its page faults.

    tessera-run -n 2 scripts/bench_outputs.py [MiB] [reps]
"""
import argparse
import statistics
import time

import numpy as np

import tessera_rt as ts
from tessera_rt import dist
from tessera_rt.dist.comm.mpi import MPI

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("mib", nargs="?", type=float, default=8.0, help="message size in MiB (default 8)")
ap.add_argument("reps", nargs="?", type=int, default=15, help="samples per case (default 15)")
args = ap.parse_args()
w = dist.init(); n = w.size
mesh = dist.Mesh(axes=["x"], shape=(n,)); g = mesh.group("x"); mpi = g.comm.mpi
nbytes, reps = int(args.mib * (1 << 20)), args.reps
x = np.ones(nbytes // 4, np.float32); pre = np.empty_like(x); b = ts.get_backend()
cases = {
  "raw, out allocated once": lambda: mpi.Allreduce(x, pre),
  "raw, pooled block per call": lambda: mpi.Allreduce(x, b.empty(x.shape, x.dtype)),
  "dist.all_reduce (pooled out)": lambda: dist.all_reduce(x, "x", mesh=mesh),
  "dist.all_reduce(out=preallocated)": lambda: dist.all_reduce(x, "x", mesh=mesh, out=pre),
  "raw, fresh np.empty per call": lambda: mpi.Allreduce(x, np.empty_like(x)),
}
times = {k: [] for k in cases}
for f in cases.values(): f(); f()
iters = 8
for _ in range(reps):
    for k, f in cases.items():
        mpi.Barrier(); t0 = time.perf_counter()
        for _ in range(iters): f()
        times[k].append(mpi.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))
if w.rank == 0:
    base = statistics.median(times["raw, out allocated once"])
    print(f"# {n} ranks, all_reduce {nbytes >> 20} MiB float32, median of {reps} x {iters} calls (slowest rank)")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:36s} {m*1e6:9.1f} us  ratio raw/this {base/m:5.2f}  (min {min(v)*1e6:.1f})")
