"""The seeds' axis collectives, on DTensors as well as arrays (seed 002 §2.7).

    dist.all_reduce(G, axis="dp", op="sum")     # G's per-rank values reduced over dp
    y = dist.all_gather(y_local, axis="tp")     # unshard tp
    dist.reduce_scatter(G, axis="dp", dim=0); dist.all_to_all(X, axis="tp", split_dim=0, concat_dim=1)

Each function is the one public dispatch point for its collective: a plain array goes to
``collectives`` unchanged; a DTensor becomes a layout change run by the redistribution
planner (so its layout stays true).  On a DTensor:

* ``all_reduce`` completes a pending reduction over ``axis``; on a replicated axis it
  reduces the ranks' local values, as the array collective would (per-replica gradients);
* ``all_gather`` unshards ``axis``; ``reduce_scatter`` reduces (as all_reduce) and shards
  ``dim`` over ``axis``; ``all_to_all`` moves ``axis`` from ``concat_dim`` to ``split_dim``;
* ``broadcast`` copies the ``root`` rank's local value along ``axis``; ``send``/``recv``
  move local pieces (pipeline stages).

``async_op=True`` on a DTensor runs the collective at once and returns a completed handle.
Every function is differentiable (``ts.grad``); the VJP rules live in
``tessera_rt.autodiff.dist_vjps``.
"""
from __future__ import annotations

from typing import Any

from ..comm import collectives as C, p2p
from ..comm.hooks import differentiable
from ..comm.mesh import Mesh
from ..comm.process_group import world
from ..comm.work import Work
from .dtensor import DTensor, meta_of
from .layout import REDUCE_OPS, Layout
from .redistribute import plan_redistribute

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv"]



def _ret(result, async_op: bool):
    return Work.completed(result) if async_op else result


def _axes(op: str, x: DTensor, axis, mesh) -> tuple[str, ...]:
    where = f"rank {world().rank}: dist.{op}(DTensor {x.dtype}{list(x.shape)} {x.layout!r}, axis={axis!r})"
    if mesh is not None and mesh != x.mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not the DTensor's mesh {x.mesh!r}; leave mesh= out")
    axes = x.mesh.axes if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    for a in axes:
        if a not in x.mesh.axes:
            raise ValueError(f"{where}: unknown mesh axis {a!r}; {x.mesh!r} has axes {list(x.mesh.axes)}")
    return axes


def _move(x: DTensor, dst: Layout, src: Layout | None = None) -> DTensor:
    m = x._meta
    plan = plan_redistribute(m.shape, src or m.layout, dst, m.mesh, m.dtype)
    out = plan.run(x._local)
    return DTensor._wrap(out, meta_of(dst, m.shape, out.dtype, m.mesh))


def _as_pending(op_name: str, x: DTensor, axes, op: str) -> Layout:
    """x's layout with ``axes`` read as pending ``op`` reductions (errors for sharded axes)."""
    lay = x.layout
    where = f"rank {world().rank}: dist.{op_name}(DTensor {list(x.shape)} {lay!r}, axis={axes}, op={op!r})"
    if op not in REDUCE_OPS:
        raise ValueError(f"{where}: op must be one of {list(REDUCE_OPS)}")
    if op == "avg" and x.dtype.kind not in "fc":
        raise TypeError(f"{where}: op='avg' needs a floating dtype")
    for a in axes:
        d = lay.dim_of(a)
        if d is not None:
            raise ValueError(f"{where}: the tensor is sharded over {a!r} (dim {d}); reducing different pieces "
                             "is not a reduction of the tensor: use all_gather / full_tensor to unshard, or "
                             "redistribute")
        p = lay.partial_op(a)
        if p is not None and p != op:
            raise ValueError(f"{where}: the tensor holds a pending {p} over {a!r}; pass op={p!r}")
    return lay.with_partial({**dict(lay.partial), **{a: op for a in axes}})


@differentiable("all_reduce")  # autodiff hook: traced inputs record the collective
def all_reduce(x, axis=None, op: str = "sum", *, mesh=None, out=None, async_op: bool = False,
               role: str = "tp_collective"):
    """Reduce over ``axis`` (sum, max, min, avg).  Arrays: ``collectives.all_reduce``."""
    if type(x) is not DTensor:
        return C.all_reduce(x, axis, op, mesh=mesh, out=out, async_op=async_op, role=role)
    axes = _axes("all_reduce", x, axis, mesh)
    src = _as_pending("all_reduce", x, axes, op)
    dst = src.with_partial({a: o for a, o in src.partial if a not in axes})
    return _ret(_move(x, dst, src), async_op)


@differentiable("reduce_scatter")  # autodiff hook: traced inputs record the collective
def reduce_scatter(x, axis=None, op: str = "sum", *, dim: int = 0, sizes=None, mesh=None, out=None,
                   async_op: bool = False, role: str = "tp_collective"):
    """Reduce over ``axis`` and shard ``dim`` over it.  Arrays: ``collectives.reduce_scatter``."""
    if type(x) is not DTensor:
        return C.reduce_scatter(x, axis, op, dim=dim, sizes=sizes, mesh=mesh, out=out, async_op=async_op,
                                role=role)
    (a,) = _single("reduce_scatter", x, axis, mesh)
    if sizes is not None:
        raise ValueError(f"rank {world().rank}: dist.reduce_scatter on a DTensor: sizes= comes from the "
                         "layout (uneven split rule); leave it out")
    d = _dim("reduce_scatter", x, dim)
    src = _as_pending("reduce_scatter", x, (a,), op)
    dims = [list(t) for t in src.dims]
    dims[d].append(a)
    dst = Layout(tuple(tuple(t) for t in dims), tuple(p for p in src.partial if p[0] != a))
    return _ret(_move(x, dst, src), async_op)


@differentiable("all_gather")  # autodiff hook: traced inputs record the collective
def all_gather(x, axis=None, *, dim: int | None = None, sizes=None, mesh=None, out=None,
               async_op: bool = False, role: str = "tp_collective"):
    """Unshard ``axis`` (every rank gets the pieces along it).  Arrays: ``collectives.all_gather``
    (``dim`` defaults to 0 there)."""
    if type(x) is not DTensor:
        return C.all_gather(x, axis, dim=0 if dim is None else dim, sizes=sizes, mesh=mesh, out=out,
                            async_op=async_op, role=role)
    axes = _axes("all_gather", x, axis, mesh)
    lay = x.layout
    for a in axes:
        where = f"rank {world().rank}: dist.all_gather(DTensor {list(x.shape)} {lay!r}, axis={axis!r})"
        if lay.partial_op(a):
            raise ValueError(f"{where}: the tensor holds a pending {lay.partial_op(a)} over {a!r}, not shards; "
                             "use dist.all_reduce (or reduce_scatter)")
        if dim is not None and lay.dim_of(a) not in (None, _dim("all_gather", x, dim)):
            raise ValueError(f"{where}: {a!r} shards dim {lay.dim_of(a)}, not dim={dim}")
    dst = lay.with_dims(tuple(tuple(b for b in t if b not in axes) for t in lay.dims))
    return _ret(_move(x, dst), async_op)


@differentiable("all_to_all")  # autodiff hook: traced inputs record the collective
def all_to_all(x, axis=None, *, split_dim: int = 0, concat_dim: int | None = None, split_sizes=None,
               recv_sizes=None, mesh=None, async_op: bool = False, role: str = "a2a"):
    """Move ``axis``'s sharding from ``concat_dim`` to ``split_dim``.  Arrays:
    ``collectives.all_to_all``."""
    if type(x) is not DTensor:
        return C.all_to_all(x, axis, split_dim=split_dim, concat_dim=concat_dim, split_sizes=split_sizes,
                            recv_sizes=recv_sizes, mesh=mesh, async_op=async_op, role=role)
    (a,) = _single("all_to_all", x, axis, mesh)
    lay = x.layout
    s = _dim("all_to_all", x, split_dim)
    c = lay.dim_of(a) if concat_dim is None else _dim("all_to_all", x, concat_dim)
    if c is None or lay.dim_of(a) != c:
        raise ValueError(f"rank {world().rank}: dist.all_to_all(DTensor {list(x.shape)} {lay!r}, axis={a!r}): "
                         f"the tensor must be sharded over {a!r} on concat_dim={concat_dim}")
    dims = [[b for b in t if b != a] for t in lay.dims]
    dims[s].append(a)
    return _ret(_move(x, lay.with_dims(dims)), async_op)


@differentiable("broadcast")  # autodiff hook: traced inputs record the collective
def broadcast(x, axis=None, *, root: int = 0, mesh=None, async_op: bool = False, role: str = "tp_collective"):
    """Arrays: in place (``collectives.broadcast``).  DTensor: a new DTensor whose local piece
    is the ``root`` rank's along ``axis`` (which must not shard it)."""
    if type(x) is not DTensor:
        return C.broadcast(x, axis, root=root, mesh=mesh, async_op=async_op, role=role)
    axes = _axes("broadcast", x, axis, mesh)
    for a in axes:
        if a in x.layout.sharded_axes or x.layout.partial_op(a):
            raise ValueError(f"rank {world().rank}: dist.broadcast(DTensor {list(x.shape)} {x.layout!r}, "
                             f"axis={a!r}): the axis must be replicated; redistribute first")
    buf = x._local.copy()
    C.broadcast(buf, axes if len(axes) > 1 else axes[0], root=root, mesh=x.mesh, role=role)
    return _ret(DTensor._wrap(buf, x._meta), async_op)


@differentiable("send")  # autodiff hook: traced inputs record the collective
def send(x: Any, dst: int, *, axis: str | tuple[str, ...] | None = None, mesh: Mesh | None = None, tag: int = 0,
         async_op: bool = False, role: str = "tp_collective") -> Any:
    """Send an array, or a DTensor's local piece, to position ``dst`` of the group.

    Parameters
    ----------
    x : array or DTensor
        What is sent.
    dst : int
        The receiver's position in the group (not a world rank).
    axis : str or tuple of str, optional
        The mesh axes of the group; None: every rank of the mesh (or the world).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    tag : int
        Matches this send with the ``recv`` of the same tag.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the send runs on.

    Returns
    -------
    Work or None
        A ``Work`` with ``async_op``, else None.
    """
    if type(x) is DTensor:
        mesh = x.mesh if mesh is None else mesh
        x = x._local if x._local.flags.c_contiguous else x._local.copy()
    return p2p.send(x, dst, axis=axis, mesh=mesh, tag=tag, async_op=async_op, role=role)


@differentiable("recv")  # autodiff hook: traced inputs record the collective
def recv(x: Any, src: int, *, axis: str | tuple[str, ...] | None = None, mesh: Mesh | None = None, tag: int = 0,
         async_op: bool = False, role: str = "tp_collective") -> Any:
    """Receive into an array (in place), or into a new DTensor shaped like ``x``.

    Parameters
    ----------
    x : array or DTensor
        The buffer received into (an array), or the DTensor whose shape, layout and dtype the
        result takes.
    src : int
        The sender's position in the group (not a world rank).
    axis : str or tuple of str, optional
        The mesh axes of the group; None: every rank of the mesh (or the world).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    tag : int
        Matches the ``send`` of the same tag.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the receive runs on.

    Returns
    -------
    array, DTensor or Work
        ``x`` filled, the new DTensor, or a ``Work`` with ``async_op``.
    """
    if type(x) is not DTensor:
        return p2p.recv(x, src, axis=axis, mesh=mesh, tag=tag, async_op=async_op, role=role)
    buf = x._local.copy()
    p2p.recv(buf, src, axis=axis, mesh=x.mesh if mesh is None else mesh, tag=tag, role=role)
    return _ret(DTensor._wrap(buf, x._meta), async_op)


def _single(op: str, x: DTensor, axis, mesh) -> tuple[str]:
    axes = _axes(op, x, axis, mesh)
    if len(axes) != 1:
        raise ValueError(f"rank {world().rank}: dist.{op} on a DTensor takes one mesh axis, got {axes}")
    return axes


def _dim(op: str, x: DTensor, dim: int) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"rank {world().rank}: dist.{op}: dim={dim} is out of range for DTensor shape {x.shape}")
    return dim % x.ndim


# The public collectives (dist.all_reduce, ...) are the array collectives themselves, so a
# plain array pays no extra call layer (small-message latency is a target); they hand
# DTensors and traced values to the hooked functions above.  send and recv stay behind the
# hook for plain arrays too: under ts.grad they are recorded even untraced, so that each
# backward send meets its recv.
_HANDLERS = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather,
             "all_to_all": all_to_all, "broadcast": broadcast}
C.route(DTensor, _HANDLERS)


def route_traced(var_type: type) -> None:
    """Route the collectives' traced operands (autodiff's Var) to the hooked versions too;
    autodiff calls this on import (the distributed core does not import autodiff)."""
    C.route(var_type, _HANDLERS)
