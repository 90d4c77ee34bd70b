"""cupy's array functions and ufuncs: NumPy's, run through ``_bridge.call_numpy``.

Only names real CuPy 14 has are exported (``FUNCTION_NAMES``, ``UFUNC_NAMES``); anything
else is an AttributeError, as on a GPU machine.  Functions refuse ``numpy.ndarray``
arguments as CuPy's kernels do; creation functions in ``_creation`` are the ones that copy
host data in.  Where CuPy 14 differs from NumPy (bfloat16, 16-bit reductions, GEMMs,
``where``) ``_bf16.dispatch`` runs CuPy's behaviour instead.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _bridge, _counters
from ._dtypes14 import NOTE
from ._ndarray import ndarray

UFUNC_NAMES = (
    "add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "remainder", "mod",
    "fmod", "power", "float_power", "negative", "positive", "absolute", "sign", "exp", "exp2",
    "expm1", "log", "log2", "log10", "log1p", "sqrt", "cbrt", "square", "reciprocal", "sin", "cos",
    "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh", "tanh", "arcsinh", "arccosh",
    "arctanh", "hypot", "maximum", "minimum", "fmax", "fmin", "equal", "not_equal", "less",
    "less_equal", "greater", "greater_equal", "logical_and", "logical_or", "logical_xor",
    "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor", "invert", "bitwise_not",
    "left_shift", "right_shift", "isfinite", "isinf", "isnan", "signbit", "copysign", "floor",
    "ceil", "trunc", "rint", "conj", "conjugate", "deg2rad", "rad2deg", "degrees", "radians",
    "divmod", "modf", "frexp", "ldexp", "logaddexp", "logaddexp2", "heaviside", "nextafter",
    "gcd", "lcm", "matmul",
)
UFUNC_ALIASES = {"abs": "absolute"}

FUNCTION_NAMES = (
    # shape and joins (views where NumPy gives views)
    "reshape", "ravel", "transpose", "moveaxis", "swapaxes", "rollaxis", "squeeze", "expand_dims",
    "broadcast_to", "broadcast_arrays", "atleast_1d", "atleast_2d", "atleast_3d", "concatenate",
    "stack", "vstack", "hstack", "dstack", "column_stack", "split", "array_split", "flip",
    "fliplr", "flipud", "roll", "rot90", "tile", "repeat", "pad", "diagonal", "diag", "tril",
    "triu",
    # indexing and selection
    "take", "take_along_axis", "where", "nonzero", "argwhere", "flatnonzero", "choose",
    "compress", "extract", "select", "searchsorted",
    # linear algebra and reductions
    "dot", "vdot", "inner", "outer", "tensordot", "kron", "cross", "einsum", "trace", "sum",
    "prod", "mean", "std", "var", "max", "min", "amax", "amin", "argmax", "argmin", "nanmax",
    "nanmin", "nansum", "nanprod", "nanmean", "nanstd", "nanvar", "nanargmax", "nanargmin",
    "cumsum", "cumprod", "diff", "all", "any", "count_nonzero", "average", "median",
    "percentile", "quantile", "bincount", "histogram", "ptp",
    # sorting, sets, comparisons and elementwise helpers
    "sort", "argsort", "partition", "argpartition", "unique", "isclose", "allclose",
    "array_equal", "clip", "around", "round", "nan_to_num", "real", "imag", "angle", "interp",
    "sinc", "fix", "convolve", "correlate", "meshgrid", "copy",
)
# CuPy reads a count back to the host to size the result: a device->host copy and a sync
SYNCING = frozenset(("nonzero", "argwhere", "flatnonzero", "unique", "compress", "extract",
                     "bincount", "histogram"))
# cupy/_core/_routines_indexing.pyx _scatter_op: the dtypes each ``ufunc.at`` supports
_AT_DTYPES = {
    "add": ("int32", "int64", "float16", "float32", "float64", "uint32", "uint64"),
    "subtract": ("int32", "uint32"),
    "maximum": ("int32", "int64", "float32", "float64", "uint32", "uint64"),
    "minimum": ("int32", "int64", "float32", "float64", "uint32", "uint64"),
    "bitwise_and": ("int32", "int64", "uint32", "uint64"),
    "bitwise_or": ("int32", "int64", "uint32", "uint64"),
    "bitwise_xor": ("int32", "int64", "uint32", "uint64"),
}
# Functions that only move data: no kernel needs a C type for the dtype (bf16 bytes may pass).
_DATA_MOVEMENT = frozenset((
    "reshape", "ravel", "transpose", "moveaxis", "swapaxes", "rollaxis", "squeeze",
    "expand_dims", "broadcast_to", "broadcast_arrays", "atleast_1d", "atleast_2d", "atleast_3d",
    "concatenate", "stack", "vstack", "hstack", "dstack", "split", "array_split", "flip",
    "fliplr", "flipud", "roll", "tile", "repeat", "diagonal", "take", "copy",
))
# Pure dtype/shape utilities: NumPy's own, given dtypes or shapes, never memory.
PASSTHROUGH_NAMES = ("dtype", "result_type", "can_cast", "promote_types", "min_scalar_type",
                     "finfo", "iinfo", "issubdtype", "isscalar", "shape", "ndim", "size",
                     "broadcast_shapes")


class ufunc:
    """A cupy ufunc: positional operands must be device arrays or scalars (CuPy refuses
    lists and host arrays: ``_preprocess_args``)."""

    def __init__(self, np_ufunc: np.ufunc, name: str):
        self._np = np_ufunc
        self.__name__ = name
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __repr__(self) -> str:
        return f"<ufunc 'cupy_{self.__name__}'>"

    def _check_operands(self, operands) -> None:
        for x in operands:
            if not isinstance(x, (ndarray, np.generic, bool, int, float, complex)):
                raise _bridge.refuse(x)

    def __call__(self, *args, **kwargs):
        self._check_operands(args[:self.nin])
        if _bf16.has_bf16((args, kwargs.get("out"))):
            return _bf16.ufunc_call(self, args, kwargs)
        _bf16.note_implicit_casts(self._np, self.__name__, args[:self.nin],
                                  kwargs.get("out", args[self.nin:] or None))
        return _bridge.call_numpy(f"cupy.{self.__name__}", self._np, args, kwargs)

    def _unsupported(self, method: str):
        # cupy/_core/_kernel.pyx ufunc.reduce/accumulate/reduceat/at
        return NotImplementedError(f"`cupy_{self.__name__}.{method}` is not supported yet")

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        """CuPy 14: ``add`` is ``sum``, ``multiply`` is ``prod``; nothing else."""
        if self.__name__ not in ("add", "multiply"):
            raise self._unsupported("reduce")
        return getattr(array, "sum" if self.__name__ == "add" else "prod")(axis, dtype, out, keepdims)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        if self.__name__ not in ("add", "multiply"):
            raise self._unsupported("accumulate")
        return getattr(array, "cumsum" if self.__name__ == "add" else "cumprod")(axis, dtype, out)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        if self.__name__ != "add":
            raise self._unsupported("reduceat")
        return _bridge.call_numpy("cupy.add.reduceat", np.add.reduceat, (array, indices),
                                  {"axis": axis, "dtype": dtype, **({} if out is None else {"out": out})})

    def outer(self, A, B, **kwargs):
        # cupy: A.reshape(A.shape + (1,) * B.ndim) op B.reshape((1,) * A.ndim + B.shape)
        self._check_operands((A, B))
        if isinstance(A, ndarray) and isinstance(B, ndarray):
            return self(A.reshape(A.shape + (1,) * B.ndim), B.reshape((1,) * A.ndim + B.shape), **kwargs)
        return _bridge.call_numpy(f"cupy.{self.__name__}.outer", self._np.outer, (A, B), kwargs)

    def at(self, a, indices, b=None):
        """In place: ``a`` is written (recorded as a write, as CuPy's scatter kernels do)."""
        allowed = _AT_DTYPES.get(self.__name__)
        if allowed is None:
            raise self._unsupported("at")
        if np.dtype(a.dtype).name not in allowed:
            # CuPy converts the values to a's dtype and checks that dtype
            raise TypeError(f"cupy.{self.__name__}.at only supports {', '.join(allowed)} as data type "
                            f"(got {a.dtype}) {NOTE}")

        def at(*operands, out):
            self._np.at(out, *operands)
            return out
        operands = (indices,) if b is None else (indices, b)
        _bridge.call_numpy(f"cupy.{self.__name__}.at", at, operands, {"out": a})


def _function(name: str):
    np_func = getattr(np, name)
    check_dtypes = name not in _DATA_MOVEMENT

    def function(*args, **kwargs):
        result = _bf16.dispatch(name, args, kwargs)
        if result is not NotImplemented:
            return result
        result = _bridge.call_numpy(f"cupy.{name}", np_func, args, kwargs, check_dtypes)
        if name in SYNCING or name == "where" and len(args) + len(kwargs) == 1:
            _bridge.implicit_sync(f"cupy.{name}")
        return result
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"``numpy.{name}`` on the device (current stream); host arrays refused."
    return function


def _passthrough(name: str):
    np_func = getattr(np, name)

    def function(*args, **kwargs):
        args = tuple(a._a if isinstance(a, ndarray) else a for a in args)
        return np_func(*args, **kwargs)
    function.__name__ = name
    return function


def copyto(dst, src, casting="same_kind", where=True):
    """``numpy.copyto`` into device array ``dst`` (a write on the current stream)."""
    if not isinstance(dst, ndarray):
        raise TypeError(f"copyto: dst must be a cupy.ndarray, got {type(dst).__name__}")

    def copy_into(src, where, out):
        np.copyto(out, src, casting=casting, where=where)
        return out
    if isinstance(src, ndarray) and src.dtype != dst.dtype:
        _counters.note_cast(f"{src.dtype}->{dst.dtype} (cupy.copyto)")
    _bridge.call_numpy("cupy.copyto", copy_into, (src, where), {"out": dst})


def build_namespace() -> dict:
    """Every function and ufunc, by its cupy name."""
    space: dict = {}
    for name in UFUNC_NAMES:
        if hasattr(np, name) and isinstance(getattr(np, name), np.ufunc):
            space[name] = ufunc(getattr(np, name), name)
    for alias, name in UFUNC_ALIASES.items():
        space[alias] = space[name]
    for name in FUNCTION_NAMES + ("matmul",):       # cupy.matmul: CuPy's GEMM, not a NumPy ufunc
        if hasattr(np, name):
            space[name] = _function(name)
    for name in PASSTHROUGH_NAMES:
        space[name] = _passthrough(name) if name not in ("dtype", "finfo", "iinfo") else getattr(np, name)
    space["copyto"] = copyto
    return space
