"""Streams and events with CUDA's ordering semantics, fed to the tracker (``_tracker``).

Work runs eagerly, so ``synchronize()`` returns at once.  What it changes is what the tracker
knows is *ordered*: a synchronize, or a ``done`` query answering True, tells the host the
stream's work so far is complete; ``wait_event`` orders a stream after the work an event
covers.  A query models work still running: the first ``done`` after new work the host has
not seen complete answers False (as a GPU still running it would), and tells the host
nothing; the next answers True (so polling loops end).
"""
from __future__ import annotations

import itertools
import threading
import time

from .. import _counters, _tracker
from .runtime import CUDARuntimeError, errorInvalidResourceHandle

__all__ = ["BaseStream", "Stream", "ExternalStream", "Event", "get_current_stream",
           "get_current_stream_ptr", "get_elapsed_time", "current_stream_state", "resolve_stream"]

# Fake but unique, nonzero handles (cudaStream_t / cudaEvent_t values).
_stream_handles = itertools.count(0x5ee0_0000, 0x100)
_event_handles = itertools.count(0xe7e0_0000, 0x100)
_local = threading.local()
# CAI v3 forbids stream 0; CuPy exports cudaStreamLegacy (1) for the null stream.
LEGACY_STREAM_HANDLE = 1


class BaseStream:
    """What Stream and ExternalStream share; state is keyed by ``ptr`` in the tracker."""

    ptr: int
    _state: _tracker.StreamState

    def synchronize(self) -> None:
        self._synchronize("Stream.synchronize")

    def _synchronize(self, kind: str) -> None:
        """A host wait for this stream (counted as a sync, as ``kind``)."""
        from .. import _capture
        cap = _capture.capture_of(self._state)
        if cap is not None:
            _capture.refuse(cap, f"{kind} (a host wait for a capturing stream)")
        _counters.note_sync(kind)
        _tracker.host_observed(self._state.snapshot())

    @property
    def done(self) -> bool:
        # a query (cudaStreamQuery) does not wait: not counted as a sync
        from .. import _capture
        cap = _capture.capture_of(self._state)
        if cap is not None:
            _capture.refuse(cap, "Stream.done (cudaStreamQuery of a capturing stream)")
        state = self._state
        if state.queried != state.seq and _tracker.pending(state.snapshot()):
            state.queried = state.seq
            return False
        # True: the host now knows everything issued so far completed
        _tracker.host_observed(state.snapshot())
        return True

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        from .. import _capture
        if _capture.wait_event(self._state, event):
            return
        if event._clock is not None:      # an unrecorded event orders nothing (as in CUDA)
            _tracker.wait_clock(self._state, event._clock)

    def begin_capture(self, mode=None) -> None:
        """Begin capturing this stream's work into a CUDA graph (``end_capture`` returns it).
        Default mode: relaxed, as CuPy's (the memory pool may grow meanwhile)."""
        from .. import _capture
        from . import runtime
        if self.ptr in (0, LEGACY_STREAM_HANDLE):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        _capture.begin(self._state, runtime.streamCaptureModeRelaxed if mode is None else int(mode))

    def end_capture(self):
        """End the capture begun on this stream: the ``cupy.cuda.Graph`` of its work."""
        from .. import _capture
        from .graph import Graph
        return Graph._from_capture(_capture.end(self._state))

    def is_capturing(self) -> bool:
        from .. import _capture
        return _capture.capture_of(self._state) is not None

    def use(self) -> BaseStream:
        _local.current = self
        return self

    def __enter__(self):
        _local.__dict__.setdefault("previous", []).append(get_current_stream())
        return self.use()

    def __exit__(self, *exc) -> None:
        _local.previous.pop().use()

    def __eq__(self, other) -> bool:
        return isinstance(other, BaseStream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(("stream", self.ptr))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr:#x}>"

    @property
    def device_id(self) -> int:
        from .device import current_device_id
        return current_device_id()


class Stream(BaseStream):
    """``Stream(null=False, non_blocking=False, ptds=False, priority=None)``."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority=None):
        if null:
            self.ptr = _tracker.NULL_STREAM_PTR
            self._state = _tracker.stream_state(self.ptr)
            return
        if ptds:
            raise NotImplementedError("the stand-in does not model per-thread default streams")
        self.ptr = next(_stream_handles)
        self.non_blocking = bool(non_blocking)
        kind = "non-blocking" if non_blocking else "blocking"
        self._state = _tracker.register_stream(self.ptr, f"stream-{self.ptr & 0xffffff:x} ({kind})",
                                               blocking=not non_blocking)


Stream.null = Stream(null=True)


class ExternalStream(BaseStream):
    """A stream made elsewhere, by pointer; the stand-in knows only its own (and 0)."""

    def __init__(self, ptr: int, device_id: int = -1):
        ptr = int(ptr)
        if ptr not in _tracker.STREAMS:
            raise CUDARuntimeError(errorInvalidResourceHandle,
                                   f"ExternalStream({ptr:#x}) is not a stream the stand-in created")
        self.ptr = ptr
        self._state = _tracker.stream_state(ptr)


def get_current_stream(device_id: int | None = None) -> BaseStream:
    return getattr(_local, "current", None) or Stream.null


def current_stream_state() -> _tracker.StreamState:
    return get_current_stream()._state


def get_current_stream_ptr() -> int:
    return get_current_stream().ptr


def resolve_stream(stream) -> BaseStream:
    """A stream argument: None (the current stream), a stream object, or a raw handle."""
    if stream is None:
        return get_current_stream()
    if isinstance(stream, BaseStream):
        return stream
    return ExternalStream(int(stream))


class Event:
    """``Event(block=False, disable_timing=False, interprocess=False)``."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        if interprocess and not disable_timing:
            # cupy/cuda/stream.pyx raises this before calling cudaEventCreateWithFlags
            raise ValueError("Timing must be disabled for interprocess events")
        self.ptr = next(_event_handles)
        self.block = block
        self.disable_timing = disable_timing
        self.interprocess = interprocess
        self._clock: dict[int, int] | None = None   # the recording stream's snapshot
        self._captured = None                        # (capture, its clock) when recorded in a capture
        self._queried = False                        # a query answered "still running"
        self._time: float | None = None

    def record(self, stream=None) -> None:
        from .. import _capture
        state = resolve_stream(stream)._state
        if _capture.record_event(self, state):
            self._clock = None          # a node of the capture, not a point on the stream
            return
        _tracker.before_issue(state)
        self._clock = state.snapshot()
        self._queried = False
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        from .. import _capture
        _capture.host_wait_on_event(self, "Event.synchronize")
        _counters.note_sync("Event.synchronize")
        self._observed()

    def _observed(self) -> None:
        if self._clock is not None:
            _tracker.host_observed(self._clock)

    @property
    def done(self) -> bool:
        """As ``BaseStream.done``: False once while the covered work is not known complete
        (a query: not counted as a sync)."""
        from .. import _capture
        _capture.host_wait_on_event(self, "Event.done")
        if not self._queried and self._clock is not None and _tracker.pending(self._clock):
            self._queried = True
            return False
        self._observed()
        return True

    def __repr__(self) -> str:
        return f"<Event {self.ptr:#x} {'recorded' if self._clock is not None else 'unrecorded'}>"


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two recorded timing events (as cudaEventElapsedTime)."""
    for event in (start_event, end_event):
        if not isinstance(event, Event):
            raise TypeError(f"expected cupy.cuda.Event, got {type(event).__name__}")
        if event.disable_timing:
            raise CUDARuntimeError(errorInvalidResourceHandle,
                                   "cudaEventElapsedTime on an event created with disable_timing=True")
        if event._clock is None:
            raise CUDARuntimeError(errorInvalidResourceHandle,
                                   "cudaEventElapsedTime on an event that was never recorded")
    # cudaEventElapsedTime does not wait (it fails on an unfinished event); the stand-in
    # assumes the caller waited, and counts no sync for it
    end_event._observed()
    start_event._observed()
    return (end_event._time - start_event._time) * 1e3

