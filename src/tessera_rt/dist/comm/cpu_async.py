"""Async collectives on a CPU role's worker stream (``backend.CpuWorkerStream``).

``work.issue`` sends an ``async_op=True`` collective here when its role's stream has
a worker.  It runs on the role's own duplicate of the group's communicator
(``MpiCommunicator.for_role``), so collectives of several roles in flight at once cannot
match each other's messages.  It is started by the caller when the stream has nothing
queued (a worker's wake-up can take a scheduler slice), else by the worker in its turn;
either way the worker alone tests it to completion (MPI forbids two threads waiting on one
request), and the returned event covers that.
"""
from __future__ import annotations

import time

from ... import runtime as rt
from ...backend import CpuWorkerStream

__all__ = ["P2P", "after_role_worker", "start_on_worker"]

# Sends and receives stay non-blocking MPI requests issued by the caller (on its
# communicator, tracked by the role's stream): on a worker, a blocking recv would hold the
# queue before the send its peer waits for (the ring of irecv-then-isend).
P2P = frozenset(("send", "recv"))

# the longest sleep between two tests of a pending request
POLL_MAX_S = 2e-4


def _progress(req, keep=None) -> None:
    """Drive a non-blocking MPI request to completion without holding a core: MPI's blocking
    calls busy-poll, which starves the caller's compute where ranks x threads exceed the
    cores; a short, growing sleep between tests leaves the core to compute.  ``keep``: the
    buffers the request reads and writes, alive until it is done."""
    if req is None or req.test():
        return
    delay = 2e-6
    while not req.test():
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def start_on_worker(stream, role: str, method, args: tuple):
    """Start communicator ``method(*args)`` (a bound method of the group's communicator) as
    an async collective on ``stream``, the worker stream of ``role``; returns the event
    after it."""
    compute = rt.stream("compute")
    fn = getattr(method.__self__.for_role(role), method.__name__)
    if not compute._pending and stream._done == stream._issued:
        req = fn(*args, blocking=False)                # nothing to wait for: start it now
        stream.submit(lambda: _progress(req, args))
    else:
        if compute._pending:
            stream.wait_event(compute.record())        # requests compute still owes
        stream.submit(lambda: _progress(fn(*args, blocking=False)))
    return stream.record()


def after_role_worker(role: str) -> None:
    """Before a blocking CPU call goes straight to MPI on the caller's thread: let the role's
    worker finish what it was given first (stream order).  The plain collectives' direct
    paths repeat these lines inline (see the note above ``all_reduce``)."""
    s = rt.ROLE_STREAMS.get(role)
    if s.__class__ is CpuWorkerStream and s._done != s._issued:
        s.wait_tasks()
