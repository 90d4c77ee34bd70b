"""Stream-order tracking: which device work could still be running when memory is touched.

Data moves eagerly in NumPy, so results are always correct here; what a real GPU would get
wrong is *ordering*.  Every operation that touches device memory is recorded as an op on a
stream with its stream-local sequence number.  Ordering facts are vector clocks:

* ``StreamState.clock[S] = n``: ops 1..n of stream S are ordered before anything issued next
  on this stream (learned from ``wait_event`` of an event recorded after them, or from the
  legacy null stream's implicit synchronization with blocking streams);
* ``HOST_CLOCK[S] = n``: the host has observed ops 1..n of S complete (``synchronize()``,
  ``done``, ``Event.synchronize()``, ``Device.synchronize()``), so they are ordered before
  everything issued afterwards on any stream.

An op (S, seq) is ordered before the next op of T when S is T, ``T.clock[S] >= seq`` or
``HOST_CLOCK[S] >= seq``.  Two checks use that:

* reuse (``check_reuse``): the pool hands a block to stream T while an unordered op on
  another stream still references its bytes.  CuPy's pool returns a freed block to the
  arena of the stream it was allocated on with no event, so this is exactly the defect
  where an async collective's input is dropped while NCCL still reads it;
* hazards (``record_op``): an op on T writes bytes an unordered op on another stream reads
  or writes, or reads bytes an unordered op writes (RAW/WAR/WAW across streams).  Only
  accesses to the same allocation count: a reused block is covered by the reuse check.
"""
from __future__ import annotations

import os
import sys
import threading

from . import _counters
from ._errors import StreamOrderError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.RLock()

# Hazard checks can be turned off (reuse checks cannot): TESSERA_STANDIN_HAZARDS=0.
HAZARDS_ENABLED = os.environ.get("TESSERA_STANDIN_HAZARDS", "1") != "0"

HOST_CLOCK: dict[int, int] = {}
# stream ptr -> the capture sequence it belongs to (``_capture``: origin and joined streams)
CAPTURING: dict = {}


class StreamState:
    """Ordering state of one CUDA stream, shared by every Python object with its ptr."""

    __slots__ = ("ptr", "name", "blocking", "seq", "clock", "queried")

    def __init__(self, ptr: int, name: str, blocking: bool):
        self.ptr = ptr
        self.name = name
        self.blocking = blocking   # False for non_blocking=True streams (no null-stream sync)
        self.seq = 0
        self.clock: dict[int, int] = {}
        self.queried = 0           # ``seq`` when a query last answered "still running"

    def snapshot(self) -> dict[int, int]:
        """The clock an event recorded now would carry: everything issued here so far."""
        clock = dict(self.clock)
        clock[self.ptr] = self.seq
        return clock

    def describe(self) -> str:
        return f"{self.name} (ptr {self.ptr:#x})"


STREAMS: dict[int, StreamState] = {}
NULL_STREAM_PTR = 0


def stream_state(ptr: int) -> StreamState:
    try:
        return STREAMS[ptr]
    except KeyError:
        raise ValueError(f"unknown CUDA stream ptr {ptr:#x}: the stand-in knows only streams it "
                         "created (cupy.cuda.Stream) and 0 (the null stream)") from None


def register_stream(ptr: int, name: str, blocking: bool) -> StreamState:
    state = STREAMS[ptr] = StreamState(ptr, name, blocking)
    return state


register_stream(NULL_STREAM_PTR, "null stream", blocking=True)


def merge_into(clock: dict[int, int], other: dict[int, int]) -> None:
    for ptr, seq in other.items():
        if clock.get(ptr, 0) < seq:
            clock[ptr] = seq


# Host-visible effects of ops that complete asynchronously (``get(blocking=False)``'s copy
# into host memory): (stream ptr, seq, apply), run once the host has seen that op complete.
_DEFERRED: list = []


def host_observed(clock: dict[int, int]) -> None:
    """The host saw everything ``clock`` covers complete."""
    with _LOCK:
        merge_into(HOST_CLOCK, clock)
        _run_deferred()


def host_synchronized_all() -> None:
    with _LOCK:
        for state in STREAMS.values():
            merge_into(HOST_CLOCK, state.snapshot())
        _run_deferred()


def pending(clock: dict[int, int]) -> bool:
    """Whether some op ``clock`` covers is not yet known to the host as complete."""
    return any(HOST_CLOCK.get(ptr, 0) < seq for ptr, seq in clock.items())


def defer_until_complete(state: StreamState, apply) -> None:
    """Run ``apply()`` when the host sees the op last issued on ``state`` complete."""
    with _LOCK:
        _DEFERRED.append((state.ptr, state.seq, apply))


def watch_pinned_source(state: StreamState, host, kind: str) -> None:
    """``host`` (pinned memory) is the source of the copy last issued on ``state``: a copy
    from pinned memory runs asynchronously, reading ``host`` until it completes, so the host
    must not write it before.  Checked when the host sees the copy complete."""
    import numpy as np
    before, where, seq = np.array(host, copy=True), caller_site(), state.seq

    def check():
        if host.tobytes() != before.tobytes():
            raise StreamOrderError(
                f"pinned-memory race: the host wrote a pinned buffer ({host.shape} {host.dtype}) that "
                f"{kind} (op #{seq} on stream {state.describe()}, issued at {where}) copies from "
                "asynchronously, before that copy was known to be complete; synchronize the stream "
                "(or an event recorded after the copy) before writing the buffer")
    defer_until_complete(state, check)


def _run_deferred() -> None:
    ready = [d for d in _DEFERRED if HOST_CLOCK.get(d[0], 0) >= d[1]]
    for d in ready:
        _DEFERRED.remove(d)
        d[2]()


def before_issue(state: StreamState) -> None:
    """The legacy null stream's implicit synchronization: work on it waits for all blocking
    streams, and work on a blocking stream waits for the null stream."""
    if state.ptr == NULL_STREAM_PTR:
        for other in STREAMS.values():
            if other.blocking and other is not state:
                merge_into(state.clock, other.snapshot())
    elif state.blocking:
        merge_into(state.clock, STREAMS[NULL_STREAM_PTR].snapshot())


def wait_clock(state: StreamState, clock: dict[int, int]) -> None:
    with _LOCK:
        merge_into(state.clock, clock)


class Op:
    """One recorded operation: what, on which stream, and where the caller issued it."""

    __slots__ = ("kind", "stream", "seq", "where")

    def __init__(self, kind: str, stream: StreamState, seq: int, where: str):
        self.kind = kind
        self.stream = stream
        self.seq = seq
        self.where = where

    def ordered_before(self, state: StreamState) -> bool:
        ptr = self.stream.ptr
        return (ptr == state.ptr or state.clock.get(ptr, 0) >= self.seq
                or HOST_CLOCK.get(ptr, 0) >= self.seq)

    def host_done(self) -> bool:
        return HOST_CLOCK.get(self.stream.ptr, 0) >= self.seq

    def describe(self) -> str:
        return f"{self.kind} (op #{self.seq} on stream {self.stream.describe()}, issued at {self.where})"


class Access:
    """Bytes [start, end) of a segment, read or written by ``op`` through allocation ``alloc_id``."""

    __slots__ = ("op", "start", "end", "write", "alloc_id")

    def __init__(self, op: Op, start: int, end: int, write: bool, alloc_id: int):
        self.op = op
        self.start = start
        self.end = end
        self.write = write
        self.alloc_id = alloc_id

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def caller_site() -> str:
    """The first frame outside this package: where the user's code issued the op."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _live_accesses(segment) -> list:
    """The segment's accesses the host has not yet seen complete (prunes the rest)."""
    live = [a for a in segment.accesses if not a.op.host_done()]
    segment.accesses = live
    return live


def record_op(kind: str, state: StreamState, accesses, op_class: str = "kernel", nbytes: int = 0) -> Op:
    """Issue an op on ``state`` touching ``accesses``: iterable of (allocation, start, end, write).
    ``op_class`` (kernel, h2d or d2h) and ``nbytes`` (of a copy) are for the counters.

    Raises StreamOrderError (before recording) on a cross-stream hazard.
    """
    if CAPTURING:
        _check_capture(kind, state, op_class)
    with _LOCK:
        before_issue(state)
        op = Op(kind, state, state.seq + 1, caller_site())
        accesses = list(accesses)
        if HAZARDS_ENABLED:
            for alloc, start, end, write in accesses:
                _check_hazard(op, alloc, start, end, write)
        state.seq += 1
        for alloc, start, end, write in accesses:
            _append_access(alloc.segment, Access(op, start, end, write, alloc.alloc_id))
    _counters.note_op(kind, op_class, nbytes, op.where)
    return op


def _check_capture(kind: str, state: StreamState, op_class: str) -> None:
    """An op reaching the tracker (so about to run now) on a capturing stream is one the
    stand-in does not defer: a pageable host->device copy is CUDA's refusal, anything else
    a gap of the model.  Work on the legacy stream while a blocking stream captures is
    refused too (it would wait on the capture)."""
    from . import _capture
    from .cuda import runtime
    cap = CAPTURING.get(state.ptr)
    if cap is not None:
        if op_class == "h2d":
            _capture.refuse(cap, f"{kind} from pageable host memory")
        from ._errors import StandinLimitation
        raise StandinLimitation(f"{kind} on a capturing stream is not modelled by the stand-in's capture")
    if state.ptr == NULL_STREAM_PTR:
        for c in {id(c): c for c in CAPTURING.values()}.values():
            if any(STREAMS[p].blocking for p, x in CAPTURING.items() if x is c):
                _capture.refuse(c, f"{kind} on the legacy null stream", runtime.errorStreamCaptureImplicit)


def _check_hazard(op: Op, alloc, start: int, end: int, write: bool) -> None:
    for prior in _live_accesses(alloc.segment):
        if (prior.alloc_id == alloc.alloc_id and (write or prior.write) and prior.overlaps(start, end)
                and not prior.op.ordered_before(op.stream)):
            what = {(True, True): "writes bytes that", (True, False): "writes bytes that",
                    (False, True): "reads bytes that"}[(write, prior.write)]
            verb = "writes" if prior.write else "reads"
            raise StreamOrderError(
                f"stream-order hazard: {op.kind} on stream {op.stream.describe()}, issued at "
                f"{op.where}, {what} {prior.op.describe()} {verb}, with no event or synchronize "
                f"ordering them (allocation of {alloc.size} bytes at {alloc.ptr:#x}, bytes "
                f"[{max(start, prior.start) - alloc.segment.base}, {min(end, prior.end) - alloc.segment.base}) "
                f"of its segment); make stream {op.stream.name} wait_event(an event recorded on "
                f"stream {prior.op.stream.name} after that op)")


def _append_access(segment, access: Access) -> None:
    # A newer access by the same stream to a range covering an older one, at least as strong
    # (write >= read), subsumes it: any stream unordered with the older op is unordered with
    # the newer one.  Dropping it keeps the list short on long-lived buffers.
    stream = access.op.stream
    segment.accesses = [a for a in segment.accesses
                        if not (a.op.stream is stream and access.start <= a.start and a.end <= access.end
                                and (access.write or not a.write))]
    segment.accesses.append(access)


def check_reuse(state: StreamState, segment, start: int, end: int, size: int) -> None:
    """The pool is about to hand bytes [start, end) of ``segment`` to stream ``state``."""
    with _LOCK:
        before_issue(state)
        for prior in _live_accesses(segment):
            if prior.overlaps(start, end) and not prior.op.ordered_before(state):
                raise StreamOrderError(
                    f"memory-pool reuse race: a {size}-byte block at {start:#x} was handed out on "
                    f"stream {state.describe()} (allocation at {caller_site()}) while "
                    f"{prior.op.describe()} still {'writes' if prior.write else 'reads'} it. "
                    "CuPy's pool returned the block to its stream's arena when the last array "
                    "referencing it was dropped, without waiting for that op; keep the array alive "
                    "until the op's stream is synchronized or waited on with an event")
        # Every remaining access to these bytes is ordered before this stream, and the block
        # stays in this stream's arena: they can never race with a later reuse.
        segment.accesses = [a for a in segment.accesses if not (start <= a.start and a.end <= end)]
