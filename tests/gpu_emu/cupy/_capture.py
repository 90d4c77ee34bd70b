"""CUDA stream capture and graphs, as CuPy 14.2 exposes them (``Stream.begin_capture`` /
``end_capture`` / ``is_capturing``, ``cupy.cuda.Graph.launch``), modelled on CUDA's rules.

What a capture does here, as on a GPU:

* nothing runs: every device op issued on a capturing stream (or a stream that joined the
  capture by waiting on an event recorded in it) becomes a *node* of the graph instead.  A
  kernel's outputs keep whatever bytes they held; an array made by a captured op is
  allocated (from the pool, on the current stream's arena) but never filled;
* a launch runs the nodes in issue order on the launch stream, each reading device memory
  (and pinned host memory) *as it is at launch time*: a graph replays addresses, not values;
* a graph keeps no memory alive.  A launch whose nodes touch an allocation freed since the
  capture is refused (``GraphMemoryError``): on a GPU the replay would silently read or write
  whatever owns those bytes now;
* refused during capture, as CUDA refuses them (``CUDARuntimeError``, and the capture is
  invalidated, so ``end_capture`` then fails with cudaErrorStreamCaptureInvalidated):
  synchronizing or querying a capturing stream, a blocking ``get``/``item``/``float(x)``, a
  CuPy call that reads a count back (``nonzero``, boolean masks), ``Device.synchronize``, a
  host->device copy from pageable memory (``ndarray.set`` of a plain NumPy array, host index
  arrays; also ``cupy.asarray(host)``, which CuPy stages through a pinned buffer it recycles,
  so a capture would replay whatever that buffer holds later: refused here as the defect it
  is), a device->host copy into pageable memory,
  waiting on an event recorded outside the capture (isolation), and in the global and
  thread-local modes a ``cudaMalloc`` (the pool growing; reusing a free pool block is fine).
  ``end_capture`` on a stream other than the origin fails (unmatched), and so does one that
  leaves a joined stream's work unjoined.  Host waits on an event recorded in a capture
  fail (cudaErrorCapturedEvent).

Counted by ``count_device_work``: a launch is one ``graph_launches`` and each of its nodes
what it would be eagerly (a kernel launch, an h2d or d2h copy); a capture counts nothing
(nothing runs).  NCCL collectives are capturable; point-to-point calls in a capture are not
modelled (``StandinLimitation``).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from . import _counters, _tracker
from ._errors import StandinLimitation
from .cuda import runtime as _rt

__all__ = ["Capture", "GraphMemoryError", "capture_of", "begin", "end", "refuse", "refuse_device_sync",
           "check_unsafe_call", "deferred_numpy"]

_LOCK = threading.RLock()


class GraphMemoryError(RuntimeError):
    """A graph launch would touch device memory freed since the capture (a use after free that a
    GPU runs silently, corrupting whatever owns the bytes now)."""


class Node:
    """One captured op: what it is, the bytes it touches (weakly held) and how to run it."""

    __slots__ = ("kind", "op_class", "nbytes", "accesses", "run", "where")

    def __init__(self, kind, op_class, nbytes, accesses, run, where):
        self.kind, self.op_class, self.nbytes, self.run, self.where = kind, op_class, nbytes, run, where
        # (weakref to the allocation, its id, start, end, write): a graph holds addresses, not memory
        self.accesses = [(weakref.ref(mem), mem.alloc_id, lo, hi, w) for mem, lo, hi, w in accesses]


class Capture:
    """One capture sequence: its origin stream, the streams that joined it, its nodes."""

    def __init__(self, origin: _tracker.StreamState, mode: int):
        self.origin, self.mode = origin, mode
        self.thread = threading.get_ident()
        self.nodes: list[Node] = []
        self.invalid: str | None = None
        self.count: dict[int, int] = {origin.ptr: 0}          # nodes issued per stream in the capture
        self.covered: dict[int, dict[int, int]] = {origin.ptr: {}}   # stream -> what it is ordered after
        self.allocations = 0                                  # pool allocations made while capturing

    def invalidate(self, why: str) -> None:
        if self.invalid is None:
            self.invalid = why

    def add(self, kind: str, op_class: str, nbytes: int, accesses, run, state: _tracker.StreamState) -> None:
        """Append a node issued on ``state`` (in this capture)."""
        with _LOCK:
            self.nodes.append(Node(kind, op_class, nbytes, list(accesses), run, _tracker.caller_site()))
            self.count[state.ptr] = self.count.get(state.ptr, 0) + 1

    def snapshot(self, state: _tracker.StreamState) -> dict[int, int]:
        clock = dict(self.covered.get(state.ptr, {}))
        clock[state.ptr] = self.count.get(state.ptr, 0)
        return clock


def capture_of(state: _tracker.StreamState) -> Capture | None:
    """The capture ``state``'s stream belongs to (as origin or joined), or None."""
    return _tracker.CAPTURING.get(state.ptr)


def refuse(cap: Capture, what: str, status: int = _rt.errorStreamCaptureUnsupported):
    """Invalidate ``cap`` and raise CUDA's error for ``what``."""
    cap.invalidate(what)
    raise _rt.CUDARuntimeError(status, f"{what} while stream {cap.origin.describe()} is capturing "
                                       f"(begin_capture ... end_capture); the capture is invalidated")


def refuse_device_sync(kind: str) -> None:
    """A device-wide wait would wait for the capturing streams: refused while any capture runs."""
    for cap in _captures():
        refuse(cap, kind)


def check_unsafe_call(what: str) -> None:
    """cudaMalloc & co.: refused while a global-mode capture runs (any thread) or a thread-local
    one on this thread; the relaxed mode (CuPy's default) allows them."""
    me = threading.get_ident()
    for cap in _captures():
        if cap.mode == _rt.streamCaptureModeGlobal or (cap.mode == _rt.streamCaptureModeThreadLocal
                                                       and cap.thread == me):
            refuse(cap, f"{what} (a potentially unsafe API call in capture mode {cap.mode})")


def note_allocation() -> None:
    for cap in _captures():
        cap.allocations += 1


def _captures() -> list[Capture]:
    with _LOCK:
        return list({id(c): c for c in _tracker.CAPTURING.values()}.values())


def begin(state: _tracker.StreamState, mode: int) -> None:
    if mode not in (_rt.streamCaptureModeGlobal, _rt.streamCaptureModeThreadLocal, _rt.streamCaptureModeRelaxed):
        raise _rt.CUDARuntimeError(_rt.errorInvalidValue, f"stream capture mode {mode}")
    with _LOCK:
        if state.ptr in _tracker.CAPTURING:
            raise _rt.CUDARuntimeError(_rt.errorIllegalState, f"stream {state.describe()} is already capturing")
        _tracker.CAPTURING[state.ptr] = Capture(state, mode)


def end(state: _tracker.StreamState):
    """End the capture begun on ``state``; returns ``(capture, None)`` or raises CUDA's error
    (the capture is over either way)."""
    with _LOCK:
        cap = _tracker.CAPTURING.get(state.ptr)
        if cap is None:
            raise _rt.CUDARuntimeError(_rt.errorIllegalState, f"stream {state.describe()} is not capturing")
        if cap.origin is not state:
            cap.invalidate("end_capture on a joined stream")
            raise _rt.CUDARuntimeError(_rt.errorStreamCaptureUnmatched,
                                       f"end_capture on {state.describe()}, but the capture began on "
                                       f"{cap.origin.describe()}")
        if cap.mode != _rt.streamCaptureModeRelaxed and cap.thread != threading.get_ident():
            raise _rt.CUDARuntimeError(_rt.errorStreamCaptureWrongThread, "end_capture from another thread")
        for ptr in [p for p, c in _tracker.CAPTURING.items() if c is cap]:
            del _tracker.CAPTURING[ptr]
        origin_clock = cap.snapshot(state)
        unjoined = [p for p, n in cap.count.items() if p != state.ptr and origin_clock.get(p, 0) < n]
    if cap.invalid is not None:
        raise _rt.CUDARuntimeError(_rt.errorStreamCaptureInvalidated, f"the capture was invalidated by: {cap.invalid}")
    if unjoined:
        names = ", ".join(_tracker.STREAMS[p].describe() for p in unjoined)
        raise _rt.CUDARuntimeError(_rt.errorStreamCaptureUnjoined,
                                   f"work captured on {names} is not joined back into the origin stream "
                                   f"{state.describe()}: record an event there after it and wait_event on the origin")
    return cap


# ------------------------------------------------------------------------ events across streams

def record_event(event, state: _tracker.StreamState) -> bool:
    """``event.record(stream)`` on a capturing stream: the event becomes a capture node (True)."""
    cap = capture_of(state)
    if cap is None:
        event._captured = None
        return False
    event._captured = (cap, cap.snapshot(state))
    return True


def wait_event(state: _tracker.StreamState, event) -> bool:
    """``stream.wait_event(event)`` with capture in play; True when handled here."""
    captured = getattr(event, "_captured", None)
    cap = capture_of(state)
    if captured is None:
        if cap is not None and event._clock is not None:
            refuse(cap, "wait_event on an event recorded outside the capture", _rt.errorStreamCaptureIsolation)
        return False
    ecap, clock = captured
    with _LOCK:
        live = any(c is ecap for c in _tracker.CAPTURING.values())
        if not live:
            raise _rt.CUDARuntimeError(_rt.errorCapturedEvent, "wait_event on an event last recorded in a capture "
                                                               "that has ended; record it again outside the capture")
        if cap is not None and cap is not ecap:
            refuse(cap, "wait_event on an event of another capture sequence", _rt.errorStreamCaptureMerge)
        if cap is None:                       # the stream joins the capture (a fork)
            _tracker.CAPTURING[state.ptr] = ecap
            ecap.count.setdefault(state.ptr, 0)
            ecap.covered[state.ptr] = {}
        cov = ecap.covered.setdefault(state.ptr, {})
        for ptr, n in clock.items():
            if cov.get(ptr, 0) < n:
                cov[ptr] = n
    return True


def host_wait_on_event(event, kind: str) -> None:
    """A host wait or query of an event recorded in a capture: refused (cudaErrorCapturedEvent)."""
    if getattr(event, "_captured", None) is not None:
        raise _rt.CUDARuntimeError(_rt.errorCapturedEvent, f"{kind} of an event last recorded in a capturing "
                                                           "stream")


# ------------------------------------------------------------------------ deferred ops

def deferred_numpy(cap: Capture, state, kind, fn, np_args, np_kwargs, reads, writes, check_dtypes, wrap, accesses,
                   check):
    """``call_numpy`` on a capturing stream: the call runs once now only to learn the shape of
    its result (its writes are undone, a fresh output is allocated but left unfilled), and is
    recorded to run again, on the memory as it is then, at each launch."""
    snaps = [(w._a, np.array(w._a, copy=True)) for w in writes]
    with np.errstate(all="ignore"):
        res = fn(*np_args, **np_kwargs)
    for a, before in snaps:
        a[...] = before
    fresh: list = []
    views: list = []
    result = wrap(res, reads + writes, fresh, views, fill=False)
    if check_dtypes:
        check(kind, fresh)
    if fresh or writes:
        targets = _targets(res, result, {id(f) for f in fresh})

        def run(_state, fn=fn, a=np_args, k=np_kwargs, t=targets):
            with np.errstate(all="ignore"):
                _assign(fn(*a, **k), t)
        cap.add(kind, "kernel", 0, [*accesses(reads, False), *accesses(writes + fresh, True)], run, state)
    return result


def _targets(res, wrapped, fresh_ids):
    """A structure parallel to ``res``: the NumPy view of each fresh output, None elsewhere."""
    if isinstance(res, (tuple, list)):
        return type(res)(_targets(r, w, fresh_ids) for r, w in zip(res, wrapped))
    if id(wrapped) in fresh_ids:
        return wrapped._a
    return None


def _assign(res, targets) -> None:
    if isinstance(targets, (tuple, list)):
        for r, t in zip(res, targets):
            _assign(r, t)
    elif targets is not None:
        targets[...] = res


def add_copy(cap: Capture, state, kind: str, op_class: str, nbytes: int, accesses, run) -> None:
    cap.add(kind, op_class, nbytes, accesses, run, state)


# ------------------------------------------------------------------------ launch

def launch(cap: Capture, state: _tracker.StreamState) -> None:
    """Run ``cap``'s nodes as one graph launch on ``state``."""
    if capture_of(state) is not None:
        raise StandinLimitation("launching a graph inside a capture (a child graph node) is not modelled")
    accesses = []
    for node in cap.nodes:
        for ref, alloc_id, lo, hi, w in node.accesses:
            mem = ref()
            if mem is None or getattr(mem, "_pool", True) is None or mem.alloc_id != alloc_id:
                raise GraphMemoryError(
                    f"graph launch: node {node.kind} (captured at {node.where}) touches device memory freed since "
                    "the capture; on a GPU the replay would read or write whatever owns those bytes now. Keep every "
                    "array the captured work uses alive as long as the graph (static buffers), and allocate them "
                    "before begin_capture")
            accesses.append((mem, lo, hi, w))
    _tracker.record_op("cudaGraphLaunch", state, accesses, "graph")
    for node in cap.nodes:
        _counters.note_op(node.kind, node.op_class, node.nbytes, node.where)
        node.run(state)
