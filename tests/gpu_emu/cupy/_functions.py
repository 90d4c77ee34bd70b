"""cupy's array functions and ufuncs: NumPy's, run through ``_bridge.call_numpy``.

Only names real CuPy 13 has are exported (``FUNCTION_NAMES``, ``UFUNC_NAMES``); anything
else is an AttributeError, as on a GPU machine.  Functions refuse ``numpy.ndarray``
arguments as CuPy's kernels do; creation functions in ``_creation`` are the ones that copy
host data in.
"""
from __future__ import annotations

import numpy as np

from . import _bridge
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
        return _bridge.call_numpy(f"cupy.{self.__name__}", self._np, args, kwargs)

    def _method(self, method: str, *args, **kwargs):
        return _bridge.call_numpy(f"cupy.{self.__name__}.{method}", getattr(self._np, method),
                                  args, kwargs)

    def reduce(self, *args, **kwargs):
        return self._method("reduce", *args, **kwargs)

    def accumulate(self, *args, **kwargs):
        return self._method("accumulate", *args, **kwargs)

    def reduceat(self, *args, **kwargs):
        return self._method("reduceat", *args, **kwargs)

    def outer(self, *args, **kwargs):
        self._check_operands(args[:2])
        return self._method("outer", *args, **kwargs)

    def at(self, a, indices, b=None):
        """In place: ``a`` is written (recorded as a write, as CuPy's scatter kernels do)."""
        def at(*operands, out):
            self._np.at(out, *operands)
            return out
        operands = (indices,) if b is None else (indices, b)
        _bridge.call_numpy(f"cupy.{self.__name__}.at", at, operands, {"out": a})


def _function(name: str):
    np_func = getattr(np, name)
    check_dtypes = name not in _DATA_MOVEMENT

    def function(*args, **kwargs):
        return _bridge.call_numpy(f"cupy.{name}", np_func, args, kwargs, check_dtypes)
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
    _bridge.call_numpy("cupy.copyto", copy_into, (src, where), {"out": dst})


def build_namespace() -> dict:
    """Every function and ufunc, by its cupy name."""
    space: dict = {}
    for name in UFUNC_NAMES:
        if hasattr(np, name) and isinstance(getattr(np, name), np.ufunc):
            space[name] = ufunc(getattr(np, name), name)
    for alias, name in UFUNC_ALIASES.items():
        space[alias] = space[name]
    for name in FUNCTION_NAMES:
        if hasattr(np, name):
            space[name] = _function(name)
    for name in PASSTHROUGH_NAMES:
        space[name] = _passthrough(name) if name not in ("dtype", "finfo", "iinfo") else getattr(np, name)
    space["copyto"] = copyto
    return space
