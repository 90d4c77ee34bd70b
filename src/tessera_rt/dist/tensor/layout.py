"""Layouts: how a tensor's global index space maps onto a device mesh (seed 002 §2.2, 000 §2.2).

Users write mesh-independent *specs*; a DTensor carries the resolved ``Layout``::

    dist.ReplicateSpec(mesh_axes=("tp", "dp"))                  # R
    dist.ShardSpec(partition=("col",), mesh_axes=("tp",))       # S(col@tp)
    dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp"))
    dist.ShardSpec(partition=("col",), mesh_axes=(("tp", "dp"),))   # one dim over tp*dp
    dist.PartialSpec(op="sum", mesh_axes=("tp",))               # P(sum@tp): a pending reduction

``partition`` names dims: ``"row"`` is dim -2, ``"col"`` dim -1, ``"experts"`` dim 0, an int
is that dim.  ``mesh_axes[i]`` is the axis (or tuple of axes, major first) that shards
``partition[i]``; ``partition=("col",), mesh_axes=("tp", "dp")`` (one dim, several axes) is
read as the dim over ``("tp", "dp")``.  Mesh axes a spec does not name are replicated.

A ``Layout`` is the canonical value: for each tensor dim the mesh axes that shard it
(major first), and the mesh axes that hold a pending reduction.  Its repr is short
(``S(1)@tp``, ``(S(0)@dp, P(sum)@tp)``, ``R``), and ``placements(mesh)`` gives the
per-mesh-axis view (``(S(1), R)``) that PyTorch users know.  All of these are frozen and
hashable, so rules and plans are cached on them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "REDUCE_OPS", "Layout", "ShardSpec", "ReplicateSpec", "PartialSpec", "Placement",
    "Replicate", "Shard", "Partial", "REPLICATE", "as_layout", "LayoutError",
]

REDUCE_OPS = ("sum", "max", "min", "avg")
_DIM_NAMES = {"row": -2, "col": -1, "experts": 0}


class LayoutError(ValueError):
    """A layout that does not fit the tensor or the mesh."""


# --------------------------------------------------------------------------- placements

@dataclass(frozen=True)
class Placement:
    """What one mesh axis does to a tensor: replicate (R), shard a dim (S(d)), or hold a
    pending reduction (P(op)).  The per-axis view of a Layout, for display and for users
    coming from PyTorch; the runtime itself works on Layouts.

    Parameters
    ----------
    kind : {"R", "S", "P"}
        Replicate, shard or partial.
    dim : int
        The sharded dim (kind "S").
    op : str
        The pending reduction (kind "P").
    """
    kind: str                 # "R", "S" or "P"
    dim: int = -1
    op: str = ""

    def __repr__(self) -> str:
        return {"R": "R", "S": f"S({self.dim})", "P": f"P({self.op})"}[self.kind]


REPLICATE_P = Placement("R")


def Replicate() -> Placement:           # PyTorch spelling
    """The replicated placement, ``R``.

    Returns
    -------
    Placement
        ``Placement("R")``.
    """
    return REPLICATE_P


def Shard(dim: int) -> Placement:
    """The placement sharding ``dim``, ``S(dim)``.

    Parameters
    ----------
    dim : int
        The tensor dim split over the axis.

    Returns
    -------
    Placement
        ``Placement("S", dim=dim)``.
    """
    return Placement("S", dim=dim)


def Partial(op: str = "sum") -> Placement:
    """The pending reduction placement, ``P(op)``.

    Parameters
    ----------
    op : {"sum", "max", "min", "avg"}
        The reduction pending over the axis.

    Returns
    -------
    Placement
        ``Placement("P", op=op)``.
    """
    _check_op(op, "Partial")
    return Placement("P", op=op)


def _check_op(op: str, where: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{where}: reduce op {op!r} is not one of {list(REDUCE_OPS)}")


# --------------------------------------------------------------------------- Layout

@dataclass(frozen=True)
class Layout:
    """Resolved layout of an ``ndim``-dim tensor (``as_layout`` makes it from a spec).

    Parameters
    ----------
    dims : tuple of tuple of str
        ``dims[d]``: mesh axes sharding dim d, major first (() = not sharded).
    partial : tuple of (str, str)
        ``((axis, op), ...)`` pending reductions, sorted by axis name.
    """
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, str], ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicate(self) -> bool:
        return not self.partial and not any(self.dims)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for axes in self.dims for a in axes)

    @property
    def partial_axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.partial)

    def partial_op(self, axis: str) -> str | None:
        """The reduction pending over ``axis``.

        Parameters
        ----------
        axis : str
            A mesh axis.

        Returns
        -------
        str or None
            None when nothing is pending there.
        """
        for a, op in self.partial:
            if a == axis:
                return op
        return None

    def dim_of(self, axis: str) -> int | None:
        """The dim ``axis`` shards.

        Parameters
        ----------
        axis : str
            A mesh axis.

        Returns
        -------
        int or None
            None when it shards no dim.
        """
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def placements(self, mesh: Any) -> tuple[Placement, ...]:
        """One placement per mesh axis, in mesh order: ``(S(1), R)``.

        Parameters
        ----------
        mesh : Mesh
            The mesh whose axes are listed.

        Returns
        -------
        tuple of Placement
            One per axis.
        """
        out = []
        for a in mesh.axes:
            d, op = self.dim_of(a), self.partial_op(a)
            out.append(Shard(d) if d is not None else Partial(op) if op else REPLICATE_P)
        return tuple(out)

    def __repr__(self) -> str:
        parts = [f"S({d})@{'.'.join(axes)}" for d, axes in enumerate(self.dims) if axes]
        parts += [f"P({op})@{a}" for a, op in self.partial]
        if not parts:
            return "R"
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"

    # functional edits (used by rules and the planner) ---------------------------
    def with_dims(self, dims: Iterable) -> Layout:
        """This layout with other dim shardings (the pending reductions kept).

        Parameters
        ----------
        dims : iterable of iterable of str
            Mesh axes per dim.

        Returns
        -------
        Layout
            The new layout.
        """
        return Layout(tuple(tuple(a) for a in dims), self.partial)

    def with_partial(self, partial: Any) -> Layout:
        """This layout with other pending reductions (the dims kept).

        Parameters
        ----------
        partial : dict or iterable of (str, str)
            ``{axis: op}``.

        Returns
        -------
        Layout
            The new layout.
        """
        return Layout(self.dims, tuple(sorted(dict(partial).items())))

    def validate(self, shape: tuple[int, ...], mesh: Any, *, what: str = "layout") -> Layout:
        """Raise LayoutError unless this layout fits ``shape`` on ``mesh``.

        Parameters
        ----------
        shape : tuple of int
            The global shape.
        mesh : Mesh
            The mesh.
        what : str
            Names the tensor in the error.

        Returns
        -------
        Layout
            This layout.
        """
        return _validate(self, tuple(shape), mesh, what)


# cache: ndim -> the replicated Layout of that rank
REPLICATE_CACHE: dict[int, Layout] = {}


def REPLICATE(ndim: int) -> Layout:      # a constant per ndim
    lay = REPLICATE_CACHE.get(ndim)
    if lay is None:
        lay = REPLICATE_CACHE[ndim] = Layout(((),) * ndim)
    return lay


def _mesh_desc(mesh) -> str:
    return "{" + ", ".join(f"{a}: {s}" for a, s in zip(mesh.axes, mesh.sizes)) + "}"


@lru_cache(maxsize=4096)
def _validate_cached(layout: Layout, shape: tuple, mesh) -> None:
    _validate_uncached(layout, shape, mesh, "layout")


def _validate(layout: Layout, shape: tuple, mesh, what: str) -> Layout:
    if what == "layout":
        _validate_cached(layout, shape, mesh)
    else:
        _validate_uncached(layout, shape, mesh, what)
    return layout


def _validate_uncached(layout: Layout, shape: tuple, mesh, what: str) -> None:
    from ..comm.process_group import world
    where = f"rank {world().rank}: {what} {layout!r} for shape {shape} on mesh {_mesh_desc(mesh)}"
    if len(layout.dims) != len(shape):
        raise LayoutError(f"{where}: the layout has {len(layout.dims)} dims but the tensor has {len(shape)}")
    seen: dict[str, str] = {}
    for d, axes in enumerate(layout.dims):
        for a in axes:
            if a not in mesh.axes:
                raise LayoutError(f"{where}: dim {d} (size {shape[d]}) is sharded over mesh axis {a!r}, "
                                  f"which the mesh does not have; use one of {list(mesh.axes)}")
            if a in seen:
                raise LayoutError(f"{where}: mesh axis {a!r} (size {mesh.size(a)}) is used by {seen[a]} "
                                  f"and by dim {d}; a mesh axis may shard one dim only")
            seen[a] = f"dim {d}"
    for a, op in layout.partial:
        _check_op(op, where)
        if a not in mesh.axes:
            raise LayoutError(f"{where}: partial over mesh axis {a!r}, which the mesh does not have; "
                              f"use one of {list(mesh.axes)}")
        if a in seen:
            raise LayoutError(f"{where}: mesh axis {a!r} (size {mesh.size(a)}) is both {seen[a]} and a "
                              "pending reduction; give each mesh axis one role")
        seen[a] = f"P({op})"
    ops = sorted({op for _, op in layout.partial})
    if len(ops) > 1 and not set(ops) <= {"sum", "avg"}:
        raise LayoutError(f"{where}: pending reductions of different kinds ({', '.join(ops)}) have no single "
                          "meaning (the order of the reductions would matter); reduce one first")


# --------------------------------------------------------------------------- specs

def _axes_tuple(v, where: str) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    try:
        axes = tuple(v)
    except TypeError:
        raise TypeError(f"{where}: mesh axes must be names or tuples of names, got {v!r}") from None
    for a in axes:
        if not isinstance(a, str):
            raise TypeError(f"{where}: mesh axes must be names or tuples of names, got {v!r}")
    return axes


@dataclass(frozen=True, init=False)
class ShardSpec:
    """Shard ``partition[i]`` over ``mesh_axes[i]``; optionally with pending reductions
    (``partial={"dp": "sum"}``) on other axes.

    Parameters
    ----------
    partition : int, str or iterable
        The sharded dims: ints, or "row" (-2), "col" (-1), "experts" (0).
    mesh_axes : str or iterable
        The mesh axis (or a tuple of axes, major first) for each entry of ``partition``.
    partial : dict or iterable of (str, str)
        ``{axis: op}`` pending reductions on other axes.
    """
    partition: tuple
    mesh_axes: tuple
    partial: tuple = ()

    def __init__(self, partition: Iterable = (), mesh_axes: Iterable = (), partial: Any = ()):
        part = (partition,) if isinstance(partition, (str, int)) else tuple(partition)
        axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        where = f"ShardSpec(partition={part!r}, mesh_axes={axes!r})"
        if len(part) == 1 and len(axes) > 1 and all(isinstance(a, str) for a in axes):
            axes = (axes,)               # one dim over several axes
        if len(part) != len(axes):
            raise ValueError(f"{where}: {len(part)} partition entries but {len(axes)} mesh axes; give one "
                             "mesh axis (or a tuple of axes) per partitioned dim")
        for p in part:
            if not (isinstance(p, int) and not isinstance(p, bool)) and p not in _DIM_NAMES:
                raise ValueError(f"{where}: partition entry {p!r} is not a dim; use an int or one of "
                                 f"{sorted(_DIM_NAMES)}")
        norm_axes = tuple(_axes_tuple(a, where) for a in axes)
        if isinstance(partial, dict):
            partial = tuple(partial.items())
        partial = tuple(sorted((str(a), str(op)) for a, op in partial))
        for a, op in partial:
            _check_op(op, where)
        object.__setattr__(self, "partition", part)
        object.__setattr__(self, "mesh_axes", norm_axes)
        object.__setattr__(self, "partial", partial)

    def __repr__(self) -> str:
        body = ", ".join(f"{p}@{'.'.join(a)}" for p, a in zip(self.partition, self.mesh_axes))
        extra = "".join(f", P({op}@{a})" for a, op in self.partial)
        return f"S({body}){extra}"


@dataclass(frozen=True, init=False)
class ReplicateSpec:
    """Every rank holds the whole tensor.

    Parameters
    ----------
    mesh_axes : iterable of str
        The axes it is replicated over (checked against the mesh); axes it leaves out are
        replicated too.
    """
    mesh_axes: tuple = ()

    def __init__(self, mesh_axes: Iterable[str] = ()):
        object.__setattr__(self, "mesh_axes", _axes_tuple(mesh_axes, "ReplicateSpec"))

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, init=False)
class PartialSpec:
    """A pending reduction: the tensor is the ``op`` of every rank's local tensor over
    ``mesh_axes``.

    Parameters
    ----------
    op : {"sum", "max", "min", "avg"}
        The reduction.
    mesh_axes : iterable of str
        The axes it is pending over.
    """
    op: str = "sum"
    mesh_axes: tuple = ()

    def __init__(self, op: str = "sum", mesh_axes: Iterable[str] = ()):
        _check_op(op, "PartialSpec")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "mesh_axes", _axes_tuple(mesh_axes, "PartialSpec"))

    def __repr__(self) -> str:
        return f"P({self.op}@{'.'.join(self.mesh_axes)})"


def _dim(p, ndim: int, spec, shape) -> int:
    d = _DIM_NAMES[p] if isinstance(p, str) else p      # (a name is one of them: checked on construction)
    if not -ndim <= d < ndim:
        raise LayoutError(f"{spec!r}: partition entry {p!r} is dim {d}, out of range for a "
                          f"{ndim}-dim tensor of shape {shape}")
    return d % ndim


@lru_cache(maxsize=4096)
def _resolve(spec, shape: tuple, mesh) -> Layout:
    ndim = len(shape)
    if isinstance(spec, Layout):
        lay = spec
    elif isinstance(spec, ReplicateSpec):
        for a in spec.mesh_axes:
            if a not in mesh.axes:
                raise LayoutError(f"{spec!r} (ReplicateSpec(mesh_axes={spec.mesh_axes})): mesh axis {a!r} "
                                  f"is not in mesh {_mesh_desc(mesh)}; use axes from {list(mesh.axes)}")
        lay = REPLICATE(ndim)
    elif isinstance(spec, PartialSpec):
        axes = spec.mesh_axes or mesh.axes
        lay = Layout(((),) * ndim, tuple(sorted((a, spec.op) for a in axes)))
    elif isinstance(spec, ShardSpec):
        dims: list[tuple[str, ...]] = [()] * ndim
        for p, axes in zip(spec.partition, spec.mesh_axes):
            d = _dim(p, ndim, spec, shape)
            if dims[d]:
                raise LayoutError(f"{spec!r}: dim {d} (size {shape[d]}) is named twice in partition "
                                  f"{spec.partition}; list it once with a tuple of mesh axes")
            dims[d] = axes
        lay = Layout(tuple(dims), spec.partial)
    else:
        raise TypeError(f"layout must be a ShardSpec, ReplicateSpec, PartialSpec or Layout, got "
                        f"{type(spec).__name__} {spec!r}")
    return _validate(lay, shape, mesh, "layout" if isinstance(spec, Layout) else f"{spec!r} ->")


def as_layout(spec: Any, shape: tuple, mesh: Any) -> Layout:
    """Resolve any spec (or a Layout) for a tensor of global ``shape`` on ``mesh``.

    Parameters
    ----------
    spec : ShardSpec, ReplicateSpec, PartialSpec, Layout or None
        The layout asked for (None: replicated).
    shape : tuple of int
        The global shape.
    mesh : Mesh
        The mesh whose axes the spec names.

    Returns
    -------
    Layout
        The resolved layout; raises LayoutError naming the dim, the mesh axis and the sizes
        when it does not fit.
    """
    if spec is None:
        return REPLICATE(len(shape))
    return _resolve(spec, tuple(shape), mesh)
