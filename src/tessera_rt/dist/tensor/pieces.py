"""Do the ranks' local pieces make up one global tensor?  ``dist.from_local`` asks the mesh
(one all_gather of every rank's piece shape and dtype) and names the ranks whose piece does
not fit the layout, or works the global shape out from the pieces."""
from __future__ import annotations

import numpy as np

from ...dtypes import dtype_name
from ..comm import collectives as C
from ..comm.mesh import Mesh
from ..comm.process_group import world
from .layout import as_layout
from .shard import local_shape_at

__all__ = ["check_pieces"]

_MAX_DIMS = 16


def check_pieces(lshape, dtype, layout, mesh: Mesh, shape):
    """``dist.from_local``'s check that every rank's local piece (``lshape``, ``dtype``) fits
    one global tensor under ``layout``; returns the global shape (``shape``, or the one the
    pieces make up).  Collective over ``mesh``: one all_gather of the pieces' shapes."""
    if len(lshape) > _MAX_DIMS:
        raise ValueError(f"rank {world().rank}: dist.from_local supports up to {_MAX_DIMS} dims")
    info = np.full(2 + _MAX_DIMS, -1, np.int64)
    info[0], info[1] = len(lshape), np.dtype(dtype).num
    info[2:2 + len(lshape)] = lshape
    every = C.all_gather(info, mesh.axes, mesh=mesh).reshape(-1, 2 + _MAX_DIMS)
    positions = list(np.ndindex(*mesh.sizes))
    ranks = [int(mesh.device_grid[p]) for p in positions]
    shapes = [tuple(int(s) for s in row[2:2 + int(row[0])]) for row in every]
    where = f"rank {world().rank}: dist.from_local(layout={layout!r}, mesh={mesh!r}, shape={shape})"
    if len({int(row[0]) for row in every}) > 1 or len({int(row[1]) for row in every}) > 1:
        mine = np.dtype(dtype)
        desc = ", ".join(f"rank {r}: {len(s)} dims{'' if int(row[1]) == mine.num else ', another dtype'}"
                         for r, s, row in zip(ranks, shapes, every))
        raise ValueError(f"{where}: the ranks' local pieces differ in ndim or dtype ({desc}; this rank has "
                         f"{dtype_name(mine)}); every rank must pass a piece with the same number of dims "
                         "and the same dtype")
    ndim = len(shapes[0])
    if shape is None:
        probe = as_layout(layout, (0,) * ndim, mesh)
        shape = []
        for d, axes in enumerate(probe.dims):
            if not axes:
                shape.append(shapes[0][d])
                continue
            idx = [mesh.axis_index(a) for a in axes]
            seen: dict = {}
            for p, s in zip(positions, shapes):
                seen.setdefault(tuple(p[i] for i in idx), s[d])
            shape.append(sum(seen.values()))
        shape = tuple(shape)
    if len(shape) != ndim:
        raise ValueError(f"{where}: the local pieces have {ndim} dims but shape has {len(shape)}")
    lay = as_layout(layout, shape, mesh)
    bad = [(r, s, local_shape_at(shape, lay, mesh, p)) for r, s, p in zip(ranks, shapes, positions)
           if s != local_shape_at(shape, lay, mesh, p)]
    if bad:
        desc = "; ".join(f"rank {r} has {s}, expected {e}" for r, s, e in bad[:8])
        raise ValueError(f"{where}: the local pieces do not make up global shape {shape} under {lay!r} "
                         f"(uneven split: the first L % n ranks of an axis get one extra): {desc}. "
                         "Pass each rank its piece, or give the right shape=")
    return shape
