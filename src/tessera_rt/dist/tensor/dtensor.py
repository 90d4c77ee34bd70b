"""DTensor's constructors: a global tensor stored as one local piece per rank of a mesh
(seed 002 §2.2), made without communication (``from_local`` checks its pieces with one small
all_gather unless ``validate=False``).

    X = dist.distribute(global_array, layout=Col, mesh=mesh)   # same array on every rank
    X = dist.from_local(local, layout=Col, mesh=mesh)          # checks the pieces fit
    X = dist.tensor(shape=(8, 6), layout=Col, mesh=mesh, dtype="bf16")   # zeros
    X = dist.randn((8, 6), layout=Col, mesh=mesh, seed=0)      # same values on any layout

The type itself (its ops, redistribution, NumPy/DLPack/pickle rules) is in ``dtensor_type``;
this module re-exports it, so ``from tessera_rt.dist.tensor.dtensor import DTensor`` holds.
"""
from __future__ import annotations

import numpy as np

from ...backend import get_backend
from ...dtypes import resolve_dtype
from ..comm.hooks import differentiable
from ..comm.mesh import Mesh, current_mesh
from ..comm.process_group import world
from .dtensor_type import DTensor, TensorMeta, meta_of
from .entries import INTEROP
from .layout import Layout, as_layout
from .pieces import check_pieces as _check_pieces
from .rng import counter_values
from .shard import local_offsets, local_shape

__all__ = [
    "DTensor", "TensorMeta", "meta_of", "tensor", "zeros", "ones", "full", "distribute", "from_local",
    "rand", "randn",
]


def _mesh(mesh, what: str) -> Mesh:
    m = mesh if mesh is not None else current_mesh()
    if m is None:
        raise ValueError(f"rank {world().rank}: {what} needs a mesh: pass mesh=, use `with mesh:`, "
                         "or call dist.set_mesh(mesh)")
    if not isinstance(m, Mesh):
        raise TypeError(f"rank {world().rank}: {what}: mesh= must be a dist.Mesh, got {type(m).__name__}")
    m._require_member(what)
    return m


def _shape(shape, what: str) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
            raise ValueError(f"rank {world().rank}: {what}: shape {shape} must be ints >= 0")
    return tuple(int(s) for s in shape)


def _partialize(local, layout: Layout, mesh: Mesh):
    """A replicated value as this rank's share of a pending reduction: for sum, rank 0 of
    each sum axis keeps it and the others hold zeros; max/min/avg keep it everywhere."""
    for a, op in layout.partial:
        if op == "sum" and mesh.coordinate(a) != 0:
            return get_backend().xp.zeros_like(local)
    return local


def full(shape: int | tuple[int, ...], fill_value: float, *, layout: object = None, mesh: Mesh | None = None,
         dtype: object = "float32") -> DTensor:
    """A DTensor filled with ``fill_value``; each rank makes only its piece.

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    fill_value : float
        The value of every element.
    layout : Layout or spec, optional
        ``ShardSpec``, ``ReplicateSpec``, ``PartialSpec`` or ``Layout``; None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        The tensor (under a partial sum layout, one rank holds the value and the others zeros).
    """
    mesh = _mesh(mesh, "dist.full")
    shape = _shape(shape, "dist.full")
    lay = as_layout(layout, shape, mesh)
    dt = resolve_dtype(dtype)
    local = get_backend().xp.full(local_shape(shape, lay, mesh), fill_value, dtype=dt)
    return DTensor._wrap(_partialize(local, lay, mesh), meta_of(lay, shape, dt, mesh))


def tensor(shape: int | tuple[int, ...], layout: object = None, mesh: Mesh | None = None,
           dtype: object = "float32") -> DTensor:
    """A DTensor of zeros (the seeds' ``dist.tensor``).

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        ``zeros(shape, layout=layout, mesh=mesh, dtype=dtype)``.
    """
    return full(shape, 0, layout=layout, mesh=mesh, dtype=dtype)


def zeros(shape: int | tuple[int, ...], *, layout: object = None, mesh: Mesh | None = None,
          dtype: object = "float32") -> DTensor:
    """A DTensor of zeros; each rank makes only its piece.

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        The tensor.
    """
    return full(shape, 0, layout=layout, mesh=mesh, dtype=dtype)


def ones(shape: int | tuple[int, ...], *, layout: object = None, mesh: Mesh | None = None,
         dtype: object = "float32") -> DTensor:
    """A DTensor of ones; each rank makes only its piece.

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        The tensor (under a partial sum layout, one rank holds the ones and the others zeros).
    """
    return full(shape, 1, layout=layout, mesh=mesh, dtype=dtype)


@differentiable("distribute")
def distribute(global_array: object, layout: object = None, mesh: Mesh | None = None) -> DTensor:
    """Cut the same global array (on every rank) into this rank's piece; no communication.

    Parameters
    ----------
    global_array : array
        The whole tensor, the same on every rank.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.

    Returns
    -------
    DTensor
        The tensor with this rank's piece.
    """
    mesh = _mesh(mesh, "dist.distribute")
    backend = get_backend()
    g = INTEROP.as_global(global_array, backend)
    shape = tuple(int(s) for s in g.shape)
    lay = as_layout(layout, shape, mesh)
    offs, sizes = local_offsets(shape, lay, mesh), local_shape(shape, lay, mesh)
    # always a copy: a contiguous slice (a row shard) would otherwise be a view that keeps
    # the whole global array alive on every rank; g[()] of a 0-d array is a scalar, so copy 0-d whole
    local = g[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].copy(order="C") if shape else g.copy()
    return DTensor._wrap(_partialize(local, lay, mesh), meta_of(lay, shape, g.dtype, mesh))


@differentiable("from_local")
def from_local(local: object, layout: object = None, mesh: Mesh | None = None,
               shape: tuple[int, ...] | None = None, *, validate: bool = True) -> DTensor:
    """Wrap this rank's piece.

    Parameters
    ----------
    local : array
        This rank's piece under ``layout``.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    shape : tuple of int, optional
        The global shape; inferred from the pieces when left out.
    validate : bool
        The ranks exchange their local shapes (one small all_gather) and every rank raises
        the same ValueError if the pieces do not make up ``shape`` under ``layout``.

    Returns
    -------
    DTensor
        The tensor (``local`` is not copied).
    """
    mesh = _mesh(mesh, "dist.from_local")
    backend = get_backend()
    if not backend.is_array(local):
        local = backend.xp.asarray(local)
    lshape = tuple(int(s) for s in local.shape)
    if shape is not None:
        shape = _shape(shape, "dist.from_local")
    if validate:
        shape = _check_pieces(lshape, local.dtype, layout, mesh, shape)
    elif shape is None:
        raise ValueError(f"rank {world().rank}: dist.from_local(validate=False) needs shape=")
    lay = as_layout(layout, shape, mesh)
    if not validate and lshape != local_shape(shape, lay, mesh):
        raise ValueError(f"rank {world().rank}: dist.from_local: local shape {lshape} is not this rank's "
                         f"piece {local_shape(shape, lay, mesh)} of {shape} under {lay!r}")
    return DTensor._wrap(local, meta_of(lay, shape, local.dtype, mesh))


# --------------------------------------------------------------------------- random (rng.py)

def _random(kind: str, shape, layout, mesh, seed: int, dtype) -> DTensor:
    mesh = _mesh(mesh, f"dist.{kind}")
    shape = _shape(shape, f"dist.{kind}")
    lay = as_layout(layout, shape, mesh)
    dt = resolve_dtype(dtype)
    xp = get_backend().xp
    offs, sizes = local_offsets(shape, lay, mesh), local_shape(shape, lay, mesh)
    vals = counter_values(xp, kind, shape, offs, sizes, seed)
    local = xp.ascontiguousarray(vals.astype(dt))
    return DTensor._wrap(_partialize(local, lay, mesh), meta_of(lay, shape, dt, mesh))


def rand(shape: int | tuple[int, ...], *, layout: object = None, mesh: Mesh | None = None, seed: int = 0,
         dtype: object = "float32") -> DTensor:
    """Uniform [0, 1) values that depend only on (seed, global index): the same global
    tensor whatever the mesh and layout; each rank computes only its piece.

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    seed : int
        The stream's seed.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        The tensor.
    """
    return _random("rand", shape, layout, mesh, seed, dtype)


def randn(shape: int | tuple[int, ...], *, layout: object = None, mesh: Mesh | None = None, seed: int = 0,
          dtype: object = "float32") -> DTensor:
    """Standard normal values, the same global tensor whatever the mesh and layout.

    Parameters
    ----------
    shape : int or tuple of int
        The global shape.
    layout : Layout or spec, optional
        None: replicated.
    mesh : Mesh, optional
        Default: the current mesh.
    seed : int
        The stream's seed.
    dtype : str or dtype
        The element type.

    Returns
    -------
    DTensor
        The tensor.
    """
    return _random("randn", shape, layout, mesh, seed, dtype)
