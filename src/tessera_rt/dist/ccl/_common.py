"""What every ccl op shares: the cluster axis and its group, the algorithm choice, errors.

``cluster_axis`` is a mesh axis index (0 = the first axis: rows of an (8, 4) Galaxy mesh)
or an axis name.  ``algo`` is one of ``ALGOS``; ``"auto"`` looks the message size up in a
per-op table (``algo_table``/``set_algo_table``, or ``tune`` to measure one), and
``TESSERA_COMM_ALGO`` overrides every choice for a run.
"""
from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from typing import Any

from ..comm import collectives as C
from ..comm.mesh import AxisGroup, Mesh, current_mesh
from ..comm.plans import clear_plans, plan
from ..comm.process_group import world

__all__ = [
    "ALGOS", "resolve", "where", "choose_algo", "algo_table", "set_algo_table", "DEFAULT_TABLE",
    "check_array", "algo_override", "reset_algo_override", "TAGS", "plan", "clear_plans",
]

ALGOS = ("ring", "line", "library", "auto")

# (upper bound in bytes of the message this rank contributes, algorithm) in rising order; the
# first row whose bound is >= the size wins.  Measured on the CPU/MPI path (scripts/bench_ccl.py,
# MPICH 4, 2 and 4 ranks on 2 cores, BENCHMARKS.md): MPI's own collectives win up to 16 MiB and
# for reduce-scatter and all-gather at every size, but this package's ring all-reduce beats
# MPICH's from 32 MiB (1.57-1.66x at 32 and 64 MiB, 2 and 4 ranks); on GPUs the ring's
# persistent buffers pay off from 64 KiB (seed 004).
DEFAULT_TABLE: dict[str, dict[str, list[tuple[float, str]]]] = {
    "cpu": {"reduce_scatter": [(float("inf"), "library")], "all_gather": [(float("inf"), "library")],
            "all_reduce": [(16 << 20, "library"), (float("inf"), "ring")]},
    "cuda": {op: [(64 << 10, "library"), (float("inf"), "ring")]
             for op in ("reduce_scatter", "all_gather", "all_reduce")},
}
# this run's per-size algorithm table (a cache of DEFAULT_TABLE for the backend, or set_algo_table's)
_TABLE: dict[str, list[tuple[float, str]]] = {}


def algo_table() -> dict[str, list[tuple[float, str]]]:
    """The table ``algo="auto"`` reads.

    Returns
    -------
    dict
        ``{op: [(max_bytes, algo), ...]}``: the first row whose ``max_bytes`` holds the
        per-rank size picks the algorithm.
    """
    if not _TABLE:
        _TABLE.update({k: list(v) for k, v in DEFAULT_TABLE[world().backend.name].items()})
    return {k: list(v) for k, v in _TABLE.items()}


def set_algo_table(table: dict[str, list[tuple[float, str]]] | None) -> None:
    """Install a measured table (``tune`` does after measuring).

    Parameters
    ----------
    table : dict or None
        ``{op: [(max_bytes, algo), ...]}``; None: back to the default.
    """
    _TABLE.clear()
    clear_plans()                       # plans hold the algorithm the old table chose
    if table is None:
        return
    for op, rows in table.items():
        rows = sorted((float(b), str(a)) for b, a in rows)
        bad = [a for _, a in rows if a not in ALGOS[:3]]
        if bad or not rows or rows[-1][0] != float("inf"):
            raise ValueError(f"set_algo_table: rows for {op!r} must be (max_bytes, algo) with algo in "
                             f"{ALGOS[:3]} and the last bound inf (covering every size); got {rows}")
        _TABLE[op] = rows
    base = DEFAULT_TABLE[world().backend.name]
    for op, rows in base.items():
        _TABLE.setdefault(op, list(rows))


_OVERRIDE: list = []        # [TESSERA_COMM_ALGO's algorithm or None], read once per run


def algo_override() -> str | None:
    """``TESSERA_COMM_ALGO`` (ring|line|library, or tree, which means the library), read on
    first use (os.environ costs microseconds per call); ``reset_algo_override`` re-reads it."""
    if _OVERRIDE:
        return _OVERRIDE[0]
    v = (os.environ.get("TESSERA_COMM_ALGO") or "").strip().lower()
    if v and v not in ALGOS[:3] + ("tree",):
        raise ValueError(f"TESSERA_COMM_ALGO={v!r}: use one of ring, line, library, tree (or leave it unset)")
    _OVERRIDE.append({"": None, "tree": "library"}.get(v, v))     # tree: MPI/NCCL pick their trees
    return _OVERRIDE[0]


def reset_algo_override() -> None:
    """Read ``TESSERA_COMM_ALGO`` again at the next call (after changing it in-process)."""
    _OVERRIDE.clear()
    clear_plans()


TAGS = C.TAGS          # one list of hints, the plain collectives' (dist.comm.collectives)


def choose_algo(op: str, algo: str, nbytes: int, where_: Callable[[], str], tag: str | None = None) -> str:
    """The algorithm this call runs (the same on every rank: it depends only on arguments).
    Precedence: TESSERA_COMM_ALGO, then an explicit ``algo``, then ``tag`` ("ring": this
    package's ring; "tree": the library, whose MPI/NCCL pick tree algorithms), then the table."""
    if algo not in ALGOS:
        raise ValueError(f"{where_()}: algo={algo!r}; use one of {ALGOS}")
    if tag is not None and tag not in TAGS:
        raise ValueError(f"{where_()}: tag={tag!r}; use one of {TAGS} (or leave it out)")
    forced = algo_override()
    if forced is not None:
        return forced
    if algo != "auto":
        return algo
    if tag is not None:
        return "ring" if tag == "ring" else "library"
    if not _TABLE:
        algo_table()
    rows = _TABLE[op]
    i = bisect.bisect_left(rows, (nbytes, ""))
    return rows[min(i, len(rows) - 1)][1]


def resolve(op: str, mesh: Mesh | None, cluster_axis: Any) -> tuple[Mesh, str, AxisGroup]:
    """(mesh, axis name, this rank's group along it); errors name the mesh's axes."""
    rank = world().rank
    if mesh is None:
        mesh = current_mesh()
        if mesh is None:
            raise ValueError(f"rank {rank}: ccl.{op} needs a mesh: pass mesh=, use `with mesh:`, "
                             "or call dist.set_mesh(mesh)")
    if isinstance(cluster_axis, bool) or not isinstance(cluster_axis, (int, str)):
        raise TypeError(f"rank {rank}: ccl.{op}: cluster_axis must be an int index or an axis name of "
                        f"{mesh!r}, got {cluster_axis!r}")
    if isinstance(cluster_axis, int):
        if not 0 <= cluster_axis < mesh.ndim:
            raise ValueError(f"rank {rank}: ccl.{op}: cluster_axis={cluster_axis} but the mesh has "
                             f"{mesh.ndim} axes {list(mesh.axes)}; use 0..{mesh.ndim - 1} or an axis name")
        name = mesh.axes[cluster_axis]
    else:
        if cluster_axis not in mesh.axes:
            raise ValueError(f"rank {rank}: ccl.{op}: cluster_axis={cluster_axis!r} is not an axis of "
                             f"the mesh (axes {list(mesh.axes)}); use one of them or its index")
        name = cluster_axis
    mesh._require_member(f"ccl.{op}")
    return mesh, name, mesh.group(name)


def where(op: str, g: AxisGroup, x: Any) -> str:
    return C.where(f"ccl.{op}", g, x)


def check_array(op: str, g: AxisGroup, x: Any):
    """A contiguous array of the backend (DTensors: pass ``.to_local()``)."""
    if type(x).__name__ == "DTensor":
        raise TypeError(f"rank {world().rank}: ccl.{op} takes this rank's local array; pass x.to_local() "
                        "(or use dist.reduce_scatter/all_gather on the DTensor for a layout change)")
    return C.check_array(f"ccl.{op}", g, x)


# Per-call plans: everything a ccl op works out from its arguments alone (the group, the
# normalized dim and part sizes, the algorithm, buffer shapes, this rank's message program,
# and for the library path the plain collective's own plan) keyed by those arguments, in the
# one table the plain collectives use (dist/comm/plans.py), so a repeated call does one lookup.
# A plan is built only when every check passed, so a bad call never reaches the cache.
