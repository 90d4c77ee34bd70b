"""CuPy's memory pool, modelled on cupy/cuda/memory.pyx (``MemoryPool._malloc`` / ``free``).

What matters for correctness testing, and is kept:

* sizes round up to 512 bytes (``ALLOCATION_UNIT_SIZE``, ``_round_size``), but the bytes an
  allocation may be used through are the ones requested (``PooledMemory.requested``): a
  kernel or NCCL call running into the rounding is out of bounds here, as it would be on a
  GPU where another allocator (or a larger array in the same block) owns those bytes;
* one arena of free chunks per stream: ``_malloc`` looks only in the arena of the *current*
  stream, takes the best-fitting chunk and splits off the rest;
* a freed chunk (its last array or view garbage collected) goes back to the arena of the
  stream it was allocated on, with no event, merged with free neighbours; the next fitting
  allocation on that stream gets it.  That is where ``_tracker.check_reuse`` looks for ops
  on other streams still using the bytes.

"Device" memory is host memory: each segment (a cudaMalloc) is a NumPy byte buffer aligned
to 256 bytes, and device pointers are its real addresses, so pointer arithmetic works and a
CUDA emulator can read and write through them.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import weakref

import numpy as np

from .. import _tracker

__all__ = ["MemoryPool", "MemoryPointer", "PooledMemory", "Memory", "get_default_memory_pool",
           "ALLOCATION_UNIT_SIZE", "resolve_pointer", "live_allocations", "set_allocator", "get_allocator"]

ALLOCATION_UNIT_SIZE = 512
_CUDA_MALLOC_ALIGN = 256
_alloc_ids = itertools.count(1)


def round_size(size: int) -> int:
    return -(-size // ALLOCATION_UNIT_SIZE) * ALLOCATION_UNIT_SIZE


class _Segment:
    """One cudaMalloc'd region; lives in the arena of the stream it was allocated for."""

    __slots__ = ("buf", "base", "size", "stream_ptr", "accesses")

    def __init__(self, size: int, stream_ptr: int):
        raw = np.empty(size + _CUDA_MALLOC_ALIGN, np.uint8)
        raw.fill(0xFF)      # uninitialized memory reads as NaN / -1, not as convenient zeros
        skip = (-raw.ctypes.data) % _CUDA_MALLOC_ALIGN
        self.buf = raw[skip:skip + size]
        self.base = self.buf.ctypes.data
        self.size = size
        self.stream_ptr = stream_ptr
        self.accesses: list = []        # _tracker.Access records on these bytes


class _Chunk:
    """A piece [offset, offset + size) of a segment, free or handed out."""

    __slots__ = ("segment", "offset", "size", "prev", "next", "free")

    def __init__(self, segment: _Segment, offset: int, size: int):
        self.segment = segment
        self.offset = offset
        self.size = size
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None
        self.free = False

    @property
    def ptr(self) -> int:
        return self.segment.base + self.offset


class Memory:
    """Zero-byte memory (CuPy's ``Memory(0)``): pointer 0, no segment."""

    ptr = 0
    size = 0
    requested = 0
    segment = None
    alloc_id = 0
    device_id = 0


_ZERO = Memory()


class PooledMemory:
    """A live allocation.  Garbage collection of the last array or view using it returns the
    chunk to its stream's arena (``__del__``, like CuPy's ``PooledMemory.__dealloc__``)."""

    __slots__ = ("ptr", "size", "requested", "segment", "chunk", "alloc_id", "device_id", "_pool",
                 "__weakref__")

    def __init__(self, pool: MemoryPool, chunk: _Chunk, device_id: int, requested: int):
        self._pool = pool
        self.chunk = chunk
        self.segment = chunk.segment
        self.ptr = chunk.ptr
        self.size = chunk.size          # the rounded block, as CuPy reports it
        self.requested = requested      # what bounds checks allow
        self.alloc_id = next(_alloc_ids)
        self.device_id = device_id

    def free(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._free(self)

    def __del__(self):
        try:
            self.free()
        except Exception:       # interpreter shutdown: module globals may be gone
            pass

    def host_view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        start = self.chunk.offset + offset
        return self.segment.buf[start:start + (self.size - offset if nbytes is None else nbytes)]


class MemoryPointer:
    """A pointer into an allocation: ``ptr = mem.ptr + offset``; keeps ``mem`` alive."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    def __sub__(self, offset: int) -> MemoryPointer:
        return self + (-int(offset))

    def __repr__(self) -> str:
        return f"<MemoryPointer {self.ptr:#x} in allocation of {self.mem.size} bytes>"


class MemoryPool:
    """Per-stream arenas of free chunks over cudaMalloc'd segments (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._arenas: dict[int, list[_Chunk]] = {}
        self._segments: list[_Segment] = []
        self._pending_frees: list[PooledMemory] = []
        # ptr -> live allocation, weakly: the last array going away must free it
        self._live: dict[int, weakref.ref] = {}
        self._live_ptrs: list[int] = []
        self._used_bytes = 0

    # -- allocation ------------------------------------------------------
    def malloc(self, size: int) -> MemoryPointer:
        if size == 0:
            return MemoryPointer(_ZERO, 0)
        from .device import current_device_id
        from .stream import current_stream_state
        rounded = round_size(size)
        state = current_stream_state()
        with self._lock:
            self._drain_pending_frees()
            arena = self._arenas.setdefault(state.ptr, [])
            fits = [c for c in arena if c.size >= rounded]
            if fits:
                chunk = min(fits, key=lambda c: (c.size, c.ptr))
                # raises before anything changes, so the pool stays consistent
                _tracker.check_reuse(state, chunk.segment, chunk.ptr, chunk.ptr + rounded, rounded)
                arena.remove(chunk)
                chunk.free = False
                if chunk.size > rounded:
                    arena.append(self._split(chunk, rounded))
            else:
                from .. import _capture
                _capture.check_unsafe_call("cudaMalloc (the memory pool growing)")
                segment = _Segment(rounded, state.ptr)
                bisect.insort(self._segments, segment, key=lambda s: s.base)
                chunk = _Chunk(segment, 0, rounded)
            mem = PooledMemory(self, chunk, current_device_id(), size)
            if _tracker.CAPTURING:
                from .. import _capture
                _capture.note_allocation()
            self._live[mem.ptr] = weakref.ref(mem)
            bisect.insort(self._live_ptrs, mem.ptr)
            self._used_bytes += chunk.size
        return MemoryPointer(mem, 0)

    @staticmethod
    def _split(chunk: _Chunk, size: int) -> _Chunk:
        rest = _Chunk(chunk.segment, chunk.offset + size, chunk.size - size)
        rest.free = True
        rest.prev, rest.next = chunk, chunk.next
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next = rest
        chunk.size = size
        return rest

    # -- free ------------------------------------------------------------
    def _free(self, mem: PooledMemory) -> None:
        # __del__ can run inside a pool call (a GC pass during malloc): defer, as CuPy does
        # with add_pending_free_atomic, and drain on the next malloc.
        if not self._lock.acquire(blocking=False):
            self._pending_frees.append(mem)
            return
        try:
            self._release(mem)
        finally:
            self._lock.release()

    def _drain_pending_frees(self) -> None:
        while self._pending_frees:
            self._release(self._pending_frees.pop())

    def _release(self, mem: PooledMemory) -> None:
        del self._live[mem.ptr]
        self._live_ptrs.pop(bisect.bisect_left(self._live_ptrs, mem.ptr))
        chunk = mem.chunk
        self._used_bytes -= chunk.size
        arena = self._arenas.setdefault(chunk.segment.stream_ptr, [])
        chunk.free = True
        for neighbour in (chunk.prev, chunk.next):
            if neighbour is not None and neighbour.free:
                arena.remove(neighbour)
                chunk = self._merge(*((neighbour, chunk) if neighbour is chunk.prev else (chunk, neighbour)))
        arena.append(chunk)

    @staticmethod
    def _merge(head: _Chunk, tail: _Chunk) -> _Chunk:
        head.size += tail.size
        head.next = tail.next
        if tail.next is not None:
            tail.next.prev = head
        return head

    def free_all_blocks(self, stream=None) -> None:
        """Give back (cudaFree) every segment that is one free chunk."""
        with self._lock:
            self._drain_pending_frees()
            for ptr, arena in self._arenas.items():
                if stream is not None and ptr != stream.ptr:
                    continue
                whole = [c for c in arena if c.prev is None and c.next is None]
                for chunk in whole:
                    arena.remove(chunk)
                    self._segments.remove(chunk.segment)

    # -- queries ---------------------------------------------------------
    def used_bytes(self) -> int:
        return self._used_bytes

    def total_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def free_bytes(self) -> int:
        return self.total_bytes() - self._used_bytes

    def n_free_blocks(self) -> int:
        return sum(len(a) for a in self._arenas.values())

    def set_limit(self, size=None, fraction=None) -> None:
        return None         # no device memory limit to model

    def get_limit(self) -> int:
        return 0

    def resolve(self, ptr: int) -> tuple[PooledMemory, int]:
        """The live allocation holding device pointer ``ptr`` and the offset into it."""
        i = bisect.bisect_right(self._live_ptrs, ptr) - 1
        if i >= 0:
            mem = self._live[self._live_ptrs[i]]()
            if mem is not None and ptr < mem.ptr + mem.size:
                return mem, ptr - mem.ptr
        raise ValueError(f"device pointer {ptr:#x} is not inside any live allocation of the "
                         "stand-in's memory pool (freed already, or not device memory)")

    def live(self) -> list[PooledMemory]:
        return [m for m in (ref() for ref in self._live.values()) if m is not None]


_DEFAULT_POOL = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _DEFAULT_POOL


_ALLOCATOR = None          # set_allocator's; None: the default pool's malloc


def set_allocator(allocator=None) -> None:
    """``cupy.cuda.set_allocator``: every device array is allocated by ``allocator(size)``
    (e.g. a wrapper around ``get_default_memory_pool().malloc``).  CuPy's ``None`` (no pool,
    cudaMalloc per array) is not modelled."""
    global _ALLOCATOR
    if allocator is None:
        from .._errors import StandinLimitation
        raise StandinLimitation("set_allocator(None) (unpooled cudaMalloc) is not modelled; pass "
                                "cupy.get_default_memory_pool().malloc")
    _ALLOCATOR = None if allocator == _DEFAULT_POOL.malloc else allocator


def get_allocator():
    """The allocator every device array comes from (``set_allocator``'s)."""
    return _ALLOCATOR or _DEFAULT_POOL.malloc


def alloc(size: int) -> MemoryPointer:
    return _DEFAULT_POOL.malloc(size) if _ALLOCATOR is None else _ALLOCATOR(size)


def resolve_pointer(ptr: int) -> tuple[PooledMemory, int]:
    return _DEFAULT_POOL.resolve(int(ptr))


def live_allocations() -> list[PooledMemory]:
    return _DEFAULT_POOL.live()
