"""The backend: an array module, streams and events, a buffer pool and a kernel table.

Picked once per process: CuPy on a usable GPU, NumPy otherwise; ``TESSERA_DEVICE=cpu|cuda``
overrides.  CuPy is imported only when the cuda backend is chosen, so a CPU install never
needs it.  Everything above this module asks ``get_backend()`` instead of branching on
"is this a GPU".

CPU streams (the caller's in-order ``compute`` stream and the worker-thread streams of the
other roles) live in ``cpu_streams``; the names are re-exported here.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from .cpu_streams import (
    WORKER_ERROR_HOOKS,
    CpuEvent,
    CpuStream,
    CpuWorkerStream,
    check_timing,
    cpu_workers,
    set_cpu_workers,
)

__all__ = [
    "Backend", "BackendUnavailable", "get_backend", "reset_backend",
    "CpuStream", "CpuEvent", "CpuWorkerStream", "HostBufferPool", "mapped_empty", "register_kernel",
    "cpu_workers", "set_cpu_workers", "WORKER_ERROR_HOOKS", "array_module", "is_cupy", "KERNELS",
]


def is_cupy(a: Any) -> bool:
    """Whether ``a`` is a CuPy array (by its type's module: CuPy is never imported here)."""
    t = type(a)
    return t is not np.ndarray and t.__module__.split(".", 1)[0] == "cupy"


def array_module(*arrays: Any):
    """``cupy`` if any argument is a CuPy array, else ``numpy``: the array module of the
    arrays themselves, whatever backend the process picked (a reference written once against
    ``xp`` runs on both)."""
    for a in arrays:
        if a is not None and is_cupy(a):
            return sys.modules["cupy"]
    return np


class BackendUnavailable(RuntimeError):
    """The requested device cannot be used; the message says why and what to do."""


# --------------------------------------------------------------------------- GPU streams

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
        self.time = True if timing else None     # only "can it be timed", for check_timing
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

    def elapsed_ms(self, end: CudaEvent) -> float:
        import cupy
        check_timing(self, end)
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


# --------------------------------------------------------------------------- host malloc

# glibc's mallopt parameters, and the values the CPU backend sets (TESSERA_MALLOC=default
# keeps glibc's own).  The mmap threshold is glibc's largest.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_host_malloc() -> bool:
    """Keep freed host memory mapped in the process (glibc only; True if set).

    NumPy's kernels allocate every temporary with malloc.  With glibc's defaults a block of
    128 KiB or more is a fresh mmap until a free raises the threshold, and freed memory at
    the heap's top beyond twice that threshold goes back to the kernel: the next step's
    temporaries are page-faulted in (and zeroed) again, every step.  In a train.py step
    (d 64, 8 x 64 tokens: 512 KiB hidden activations) one sigmoid took 0.85-1.2 ms for
    131 K elements and the step ran 25-30% slower than with the heap kept (1 rank,
    the development VM).  PyTorch's CPU guides get the same from jemalloc/tcmalloc.  The
    cost: the heap keeps up to TRIM_THRESHOLD_BYTES free at its top for reuse."""
    if os.environ.get("TESSERA_MALLOC", "").strip().lower() in ("default", "0", "off", "no"):
        return False
    try:
        libc = ctypes.CDLL(None)         # the process's own symbols (find_library runs ldconfig: ~3 ms)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version     # (glibc's; musl has neither)
    except (OSError, AttributeError, TypeError):
        return False
    del version
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                     TRIM_THRESHOLD_BYTES))


# --------------------------------------------------------------------------- buffer pool

def _mapped(shape, dtype) -> np.ndarray:
    """An uninitialized array on a fresh anonymous mapping advised for transparent huge pages
    and started on a 2 MiB boundary (so every 2 MiB of it can be one huge page).

    malloc serves a large block from recycled heap memory once its mmap threshold has grown
    (glibc raises it after the first large free), and pages already faulted in there stay
    4 KiB pages: a 16 MiB all_reduce into such a block ran 0.6-0.8 ms (~15%) slower than
    into a fresh mapping, every call, on the development VM (THP "madvise" mode).  The array
    is made on the mapping itself, so it is the ``.base`` of every view of it (the pool's and
    dist.ccl's reference counts rely on that)."""
    dt = np.dtype(dtype)
    if not hasattr(mmap, "MAP_ANONYMOUS"):          # (not a POSIX system: NumPy's memory)
        return np.empty(shape, dt)
    nbytes = math.prod((shape,) if isinstance(shape, int) else shape) * dt.itemsize
    huge = 1 << 21
    m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:                  # kernels without THP
            pass
    skip = -np.frombuffer(m, np.uint8, count=1).ctypes.data % huge
    return np.ndarray(shape, dt, m, offset=skip)


def mapped_empty(shape, dtype) -> np.ndarray:
    """An uninitialized host array on memory of the kind the pool gives large outputs (a fresh
    mapping with huge pages from ``HostBufferPool.MAPPED_BYTES``; NumPy's below), owning
    its memory as far as views are concerned (it is their ``.base``).  Long-lived buffers
    use it (dist.ccl's persistent sets, compiled plans' scratch), and the benchmarks give
    their hand-written peers these, so a ratio measures the call, not page sizes."""
    dt = np.dtype(dtype)
    nbytes = math.prod((shape,) if isinstance(shape, int) else shape) * dt.itemsize
    if nbytes < HostBufferPool.MAPPED_BYTES:
        return np.empty(shape, dt)
    return _mapped(shape, dt)


class HostBufferPool:
    """Reuses host blocks once every view of them is gone (seed 004's persistent buffers).

    A fresh multi-MiB NumPy array is page-faulted in on first touch, which costs more than
    moving it over shared memory.  The pool keeps released blocks mapped.  A block is free
    when the pool holds the only reference to it: every array handed out is a view whose
    ``.base`` is the block, so a live view (or an in-flight request holding one) keeps it busy.
    """

    MIN_BYTES = 1 << 16          # below this NumPy's own small-block cache is as good
    MAPPED_BYTES = 1 << 21       # blocks from here up are fresh mappings with huge pages (_mapped)
    MAX_PER_CLASS = 8

    def __init__(self, max_cached_bytes: int = 2 << 30):
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0
        self._blocks: dict[int, list[np.ndarray]] = defaultdict(list)
        # (shape, dtype) -> False below MIN_BYTES, else (size class, its block list, np.dtype):
        # what a request works out from its arguments, once (1.6 -> ~0.5 us per request)
        self._specs: dict = {}
        self._lock = threading.Lock()    # worker streams allocate too (bf16 staging)

    @staticmethod
    def _size_class(nbytes: int) -> int:
        # Four classes per power of two: at most 25% slack.
        step = max(4096, 1 << max(0, nbytes.bit_length() - 3))
        return -(-nbytes // step) * step

    def _spec(self, shape, dtype):
        if len(self._specs) > 4096:      # a bound (shapes that change every call)
            self._specs.clear()
        dt = np.dtype(dtype)
        nbytes = math.prod((shape,) if shape.__class__ is int else shape) * dt.itemsize
        if nbytes < self.MIN_BYTES:
            spec = False
        else:
            size = self._size_class(nbytes)
            spec = (size, self._blocks[size], dt)
        self._specs[(shape, dtype)] = spec
        return spec

    def empty(self, shape, dtype) -> np.ndarray:
        spec = self._specs.get((shape, dtype))
        if not spec:
            if spec is None:
                spec = self._spec(shape, dtype)
            if spec is False:
                return np.empty(shape, dtype)
        return self._take(shape, spec)

    def empty_like(self, x: np.ndarray) -> np.ndarray:
        """An uninitialized array of x's shape and dtype (C order)."""
        return self.empty(x.shape, x.dtype)

    def allocator(self, shape: tuple, dtype) -> Callable[[], np.ndarray]:
        """() -> ``empty(shape, dtype)``, with the request's spec worked out now (for callers
        that allocate one shape over and over: a compiled redistribution's output).

        Below ``MAPPED_BYTES`` that is NumPy's own ``empty``: malloc hands a block of one
        size freed on the previous call straight back (its mmap threshold has grown past it
        after the first free), 0.4 us against the pool's 1 us, and an Allgather into it ran
        1-2 us faster than into a pooled block at 64 KiB-1.5 MiB (2 ranks, the development
        VM).  From ``MAPPED_BYTES`` up the pool's huge-page mappings win (see _mapped)."""
        spec = self._spec(shape, dtype)
        if spec is False or spec[0] < self.MAPPED_BYTES:
            return functools.partial(np.empty, shape, dtype)
        return functools.partial(self._take, shape, spec)

    def _take(self, shape, spec) -> np.ndarray:
        size, blocks, dt = spec
        with self._lock:
            for block in blocks:
                # refs: the list, the loop variable, getrefcount's argument (a handed-out array,
                # and every view of it, has the block as its .base)
                if sys.getrefcount(block) == 3:
                    return np.ndarray(shape, dt, block)
            return np.ndarray(shape, dt, self._new_block(size, blocks))

    def _new_block(self, size: int, blocks: list) -> np.ndarray:
        block = _mapped(size, np.uint8) if size >= self.MAPPED_BYTES else np.empty(size, np.uint8)
        if len(blocks) < self.MAX_PER_CLASS and self.cached_bytes + size <= self.max_cached_bytes:
            blocks.append(block)
            self.cached_bytes += size
        return block

    def clear(self) -> None:
        self._blocks.clear()
        self._specs.clear()
        self.cached_bytes = 0


# --------------------------------------------------------------------------- kernel table

# op name -> {backend name -> implementation}; filled by tessera_rt.kernels at import.
KERNELS: dict[str, dict[str, Callable]] = defaultdict(dict)


def register_kernel(op: str, device: str, fn: Callable | None = None):
    """Register ``fn`` as ``op``'s implementation on ``device`` ("cpu" or "cuda").

    Usable as a decorator: ``@register_kernel("softmax", "cpu")``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"register_kernel: device must be 'cpu' or 'cuda', got {device!r}")

    def put(f: Callable) -> Callable:
        KERNELS[op][device] = f
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
        impls = KERNELS.get(op)
        if not impls:
            raise KeyError(f"no kernel registered for op {op!r}; known ops: {sorted(KERNELS)}")
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
    """The process's backend, chosen on first call.

    Returns
    -------
    Backend
        CuPy on a GPU when one is usable, else NumPy on the CPU (``TESSERA_DEVICE=cpu|cuda`` forces
        one).
    """
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
    if backend is None:
        tune_host_malloc()
    _BACKEND = backend or Backend("cpu", np)
    return _BACKEND


def reset_backend() -> None:
    """Forget the chosen backend (tests only: the next get_backend() chooses again)."""
    global _BACKEND
    _BACKEND = None
