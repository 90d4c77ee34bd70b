"""Shard math: pure functions from (global shape, layout, mesh position) to local pieces.

Uneven split convention ("array_split"): a length ``L`` over ``n`` ranks gives the first
``L % n`` ranks ``L // n + 1`` elements and the rest ``L // n``, so ``L < n`` leaves some
ranks with zero.  A dim sharded over several mesh axes ``(a, b)`` is split hierarchically:
first into ``n_a`` parts over ``a`` (major), then each part into ``n_b`` parts over ``b``.
With even splits this is the flat row-major order of JAX's ``P(("a", "b"))``; with uneven
ones it keeps "gather the minor axis" a single all_gather.

Nothing here talks to a communicator; everything is cached on hashable arguments.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import product

from ..comm.mesh import Mesh
from .layout import Layout

__all__ = [
    "split_sizes", "split_offsets", "dim_extent", "dim_extents_all", "local_shape", "local_offsets",
    "local_slices", "local_shape_at",
]


@lru_cache(maxsize=8192)
def split_sizes(length: int, n: int) -> tuple[int, ...]:
    """Part sizes of ``length`` over ``n`` ranks: the first ``length % n`` get one extra.

    Parameters
    ----------
    length : int
        The dim's global length.
    n : int
        The number of parts.

    Returns
    -------
    tuple of int
        ``n`` sizes summing to ``length``.
    """
    q, r = divmod(length, n)
    return tuple(q + 1 if i < r else q for i in range(n))


@lru_cache(maxsize=8192)
def split_offsets(length: int, n: int) -> tuple[int, ...]:
    """Where each of ``split_sizes(length, n)``'s parts starts.

    Parameters
    ----------
    length : int
        The dim's global length.
    n : int
        The number of parts.

    Returns
    -------
    tuple of int
        ``n`` offsets, the first 0.
    """
    q, r = divmod(length, n)
    return tuple(i * q + min(i, r) for i in range(n))


def dim_extent(length: int, axis_sizes: tuple[int, ...], coords: tuple[int, ...]) -> tuple[int, int]:
    """(offset, size) of the piece at ``coords`` (one coordinate per axis, major first)."""
    off, size = 0, length
    for n, c in zip(axis_sizes, coords):
        q, r = divmod(size, n)
        off += c * q + min(c, r)
        size = q + 1 if c < r else q
    return off, size


@lru_cache(maxsize=4096)
def dim_extents_all(length: int, axis_sizes: tuple[int, ...]) -> dict:
    """{coords: (offset, size)} for every position over the axes (validation, reshape rules)."""
    return {c: dim_extent(length, axis_sizes, c) for c in product(*(range(n) for n in axis_sizes))}


def _axis_info(mesh, axes: tuple[str, ...], coords: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(mesh.size(a) for a in axes), tuple(coords[a] for a in axes)


@lru_cache(maxsize=8192)
def _local(shape: tuple, layout: Layout, mesh, coords_key: tuple) -> tuple[tuple, tuple]:
    coords = dict(zip(mesh.axes, coords_key))
    offs, sizes = [], []
    for length, axes in zip(shape, layout.dims):
        if axes:
            off, size = dim_extent(length, *_axis_info(mesh, axes, coords))
        else:
            off, size = 0, length
        offs.append(off)
        sizes.append(size)
    return tuple(offs), tuple(sizes)


def _coords_key(mesh, coords) -> tuple:
    if coords is None:
        c = mesh.coords
        if c is None:
            mesh._require_member("a DTensor")
        coords = c
    return tuple(coords[a] for a in mesh.axes)


def local_shape(shape: tuple, layout: Layout, mesh: Mesh, coords: dict | None = None) -> tuple[int, ...]:
    """This rank's (or ``coords``') local shape for a tensor of global ``shape``.

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    layout : Layout
        The resolved layout (``as_layout``).
    mesh : Mesh
        The mesh the layout names axes of.
    coords : dict, optional
        ``{axis: coordinate}`` of another position; default this rank's.

    Returns
    -------
    tuple of int
        The piece's shape.
    """
    return _local(tuple(shape), layout, mesh, _coords_key(mesh, coords))[1]


def local_shape_at(shape: tuple, layout: Layout, mesh, coords_key: tuple) -> tuple[int, ...]:
    return _local(tuple(shape), layout, mesh, coords_key)[1]


def local_offsets(shape: tuple, layout: Layout, mesh, coords: dict | None = None) -> tuple[int, ...]:
    return _local(tuple(shape), layout, mesh, _coords_key(mesh, coords))[0]


def local_slices(shape: tuple, layout: Layout, mesh: Mesh, coords: dict | None = None) -> tuple[slice, ...]:
    """The index of this rank's piece in the global tensor.

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    layout : Layout
        The resolved layout (``as_layout``).
    mesh : Mesh
        The mesh the layout names axes of.
    coords : dict, optional
        ``{axis: coordinate}`` of another position; default this rank's.

    Returns
    -------
    tuple of slice
        One slice per dim: ``global[local_slices(...)]`` is the piece.
    """
    offs, sizes = _local(tuple(shape), layout, mesh, _coords_key(mesh, coords))
    return tuple(slice(o, o + s) for o, s in zip(offs, sizes))
