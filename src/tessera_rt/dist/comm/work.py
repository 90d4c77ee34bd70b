"""How a collective call is issued: the group it runs on, its role's stream ordered against
compute, the hooks around it, and the ``Work`` handle of a non-blocking one.

The array collectives (``collectives``), the point-to-point calls (``p2p``) and the layers
above (a compiled redistribution plan's steps, ``dist.ccl``) all go through ``issue`` (or
``issue_call`` / ``issue_watched`` when something watches collectives).  On CPU ranks a blocking call
goes straight to MPI on the caller's thread; an async one runs on its role's worker.
"""
from __future__ import annotations

from typing import Any

from ... import runtime as rt
from ...backend import CpuWorkerStream
from ...runtime import ROLE_STREAMS  # the role -> stream cache (the runtime clears it in place)
from .calls import Call as _Call
from .cpu_async import P2P, start_on_worker
from .hooks import SEAM as _SEAM
from .mesh import AxisGroup, current_mesh
from .plans import backend
from .process_group import world

__all__ = ["Work", "world_group", "WORLD_GROUP", "WATCHERS", "resolve_group", "issue", "issue_watched",
           "issue_call"]

# What the hot paths read from the seam (dist.comm.hooks): the agreement check (SEAM.check, and
# SEAM.check_plan for a planned call; None when off or replaced by TESSERA_DEBUG=collectives),
# called before any data moves, and the watchers (the same list as SEAM.watchers).  An async
# collective's role is part of what must agree: on CPU ranks each role's worker has its own
# communicator, so ranks issuing one collective on different roles would never match up.
WATCHERS = _SEAM.watchers

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

    def __init__(self, event: Any, result: Any, then: Any = None, keep: Any = None) -> None:
        self._event = event
        self._result = result
        self._then = then
        self._done = False
        self._call: _Call | None = None  # set while hooks watch this collective
        # Every buffer the pending collective reads or writes (the caller's array, the
        # contiguous copy, the pack temporaries).  CuPy's pool hands a freed block to the
        # next allocation on the stream it came from with no event, so dropping these
        # before compute is ordered after the collective lets compute overwrite what NCCL
        # is still reading on its own stream.
        self._keep = keep

    def wait(self) -> Any:
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
                for h in WATCHERS:
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
    def completed(cls, result) -> Work:
        """A handle for work that already ran (the same API for every ``async_op=True`` path)."""
        w = cls(None, result)
        w._done = True
        return w


# The world group, made on first use (a list so dist/comm/_hot.c and issue_watched read the
# live cache: empty until then).  Owned here; nothing else writes it.
WORLD_GROUP: list[AxisGroup] = []


def world_group() -> AxisGroup:
    """The group of every rank in the job (used when no mesh and no axis are given).

    Returns
    -------
    AxisGroup
        All ranks, in world order.
    """
    if not WORLD_GROUP:
        w = world()
        WORLD_GROUP.append(AxisGroup(("world",), tuple(range(w.size)), w.rank, w.communicator()))
    return WORLD_GROUP[0]


def resolve_group(mesh, axis, op: str, x=None) -> AxisGroup:
    """The group a collective ``op`` runs on: ``mesh``'s (or the current mesh's) group over
    ``axis`` (None: the mesh's axes; "world"/None without a mesh: every rank), made on first
    use.  Making a group is collective over its members: with ``TESSERA_DEBUG=collectives``
    the desync check runs first on ``x`` (``SEAM.precheck``)."""
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


def issue(role: str, async_op: bool, method, args: tuple, result, then=None):
    """Run the communicator ``method(*args)`` on the role's stream, ordered against compute:
    ``result`` (or ``then()``) when blocking, a ``Work`` when ``async_op``.  The one issue path
    of the collectives, point-to-point calls and compiled redistribution plans."""
    on_gpu = backend().is_gpu
    if not on_gpu:
        stream = ROLE_STREAMS.get(role) or rt.stream(role)
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


def issue_watched(info: tuple, role: str, async_op: bool, method, args: tuple, result, then=None, det=None,
                  tag: str | None = None):
    """``issue`` with the watchers (``WATCHERS``) around it.  ``info`` = (op, group, x, data bytes, mesh as given,
    shape that must match within the group, arguments that must match mesh-wide)."""
    op, g, x, nbytes, mesh, gshape, extra = info
    if mesh is None and not (WORLD_GROUP and g is WORLD_GROUP[0]):
        mesh = current_mesh()
    call = _Call(op, g, x, nbytes, mesh, gshape, extra, role, async_op)
    if tag is not None:
        call.tag = tag
    try:
        for h in tuple(WATCHERS):
            h.before(call)                            # may raise (a desync): after() still runs
        if det is not None and _SEAM.det:
            r = _SEAM.fixed_order[op](*det, role=role, issue=issue)     # fixed-order reduction (blocking)
            if async_op:
                r = Work.completed(r)
        else:
            r = issue(role, async_op, method, args, result, then)
    except BaseException:
        _after(call)
        raise
    if type(r) is Work and not r._done:
        r._call = call                                 # the hooks' after() runs in wait()
    else:
        _after(call)
    return r


def issue_call(info, role: str, async_op: bool, method, args: tuple, result, then=None, tag: str | None = None):
    """``issue``, or ``issue_watched`` when something watches collectives (``info`` is None otherwise)."""
    if info is None:
        return issue(role, async_op, method, args, result, then)
    return issue_watched(info, role, async_op, method, args, result, then, tag=tag)


def _after(call) -> None:
    for h in reversed(WATCHERS):
        if hasattr(h, "after"):
            h.after(call)
