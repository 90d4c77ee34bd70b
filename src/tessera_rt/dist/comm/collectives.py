"""Collectives on arrays over a mesh-axis group (seed 002 §2.7, 003 §4.6, 004).

    y = dist.all_reduce(x, axis="dp", op="sum")               # blocking, new (pooled) array
    work = dist.all_gather(x, axis="tp", dim=-1, async_op=True)
    ...                                                         # overlap compute here
    y = work.wait()                                             # compute stream waits for it

Each call checks its input on this rank before any communication, runs on its role's
stream (``tp_collective`` for most, ``a2a`` for all_to_all; ``role=`` overrides), and is
ordered against the ``compute`` stream with events.  ``dim`` picks the tensor dim that is
split or gathered; ``sizes``/``split_sizes`` allow uneven parts, zero included.

``tag="tree"|"ring"`` (seed 000 §3.6) is an algorithm hint, recorded in the trace records
and checked to agree across the group.  What it can change depends on the library, which
picks its algorithm itself: NCCL reads ``NCCL_ALGO`` once, when a communicator is created,
and takes no per-call choice, so a tagged ``all_reduce`` on NCCL runs on a second
communicator of the same group made with ``NCCL_ALGO=Tree`` (or ``Ring``), created on the
first call with that tag (collective over the group, once).  NCCL has no tree algorithm for
reduce-scatter, all-gather, broadcast or all-to-all (it runs rings, PAT or NVLS there), and
MPI has no per-call algorithm choice at all (MPICH reads ``MPIR_CVAR_<OP>_INTRA_ALGORITHM``
from the environment for the whole run): there the tag is recorded and changes nothing.
``dist.ccl`` ops take the same tag and run their own ring for ``tag="ring"``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...backend import CpuWorkerStream
from . import c_path
from .cpu_async import after_role_worker
from .hooks import SEAM as _SEAM
from .mesh import Mesh
from .mpi import MPI, MPI_ERROR
from .packing import then_unpack as _then_unpack, with_dim  # noqa: F401  (with_dim: dist.ccl's shape arithmetic)

# with_dim, check_array, check_sizes, norm_dim, where: re-exported, dist.ccl checks and shapes as these do
from .plans import (  # noqa: F401
    CallPlan,
    Plan,
    _tagged,
    _tup,
    all_gather_plan,
    all_reduce_plan,
    all_to_all_plan,
    backend,
    bad_out as _bad_out,
    broadcast_plan,
    check_array,
    check_dtype,
    check_sizes,
    norm_dim,
    plan_for,
    reduce_scatter_plan,
    untaggable as _untaggable,
    where,
)
from .trace import TAGS, CollectiveRecord, bus_factor, trace_collectives

# the issue path (work.py); issue is also a compiled redistribution plan's step (dist.tensor)
from .work import ROLE_STREAMS, WATCHERS, WORLD_GROUP, issue, issue_call, issue_watched, resolve_group

__all__ = [
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "trace_collectives", "CollectiveRecord",
    "bus_factor", "route", "TAGS", "HOT", "HOT_ARRAY_FIELDS",
]


_IN_PLACE = None if MPI_ERROR else MPI.IN_PLACE      # None: no MPI library (see dist/comm/mpi.py)


# --------------------------------------------------------------------------- plumbing

# type -> {collective name -> handler}: the DTensor layer and autodiff register their types
# here, so the public collectives take DTensors and traced values while a plain array
# (the latency-critical case) pays one dict lookup.
_ROUTES: dict = {}


def route(cls: type, handlers: dict) -> None:
    """Send collectives whose first argument is a ``cls`` to ``handlers[name]``."""
    _ROUTES[cls] = handlers


# --------------------------------------------------------------------------- collectives
#
# Each collective looks its plan up by everything that determines it (plans.py) and, on a
# miss, builds it: the builder makes every check, so bad input errors on the first call
# with that key, before any communication.  ``prologue`` is that part, for all five, and
# also runs the agreement check (it reads the user's call site three frames up: the check,
# the prologue, the collective).  On the blocking CPU path ``p.fn`` is the raw mpi4py call,
# after the role's worker (if any) has run what it was given before.  A repeat call on a
# NumPy array takes the same steps in C (dist/comm/_hot.c, set up by c_path.py).

_NO_OUT = object()        # prologue: the collective makes its output itself (all_to_all)
_X_OUT = object()         # prologue: the collective writes x in place (broadcast)


def prologue(name: str, x, axis, mesh, build, args: tuple, out=_NO_OUT):
    """What every plain collective does before its data moves, in this order: the group (mesh
    and axis resolved), the plan (``plan_for``), a contiguous input, the output (a new one, or
    ``out=`` checked), the agreement check.  Returns (plan, x, out).  A dtype collectives cannot
    move is refused before the group is made (collective); a plan is built only for a dtype
    its builder checked, so a repeat call pays nothing for that check."""
    g = mesh._groups.get(axis) if mesh is not None else None      # (the hot path of resolve_group)
    if g is None:
        check_dtype(name, x)
        g = resolve_group(mesh, axis, name, x)
    p = plan_for(name, g, x, build, args)
    if not x.flags.c_contiguous:
        if out is _X_OUT:
            build(g, x, *args)                   # raises: names what x must be
        x = backend().xp.ascontiguousarray(x)
    if out is None:
        out = p.empty(p.shape, p.dtype)
    elif out is not _NO_OUT and out is not _X_OUT and (
            out.shape != p.shape or out.dtype != p.dtype or not out.flags.c_contiguous):
        _bad_out(p, x, out)
    check = _SEAM.check_plan
    if check is not None:
        check(p, 3)
    return p, x, out


def all_reduce(x: Any, axis: str | tuple[str, ...] | None = None, op: str = "sum", *, mesh: Mesh | None = None,
               out: Any = None, async_op: bool = False, role: str = "tp_collective",
               tag: str | None = None) -> Any:
    """Reduce ``x`` elementwise over the group; every rank gets the result.

    Parameters
    ----------
    x : array or DTensor
        This rank's contribution (a DTensor's layout change is planned instead).
    axis : str or tuple of str, optional
        The mesh axes whose group reduces; None: every rank of the mesh (or the world).
    op : {"sum", "max", "min", "avg"}
        The reduction.
    mesh : Mesh, optional
        Default: the current mesh (``dist.set_mesh``), else the world.
    out : array, optional
        Receives the result (``out=x``: in place).
    async_op : bool
        Return a ``Work`` at once; ``wait()`` gives the result.
    role : str
        The stream role the collective runs on.
    tag : {None, "tree", "ring"}
        An algorithm hint (see the module docstring).

    Returns
    -------
    array, DTensor or Work
        The reduced array (a new pooled one unless ``out``), or a ``Work`` with ``async_op``.
    """
    cls = x.__class__
    if cls in _ROUTES:
        _untaggable("all_reduce", x, tag)
        return _ROUTES[cls]["all_reduce"](x, axis, op, mesh=mesh, out=out, async_op=async_op, role=role)
    p, x, out = prologue("all_reduce", x, axis, mesh, all_reduce_plan, (op, tag, role, async_op), out)
    if p.fn is None or WATCHERS:
        return run_all_reduce(p, x, out, role, async_op, mesh, tag)
    s = ROLE_STREAMS.get(role)                  # run_all_reduce's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(_IN_PLACE if x is out else x, out, p.mop)
    return out


def run_all_reduce(p: CallPlan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned all_reduce after its checks (the plain collective, and dist.ccl's library path)."""
    if WATCHERS:
        g, op = p.g, p.rop
        return issue_watched(("all_reduce", g, x, x.nbytes, mesh, p.gshape, p.extra), role, async_op, p.comm.all_reduce,
                       (x, out, op), out, det=(g, x, out, op) if op in ("sum", "avg") else None, tag=tag)
    if p.fn is not None:
        after_role_worker(role)
        p.fn(_IN_PLACE if x is out else x, out, p.mop)
        return out
    return issue(role, async_op, p.comm.all_reduce, (x, out, p.rop), out)


def reduce_scatter(x: Any, axis: str | tuple[str, ...] | None = None, op: str = "sum", *, dim: int = 0,
                   sizes: Sequence[int] | None = None, mesh: Mesh | None = None, out: Any = None,
                   async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> Any:
    """Reduce over the group and leave each rank its part of ``dim``.

    Parameters
    ----------
    x : array or DTensor
        This rank's full-size contribution.
    axis : str or tuple of str, optional
        The mesh axes whose group reduces; None: every rank of the mesh (or the world).
    op : {"sum", "max", "min", "avg"}
        The reduction.
    dim : int
        The dim split among the ranks.
    sizes : sequence of int, optional
        Each rank's length along ``dim`` (the same list on every rank); default equal parts.
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    out : array, optional
        Receives this rank's part.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the collective runs on.
    tag : {None, "tree", "ring"}
        An algorithm hint (see the module docstring).

    Returns
    -------
    array, DTensor or Work
        This rank's reduced part, or a ``Work`` with ``async_op``.
    """
    cls = x.__class__
    if cls in _ROUTES:
        _untaggable("reduce_scatter", x, tag)
        return _ROUTES[cls]["reduce_scatter"](x, axis, op, dim=dim, sizes=sizes, mesh=mesh, out=out,
                                              async_op=async_op, role=role)
    p, x, out = prologue("reduce_scatter", x, axis, mesh, reduce_scatter_plan,
                         (op, dim, _tup(sizes), tag, role, async_op), out)
    if p.fn is None or WATCHERS or p.pack is not None:
        return run_reduce_scatter(p, x, out, role, async_op, mesh, tag)
    s = ROLE_STREAMS.get(role)                  # run_reduce_scatter's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(x, out, p.mop)
    return out


def run_reduce_scatter(p: CallPlan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned reduce_scatter after its checks (the plain collective, and dist.ccl's library path)."""
    # out is contiguous and this rank's part is one run of the packed buffer: no unpacking
    send = x if p.pack is None else p.pack(x)
    if WATCHERS:
        g, op = p.g, p.rop
        if p.dim:
            send, flat = send.reshape(-1), out.reshape(-1)
        else:
            flat = out
        return issue_watched(("reduce_scatter", g, x, x.nbytes, mesh, p.gshape, p.extra), role, async_op,
                       p.comm.reduce_scatter, (send, flat, p.counts, op), out,
                       det=(g, send, flat, p.counts, op, out) if op in ("sum", "avg") else None, tag=tag)
    if p.fn is not None:
        after_role_worker(role)
        p.fn(send, out, p.mop)
        return out
    return issue(role, async_op, p.comm.reduce_scatter, (send, out, p.counts, p.rop), out)


def all_gather(x: Any, axis: str | tuple[str, ...] | None = None, *, dim: int | None = None,
               sizes: Sequence[int] | None = None, mesh: Mesh | None = None, out: Any = None,
               async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> Any:
    """Concatenate every rank's ``x`` along ``dim`` in group order.

    Parameters
    ----------
    x : array or DTensor
        This rank's part.
    axis : str or tuple of str, optional
        The mesh axes whose group gathers; None: every rank of the mesh (or the world).
    dim : int, optional
        The dim concatenated along (None: 0).
    sizes : sequence of int, optional
        Each rank's length along ``dim`` when they differ (the same list on every rank).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    out : array, optional
        Receives the gathered array.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the collective runs on.
    tag : {None, "tree", "ring"}
        An algorithm hint (see the module docstring).

    Returns
    -------
    array, DTensor or Work
        The concatenation, or a ``Work`` with ``async_op``.
    """
    cls = x.__class__
    if cls in _ROUTES:
        _untaggable("all_gather", x, tag)
        return _ROUTES[cls]["all_gather"](x, axis, dim=dim, sizes=sizes, mesh=mesh, out=out, async_op=async_op,
                                          role=role)
    p, x, out = prologue("all_gather", x, axis, mesh, all_gather_plan, (dim, _tup(sizes), tag, role, async_op), out)
    if p.fn is None or WATCHERS:
        return run_all_gather(p, x, out, role, async_op, mesh, tag)
    s = ROLE_STREAMS.get(role)                  # run_all_gather's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(x, out)
    return out


def run_all_gather(p: CallPlan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned all_gather after its checks (the plain collective, and dist.ccl's library path)."""
    info = ("all_gather", p.g, x, out.nbytes, mesh, p.gshape, p.extra) if WATCHERS else None
    if not p.flat:                    # communicators take flat buffers: gather, then lay out along dim
        recv = backend().empty((out.size,), x.dtype)
        return issue_call(info, role, async_op, p.comm.all_gather, (x, recv, p.counts), out, _then_unpack(p, recv, out),
                    tag=tag)
    if p.fn is not None and info is None:
        after_role_worker(role)
        p.fn(x, out)
        return out
    return issue_call(info, role, async_op, p.comm.all_gather, (x, out, p.counts), out, tag=tag)


def all_to_all(x: Any, axis: str | tuple[str, ...] | None = None, *, split_dim: int = 0,
               concat_dim: int | None = None, split_sizes: Sequence[int] | None = None,
               recv_sizes: Sequence[int] | None = None, mesh: Mesh | None = None, async_op: bool = False,
               role: str = "a2a", out: Any = None, tag: str | None = None) -> Any:
    """Split ``x`` along ``split_dim`` into one part per rank, send part i to rank i, and
    concatenate what arrives along ``concat_dim``.

    ``tag="tree"|"ring"`` is recorded and checked to agree like the other collectives' tags;
    it changes nothing: neither NCCL (an all-to-all is its grouped sends/recvs) nor MPI has
    an algorithm choice per all-to-all call.

    Parameters
    ----------
    x : array or DTensor
        What this rank sends.
    axis : str or tuple of str, optional
        The mesh axes whose group exchanges; None: every rank of the mesh (or the world).
    split_dim : int
        The dim cut into one part per rank.
    concat_dim : int, optional
        The dim the received parts are concatenated along (default: ``split_dim``).
    split_sizes : sequence of int, optional
        Uneven part lengths along ``split_dim`` (zeros allowed).
    recv_sizes : sequence of int, optional
        ``recv_sizes[j]``: the length along ``concat_dim`` of what rank j sends here; left out
        with uneven parts, the sizes are exchanged first (one small extra all_to_all).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the collective runs on.
    out : array, optional
        Receives the result (needs ``split_dim=concat_dim=0``): a persistent buffer needs no
        allocation per call.
    tag : {None, "tree", "ring"}
        Recorded and checked; changes nothing here.

    Returns
    -------
    array, DTensor or Work
        The concatenated parts, or a ``Work`` with ``async_op``.
    """
    cls = x.__class__
    if cls in _ROUTES:
        _untaggable("all_to_all", x, tag)
        return _ROUTES[cls]["all_to_all"](x, axis, split_dim=split_dim, concat_dim=concat_dim,
                                          split_sizes=split_sizes, recv_sizes=recv_sizes, mesh=mesh,
                                          async_op=async_op, role=role)
    args = (split_dim, concat_dim, _tup(split_sizes), _tup(recv_sizes), out is not None, tag, role, async_op)
    p, x, _ = prologue("all_to_all", x, axis, mesh, all_to_all_plan, args)
    g = p.g
    if p.exchange:                    # uneven parts: the receive sizes come from the peers
        got = tuple(g.comm.mpi.alltoall(p.mine))
        p = plan_for("all_to_all", g, x, all_to_all_plan, args[:3] + (got,) + args[4:])
    send = x if p.pack is None else p.pack(x)
    if out is None:
        out = p.empty(p.shape, p.dtype)
    elif out.shape != p.shape or out.dtype != p.dtype or not out.flags.c_contiguous:
        _bad_out(p, x, out)
    info = ("all_to_all", g, x, x.nbytes, mesh, p.gshape, p.extra) if WATCHERS else None
    if not p.flat:
        recv = backend().empty((out.size,), x.dtype)
        return issue_call(info, role, async_op, p.comm.all_to_all, (send, recv, *p.counts), out,
                    _then_unpack(p, recv, out), tag=tag)
    if p.fn is not None and info is None:
        s = ROLE_STREAMS.get(role)          # (inline: the plain collective's direct path)
        if s.__class__ is CpuWorkerStream and s._done != s._issued:
            s.wait_tasks()
        p.fn(send, out)
        return out
    return issue_call(info, role, async_op, p.comm.all_to_all, (send, out, *p.counts), out, tag=tag)


def broadcast(x: Any, axis: str | tuple[str, ...] | None = None, *, root: int = 0, mesh: Mesh | None = None,
              async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> Any:
    """Copy the group's ``root`` rank's ``x`` into ``x`` on every rank (in place).

    Parameters
    ----------
    x : array or DTensor
        The root's data; the buffer received into elsewhere.
    axis : str or tuple of str, optional
        The mesh axes whose group takes part; None: every rank of the mesh (or the world).
    root : int
        A position in the group, not a world rank.
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role the collective runs on.
    tag : {None, "tree", "ring"}
        An algorithm hint (see the module docstring).

    Returns
    -------
    array, DTensor or Work
        ``x``, or a ``Work`` with ``async_op``.
    """
    cls = x.__class__
    if cls in _ROUTES:
        _untaggable("broadcast", x, tag)
        return _ROUTES[cls]["broadcast"](x, axis, root=root, mesh=mesh, async_op=async_op, role=role)
    p, x, _ = prologue("broadcast", x, axis, mesh, broadcast_plan, (root, tag, role, async_op), _X_OUT)
    g = p.g
    if WATCHERS:
        return issue_watched(("broadcast", g, x, x.nbytes if g.index == root else 0, mesh, x.shape, p.extra), role,
                       async_op, p.comm.broadcast, (x, root), x, tag=tag)
    if p.fn is not None:
        s = ROLE_STREAMS.get(role)          # (inline: the plain collective's direct path)
        if s.__class__ is CpuWorkerStream and s._done != s._issued:
            s.wait_tasks()
        p.fn(x, root)
        return x
    return issue(role, async_op, p.comm.broadcast, (x, root), x)


# --------------------------------------------------------------------------- the C path (c_path.py)

# HOT: the C extension set up (dist/comm/_hot.c; None: TESSERA_HOT=0 or no compiler at build),
# whose run_compiled is also a redistribution plan's repeat path (dist.tensor.redistribute);
# HOT_ARRAY_FIELDS: whether it reads NumPy arrays' fields directly (setup's layout check)
HOT, HOT_ARRAY_FIELDS = c_path.load(_ROUTES, WORLD_GROUP, _IN_PLACE)
all_reduce = c_path.wrap(HOT, all_reduce, ("op", "tag", "role", "async_op"))
reduce_scatter = c_path.wrap(HOT, reduce_scatter, ("op", "dim", "sizes", "tag", "role", "async_op"), ("sizes",))
all_gather = c_path.wrap(HOT, all_gather, ("dim", "sizes", "tag", "role", "async_op"), ("sizes",))
all_to_all = c_path.wrap(HOT, all_to_all, ("split_dim", "concat_dim", "split_sizes", "recv_sizes", "out is not None",
                                            "tag", "role", "async_op"), ("split_sizes", "recv_sizes"))
broadcast = c_path.wrap(HOT, broadcast, ("root", "tag", "role", "async_op"))
