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

import math
from typing import Sequence

from .. import runtime as rt
from ..backend import CpuWorkerStream
from ..dtypes import dtype_name
from .comm import REDUCE_OPS
from .cpu_async import P2P, start_on_worker
from .mesh import AxisGroup, current_mesh
from .packing import _even, _pack, _unpack, _with_dim
from .process_group import world
from .trace import _HOOKS, TAGS, CollectiveRecord, bus_factor, trace_collectives

__all__ = [
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
    "barrier", "Work", "trace_collectives", "CollectiveRecord", "bus_factor", "world_group", "route", "TAGS",
]


# --------------------------------------------------------------------------- handles

# The default cross-rank agreement check (consistency.check), or None when it is off or the
# full TESSERA_DEBUG=collectives check replaces it.  Called before any data moves.  An async
# collective's role is part of what must agree: on CPU ranks each role's worker has its own
# communicator, so ranks issuing one collective on different roles would never match up.
_check = None

class Work:
    """Handle of a non-blocking collective; ``wait()`` orders compute after it and returns
    the result."""

    __slots__ = ("_event", "_result", "_then", "_done", "_call", "_keep")

    def __init__(self, event, result, then=None, keep=None):
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

    def wait(self):
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
    """The group of every rank in the job (used when no mesh and no axis are given)."""
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
    if _HOOKS and x is not None and axis not in mesh._groups:
        # making a group is collective over its members: check before, or a rank that
        # issues another collective would leave its peers waiting here, unchecked
        from .debug import precheck
        precheck(op, mesh, axis, x)
    return mesh.group(axis)


def _where(op: str, g: AxisGroup, x) -> str:
    return (f"rank {world().rank}: {op} over mesh axis {g.name!r} (group of {g.size}) "
            f"on {dtype_name(x.dtype)}{list(x.shape)}")


_BACKEND: list = []


def _backend():
    """The backend, looked up once (it is fixed for the life of the process)."""
    if not _BACKEND:
        _BACKEND.append(world().backend)
    return _BACKEND[0]


def _check_array(op: str, g: AxisGroup, x):
    backend = _backend()
    if not isinstance(x, backend.xp.ndarray):
        raise TypeError(f"rank {world().rank}: {op} over {g.name!r} takes a {backend.xp.__name__} array "
                        f"on the {backend.name} backend, got {type(x).__name__}")
    return x if x.flags.c_contiguous else backend.xp.ascontiguousarray(x)


def _norm_dim(op: str, g: AxisGroup, x, dim: int) -> int:
    if not -x.ndim <= dim < max(x.ndim, 1):
        raise ValueError(f"{_where(op, g, x)}: dim={dim} is out of range for {x.ndim} dims")
    return dim % x.ndim


def _check_sizes(op, g, x, sizes, length, name) -> list[int]:
    if sizes is None:
        if length % g.size:
            raise ValueError(
                f"{_where(op, g, x)}: dim of length {length} does not split evenly over {g.size} ranks; "
                f"pass {name}= with {g.size} part sizes adding up to {length} (uneven and zero parts are fine)")
        return [length // g.size] * g.size
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or any(s < 0 for s in sizes) or sum(sizes) != length:
        raise ValueError(f"{_where(op, g, x)}: {name}={sizes} must be {g.size} sizes >= 0 adding up to {length}")
    return sizes


def _out(op, g, x, out, shape, dtype):
    if out is None:
        return _backend().empty(shape, dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{_where(op, g, x)}: out= must be a contiguous {dtype_name(dtype)}{list(shape)}, "
                         f"got {dtype_name(out.dtype)}{list(out.shape)}")
    return out


_ROLE_STREAMS = rt._role_streams          # the runtime's role -> stream cache (cleared in place)


def _issue(role: str, async_op: bool, method, args: tuple, result, then=None):
    """Run the communicator ``method(*args)`` on the role's stream, ordered against compute."""
    on_gpu = _backend().is_gpu
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
        if det is not None and _DET:
            from .determinism import FIXED_ORDER
            r = FIXED_ORDER[op](*det, role=role)     # fixed-order reduction (blocking)
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


def _tagged(op: str, g: AxisGroup, x, tag: str, extra):
    """(the communicator that serves ``tag``, ``extra`` with the tag in it for the agreement
    check).  Only reached when a tag is given: the untagged path pays one ``is None`` test."""
    if tag not in TAGS:
        raise ValueError(f"{_where(op, g, x) if x is not None else f'rank {world().rank}: {op}'}: "
                         f"tag={tag!r}; use one of {TAGS} (or leave it out)")
    return g.comm.tagged(op, tag), (extra, ("tag", tag))


def _untaggable(op: str, x, tag) -> None:
    if tag is not None:
        raise ValueError(f"rank {world().rank}: dist.{op}(tag={tag!r}) on a {type(x).__name__}: the tag applies to "
                         "arrays (a DTensor's collectives come from its redistribution plan); pass x.to_local() "
                         "or leave tag out")


def _after(call) -> None:
    for h in reversed(_HOOKS):
        if hasattr(h, "after"):
            h.after(call)


# While dist.deterministic() is on, _DET holds its "compensated" flag and sum/avg
# reductions take determinism's fixed-order paths instead of MPI's/NCCL's own order.
_DET: list = []


# --------------------------------------------------------------------------- collectives

def all_reduce(x, axis=None, op: str = "sum", *, mesh=None, out=None, async_op: bool = False,
               role: str = "tp_collective", tag: str | None = None):
    """Reduce ``x`` elementwise over the group (sum, max, min, avg); every rank gets the result.
    ``out=x`` reduces in place.  ``tag="tree"|"ring"``: see the module docstring."""
    if x.__class__ in _ROUTES:
        _untaggable("all_reduce", x, tag)
        return _ROUTES[x.__class__]["all_reduce"](x, axis, op, mesh=mesh, out=out, async_op=async_op, role=role)
    g = _group(mesh, axis, "all_reduce", x)
    x = _check_array("all_reduce", g, x)
    if op not in REDUCE_OPS:
        raise ValueError(f"{_where('all_reduce', g, x)}: op={op!r}; use one of {list(REDUCE_OPS)}")
    if op == "avg" and x.dtype.kind not in "fc" and x.dtype.kind != "V":
        raise TypeError(f"{_where('all_reduce', g, x)}: op='avg' needs a floating dtype; use op='sum'")
    out = _backend().empty_like(x) if out is None else _out("all_reduce", g, x, out, x.shape, x.dtype)
    # this block repeats in each collective on purpose: consistency.check reads its caller's
    # caller's frame (the user's call site), which a shared helper would move one level down
    extra = op
    if tag is None:
        comm = g.comm
    else:
        comm, extra = _tagged("all_reduce", g, x, tag, op)
    if _check is not None:
        _check("all_reduce", g, x.dtype, x.shape, (extra, role) if async_op else extra)
    if _HOOKS:
        return _hooked(("all_reduce", g, x, x.nbytes, mesh, x.shape, extra), role, async_op, comm.all_reduce,
                       (x, out, op), out, det=(g, x, out, op) if op in ("sum", "avg") else None, tag=tag)
    return _issue(role, async_op, comm.all_reduce, (x, out, op,), out)


def reduce_scatter(x, axis=None, op: str = "sum", *, dim: int = 0, sizes: Sequence[int] | None = None,
                   mesh=None, out=None, async_op: bool = False, role: str = "tp_collective",
                   tag: str | None = None):
    """Reduce over the group and leave each rank its part of ``dim`` (equal parts unless
    ``sizes`` says otherwise).  ``tag``: see the module docstring."""
    if x.__class__ in _ROUTES:
        _untaggable("reduce_scatter", x, tag)
        return _ROUTES[x.__class__]["reduce_scatter"](x, axis, op, dim=dim, sizes=sizes, mesh=mesh, out=out, async_op=async_op, role=role)
    g = _group(mesh, axis, "reduce_scatter", x)
    x = _check_array("reduce_scatter", g, x)
    if op not in REDUCE_OPS:
        raise ValueError(f"{_where('reduce_scatter', g, x)}: op={op!r}; use one of {list(REDUCE_OPS)}")
    if not 0 <= dim < x.ndim:
        dim = _norm_dim("reduce_scatter", g, x, dim)
    if sizes is None and not x.shape[dim] % g.size:          # the common case, kept cheap
        even, mine, counts = True, x.shape[dim] // g.size, None
    else:
        sizes = _check_sizes("reduce_scatter", g, x, sizes, x.shape[dim], "sizes")
        even, mine = _even(sizes), sizes[g.index]
        inner = math.prod(_with_dim(x.shape, dim, 1))
        counts = None if even else [s * inner for s in sizes]      # None: the fixed-size collective
    shape = (mine,) + x.shape[1:] if dim == 0 else _with_dim(x.shape, dim, mine)
    out = _backend().empty(shape, x.dtype) if out is None else _out("reduce_scatter", g, x, out, shape, x.dtype)
    extra = (op, dim)
    if tag is None:
        comm = g.comm
    else:
        comm, extra = _tagged("reduce_scatter", g, x, tag, extra)
    if _check is not None:
        _check("reduce_scatter", g, x.dtype, x.shape, (extra, role) if async_op else extra)
    # out is contiguous and this rank's part is one run of the packed buffer: no unpacking
    send = x if dim == 0 else _pack(x, dim, [mine] * g.size if even else sizes, even)
    if _HOOKS:
        flat = out.reshape(-1) if dim else out
        return _hooked(("reduce_scatter", g, x, x.nbytes, mesh, x.shape, extra), role, async_op,
                       comm.reduce_scatter, (send, flat, counts, op), out,
                       det=(g, send, flat, counts, op, out) if op in ("sum", "avg") else None, tag=tag)
    return _issue(role, async_op, comm.reduce_scatter, (send, out, counts, op), out)


def all_gather(x, axis=None, *, dim: int | None = None, sizes: Sequence[int] | None = None, mesh=None,
               out=None, async_op: bool = False, role: str = "tp_collective", tag: str | None = None):
    """Concatenate every rank's ``x`` along ``dim`` (None: 0) in group order.  Ranks may hold
    different lengths along ``dim`` if ``sizes`` lists them (the same list on every rank).
    ``tag``: see the module docstring."""
    if x.__class__ in _ROUTES:
        _untaggable("all_gather", x, tag)
        return _ROUTES[x.__class__]["all_gather"](x, axis, dim=dim, sizes=sizes, mesh=mesh, out=out, async_op=async_op, role=role)
    g = _group(mesh, axis, "all_gather", x)
    x = _check_array("all_gather", g, x)
    if dim is None:
        dim = 0
    if not 0 <= dim < x.ndim:
        dim = _norm_dim("all_gather", g, x, dim)
    if sizes is None:                                          # the common case, kept cheap
        even, total, counts = True, x.shape[dim] * g.size, None
    else:
        sizes = [int(s) for s in sizes]
        if len(sizes) != g.size or any(s < 0 for s in sizes) or sizes[g.index] != x.shape[dim]:
            raise ValueError(f"{_where('all_gather', g, x)}: sizes={sizes} must list {g.size} lengths "
                             f"along dim {dim}, this rank's ({g.index}) being {x.shape[dim]}")
        even, total = _even(sizes), sum(sizes)
        inner = math.prod(_with_dim(x.shape, dim, 1))
        counts = None if even else [s * inner for s in sizes]
    shape = (total,) + x.shape[1:] if dim == 0 else _with_dim(x.shape, dim, total)
    out = _backend().empty(shape, x.dtype) if out is None else _out("all_gather", g, x, out, shape, x.dtype)
    extra = dim
    if tag is None:
        comm = g.comm
    else:
        comm, extra = _tagged("all_gather", g, x, tag, dim)
    if _check is not None:
        _check("all_gather", g, x.dtype, x.shape if sizes is None else _with_dim(x.shape, dim, -1),
               (extra, role) if async_op else extra)
    info = ("all_gather", g, x, out.nbytes, mesh, x.shape if sizes is None else _with_dim(x.shape, dim, -1),
            extra) if _HOOKS else None
    # communicators take flat contiguous buffers: shapes do not matter to them
    if dim == 0 or math.prod(x.shape[:dim]) == 1:
        if info is None:
            return _issue(role, async_op, comm.all_gather, (x, out, counts), out)
        return _hooked(info, role, async_op, comm.all_gather, (x, out, counts), out, tag=tag)
    recv = _backend().empty((out.size,), x.dtype)

    def then():
        return _unpack(recv, shape, dim, [x.shape[dim]] * g.size if even else sizes, even, out)
    return _run(info, role, async_op, comm.all_gather, (x, recv, counts), out, then, tag=tag)


def all_to_all(x, axis=None, *, split_dim: int = 0, concat_dim: int | None = None,
               split_sizes: Sequence[int] | None = None, recv_sizes: Sequence[int] | None = None,
               mesh=None, async_op: bool = False, role: str = "a2a", out=None):
    """Split ``x`` along ``split_dim`` into one part per rank, send part i to rank i, and
    concatenate what arrives along ``concat_dim`` (default: ``split_dim``).

    ``split_sizes`` gives uneven parts (zeros allowed).  ``recv_sizes[j]`` is the length
    along ``concat_dim`` of what rank j sends here; left out with uneven parts, the sizes are
    exchanged first (one small extra all_to_all).  ``out=`` (dim 0 only) receives into a
    caller-owned buffer, so a persistent dispatch buffer needs no allocation per call.
    """
    if x.__class__ in _ROUTES:
        return _ROUTES[x.__class__]["all_to_all"](x, axis, split_dim=split_dim, concat_dim=concat_dim, split_sizes=split_sizes,
                                                 recv_sizes=recv_sizes, mesh=mesh, async_op=async_op, role=role)
    g = _group(mesh, axis, "all_to_all", x)
    x = _check_array("all_to_all", g, x)
    if not 0 <= split_dim < x.ndim:
        split_dim = _norm_dim("all_to_all", g, x, split_dim)
    concat_dim = split_dim if concat_dim is None else _norm_dim("all_to_all", g, x, concat_dim)
    n = g.size
    if _check is not None:
        _check("all_to_all", g, x.dtype, tuple(-1 if i in (split_dim, concat_dim) else s
                                               for i, s in enumerate(x.shape)),
               (split_dim, concat_dim, role) if async_op else (split_dim, concat_dim))
    info = ("all_to_all", g, x, x.nbytes, mesh, tuple(-1 if i in (split_dim, concat_dim) else s
                                                      for i, s in enumerate(x.shape)),
            (split_dim, concat_dim)) if _HOOKS else None
    if out is not None and (split_dim != 0 or concat_dim != 0):
        raise ValueError(f"{_where('all_to_all', g, x)}: out= needs split_dim=concat_dim=0")
    if split_sizes is None and recv_sizes is None and concat_dim == split_dim and not x.shape[split_dim] % n:
        # equal parts along one dim (the common case, kept cheap): the result has x's shape
        out = _backend().empty_like(x) if out is None else _out("all_to_all", g, x, out, x.shape, x.dtype)
        if split_dim == 0 or math.prod(x.shape[:split_dim]) == 1:
            if info is None:
                return _issue(role, async_op, g.comm.all_to_all, (x, out, None, None), out)
            return _hooked(info, role, async_op, g.comm.all_to_all, (x, out, None, None), out)
        parts = [x.shape[split_dim] // n] * n
        recv = _backend().empty((x.size,), x.dtype)
        return _run(info, role, async_op, g.comm.all_to_all, (_pack(x, split_dim, parts, True), recv, None, None),
                    out, lambda: _unpack(recv, x.shape, split_dim, parts, True, out))
    exchange = split_sizes is not None and recv_sizes is None
    split_sizes = _check_sizes("all_to_all", g, x, split_sizes, x.shape[split_dim], "split_sizes")
    if recv_sizes is None:
        if not exchange:
            recv_sizes = split_sizes if concat_dim == split_dim else [x.shape[concat_dim]] * n
        else:
            mine = split_sizes if concat_dim == split_dim else [x.shape[concat_dim]] * n
            recv_sizes = g.comm.mpi.alltoall(mine)
    else:
        recv_sizes = [int(s) for s in recv_sizes]
        if len(recv_sizes) != n or any(s < 0 for s in recv_sizes):
            raise ValueError(f"{_where('all_to_all', g, x)}: recv_sizes={recv_sizes} must be {n} sizes >= 0")
    # every piece that arrives has x's shape with this rank's split length and the sender's
    # length along concat_dim
    base = _with_dim(x.shape, split_dim, split_sizes[g.index])
    shape = _with_dim(base, concat_dim, sum(recv_sizes))
    send_counts = [math.prod(_with_dim(x.shape, split_dim, s)) for s in split_sizes]
    recv_counts = [math.prod(_with_dim(base, concat_dim, r)) for r in recv_sizes]
    fixed = _even(send_counts) and send_counts == recv_counts
    counts = (None, None) if fixed else (send_counts, recv_counts)
    send = _pack(x, split_dim, split_sizes, _even(split_sizes))
    out = _backend().empty(shape, x.dtype) if out is None else _out("all_to_all", g, x, out, shape, x.dtype)
    if concat_dim == 0 or math.prod(shape[:concat_dim]) == 1:
        return _run(info, role, async_op, g.comm.all_to_all, (send, out, *counts), out)
    recv = _backend().empty((out.size,), x.dtype)

    def then():
        return _unpack(recv, shape, concat_dim, recv_sizes, _even(recv_sizes), out)
    return _run(info, role, async_op, g.comm.all_to_all, (send, recv, *counts), out, then)


def broadcast(x, axis=None, *, root: int = 0, mesh=None, async_op: bool = False, role: str = "tp_collective",
              tag: str | None = None):
    """Copy the group's ``root`` rank's ``x`` into ``x`` on every rank (in place; returns x).
    ``root`` is a position in the group, not a world rank.  ``tag``: see the module docstring."""
    if x.__class__ in _ROUTES:
        _untaggable("broadcast", x, tag)
        return _ROUTES[x.__class__]["broadcast"](x, axis, root=root, mesh=mesh, async_op=async_op, role=role)
    g = _group(mesh, axis, "broadcast", x)
    if not _backend().is_array(x) or not x.flags.c_contiguous:
        raise TypeError(f"rank {world().rank}: broadcast over {g.name!r} fills x in place: pass a contiguous "
                        f"{_backend().xp.__name__} array, got {type(x).__name__}")
    if not 0 <= root < g.size:
        raise ValueError(f"{_where('broadcast', g, x)}: root={root} is not a position in the group (0..{g.size - 1})")
    extra = root
    if tag is None:
        comm = g.comm
    else:
        comm, extra = _tagged("broadcast", g, x, tag, root)
    if _check is not None:
        _check("broadcast", g, x.dtype, x.shape, (extra, role) if async_op else extra)
    if _HOOKS:
        return _hooked(("broadcast", g, x, x.nbytes if g.index == root else 0, mesh, x.shape, extra), role,
                       async_op, comm.broadcast, (x, root), x, tag=tag)
    return _issue(role, async_op, comm.broadcast, (x, root,), x)


def _peer(op, g, x, peer, name):
    if not 0 <= peer < g.size or peer == g.index:
        raise ValueError(f"{_where(op, g, x)}: {name}={peer} must be another position in the group "
                         f"(0..{g.size - 1}, this rank is {g.index})")


def send(x, dst: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Send ``x`` to position ``dst`` of the group (a world rank when no mesh or axis is given)."""
    g = _group(mesh, axis, "send", x)
    x = _check_array("send", g, x)
    _peer("send", g, x, dst, "dst")
    comm = g.comm
    if _HOOKS:
        return _hooked(("send", g, x, x.nbytes, mesh, (), (dst, tag)), role, async_op, comm.send, (x, dst, tag), None)
    return _issue(role, async_op, comm.send, (x, dst, tag,), None)


def recv(x, src: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Receive into ``x`` (in place; returns x) from position ``src`` of the group."""
    g = _group(mesh, axis, "recv", x)
    if not _backend().is_array(x) or not x.flags.c_contiguous:
        raise TypeError(f"rank {world().rank}: recv fills x in place: pass a contiguous "
                        f"{_backend().xp.__name__} array, got {type(x).__name__}")
    _peer("recv", g, x, src, "src")
    comm = g.comm
    if _HOOKS:
        return _hooked(("recv", g, x, 0, mesh, (), (src, tag)), role, async_op, comm.recv, (x, src, tag), x)
    return _issue(role, async_op, comm.recv, (x, src, tag,), x)


def barrier(axis=None, *, mesh=None, async_op: bool = False, role: str = "tp_collective"):
    """Wait until every rank of the group gets here (drains the role's stream on GPU)."""
    g = _group(mesh, axis, "barrier")
    if _check is not None:
        _check("barrier", g, None, (), role if async_op else None)
    comm = g.comm
    if _HOOKS:
        return _hooked(("barrier", g, None, 0, mesh, (), None), role, async_op, comm.barrier, (), None)
    return _issue(role, async_op, comm.barrier, (), None)


from .debug import Call as _Call  # noqa: E402  (debug imports this module lazily)
