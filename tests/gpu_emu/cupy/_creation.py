"""Array creation: the only functions that take host data (and copy it to the device)."""
from __future__ import annotations

import numpy as np

from . import _bridge
from ._errors import StandinLimitation
from ._ndarray import ndarray

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
           "arange", "linspace", "eye", "identity", "array", "asarray", "asanyarray",
           "ascontiguousarray", "asfortranarray", "asnumpy", "get_array_module", "from_dlpack"]


def _shape(shape) -> tuple:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)


def empty(shape, dtype=float, order="C") -> ndarray:
    """Uninitialized: a reused pool block keeps its old bytes, a new one is 0xff-filled."""
    return ndarray(_shape(shape), dtype, order=order)


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    if dtype is None:
        dtype = fill_value.dtype if isinstance(fill_value, ndarray) else np.asarray(fill_value).dtype
    out = empty(shape, dtype, order)
    if isinstance(fill_value, ndarray):
        from ._functions import copyto
        copyto(out, fill_value, casting="unsafe")
    else:
        _fill(out, fill_value)
    return out


def _fill(out: ndarray, value) -> None:
    def fill(value, out):
        out.fill(value)
        return out
    _bridge.call_numpy("fill kernel", fill, (value,), {"out": out}, check_dtypes=False)


def zeros(shape, dtype=float, order="C") -> ndarray:
    out = empty(shape, dtype, order)
    _fill(out, 0)       # a cudaMemsetAsync on the current stream
    return out


def ones(shape, dtype=float, order="C") -> ndarray:
    return full(shape, 1, dtype, order)


def _like(a, dtype, order, shape):
    dtype = a.dtype if dtype is None else dtype
    shape = a.shape if shape is None else _shape(shape)
    if order in ("K", "A"):
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    return shape, dtype, order


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return empty(*_like(prototype, dtype, order, shape))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return zeros(*_like(a, dtype, order, shape))


def ones_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return ones(*_like(a, dtype, order, shape))


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    shape, dtype, order = _like(a, dtype, order, shape)
    return full(shape, fill_value, dtype, order)


def _from_host(kind: str, host: np.ndarray, op_class: str = "h2d") -> ndarray:
    """``host`` on the device: copied in (h2d), or, ``op_class="kernel"``, what CuPy computes
    on the device itself (arange, linspace, eye: one kernel, no copy)."""
    if host.dtype.hasobject:
        raise ValueError(f"Unsupported dtype {host.dtype}")
    # (np.ascontiguousarray would make a 0-d array 1-d; CuPy keeps the shape)
    return _bridge.host_to_device(kind, host if host.flags.c_contiguous else host.copy(order="C"), op_class=op_class)


def arange(start, stop=None, step=1, dtype=None) -> ndarray:
    return _from_host("cupy.arange", np.arange(start, stop, step, dtype=dtype) if stop is not None
                      else np.arange(start, step=step, dtype=dtype), "kernel")


def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    res = np.linspace(start, stop, num, endpoint, retstep, dtype, axis)
    if retstep:
        return _from_host("cupy.linspace", res[0], "kernel"), res[1]
    return _from_host("cupy.linspace", res, "kernel")


def eye(N, M=None, k=0, dtype=float, order="C") -> ndarray:
    return _from_host("cupy.eye", np.eye(N, M, k, dtype, order), "kernel")


def identity(n, dtype=float) -> ndarray:
    return eye(n, dtype=dtype)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False) -> ndarray:
    """A new device array from host data, or a device copy of a device array."""
    if isinstance(obj, ndarray):
        out = obj.astype(obj.dtype if dtype is None else dtype, copy=copy is not False)
        return out if ndmin <= out.ndim else out.reshape((1,) * (ndmin - out.ndim) + out.shape)
    if isinstance(obj, (list, tuple)) and any(isinstance(x, ndarray) for x in obj):
        from ._functions import build_namespace
        return build_namespace()["stack"]([asarray(x, dtype) for x in obj])
    host = np.array(obj, dtype=dtype, order="C" if order in ("K", "A", None) else order, ndmin=ndmin)
    return _from_host("cupy.array (host->device copy)", host)


def asarray(a, dtype=None, order=None, *, blocking=False) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return array(a, dtype=dtype, order=order or "K")


asanyarray = asarray


def ascontiguousarray(a, dtype=None) -> ndarray:
    # core.pyx: cpdef ascontiguousarray(_ndarray_base a, dtype=None): device arrays only
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
                        f"got {type(a).__name__})")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _bridge.call_numpy("cupy.ascontiguousarray", np.ascontiguousarray, (a,), {"dtype": dtype})


def asfortranarray(a, dtype=None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
                        f"got {type(a).__name__})")
    return _bridge.call_numpy("cupy.asfortranarray", np.asfortranarray, (a,), {"dtype": dtype})


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if hasattr(a, "__cuda_array_interface__"):
        raise StandinLimitation("asnumpy of a foreign __cuda_array_interface__ object is not modelled")
    return np.asarray(a, order=order)


def get_array_module(*args):
    import cupy
    return cupy if any(isinstance(a, ndarray) for a in args) else np


def from_dlpack(x):
    if isinstance(x, ndarray):
        return x
    x.__dlpack__()      # the producer's own refusal (e.g. a DTensor's) comes first
    raise StandinLimitation("cupy.from_dlpack of a foreign producer is not modelled by the stand-in")
