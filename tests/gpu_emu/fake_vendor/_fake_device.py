"""Device memory as the fake vendor libraries see it: raw pointers into the CuPy stand-in's pool.

A vendor library gets device pointers, dims and strides, never arrays.  These helpers turn a
pointer back into a stand-in array (checking that every element the dims and strides reach
lies inside one live allocation, as a GPU would fault otherwise) and move values to and from
the host on a given stream, so the stand-in's stream-order tracker sees every read and write
the "library" makes on the stream it was told to use.
"""
from __future__ import annotations

import numpy as np


def _cupy():
    import cupy
    if not getattr(cupy, "__tessera_standin__", False):
        raise RuntimeError("the fake vendor libraries run on the CuPy stand-in only (tests/gpu_emu)")
    return cupy


def view(ptr: int, dims, strides, dtype, what: str = "tensor"):
    """A stand-in array over device memory at ``ptr`` (strides in elements)."""
    cupy = _cupy()
    dt = np.dtype(dtype)
    if int(ptr) == 0:
        raise ValueError(f"fake vendor: {what} got a null device pointer")
    mem, off = cupy.cuda.memory.resolve_pointer(int(ptr))
    dims = tuple(int(d) for d in dims)
    strides = tuple(int(s) for s in strides)
    if len(dims) != len(strides):
        raise ValueError(f"fake vendor: {what} dims {dims} and strides {strides} differ in rank")
    if any(d == 0 for d in dims):
        hi = 0
    else:
        if any(s < 0 for s in strides):
            raise ValueError(f"fake vendor: {what} has negative strides {strides}")
        hi = sum((d - 1) * s for d, s in zip(dims, strides)) + 1
    if off + hi * dt.itemsize > mem.requested:
        raise ValueError(f"fake vendor: {what} dims {dims} strides {strides} ({dt}) reach {hi * dt.itemsize} bytes "
                         f"from offset {off} of an allocation of {mem.requested}: out of bounds")
    return cupy.ndarray(dims, dt, memptr=cupy.cuda.MemoryPointer(mem, off),
                        strides=tuple(s * dt.itemsize for s in strides))


def read(ptr: int, dims, strides, dtype, stream_ptr: int, what: str = "tensor") -> np.ndarray:
    """The values at ``ptr`` copied to the host, the copy issued on ``stream_ptr``."""
    cupy = _cupy()
    return view(ptr, dims, strides, dtype, what).get(stream=cupy.cuda.ExternalStream(stream_ptr))


def write(ptr: int, dims, strides, dtype, values: np.ndarray, stream_ptr: int, what: str = "tensor") -> None:
    """Store ``values`` (rounded to ``dtype``) at ``ptr``, on ``stream_ptr``."""
    cupy = _cupy()
    dst = view(ptr, dims, strides, dtype, what)
    with cupy.cuda.ExternalStream(stream_ptr):
        dst[...] = cupy.asarray(np.asarray(values).astype(dst.dtype))


def current_stream_ptr() -> int:
    return _cupy().cuda.get_current_stream().ptr
