"""The backend: an array module, streams and events, a buffer pool and a kernel table.

Picked once per process: CuPy on a usable GPU, NumPy otherwise; ``TESSERA_DEVICE=cpu|cuda``
overrides.  CuPy is imported only when the cuda backend is chosen, so a CPU install never
needs it.  Everything above this module asks ``get_backend()`` instead of branching on
"is this a GPU".

A CPU stream is a real object with the GPU stream's API.  The ``compute`` stream is the
calling thread: host work runs at once, and non-blocking MPI requests issued on it stay
pending until something waits on the stream or on an event recorded after them.  Every
other role's stream (``CpuWorkerStream``) has a worker thread that runs its queue in order,
so a collective on it runs while the caller computes, and events order streams against
each other as CUDA events do: ``b.wait_event(a.record())`` holds b's later work until a's
earlier work is done, ``event.synchronize()`` blocks the caller, ``query()`` does not.
An exception on a worker is raised again, with its own traceback, by the next wait that
covers it (``synchronize``, an event's ``synchronize``, a collective's ``wait()``); the
stream stays failed, as a CUDA context does after a kernel fault.  ``TESSERA_CPU_STREAMS=inorder``
(or an MPI without MPI_THREAD_MULTIPLE, see ``dist.init``) keeps every stream on the caller.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable

import numpy as np

__all__ = [
    "Backend", "BackendUnavailable", "get_backend", "reset_backend",
    "CpuStream", "CpuEvent", "CpuWorkerStream", "HostBufferPool", "register_kernel",
    "cpu_workers", "set_cpu_workers", "WORKER_ERROR_HOOKS",
]


class BackendUnavailable(RuntimeError):
    """The requested device cannot be used; the message says why and what to do."""


# --------------------------------------------------------------------------- CPU streams

def _check_timing(start, end) -> None:
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

    def elapsed_ms(self, end: "CpuEvent") -> float:
        _check_timing(self, end)
        end.synchronize()
        self.synchronize()
        return (end.time - self.time) * 1e3


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
        if self._pending:
            self._pending = [w for w in self._pending if not w.test()]
        self._pending.append(work)

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
_CPU_WORKERS = [os.environ.get("TESSERA_CPU_STREAMS", "threads").strip().lower() != "inorder"]


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

    def __init__(self, stream: "CpuWorkerStream", seq: int, fn: Callable):
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
                except BaseException as exc:   # noqa: BLE001 - handed to the caller's next wait
                    skipped = self._issued - task.seq
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


class CudaEvent:
    """A CUDA event, plus the host-side work its stream still owed when it was recorded.

    Two kinds of work reach a CUDA stream from the host: MPI requests of the host-staged
    path, and NCCL sends/recvs held back so that the sends and receives of one exchange are
    launched together in one NCCL group (a lone recv on a stream blocks that stream until
    the peer's send arrives, so a ring of irecv-then-isend would hang).  Such an event is
    recorded only once that work is done or launched, the first time something waits on it.
    """

    __slots__ = ("_event", "time", "_pending", "_stream")

    def __init__(self, event, timing: bool = False, pending: tuple = (), stream=None):
        self._event = event
        self.time = True if timing else None     # only "can it be timed", for _check_timing
        self._pending = pending
        self._stream = stream

    def _ready(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ()
            for work in pending:
                work.wait_done()
            self._event.record(self._stream)

    def synchronize(self) -> None:
        self._ready()
        self._event.synchronize()

    def query(self) -> bool:
        if self._pending and not all(work.test() for work in self._pending):
            return False
        self._ready()
        return self._event.done

    def elapsed_ms(self, end: "CudaEvent") -> float:
        import cupy
        _check_timing(self, end)
        end.synchronize()
        self._ready()
        return cupy.cuda.get_elapsed_time(self._event, end._event)


class CudaStream:
    """A non-blocking CuPy stream; ``with stream:`` makes it CuPy's current stream."""

    def __init__(self, name: str = "compute"):
        import cupy
        self.name = name
        self._cupy = cupy
        self.raw = cupy.cuda.Stream(non_blocking=True)
        self._pending: list = []     # host-side work the next events must cover (see CudaEvent)

    def __repr__(self) -> str:
        return f"CudaStream({self.name!r}, ptr={self.raw.ptr:#x})"

    @property
    def ptr(self) -> int:
        return self.raw.ptr

    def enqueue(self, work) -> None:
        """Track host-side work issued for this stream (anything with test() and wait_done())."""
        if self._pending:
            self._pending = [w for w in self._pending if not w.test()]
        self._pending.append(work)

    def record(self, timing: bool = False) -> CudaEvent:
        """An event after the work enqueued so far; ``timing=True`` for ``elapsed_ms``.

        Most events only order one stream after another: those skip the timestamp, which
        CUDA documents as the cheaper kind (cudaEventDisableTiming) for synchronization."""
        event = self._cupy.cuda.Event(block=False, disable_timing=not timing)
        pending = tuple(self._pending)
        if not pending:
            event.record(self.raw)
        return CudaEvent(event, timing, pending, self.raw)

    def wait_event(self, event: CudaEvent) -> None:
        event._ready()
        self.raw.wait_event(event._event)

    def synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait_done()
        self.raw.synchronize()

    def query(self) -> bool:
        return all(w.test() for w in self._pending) and self.raw.done

    def make_current(self) -> None:
        """Make this CuPy's current stream, so plain CuPy calls are enqueued on it."""
        self.raw.use()

    def __enter__(self):
        self.raw.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.raw.__exit__(*exc)


# --------------------------------------------------------------------------- buffer pool

class HostBufferPool:
    """Reuses host blocks once every view of them is gone (seed 004's persistent buffers).

    A fresh multi-MiB NumPy array is page-faulted in on first touch, which costs more than
    moving it over shared memory.  The pool keeps released blocks mapped.  A block is free
    when the pool holds the only reference to it: every array handed out is a view whose
    ``.base`` is the block, so a live view (or an in-flight request holding one) keeps it busy.
    """

    MIN_BYTES = 1 << 16          # below this NumPy's own small-block cache is as good
    MAX_PER_CLASS = 8

    def __init__(self, max_cached_bytes: int = 2 << 30):
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0
        self._blocks: dict[int, list[np.ndarray]] = defaultdict(list)
        self._dtypes: dict = {}
        self._lock = threading.Lock()    # worker streams allocate too (bf16 staging)

    @staticmethod
    def _size_class(nbytes: int) -> int:
        # Four classes per power of two: at most 25% slack.
        step = max(4096, 1 << max(0, nbytes.bit_length() - 3))
        return -(-nbytes // step) * step

    def empty(self, shape, dtype) -> np.ndarray:
        if shape.__class__ is int:
            shape = (shape,)
        spec = self._dtypes.get(dtype)
        if spec is None:   # np.dtype(...) and isinstance checks are slow on a hot path: memoize
            spec = self._dtypes[dtype] = (np.dtype(dtype), np.dtype(dtype).itemsize)
        nbytes = math.prod(shape) * spec[1]
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, spec[0])
        return self._take(nbytes, shape, spec[0])

    def empty_like(self, x: np.ndarray) -> np.ndarray:
        """An uninitialized array of x's shape and dtype (C order)."""
        nbytes = x.nbytes
        if nbytes < self.MIN_BYTES:
            return np.empty(x.shape, x.dtype)
        return self._take(nbytes, x.shape, x.dtype)

    def _take(self, nbytes: int, shape, dtype) -> np.ndarray:
        size = self._size_class(nbytes)
        with self._lock:
            blocks = self._blocks[size]
            for block in blocks:
                # refs: the list, the loop variable, getrefcount's argument
                if sys.getrefcount(block) == 3:
                    return block[:nbytes].view(dtype).reshape(shape)
            block = np.empty(size, np.uint8)
            if len(blocks) < self.MAX_PER_CLASS and self.cached_bytes + size <= self.max_cached_bytes:
                blocks.append(block)
                self.cached_bytes += size
            return block[:nbytes].view(dtype).reshape(shape)

    def clear(self) -> None:
        self._blocks.clear()
        self.cached_bytes = 0


# --------------------------------------------------------------------------- kernel table

# op name -> {backend name -> implementation}; filled by tessera_rt.kernels at import.
_KERNELS: dict[str, dict[str, Callable]] = defaultdict(dict)


def register_kernel(op: str, device: str, fn: Callable | None = None):
    """Register ``fn`` as ``op``'s implementation on ``device`` ("cpu" or "cuda").

    Usable as a decorator: ``@register_kernel("softmax", "cpu")``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"register_kernel: device must be 'cpu' or 'cuda', got {device!r}")

    def put(f: Callable) -> Callable:
        _KERNELS[op][device] = f
        return f

    return put(fn) if fn is not None else put


# --------------------------------------------------------------------------- backend

class Backend:
    """An array module plus its streams, buffer pool and kernel table."""

    def __init__(self, name: str, xp: Any, device_id: int | None = None):
        self.name = name
        self.xp = xp
        self.device_id = device_id
        self.is_gpu = name == "cuda"
        self._stream_cls = CudaStream if self.is_gpu else CpuStream
        self._pool = None if self.is_gpu else HostBufferPool()
        # bound once: these are on every collective's hot path
        self.empty = xp.empty if self._pool is None else self._pool.empty
        self.empty_like = xp.empty_like if self._pool is None else self._pool.empty_like

    def __repr__(self) -> str:
        where = f", device={self.device_id}" if self.is_gpu else ""
        return f"Backend({self.name!r}{where})"

    # devices -------------------------------------------------------------
    def use_device(self, device_id: int) -> None:
        """Make ``device_id`` current (GPU only; a no-op on CPU)."""
        if self.is_gpu:
            self.xp.cuda.Device(device_id).use()
            self.device_id = device_id

    def device_count(self) -> int:
        return self.xp.cuda.runtime.getDeviceCount() if self.is_gpu else 0

    # streams -------------------------------------------------------------
    def new_stream(self, name: str, worker: bool = False):
        """A stream for ``name``; on the CPU ``worker=True`` gives it a worker thread (unless
        worker streams are off), on a GPU every stream runs on the device anyway."""
        if worker and not self.is_gpu and cpu_workers():
            return CpuWorkerStream(name)
        return self._stream_cls(name)

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device().synchronize()

    # arrays --------------------------------------------------------------
    # ``empty(shape, dtype)`` and ``empty_like(x)``: pooled, uninitialized arrays (CuPy's
    # memory pool on GPU, HostBufferPool on CPU); bound in __init__.
    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return a.get() if self.is_gpu and hasattr(a, "get") else np.asarray(a)

    def is_array(self, a) -> bool:
        return isinstance(a, self.xp.ndarray)

    # kernels -------------------------------------------------------------
    def kernel(self, op: str, like: Any = None) -> Callable:
        """The implementation of ``op`` on this backend; the CPU reference if there is no GPU one.

        ``like``: an input array; host (NumPy) arrays get the CPU reference even on the GPU
        backend, as a host tensor runs host kernels in PyTorch, since a GPU kernel cannot
        read host memory."""
        impls = _KERNELS.get(op)
        if not impls:
            raise KeyError(f"no kernel registered for op {op!r}; known ops: {sorted(_KERNELS)}")
        device = self.name if like is None or isinstance(like, self.xp.ndarray) else "cpu"
        fn = impls.get(device) or impls.get("cpu")
        if fn is None:
            raise KeyError(f"op {op!r} has no {self.name} kernel and no CPU reference")
        return fn


_BACKEND: Backend | None = None


def _make_cuda_backend(explicit: bool) -> Backend | None:
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, CUDARuntimeError, missing driver
        if explicit:
            raise BackendUnavailable(
                f"TESSERA_DEVICE=cuda but no usable GPU ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'cupy not importable'}); "
                "install tessera_rt[cuda12] or [cuda13] on a GPU machine, or set TESSERA_DEVICE=cpu"
            ) from None
        return None
    if count < 1:
        if explicit:
            raise BackendUnavailable("TESSERA_DEVICE=cuda but CUDA reports 0 devices; set TESSERA_DEVICE=cpu")
        return None
    return Backend("cuda", cupy, device_id=cupy.cuda.Device().id)


def get_backend() -> Backend:
    """The process's backend, chosen on first call."""
    global _BACKEND
    if _BACKEND is not None:
        return _BACKEND
    choice = os.environ.get("TESSERA_DEVICE", "").strip().lower()
    if choice not in ("", "auto", "cpu", "cuda", "gpu"):
        raise BackendUnavailable(f"TESSERA_DEVICE={choice!r}: use 'cpu' or 'cuda' (or leave it unset)")
    backend = None
    if choice in ("cuda", "gpu"):
        backend = _make_cuda_backend(explicit=True)
    elif choice in ("", "auto"):
        backend = _make_cuda_backend(explicit=False)
    _BACKEND = backend or Backend("cpu", np)
    return _BACKEND


def reset_backend() -> None:
    """Forget the chosen backend (tests only: the next get_backend() chooses again)."""
    global _BACKEND
    _BACKEND = None
