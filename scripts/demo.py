"""tessera_rt demo: a tensor-parallel MLP block on a 2x2 (tp x dp) mesh, with DTensors.

    tessera-run -n 4 scripts/demo.py

The batch is split over dp; W1 is column-sharded and W2 row-sharded over tp.  The DTensor
layer inserts exactly the collectives those layouts need, when they are needed: none for
the two matmuls (the second leaves a pending sum over tp), one reduce_scatter for the
RMSNorm and one all_gather to assemble the rows: the seeds' RS -> local work -> AG pattern.
Every rank checks the result against NumPy on the full tensors; rank 0 prints what each
rank issued, and the plan for one more layout change.
"""
import argparse
import sys

import numpy as np

import tessera_rt as ts
from tessera_rt import dist, op

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
w = dist.init()
if w.size != 4:
    sys.exit(f"demo.py wants 4 ranks (tessera-run -n 4 scripts/demo.py); got {w.size}")
mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
Batch = dist.ShardSpec(partition=("row",), mesh_axes=("dp",))      # rows of X over dp
Col = dist.ShardSpec(partition=("col",), mesh_axes=("tp",))        # column-parallel W1
Row = dist.ShardSpec(partition=("row",), mesh_axes=("tp",))        # row-parallel W2

B, D, H = 8, 6, 16
X = dist.randn((B, D), layout=Batch, mesh=mesh, seed=0)            # same values on any mesh/layout
W1 = dist.randn((D, H), layout=Col, mesh=mesh, seed=1)
W2 = dist.randn((H, D), layout=Row, mesh=mesh, seed=2)

with dist.trace_collectives() as log:
    Hid = op.relu(X @ W1)                 # (S(0)@dp, S(1)@tp): local, no communication
    Y = Hid @ W2                          # (S(0)@dp, P(sum)@tp): a pending sum, still local
    Z = op.rmsnorm(Y)                     # needs whole sums: one reduce_scatter over tp (RS)
    out = Z.redistribute(Batch) + X       # one all_gather over tp (AG), then the residual

x, w1, w2 = X.full_tensor(), W1.full_tensor(), W2.full_tensor()
expect = op.rmsnorm(np.maximum(x @ w1, 0) @ w2) + x
ok = np.allclose(out.full_tensor(), expect, rtol=1e-5, atol=1e-5)
all_ok = bool(ts.get_backend().to_host(dist.all_reduce(np.array([int(ok)])))[0] == w.size)

report = w.mpi.gather((w.rank, mesh.coords, [str(r) for r in log.records]), root=0)
if w.rank == 0:
    print(f"tessera_rt {ts.__version__} on {ts.get_backend().name}: {w.size} ranks, {mesh}, "
          f"communicator {mesh.group('tp').comm.kind}")
    print(f"layouts: X {X.layout!r}  W1 {W1.layout!r}  W2 {W2.layout!r}")
    print(f"         Hid {Hid.layout!r}  Y {Y.layout!r}  Z {Z.layout!r}  out {out.layout!r}")
    for rank, coords, records in report:
        print(f"rank {rank} {coords} issued:")
        for r in records:
            print(f"    {r}")
    print("plan to replicate out everywhere:")
    print(out.explain_redistribute(dist.ReplicateSpec()))
    print(f"matches NumPy on the full tensors: {all_ok}")
sys.exit(0 if all_ok else 1)
