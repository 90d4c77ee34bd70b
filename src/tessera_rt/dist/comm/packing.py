"""Parts of a tensor along a dim as one flat buffer, and back (the layout MPI and NCCL move
for reduce_scatter / all_gather / all_to_all along a dim other than 0)."""
from __future__ import annotations

import math

from ...backend import get_backend

__all__: list = []     # internal to dist


def with_dim(shape: tuple, dim: int, length: int) -> tuple:
    return shape[:dim] + (length,) + shape[dim + 1:]


# Parts along a dim other than 0 are not contiguous.  _pack lays them out one after another
# (one copy) so MPI/NCCL move flat runs; _unpack is its inverse (one copy).  Equal parts
# take one vectorized copy; dims before ``dim`` of size 1 need no copy at all.

def _pack(x, dim: int, sizes, even: bool):
    """x's parts along ``dim`` (lengths ``sizes``), each contiguous, in one flat buffer."""
    if dim == 0 or math.prod(x.shape[:dim]) == 1:
        return x.reshape(-1)
    b = get_backend()
    buf = b.empty((x.size,), x.dtype)
    if even:
        n, part = len(sizes), sizes[0]
        split = x.shape[:dim] + (n, part) + x.shape[dim + 1:]
        buf.reshape((n,) + with_dim(x.shape, dim, part))[...] = b.xp.moveaxis(x.reshape(split), dim, 0)
        return buf
    pos = off = 0
    for p in sizes:
        piece = with_dim(x.shape, dim, p)
        cnt = math.prod(piece)
        buf[pos:pos + cnt].reshape(piece)[...] = x[(slice(None),) * dim + (slice(off, off + p),)]
        pos, off = pos + cnt, off + p
    return buf


def _unpack(flat, shape: tuple, dim: int, sizes, even: bool, out):
    """Inverse of _pack: the parts in ``flat`` concatenated along ``dim`` into ``out`` (of ``shape``)."""
    if dim == 0 or math.prod(shape[:dim]) == 1:
        out.reshape(-1)[...] = flat
        return out
    xp = get_backend().xp
    if even:
        n, part = len(sizes), sizes[0]
        out.reshape(shape[:dim] + (n, part) + shape[dim + 1:])[...] = xp.moveaxis(
            flat.reshape((n,) + with_dim(shape, dim, part)), 0, dim)
        return out
    pos = off = 0
    for p in sizes:
        piece = with_dim(shape, dim, p)
        cnt = math.prod(piece)
        out[(slice(None),) * dim + (slice(off, off + p),)] = flat[pos:pos + cnt].reshape(piece)
        pos, off = pos + cnt, off + p
    return out


def _even(sizes) -> bool:
    return min(sizes) == max(sizes)


def then_unpack(p, recv, out):
    """What runs once the flat ``recv`` has arrived: lay it out along ``p.dim`` into ``out``.
    (Made here, not as a closure in the collective: captured names become cells, which
    every call of the collective would pay for, on its direct path too.)"""
    return lambda: _unpack(recv, p.shape, p.dim, p.sizes, p.even, out)
