"""``cupy.cuda.alloc_pinned_memory``: page-locked host memory (here: anonymous, page-aligned
mmap'd memory, as cudaHostAlloc's is page-aligned).

What tessera_rt needs of it is the buffer protocol (``np.frombuffer(mem, dtype, n)``,
``numpy.ndarray(shape, dtype, buffer=mem)``) and ``ptr``/``size()``; copies between it and
the device run through the stand-in like any host copy.  Pointer arithmetic (``mem + n``,
which CuPy supports) is refused: nothing here uses it, and an mmap cannot export a buffer
from an offset.
"""
from __future__ import annotations

import ctypes
import mmap

from .._errors import StandinLimitation

__all__ = ["PinnedMemoryPointer", "alloc_pinned_memory", "is_pinned"]


class PinnedMemoryPointer(mmap.mmap):
    """A pinned host allocation of ``size()`` bytes at ``ptr``; exports its bytes as a buffer."""

    def __new__(cls, size: int):
        size = int(size)
        if size < 0:
            raise ValueError(f"alloc_pinned_memory: size {size} must be >= 0")
        self = super().__new__(cls, -1, max(size, 1))       # an mmap cannot be empty
        probe = ctypes.c_char.from_buffer(self)
        self.ptr = ctypes.addressof(probe)
        del probe                                           # a live export would pin the mmap open
        self._size = size
        self.mem = self
        return self

    def size(self) -> int:
        return self._size

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset):
        raise StandinLimitation("the stand-in's pinned memory has no pointer arithmetic; allocate "
                                "the piece you need with alloc_pinned_memory")

    __sub__ = __iadd__ = __isub__ = __radd__ = __add__

    def __repr__(self) -> str:
        return f"<PinnedMemoryPointer {self.ptr:#x}, {self._size} bytes>"


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(size)


def is_pinned(a) -> bool:
    """Whether NumPy array ``a`` is a view of pinned memory (through its bases)."""
    while a is not None and not isinstance(a, PinnedMemoryPointer):
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return a is not None
