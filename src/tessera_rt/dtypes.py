"""One dtype map for the whole runtime.

Users spell dtypes the seeds' way ("bf16", "fp8_e4m3", "f32") or NumPy's way
("float32", np.float16).  Low-precision types that NumPy lacks come from ml-dtypes,
so a bf16 array is a real NumPy array on the CPU path.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["resolve_dtype", "dtype_name", "is_low_precision_float", "LOW_PRECISION_FLOATS"]

_ALIASES: dict[str, np.dtype] = {
    "f64": np.dtype(np.float64), "fp64": np.dtype(np.float64), "float64": np.dtype(np.float64),
    "f32": np.dtype(np.float32), "fp32": np.dtype(np.float32), "float32": np.dtype(np.float32),
    "f16": np.dtype(np.float16), "fp16": np.dtype(np.float16), "float16": np.dtype(np.float16),
    "half": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "i8": np.dtype(np.int8), "int8": np.dtype(np.int8), "u8": np.dtype(np.uint8), "uint8": np.dtype(np.uint8),
    "i32": np.dtype(np.int32), "int32": np.dtype(np.int32),
    "i64": np.dtype(np.int64), "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}

LOW_PRECISION_FLOATS = frozenset(
    np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)

_SHORT_NAMES = {
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(ml_dtypes.float8_e4m3fn): "fp8_e4m3",
    np.dtype(ml_dtypes.float8_e5m2): "fp8_e5m2",
}


def resolve_dtype(dtype: Any) -> np.dtype:
    """Return the NumPy dtype for any accepted spelling; raise TypeError naming the choices.

    Parameters
    ----------
    dtype : str or dtype
        A name ("f32", "bf16", "fp8_e4m3", ...) or a NumPy dtype.

    Returns
    -------
    numpy.dtype
        The dtype.
    """
    if isinstance(dtype, str):
        try:
            return _ALIASES[dtype.lower()]
        except KeyError:
            raise TypeError(
                f"unknown dtype {dtype!r}; use one of {sorted(_ALIASES)} or a NumPy dtype"
            ) from None
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"unknown dtype {dtype!r}; use one of {sorted(_ALIASES)} or a NumPy dtype") from None


def dtype_name(dtype) -> str:
    """Short name used in reprs, logs and error messages (float32, bf16, fp8_e4m3)."""
    dt = np.dtype(dtype)
    return _SHORT_NAMES.get(dt, dt.name)


def is_low_precision_float(dtype) -> bool:
    return np.dtype(dtype) in LOW_PRECISION_FLOATS
