"""The tape's bookkeeping cost per op, beside the same chain with no tape, in one run.

    python scripts/bench_autodiff.py [--ops 2000] [--reps 7]

A chain of ``--ops`` elementwise ops on a 4x4 float32 array (small, so the arithmetic is
negligible and what remains is bookkeeping): raw NumPy, ``op.*`` outside ``ts.grad``
(the cost of the hook), ``op.*`` under ``ts.grad`` forward only, and forward + backward;
the same on a DTensor.  Medians in microseconds per op.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tessera_rt as ts
from tessera_rt import dist, op


def per_op_us(fn, n_ops: int, reps: int) -> float:
    fn()                                                   # warm caches (plans, rules)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / n_ops * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    n = args.ops
    dist.init()
    x0 = np.full((4, 4), 0.5, np.float32)
    mesh = dist.Mesh(axes=["x"], shape=(dist.get_world_size(),))
    X0 = dist.distribute(x0, layout=dist.ShardSpec(partition=(0,), mesh_axes=("x",)), mesh=mesh)

    def chain(x, f):
        other = X0 if isinstance(x, dist.DTensor) or ts.autodiff.is_traced(x) and isinstance(
            getattr(x, "value", None), dist.DTensor) else x0
        for _ in range(n):
            x = f(x, other)
        return x

    def raw():
        x = x0
        for _ in range(n):
            x = np.add(x, x0)
        return x

    def traced_loss(x):
        return op.sum(chain(x, op.add))

    rows = [
        ("numpy add (no tessera)", per_op_us(raw, n, args.reps)),
        ("op.add, not traced (the hook)", per_op_us(lambda: chain(x0, op.add), n, args.reps)),
        ("op.add under ts.grad, forward + backward", per_op_us(lambda: ts.grad(traced_loss)(x0), n, args.reps)),
        ("op.mul under ts.grad, forward + backward",
         per_op_us(lambda: ts.grad(lambda x: op.sum(chain(x, op.mul)))(x0 * 0 + 1.0), n, args.reps)),
        ("DTensor op.add, not traced", per_op_us(lambda: chain(X0, op.add), n, args.reps)),
        ("DTensor op.add under ts.grad, forward + backward",
         per_op_us(lambda: ts.grad(traced_loss)(X0), n, args.reps)),
    ]
    if dist.get_rank() == 0:
        print(f"# tape cost per op: chain of {n} ops on float32[4,4], {dist.get_world_size()} rank(s), "
              f"median of {args.reps} (us/op)")
        for name, us in rows:
            print(f"{name:50s} {us:8.2f}")


if __name__ == "__main__":
    main()
