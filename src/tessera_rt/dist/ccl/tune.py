"""Measure the per-size table that ``algo="auto"`` reads, on this job's mesh axis.

    table = ccl.tune(mesh=mesh, cluster_axis="tp")        # collective over the axis group
    ccl.set_algo_table(table)                               # (tune installs it unless install=False)

For each op and size every algorithm runs on the same buffer, interleaved; the time of a
repetition is the slowest rank's (an all-reduce of the maxima), so every rank gets the same
table.  A row's bound is the size measured; the last row extends to every larger size.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from ..comm import collectives as C
from ..comm.mesh import Mesh
from ..comm.mpi import MPI
from ._common import resolve, set_algo_table
from .buffers import clear_persistent_buffers
from .line import line_all_gather, line_all_reduce, line_reduce_scatter

__all__ = ["tune"]

_OPS = {
    "reduce_scatter": lambda x, ax, mesh, algo, key: line_reduce_scatter(x, 0, ax, mesh=mesh, algo=algo, buffer_key=key),
    "all_gather": lambda x, ax, mesh, algo, key: line_all_gather(x, 0, ax, mesh=mesh, algo=algo, buffer_key=key),
    "all_reduce": lambda x, ax, mesh, algo, key: line_all_reduce(x, ax, mesh=mesh, algo=algo, buffer_key=key),
}


def tune(mesh: Mesh | None = None, cluster_axis: int | str = 0, *, sizes: Sequence[int] = (1 << 10, 64 << 10, 1 << 20),
         algos: Sequence[str] = ("library", "ring", "line"), reps: int = 3, iters: int = 3,
         install: bool = True) -> dict[str, list[tuple[float, str]]]:
    """Measure the fastest algorithm per op at each size (collective over the axis).

    Parameters
    ----------
    mesh : Mesh, optional
        Default: the current mesh.
    cluster_axis : int or str
        The mesh axis (index or name) measured.
    sizes : sequence of int
        Bytes each rank contributes.
    algos : sequence of str
        The algorithms raced.
    reps, iters : int
        Repetitions (the median wins) of ``iters`` calls each.
    install : bool
        Install the result as the ``algo="auto"`` table (``set_algo_table``).

    Returns
    -------
    dict
        ``{op: [(max_bytes, algo), ...]}``, the same on every rank.
    """
    mesh, axis, g = resolve("tune", mesh, cluster_axis)
    xp = C.backend().xp
    sync = (lambda: __import__("tessera_rt").runtime.synchronize()) if C.backend().is_gpu else (lambda: None)
    table: dict[str, list[tuple[float, str]]] = {}
    for op, run in _OPS.items():
        rows = []
        for nbytes in sorted(int(s) for s in sizes):
            count = max(g.size, nbytes // 4 // g.size * g.size)
            x = xp.ones(count // g.size if op == "all_gather" else count, np.float32)
            times: dict[str, list[float]] = {a: [] for a in algos}
            for a in algos:
                run(x, axis, mesh, a, f"_tune/{op}/{a}")             # warm up: make the buffers
            for _ in range(reps):
                for a in algos:
                    g.comm.mpi.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        run(x, axis, mesh, a, f"_tune/{op}/{a}")
                    sync()
                    times[a].append(g.comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            best = min(algos, key=lambda a: statistics.median(times[a]))
            rows.append((float(count * 4 if op != "all_gather" else count // g.size * 4), best))
            for a in algos:
                clear_persistent_buffers(f"_tune/{op}/{a}")
        rows[-1] = (float("inf"), rows[-1][1])
        table[op] = rows
    if install:
        set_algo_table(table)
    return table
