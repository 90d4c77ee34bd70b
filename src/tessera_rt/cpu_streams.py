"""CPU streams: the CUDA stream API on host threads (see ``backend``).

A CPU stream is a real object with the GPU stream's API.  The ``compute`` stream is the
calling thread: host work runs at once, and non-blocking MPI requests issued on it stay
pending until something waits on the stream or on an event recorded after them.  Every
other role's stream (``CpuWorkerStream``) has a worker thread that runs its queue in order,
so a collective on it runs while the caller computes, and events order streams against
each other as CUDA events do: ``b.wait_event(a.record())`` holds b's later work until a's
earlier work is done, ``event.synchronize()`` blocks the caller, ``query()`` does not.
An exception on a worker is raised again, with its own traceback, by the next wait that
covers it (``synchronize``, an event's ``synchronize``, a collective's ``wait()``); the
stream stays failed, as a CUDA context does after a kernel fault.  Worker streams are opt-in
(``TESSERA_CPU_STREAMS=threads`` or ``set_cpu_workers(True)``); by default, and with an MPI
without MPI_THREAD_MULTIPLE (see ``dist.init``), every stream stays on the caller.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["CpuEvent", "CpuStream", "CpuWorkerStream", "cpu_workers", "set_cpu_workers", "WORKER_ERROR_HOOKS",
           "check_timing"]


def check_timing(start, end) -> None:
    """Raise unless both events were recorded with ``timing=True`` (``elapsed_ms``: CPU and CUDA)."""
    if start.time is None or end.time is None:
        raise ValueError("elapsed_ms needs events recorded with stream.record(timing=True); plain "
                         "record() makes ordering-only events, which are cheaper (CUDA refuses to time them)")


class CpuEvent:
    """A point in a CPU stream: done when every request issued before it has finished.

    ``task``: the last worker task it covers (its ``t0``/``t1`` say when it really ran)."""

    __slots__ = ("_pending", "time", "task")

    def __init__(self, pending: tuple = (), timing: bool = False, task=None):
        self._pending = pending
        self.time = time.perf_counter() if timing else None
        self.task = task

    def synchronize(self) -> None:
        for work in self._pending:
            work.wait_done()
        self._pending = ()

    def query(self) -> bool:
        return all(work.test() for work in self._pending)

    def elapsed_ms(self, end: CpuEvent) -> float:
        check_timing(self, end)
        end.synchronize()
        self.synchronize()
        t0, t1 = self.time, end.time
        assert t0 is not None and t1 is not None          # (_check_timing)
        return (t1 - t0) * 1e3


class CpuStream:
    """In-order CPU work queue with the CUDA stream API (record, wait_event, synchronize)."""

    def __init__(self, name: str = "compute"):
        self.name = name
        self._pending: list = []

    def __repr__(self) -> str:
        return f"CpuStream({self.name!r}, pending={len(self._pending)})"

    @property
    def ptr(self) -> int:
        return 0

    def enqueue(self, work) -> None:
        """Track a request issued on this stream (anything with test() and wait_done())."""
        pending = self._pending
        # Finished requests leave from the front: a stream's requests finish in issue order as
        # a rule, so the first one still in flight ends the scan (one MPI poll per issue, not
        # one per request in flight: ~15-20 us each inside the backward's gradient buckets).
        # A long list (a receive at the front that waits while later sends finish) is swept.
        if len(pending) > 32:
            pending[:] = [w for w in pending if not w.test()]
        while pending and pending[0].test():
            del pending[0]
        pending.append(work)

    def record(self, timing: bool = False) -> CpuEvent:
        """An event after the work issued so far; ``timing=True`` for ``elapsed_ms``."""
        return CpuEvent(tuple(self._pending), timing)

    def wait_event(self, event: CpuEvent) -> None:
        # A CPU stream orders work by finishing what the event covers.
        event.synchronize()

    def synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait_done()

    def query(self) -> bool:
        return all(w.test() for w in self._pending)

    def make_current(self) -> None:
        return None    # host work always runs in the caller's order

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


# Called as hook(stream, exc) on the worker thread when a task fails (dist.init adds one that
# ends the job if the caller does not pick the error up within seconds).
WORKER_ERROR_HOOKS: list = []
# Off by default: on 2-rank CPU training, worker threads made the step slower (26 vs 18 ms
# median, quiet 2-core VM, BENCHMARKS.md) -- the many small gradient all-reduces already
# progress inside the step's later MPI calls, and a worker pays for the GIL on every test.
# With gradient buckets (6 all-reduces instead of 22) workers are still not faster (1.05x
# the in-order step, median of 12 rounds, loaded VM): on 2 cores there is no core to spare.
# TESSERA_CPU_STREAMS=threads (or set_cpu_workers(True)) turns them on.
_CPU_WORKERS = [os.environ.get("TESSERA_CPU_STREAMS", "inorder").strip().lower() in ("threads", "workers")]


def cpu_workers() -> bool:
    """Whether CPU streams other than compute get worker threads (see the module doc)."""
    return _CPU_WORKERS[0]


def set_cpu_workers(on: bool) -> None:
    """Choose worker-thread CPU streams (True) or in-order streams on the caller (False);
    affects streams made from now on (``runtime.reset()`` drops the old ones)."""
    _CPU_WORKERS[0] = bool(on)


class _Task:
    """One function queued on a worker stream; ``t0``/``t1`` (perf_counter) once it ran."""

    __slots__ = ("stream", "seq", "fn", "t0", "t1")

    def __init__(self, stream: CpuWorkerStream, seq: int, fn: Callable):
        self.stream, self.seq, self.fn = stream, seq, fn
        self.t0 = self.t1 = None

    def test(self) -> bool:
        return self.stream._done >= self.seq

    def wait_done(self) -> None:
        self.stream._wait(self.seq)


class CpuWorkerStream(CpuStream):
    """A CPU stream with its own worker thread (started on first use) running its queue in order.

    ``submit(fn)`` queues host work (a blocking MPI call releases the GIL, as NumPy's kernels
    do, so it runs while the caller computes).  Requests ``enqueue``d from the caller are
    covered by events as on the in-order stream."""

    def __init__(self, name: str = "worker"):
        super().__init__(name)
        lock = threading.Lock()
        self._work_cv = threading.Condition(lock)      # the worker waits here for tasks
        self._done_cv = threading.Condition(lock)      # waiters wait here for completions
        self._queue: deque = deque()
        self._issued = 0          # seq of the last task submitted
        self._done = 0            # seq of the last task finished (failed or skipped included)
        self._last: _Task | None = None
        self._error: tuple | None = None      # (seq, exception) of the first failure
        self._closed = False
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"CpuWorkerStream({self.name!r}, queued={self._issued - self._done})"

    # the caller's side ------------------------------------------------------
    def submit(self, fn: Callable) -> _Task:
        """Queue ``fn()`` after everything already on this stream; returns its task."""
        if self._error is not None:
            self._raise()
        with self._work_cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"tessera-stream-{self.name}", daemon=True)
                self._thread.start()
            self._issued += 1
            task = self._last = _Task(self, self._issued, fn)
            self._queue.append(task)
            self._work_cv.notify()
        return task

    def wait_tasks(self) -> None:
        """Wait for the submitted tasks (not for requests ``enqueue``d by the caller)."""
        self._wait(self._issued)

    def record(self, timing: bool = False) -> CpuEvent:
        last = self._last
        # the last task even when done: its wait raises if it (or one before it) failed
        pending = tuple(self._pending) + ((last,) if last is not None else ())
        if timing:
            # the event's time is when the worker gets to it, as on a GPU
            ev = CpuEvent((), True, last)
            stamp = self.submit(lambda: setattr(ev, "time", time.perf_counter()))
            ev._pending = tuple(self._pending) + (stamp,)
            return ev
        return CpuEvent(pending, False, last)

    def wait_event(self, event: CpuEvent) -> None:
        if event.query():
            return
        if all(type(w) is _Task for w in event._pending):
            self.submit(event.synchronize)      # later work here waits for it, not the caller
        else:
            event.synchronize()                 # MPI requests are waited on by the thread that made them

    def synchronize(self) -> None:
        CpuStream.synchronize(self)
        self._wait(self._issued)

    def query(self) -> bool:
        return CpuStream.query(self) and self._done >= self._issued

    def _wait(self, seq: int) -> None:
        if self._done < seq:
            with self._done_cv:
                while self._done < seq:
                    self._done_cv.wait()
        err = self._error
        if err is not None and err[0] <= seq:
            self._raise()

    def _raise(self) -> None:
        assert self._error is not None                    # (a failed stream's)
        exc = self._error[1]
        exc._tessera_seen = True          # picked up: the job-ending timer (dist.init) stands down
        raise exc

    def close(self, timeout: float | None = None) -> None:
        """Finish the queue and stop the worker (errors are dropped: runtime.reset and exit only)."""
        with self._work_cv:
            self._closed = True
            self._work_cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # the worker's side --------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._work_cv:
                while not self._queue and not self._closed:
                    self._work_cv.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
            fn, task.fn = task.fn, None
            if self._error is None:          # after a failure the rest of the queue is skipped
                task.t0 = time.perf_counter()
                try:
                    fn()
                except BaseException as exc:   # handed to the caller's next wait
                    skipped = self._issued - task.seq
                    if sys.version_info >= (3, 11):          # (3.10 has no notes: the exception alone)
                        exc.add_note(f"(raised on the {self.name!r} stream's worker thread; re-raised at the next "
                                     f"wait on that stream, which stays failed: {skipped} later task(s) skipped "
                                     "so far, and later ones too, until runtime.reset())")
                    self._error = (task.seq, exc)
                    for hook in tuple(WORKER_ERROR_HOOKS):
                        hook(self, exc)
                task.t1 = time.perf_counter()
            with self._done_cv:
                self._done = task.seq
                self._done_cv.notify_all()
