"""The part of ``cupyx`` tessera_rt uses, for the CuPy stand-in (``tests/gpu_emu/cupy``):
the pinned host arrays of cupyx/_pinned_array.py.  Anything else is refused by name."""
from __future__ import annotations

import numpy as _np
from cupy.cuda import alloc_pinned_memory as _alloc_pinned_memory

__all__ = ["empty_pinned", "zeros_pinned"]


def empty_pinned(shape, dtype=float, order="C") -> _np.ndarray:
    """A NumPy array over pinned host memory (contents undefined)."""
    shape = (int(shape),) if _np.isscalar(shape) else tuple(int(s) for s in shape)
    dtype = _np.dtype(dtype)
    mem = _alloc_pinned_memory(int(_np.prod(shape, dtype=_np.int64)) * dtype.itemsize)
    return _np.ndarray(shape, dtype=dtype, buffer=mem, order=order)


def zeros_pinned(shape, dtype=float, order="C") -> _np.ndarray:
    out = empty_pinned(shape, dtype, order)
    _np.copyto(out, 0, casting="unsafe")
    return out


def __getattr__(name: str):
    # an AttributeError (hasattr and imports rely on it), saying why
    raise AttributeError(f"cupyx.{name}: the CuPy stand-in's cupyx has only {', '.join(__all__)} (what "
                         "tessera_rt uses); add it to tests/gpu_emu/cupyx if the project needs it")
