"""Pipeline step time and measured bubble per schedule, against data parallelism alone.

    tessera-run -n 4 scripts/bench_pipeline.py                  # pp = 2 (x dp 2) and pp = 4
    tessera-run -n 2 scripts/bench_pipeline.py --microbatches 4 8 16

For each pp that divides the world size (2 and 4; the rest of the ranks are dp), each
schedule and each micro-batch count, the same model and global batch take ``--steps``
pipelined steps; the table shows the median step time, its ratio to the same model on a
dp-only mesh of the same ranks (measured in the same run), the measured bubble (the mean
over stages of idle / step time, ``pipe.stats()``) and the textbook figure
((pp-1)/(m+pp-1), interleaved (pp-1)/(v*m+pp-1)).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (those dividing the world)")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    return p.parse_args(argv)


def _median_step(fn, steps: int) -> float:
    from mpi4py import MPI
    fn()                                             # warm-up: caches, plans, communicators
    times = []
    for _ in range(steps):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    slowest = np.empty(len(times))
    MPI.COMM_WORLD.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return float(np.median(slowest))


def main(argv=None) -> int:
    import tessera_rt as ts
    from tessera_rt import dist, nn
    from tessera_rt.pipeline import theory_bubble

    a = parse_args(argv)
    w = dist.init()
    n = w.size
    rng = np.random.default_rng(0)
    x = rng.integers(0, a.vocab, (a.batch, a.seq))
    y = rng.integers(0, a.vocab, (a.batch, a.seq))
    cfg = (a.vocab, a.d_model, 4, a.layers, a.seq)

    dmesh = dist.Mesh(axes=["dp"], shape={"dp": n})
    dmodel = nn.Transformer(*cfg, mesh=dmesh)
    dparams = dmodel.init(0)
    step_dp = ts.value_and_grad(dmodel.loss)
    t_dp = _median_step(lambda: step_dp(dparams, dmodel.batch(x), dmodel.batch(y)), a.steps)
    rows = []
    for pp in [p for p in a.pp if n % p == 0 and p > 1]:
        mesh = dist.Mesh(axes=["pp", "dp"], shape={"pp": pp, "dp": n // pp})
        for sched in a.schedules:
            v = 2 if sched == "interleaved" else 1
            if a.layers % (pp * v):
                continue
            model = nn.Transformer(*cfg, mesh=mesh, virtual_stages=v)
            params = model.init(0)
            for m in a.microbatches:
                if m > a.batch or (sched == "interleaved" and m % pp):
                    continue
                pipe = dist.Pipeline(model, mesh=mesh, microbatches=m, schedule=sched)
                bubbles = []

                def step():
                    pipe.value_and_grad(params, x, y)
                    bubbles.append(pipe.stats().bubble)
                t = _median_step(step, a.steps)
                rows.append((pp, n // pp, sched, m, t, float(np.median(bubbles[1:])), theory_bubble(sched, pp, m, v)))
    if w.rank == 0:
        print(f"# pipeline bench: {n} ranks, model d={a.d_model} layers={a.layers} seq={a.seq} vocab={a.vocab}, "
              f"batch {a.batch}, median of {a.steps} steps (slowest rank)")
        print(f"# dp={n} alone: {t_dp * 1e3:.1f} ms/step")
        print(f"{'pp':>3} {'dp':>3} {'schedule':>12} {'m':>4} {'ms/step':>9} {'vs dp':>7} {'bubble':>8} {'theory':>8}")
        for pp, dp, sched, m, t, b, th in rows:
            print(f"{pp:>3} {dp:>3} {sched:>12} {m:>4} {t * 1e3:>9.1f} {t / t_dp:>6.2f}x {b:>8.1%} {th:>8.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
