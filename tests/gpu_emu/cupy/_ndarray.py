"""``cupy.ndarray``: a NumPy view into pool memory, with CuPy's API and CuPy's refusals.

Refusals matched from CuPy 14.2 (cupy/_core/core.pyx):

* ``__array__`` raises "Implicit conversion to a NumPy array is not allowed. Please use
  `.get()` to construct a NumPy array explicitly." (core.pyx ``__array__``), so
  ``np.asarray(x)`` and NumPy functions needing a host array fail;
* operators with a ``numpy.ndarray`` operand go to the cupy ufunc, which refuses it with
  "Unsupported type <class 'numpy.ndarray'>" (``_should_use_rop`` + ``_preprocess_arg``);
* NumPy ufuncs/functions called on a device array dispatch to the cupy function of the same
  name (``__array_ufunc__`` / ``__array_function__``), which refuses host operands the same way.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _bridge, _capture, _counters, _tracker
from ._dtypes14 import check_creatable
from ._indexing import SetItem, as_tuple, copy_host_indices, has_mask, is_basic, setitem_value
from .cuda import memory as _memory
from .cuda.pinned_memory import is_pinned
from .cuda.stream import LEGACY_STREAM_HANDLE, get_current_stream, resolve_stream

_NO_UFUNC = object()


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, a: ndarray):
        self.c_contiguous = a._a.flags.c_contiguous
        self.f_contiguous = a._a.flags.f_contiguous
        self.owndata = a.base is None

    def __getitem__(self, key: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]


class ndarray:
    """``ndarray(shape, dtype=float, memptr=None, strides=None, order='C')``."""

    __slots__ = ("_a", "data", "base", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ValueError(f"Unsupported dtype {dtype}")
        if memptr is None:
            check_creatable(dtype)    # CuPy 14: get_dtype_with_itemsize(check_support=True)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr is None:
            memptr = _memory.alloc(nbytes)
        self.base = None
        self.data = memptr
        mem = memptr.mem
        if mem.segment is None or nbytes == 0:
            self._a = np.empty(shape, dtype, order=order) if strides is None else \
                np.lib.stride_tricks.as_strided(np.empty(1, dtype), shape, strides)
            return
        offset = memptr.ptr - mem.segment.base
        self._a = np.ndarray(shape, dtype, buffer=mem.segment.buf, offset=offset,
                             strides=strides, order=order)

    @classmethod
    def _view_of(cls, view: np.ndarray, owner: ndarray) -> ndarray:
        """A stand-in array for ``view``, a NumPy view into ``owner``'s allocation."""
        self = object.__new__(cls)
        self._a = view
        mem = owner.data.mem
        self.data = _memory.MemoryPointer(mem, view.__array_interface__["data"][0] - mem.ptr)
        self.base = owner if owner.base is None else owner.base
        return self

    # -- attributes ------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(_Flags)
    T = property(lambda self: self.transpose())
    mT = property(lambda self: self.swapaxes(-1, -2))

    @property
    def real(self):
        return _bridge.call_numpy("ndarray.real", lambda a: a.real, (self,), {})

    @property
    def imag(self):
        return _bridge.call_numpy("ndarray.imag", lambda a: a.imag, (self,), {})

    @property
    def device(self):
        from .cuda.device import Device
        return Device(self.data.device_id)

    @property
    def __cuda_array_interface__(self) -> dict:
        ptr = get_current_stream().ptr
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "version": 3,
            "strides": None if self._a.flags.c_contiguous else self.strides,
            "data": (self.data.ptr if self.size > 0 else 0, False),
            # CAI v3 disallows 0; CuPy exports cudaStreamLegacy for the null stream
            "stream": ptr if ptr != 0 else LEGACY_STREAM_HANDLE,
        }

    def __repr__(self) -> str:
        return f"cupy.ndarray({np.array2string(self._a, separator=', ')}, dtype={self.dtype})"

    __str__ = __repr__

    # -- host transfers --------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Copy to the host on ``stream`` (default: current), then synchronize it (blocking).

        ``blocking=False`` leaves the copy running: the host array holds garbage (0xFF bytes)
        until the host has seen the copy complete (the stream or a later event synchronized,
        or a ``done`` query answering True)."""
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if out.shape != self.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
        s = resolve_stream(stream)
        cap = _capture.capture_of(s._state)
        if cap is not None:
            return self._captured_get(cap, s._state, out, blocking)
        host = _bridge.device_to_host("ndarray.get (device->host copy)", self, s._state)
        if out is None:
            out = np.empty(self.shape, self.dtype, order=order if order in "CF" else "C")
        if blocking:
            s._synchronize("ndarray.get")
            out[...] = host
            return out
        if not is_pinned(out):
            # cudaMemcpyAsync to pageable memory returns once the copy is done: the host waits
            # (counted), though the data is still modelled as landing at the next sync
            _counters.note_sync("ndarray.get(blocking=False) into pageable memory")
        garbage = np.empty(self.shape, self.dtype)
        garbage.reshape(-1).view(np.uint8).fill(0xFF)
        out[...] = garbage

        def land(out=out, host=host):
            out[...] = host
        _tracker.defer_until_complete(s._state, land)
        return out

    def _captured_get(self, cap, state, out, blocking):
        """``get`` in a capture: only a non-blocking copy into pinned memory is a graph node (its
        data lands when the host sees the launch complete); anything else waits: refused."""
        if blocking or out is None or not is_pinned(out):
            _capture.refuse(cap, "ndarray.get (a device->host copy the host waits for, or into pageable memory; "
                                 "capture get(out=<pinned array>, blocking=False))")
        src, kind = self._a, "ndarray.get (device->host copy)"

        def run(launch_state, src=src, out=out):
            data = np.array(src, copy=True)
            out.reshape(-1).view(np.uint8).fill(0xFF)      # undefined until the host sees the launch done

            def land(out=out, data=data):
                out[...] = data
            _tracker.defer_until_complete(launch_state, land)
        _capture.add_copy(cap, state, kind, "d2h", self.nbytes, list(_bridge.accesses((self,), False)), run)
        return out

    def set(self, arr, stream=None) -> None:
        """Copy host ``arr`` in, asynchronously on ``stream`` (core.pyx ``set``'s checks)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        state = resolve_stream(stream)._state
        _bridge.host_to_device("ndarray.set (host->device copy)", arr, self, state)
        # CuPy copies with cudaMemcpyAsync, which stages a pageable source before returning but
        # reads a pinned one while the copy runs: the host must not write it meanwhile
        if is_pinned(arr):
            _tracker.watch_pinned_source(state, arr, "ndarray.set (host->device copy)")

    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()

    # -- refusals and conversions ----------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __bool__(self):
        return bool(self.get())

    def __index__(self):
        if self.size != 1 or self.dtype.kind not in "iub":
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.get())

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __copy__(self):
        return self.copy()

    # -- NumPy protocol dispatch (core.pyx __array_ufunc__ / __array_function__) --
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        import cupy
        func = getattr(cupy, ufunc.__name__, None)
        if func is None or method not in ("__call__", "outer", "at", "reduce", "accumulate", "reduceat"):
            return NotImplemented
        if method != "__call__":
            func = getattr(func, method, None)
            if func is None:
                return NotImplemented
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            kwargs["out"] = out[0]
        for x in inputs + ((kwargs["out"],) if "out" in kwargs else ()):
            if not (isinstance(x, (ndarray, np.ndarray, np.generic, bool, int, float, complex))
                    or hasattr(x, "__cuda_array_interface__")):
                return NotImplemented
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        import cupy
        module = cupy
        try:
            for part in func.__module__.split(".")[1:]:
                module = getattr(module, part)
            cupy_func = getattr(module, func.__name__)
        except AttributeError:
            return NotImplemented
        if cupy_func is func:
            return NotImplemented
        if not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return cupy_func(*args, **kwargs)

    # -- indexing --------------------------------------------------------
    def __getitem__(self, key):
        np_key = _index(key)
        copy_host_indices(key)
        masked = has_mask(np_key)
        if is_basic(np_key) and Ellipsis not in as_tuple(np_key):
            # ``a[0]`` is a 0-d *view* in CuPy; NumPy copies to a scalar unless an Ellipsis is there
            np_key = as_tuple(np_key) + (Ellipsis,)
        # the key rides in the closure: an index array (unwrapped above) is not an operand
        result = _bridge.call_numpy("ndarray.__getitem__", lambda a: a[np_key], (self,), {},
                                    check_dtypes=False)
        if masked:       # _getitem_mask_single reads the number of True values back
            _bridge.implicit_sync("ndarray.__getitem__ (boolean mask)")
        return result

    def __setitem__(self, key, value):
        np_key = _index(key)
        copy_host_indices(key)
        value = setitem_value(self, np_key, value)
        _bridge.call_numpy("ndarray.__setitem__", SetItem(np_key), (value,), {"out": self},
                           check_dtypes=False)

    __hash__ = None


# -- methods that are NumPy's, run through the bridge --------------------------------------

def _method(name: str, check_dtypes: bool = True):
    np_method = getattr(np.ndarray, name)

    def method(self, *args, **kwargs):
        result = _bf16.dispatch(name, (self,) + args, kwargs)
        if result is not NotImplemented:
            return result
        result = _bridge.call_numpy(f"ndarray.{name}", np_method, (self,) + args, kwargs, check_dtypes)
        if name in ("nonzero", "compress"):        # the count is read back (a sync)
            _bridge.implicit_sync(f"ndarray.{name}")
        return result
    method.__name__ = name
    method.__doc__ = f"As ``numpy.ndarray.{name}``, on the device (current stream)."
    return method


for _name in ("sum", "mean", "max", "min", "prod", "std", "var", "argmax", "argmin", "cumsum",
              "cumprod", "all", "any", "clip", "round", "dot", "conj", "conjugate", "nonzero",
              "repeat", "take", "trace", "sort", "argsort", "fill", "choose", "compress",
              "argpartition", "partition", "put", "searchsorted"):
    setattr(ndarray, _name, _method(_name))
# data movement only: no kernel needs a C type for the dtype
for _name in ("reshape", "ravel", "view", "copy", "transpose", "swapaxes", "squeeze", "flatten",
              "diagonal"):
    setattr(ndarray, _name, _method(_name, check_dtypes=False))


def _astype(self, dtype, order="K", casting=None, subok=None, copy=True):
    if not copy and np.dtype(dtype) == self.dtype:
        return self
    out = _bridge.call_numpy("ndarray.astype", np.ndarray.astype, (self, dtype),
                             {"order": order, "casting": casting or "unsafe", "copy": True})
    if out.dtype != self.dtype:
        _counters.note_cast(f"{self.dtype}->{out.dtype} (astype)")
    return out


ndarray.astype = _astype


def _index(key):
    """An index with device arrays unwrapped; host index arrays allowed (CuPy copies them in)."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, tuple):
        return tuple(k._a if isinstance(k, ndarray) else k for k in key)
    return key


def _install_operators() -> None:
    """Operators go to the cupy ufuncs, as core.pyx's do (NumPy operands are refused there)."""
    import cupy

    def should_use_rop(x, y) -> bool:
        y_ufunc = getattr(y, "__array_ufunc__", _NO_UFUNC)
        if y_ufunc is not _NO_UFUNC:
            return y_ufunc is None
        return x.__array_priority__ < getattr(y, "__array_priority__", 0)

    def binary(ufunc_name: str, dunder: str):
        ufunc = getattr(cupy, ufunc_name)

        def op(self, other):
            if should_use_rop(self, other):
                return NotImplemented
            return ufunc(self, other)

        def rop(self, other):
            return ufunc(other, self)

        def iop(self, other):
            return ufunc(self, other, out=self)
        setattr(ndarray, f"__{dunder}__", op)
        setattr(ndarray, f"__r{dunder}__", rop)
        setattr(ndarray, f"__i{dunder}__", iop)

    for ufunc_name, dunder in (("add", "add"), ("subtract", "sub"), ("multiply", "mul"),
                               ("true_divide", "truediv"), ("floor_divide", "floordiv"),
                               ("remainder", "mod"), ("power", "pow"), ("bitwise_and", "and"),
                               ("bitwise_or", "or"), ("bitwise_xor", "xor"), ("left_shift", "lshift"),
                               ("right_shift", "rshift"), ("matmul", "matmul")):
        binary(ufunc_name, dunder)
    for ufunc_name, dunder in (("less", "lt"), ("less_equal", "le"), ("greater", "gt"),
                               ("greater_equal", "ge"), ("equal", "eq"), ("not_equal", "ne")):
        ufunc = getattr(cupy, ufunc_name)
        setattr(ndarray, f"__{dunder}__", lambda self, other, _u=ufunc: _u(self, other))
    for ufunc_name, dunder in (("negative", "neg"), ("positive", "pos"), ("absolute", "abs"),
                               ("invert", "invert")):
        ufunc = getattr(cupy, ufunc_name)
        setattr(ndarray, f"__{dunder}__", lambda self, _u=ufunc: _u(self))
    ndarray.__divmod__ = lambda self, other: cupy.divmod(self, other)
    ndarray.__rdivmod__ = lambda self, other: cupy.divmod(other, self)
    ndarray.__hash__ = None
