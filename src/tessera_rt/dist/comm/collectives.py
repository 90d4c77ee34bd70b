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

from typing import Sequence

from .mpi import MPI, MPI_ERROR

from ... import runtime as rt
from ...backend import CpuWorkerStream
from .calls import Call as _Call
from . import c_path
from .cpu_async import P2P, after_role_worker, start_on_worker
from .mesh import AxisGroup, current_mesh
from .packing import then_unpack as _then_unpack, with_dim  # noqa: F401  (with_dim: dist.ccl's shape arithmetic)
from .plans import (Plan, backend, check_array, check_sizes, norm_dim, _tagged, _tup, where,  # noqa: F401
                    all_gather_plan, all_reduce_plan, all_to_all_plan, broadcast_plan, plan_for, reduce_scatter_plan)
from .plans import bad_out as _bad_out, check_peer as _peer, untaggable as _untaggable
from .process_group import world
from .hooks import SEAM as _SEAM
from .trace import TAGS, CollectiveRecord, bus_factor, trace_collectives

__all__ = [
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
    "barrier", "Work", "trace_collectives", "CollectiveRecord", "bus_factor", "world_group", "route", "TAGS",
]


# --------------------------------------------------------------------------- handles

# What the hot paths read from the seam (dist.comm.hooks): the agreement check (SEAM.check, and
# SEAM.check_plan for a planned call; None when off or replaced by TESSERA_DEBUG=collectives),
# called before any data moves, and the watchers (the same list as SEAM.watchers).  An async
# collective's role is part of what must agree: on CPU ranks each role's worker has its own
# communicator, so ranks issuing one collective on different roles would never match up.
_HOOKS = _SEAM.watchers
_IN_PLACE = None if MPI_ERROR else MPI.IN_PLACE      # None: no MPI library (see dist/comm/mpi.py)

class Work:
    """Handle of a non-blocking collective; ``wait()`` orders compute after it and returns
    the result.  The collectives make it (``async_op=True``); it is not made by hand.

    Parameters
    ----------
    event : object
        The event recorded on the collective's stream after it (None: already complete).
    result : object
        What ``wait()`` returns.
    then : callable, optional
        Run once by the first ``wait()`` (e.g. unpacking into the caller's array).
    keep : object, optional
        Buffers the pending collective reads or writes, kept alive until ``wait()``.
    """

    __slots__ = ("_event", "_result", "_then", "_done", "_call", "_keep")

    def __init__(self, event: object, result: object, then: object = None, keep: object = None) -> None:
        self._event = event
        self._result = result
        self._then = then
        self._done = False
        self._call = None          # set while hooks watch this collective
        # Every buffer the pending collective reads or writes (the caller's array, the
        # contiguous copy, the pack temporaries).  CuPy's pool hands a freed block to the
        # next allocation on the stream it came from with no event, so dropping these
        # before compute is ordered after the collective lets compute overwrite what NCCL
        # is still reading on its own stream.
        self._keep = keep

    def wait(self) -> object:
        """Order the compute stream after the collective and return its result (once done, again
        without waiting).

        Returns
        -------
        array or object
            What the collective returns.
        """
        if not self._done:
            call = self._call
            if call is not None:
                for h in _HOOKS:
                    if hasattr(h, "wait"):
                        h.wait(call)
            rt.stream("compute").wait_event(self._event)
            if self._then is not None:
                self._result = self._then()
                self._then = None
            self._done = True
            self._keep = None            # compute is ordered after the collective now
            if call is not None:
                self._call = None
                call.ran = getattr(self._event, "task", None)     # when a CPU worker really ran it
                _after(call)
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has finished (no waiting).

        Returns
        -------
        bool
            True once done.
        """
        return self._done or self._event.query()

    @classmethod
    def completed(cls, result) -> "Work":
        """A handle for work that already ran (the same API for every ``async_op=True`` path)."""
        w = cls(None, result)
        w._done = True
        return w




# --------------------------------------------------------------------------- plumbing

# type -> {collective name -> handler}: the DTensor layer and autodiff register their types
# here, so the public collectives take DTensors and traced values while a plain array
# (the latency-critical case) pays one dict lookup.
_ROUTES: dict = {}


def route(cls: type, handlers: dict) -> None:
    """Send collectives whose first argument is a ``cls`` to ``handlers[name]``."""
    _ROUTES[cls] = handlers


_WORLD_GROUP: list[AxisGroup] = []


def world_group() -> AxisGroup:
    """The group of every rank in the job (used when no mesh and no axis are given).

    Returns
    -------
    AxisGroup
        All ranks, in world order.
    """
    if not _WORLD_GROUP:
        w = world()
        _WORLD_GROUP.append(AxisGroup(("world",), tuple(range(w.size)), w.rank, w.communicator()))
    return _WORLD_GROUP[0]


def _group(mesh, axis, op: str, x=None) -> AxisGroup:
    if mesh is not None:
        g = mesh._groups.get(axis)      # the hot path: a group already made
        if g is not None:
            return g
    else:
        mesh = current_mesh()
        if mesh is None:
            if axis is None or axis == "world":
                return world_group()
            raise ValueError(f"rank {world().rank}: {op}(axis={axis!r}) on an array needs a mesh: "
                             "pass mesh=, use `with mesh:`, or call dist.set_mesh(mesh)")
    if axis is None:
        axis = mesh.axes[0] if mesh.ndim == 1 else mesh.axes
    elif isinstance(axis, list):
        axis = tuple(axis)
    if not mesh.is_member:
        mesh._require_member(op)
    precheck = _SEAM.precheck
    if precheck is not None and x is not None and axis not in mesh._groups:
        # making a group is collective over its members: check before, or a rank that
        # issues another collective would leave its peers waiting here, unchecked
        precheck(op, mesh, axis, x)
    return mesh.group(axis)


_ROLE_STREAMS = rt._role_streams          # the runtime's role -> stream cache (cleared in place)


def _issue(role: str, async_op: bool, method, args: tuple, result, then=None):
    """Run the communicator ``method(*args)`` on the role's stream, ordered against compute."""
    on_gpu = backend().is_gpu
    if not on_gpu:
        stream = _ROLE_STREAMS.get(role) or rt.stream(role)
        if not async_op:
            # CPU, blocking: straight to MPI on the caller's communicator, after the tasks
            # the role's worker still runs (stream order; its pending sends/recvs are MPI's
            # already, and waiting for them here would hang a ring of irecv-then-send)
            if type(stream) is CpuWorkerStream and stream._done != stream._issued:
                stream.wait_tasks()
            method(*args)
            return then() if then is not None else result
        if type(stream) is CpuWorkerStream:
            if method.__name__ not in P2P:
                work = Work(start_on_worker(stream, role, method, args), result, then, keep=args)
                if not rt.overlaps(role):
                    work.wait()
                return work
            if stream._done != stream._issued:
                stream.wait_tasks()       # a send may read what a queued collective writes
    stream, compute = rt.stream(role), rt.stream("compute")
    if on_gpu and stream is not compute:
        stream.wait_event(compute.record())          # inputs made on compute are ready
    req = method(*args, blocking=not async_op, stream=stream)
    if req is not None:
        stream.enqueue(req)
    event = stream.record()
    if not async_op:
        compute.wait_event(event)
        return then() if then is not None else result
    work = Work(event, result, then, keep=args)
    if not rt.overlaps(role):
        work.wait()                                  # this role may not overlap compute
    return work


def _hooked(info: tuple, role: str, async_op: bool, method, args: tuple, result, then=None, det=None,
            tag: str | None = None):
    """_issue with the hooks around it.  ``info`` = (op, group, x, data bytes, mesh as given,
    shape that must match within the group, arguments that must match mesh-wide)."""
    op, g, x, nbytes, mesh, gshape, extra = info
    if mesh is None and not (_WORLD_GROUP and g is _WORLD_GROUP[0]):
        mesh = current_mesh()
    call = _Call(op, g, x, nbytes, mesh, gshape, extra, role, async_op)
    if tag is not None:
        call.tag = tag
    try:
        for h in tuple(_HOOKS):
            h.before(call)                            # may raise (a desync): after() still runs
        if det is not None and _SEAM.det:
            r = _SEAM.fixed_order[op](*det, role=role, issue=_issue)     # fixed-order reduction (blocking)
            if async_op:
                r = Work.completed(r)
        else:
            r = _issue(role, async_op, method, args, result, then)
    except BaseException:
        _after(call)
        raise
    if type(r) is Work and not r._done:
        r._call = call                                 # the hooks' after() runs in wait()
    else:
        _after(call)
    return r


def _run(info, role: str, async_op: bool, method, args: tuple, result, then=None, tag: str | None = None):
    """_issue, or _hooked when something watches collectives (``info`` is None otherwise)."""
    if info is None:
        return _issue(role, async_op, method, args, result, then)
    return _hooked(info, role, async_op, method, args, result, then, tag=tag)


def _after(call) -> None:
    for h in reversed(_HOOKS):
        if hasattr(h, "after"):
            h.after(call)


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
    ``out=`` checked), the agreement check.  Returns (plan, x, out)."""
    g = mesh._groups.get(axis) if mesh is not None else None      # (the hot path of _group)
    if g is None:
        g = _group(mesh, axis, name, x)
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


def all_reduce(x: object, axis: str | tuple[str, ...] | None = None, op: str = "sum", *, mesh: Mesh | None = None,
               out: object = None, async_op: bool = False, role: str = "tp_collective",
               tag: str | None = None) -> object:
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
    if p.fn is None or _HOOKS:
        return run_all_reduce(p, x, out, role, async_op, mesh, tag)
    s = _ROLE_STREAMS.get(role)                  # run_all_reduce's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(_IN_PLACE if x is out else x, out, p.mop)
    return out


def run_all_reduce(p: Plan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned all_reduce after its checks (the plain collective, and dist.ccl's library path)."""
    if _HOOKS:
        g, op = p.g, p.rop
        return _hooked(("all_reduce", g, x, x.nbytes, mesh, p.gshape, p.extra), role, async_op, p.comm.all_reduce,
                       (x, out, op), out, det=(g, x, out, op) if op in ("sum", "avg") else None, tag=tag)
    if p.fn is not None:
        after_role_worker(role)
        p.fn(_IN_PLACE if x is out else x, out, p.mop)
        return out
    return _issue(role, async_op, p.comm.all_reduce, (x, out, p.rop), out)


def reduce_scatter(x: object, axis: str | tuple[str, ...] | None = None, op: str = "sum", *, dim: int = 0,
                   sizes: Sequence[int] | None = None, mesh: Mesh | None = None, out: object = None,
                   async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> object:
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
    if p.fn is None or _HOOKS or p.pack is not None:
        return run_reduce_scatter(p, x, out, role, async_op, mesh, tag)
    s = _ROLE_STREAMS.get(role)                  # run_reduce_scatter's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(x, out, p.mop)
    return out


def run_reduce_scatter(p: Plan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned reduce_scatter after its checks (the plain collective, and dist.ccl's library path)."""
    # out is contiguous and this rank's part is one run of the packed buffer: no unpacking
    send = x if p.pack is None else p.pack(x)
    if _HOOKS:
        g, op = p.g, p.rop
        if p.dim:
            send, flat = send.reshape(-1), out.reshape(-1)
        else:
            flat = out
        return _hooked(("reduce_scatter", g, x, x.nbytes, mesh, p.gshape, p.extra), role, async_op,
                       p.comm.reduce_scatter, (send, flat, p.counts, op), out,
                       det=(g, send, flat, p.counts, op, out) if op in ("sum", "avg") else None, tag=tag)
    if p.fn is not None:
        after_role_worker(role)
        p.fn(send, out, p.mop)
        return out
    return _issue(role, async_op, p.comm.reduce_scatter, (send, out, p.counts, p.rop), out)


def all_gather(x: object, axis: str | tuple[str, ...] | None = None, *, dim: int | None = None,
               sizes: Sequence[int] | None = None, mesh: Mesh | None = None, out: object = None,
               async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> object:
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
    if p.fn is None or _HOOKS:
        return run_all_gather(p, x, out, role, async_op, mesh, tag)
    s = _ROLE_STREAMS.get(role)                  # run_all_gather's direct path, inline (saves a call)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
    p.fn(x, out)
    return out


def run_all_gather(p: Plan, x, out, role: str, async_op: bool, mesh, tag):
    """A planned all_gather after its checks (the plain collective, and dist.ccl's library path)."""
    info = ("all_gather", p.g, x, out.nbytes, mesh, p.gshape, p.extra) if _HOOKS else None
    if not p.flat:                    # communicators take flat buffers: gather, then lay out along dim
        recv = backend().empty((out.size,), x.dtype)
        return _run(info, role, async_op, p.comm.all_gather, (x, recv, p.counts), out, _then_unpack(p, recv, out),
                    tag=tag)
    if p.fn is not None and info is None:
        after_role_worker(role)
        p.fn(x, out)
        return out
    return _run(info, role, async_op, p.comm.all_gather, (x, out, p.counts), out, tag=tag)


def all_to_all(x: object, axis: str | tuple[str, ...] | None = None, *, split_dim: int = 0,
               concat_dim: int | None = None, split_sizes: Sequence[int] | None = None,
               recv_sizes: Sequence[int] | None = None, mesh: Mesh | None = None, async_op: bool = False,
               role: str = "a2a", out: object = None, tag: str | None = None) -> object:
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
    info = ("all_to_all", g, x, x.nbytes, mesh, p.gshape, p.extra) if _HOOKS else None
    if not p.flat:
        recv = backend().empty((out.size,), x.dtype)
        return _run(info, role, async_op, p.comm.all_to_all, (send, recv, *p.counts), out,
                    _then_unpack(p, recv, out), tag=tag)
    if p.fn is not None and info is None:
        s = _ROLE_STREAMS.get(role)          # (inline: the plain collective's direct path)
        if s.__class__ is CpuWorkerStream and s._done != s._issued:
            s.wait_tasks()
        p.fn(send, out)
        return out
    return _run(info, role, async_op, p.comm.all_to_all, (send, out, *p.counts), out, tag=tag)


def broadcast(x: object, axis: str | tuple[str, ...] | None = None, *, root: int = 0, mesh: Mesh | None = None,
              async_op: bool = False, role: str = "tp_collective", tag: str | None = None) -> object:
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
    if _HOOKS:
        return _hooked(("broadcast", g, x, x.nbytes if g.index == root else 0, mesh, x.shape, p.extra), role,
                       async_op, p.comm.broadcast, (x, root), x, tag=tag)
    if p.fn is not None:
        s = _ROLE_STREAMS.get(role)          # (inline: the plain collective's direct path)
        if s.__class__ is CpuWorkerStream and s._done != s._issued:
            s.wait_tasks()
        p.fn(x, root)
        return x
    return _issue(role, async_op, p.comm.broadcast, (x, root), x)


def send(x, dst: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Send ``x`` to position ``dst`` of the group (a world rank when no mesh or axis is given)."""
    g = _group(mesh, axis, "send", x)
    x = check_array("send", g, x)
    _peer("send", g, x, dst, "dst")
    comm = g.comm
    if _HOOKS:
        return _hooked(("send", g, x, x.nbytes, mesh, (), (dst, tag)), role, async_op, comm.send, (x, dst, tag), None)
    return _issue(role, async_op, comm.send, (x, dst, tag,), None)


def recv(x, src: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Receive into ``x`` (in place; returns x) from position ``src`` of the group."""
    g = _group(mesh, axis, "recv", x)
    if not backend().is_array(x) or not x.flags.c_contiguous:
        raise TypeError(f"rank {world().rank}: recv fills x in place: pass a contiguous "
                        f"{backend().xp.__name__} array, got {type(x).__name__}")
    _peer("recv", g, x, src, "src")
    comm = g.comm
    if _HOOKS:
        return _hooked(("recv", g, x, 0, mesh, (), (src, tag)), role, async_op, comm.recv, (x, src, tag), x)
    return _issue(role, async_op, comm.recv, (x, src, tag,), x)


def barrier(axis: str | tuple[str, ...] | None = None, *, mesh: Mesh | None = None, async_op: bool = False,
            role: str = "tp_collective") -> Work | None:
    """Wait until every rank of the group gets here (drains the role's stream on GPU).

    Parameters
    ----------
    axis : str or tuple of str, optional
        The mesh axes whose group waits; None: every rank of the mesh (or the world).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role drained.

    Returns
    -------
    Work or None
        A ``Work`` with ``async_op``, else None.
    """
    g = _group(mesh, axis, "barrier")
    check = _SEAM.check
    if check is not None:
        check("barrier", g, None, (), role if async_op else None)
    comm = g.comm
    if _HOOKS:
        return _hooked(("barrier", g, None, 0, mesh, (), None), role, async_op, comm.barrier, (), None)
    return _issue(role, async_op, comm.barrier, (), None)


# --------------------------------------------------------------------------- the C path (c_path.py)

# _HOT_ARRAY_FIELDS: whether the C path reads NumPy arrays' fields directly (setup's layout check)
_hot, _HOT_ARRAY_FIELDS = c_path.load(_ROUTES, _WORLD_GROUP, _IN_PLACE)
all_reduce = c_path.wrap(_hot, all_reduce, ("op", "tag", "role", "async_op"))
reduce_scatter = c_path.wrap(_hot, reduce_scatter, ("op", "dim", "sizes", "tag", "role", "async_op"), ("sizes",))
all_gather = c_path.wrap(_hot, all_gather, ("dim", "sizes", "tag", "role", "async_op"), ("sizes",))
all_to_all = c_path.wrap(_hot, all_to_all, ("split_dim", "concat_dim", "split_sizes", "recv_sizes", "out is not None",
                                            "tag", "role", "async_op"), ("split_sizes", "recv_sizes"))
broadcast = c_path.wrap(_hot, broadcast, ("root", "tag", "role", "async_op"))
