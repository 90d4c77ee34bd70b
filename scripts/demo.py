"""tessera_rt demo: a tensor-parallel MLP block on a 2x2 (tp x dp) mesh.

    tessera-run -n 4 scripts/demo.py

The batch is split over dp; W1 is column-sharded and W2 row-sharded over tp, so each rank
computes a partial product and the seeds' RS -> (local work) -> AG pattern finishes it.
Every rank checks its result against NumPy on the full tensors; rank 0 prints the
collectives each rank issued.
"""
import sys

import numpy as np

import tessera_rt as ts
from tessera_rt import dist

w = dist.init()
if w.size != 4:
    sys.exit(f"demo.py wants 4 ranks (tessera-run -n 4 scripts/demo.py); got {w.size}")
xp, backend = ts.get_backend().xp, ts.get_backend()
mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
tp, dp = mesh.coordinate("tp"), mesh.coordinate("dp")

# The same global tensors on every rank (seeded), then each rank keeps its shards.
rng = np.random.default_rng(0)
B, D, H = 8, 6, 16
X, W1, W2 = (rng.standard_normal(s).astype(np.float32) for s in [(B, D), (D, H), (H, D)])
x = xp.asarray(np.array_split(X, 2, axis=0)[dp])            # rows of the batch: dp
w1 = xp.asarray(np.array_split(W1, 2, axis=1)[tp])          # columns of W1: tp
w2 = xp.asarray(np.array_split(W2, 2, axis=0)[tp])          # rows of W2: tp

with dist.trace_collectives() as log:
    h = xp.maximum(x @ w1, 0)                               # local: no communication
    y_partial = h @ w2                                      # a partial sum over tp
    y_shard = dist.reduce_scatter(y_partial, "tp", dim=1, mesh=mesh)   # RS: sum + split columns
    y_shard = y_shard + x[:, tp * 3:(tp + 1) * 3]          # residual on the shard: x is whole over tp
    y = dist.all_gather(y_shard, "tp", dim=1, mesh=mesh)    # AG: whole rows back
    loss = dist.all_reduce(xp.asarray([float((y ** 2).mean())]), "dp", op="avg", mesh=mesh)

expect_y = np.maximum(X @ W1, 0) @ W2 + X
ok = np.allclose(backend.to_host(y), np.array_split(expect_y, 2, axis=0)[dp], rtol=1e-5, atol=1e-5)
ok &= np.isclose(float(backend.to_host(loss)[0]), float((expect_y ** 2).mean()), rtol=1e-5)
all_ok = dist.all_reduce(np.array([int(ok)]), mesh=None)[0] == w.size

report = w.mpi.gather((w.rank, mesh.coords, [str(r) for r in log.records]), root=0)
if w.rank == 0:
    print(f"tessera_rt {ts.__version__} on {backend.name}: {w.size} ranks, {mesh}, "
          f"communicator: {mesh.group('tp').comm.kind}")
    for rank, coords, records in report:
        print(f"rank {rank} {coords}:")
        for r in records:
            print(f"    {r}")
    print(f"loss = {float(backend.to_host(loss)[0]):.6f};  matches NumPy on the full tensors: {bool(all_ok)}")
sys.exit(0 if all_ok else 1)
