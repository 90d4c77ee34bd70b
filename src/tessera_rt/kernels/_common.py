"""Checks and plumbing shared by every kernel: array module, dtype/shape checks, ``out=``.

References are written once against ``xp`` (NumPy or CuPy), picked from the arrays
themselves, so the CPU path and a CuPy fallback are the same code.  CuPy is looked up in
``sys.modules`` only: a NumPy caller never imports it.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ..backend import array_module, is_cupy
from ..dtypes import dtype_name
from .numerics import FLOAT_DTYPES, NumericPolicy

__all__ = ["array_module", "check_float", "check_policy", "finish", "widen", "shape_str",
           "is_cupy", "check_stream", "check_out", "null_ptr"]


def shape_str(a: Any) -> str:
    return f"{tuple(a.shape)} {dtype_name(a.dtype)}"


# cache: an allowed-dtypes iterable -> its frozenset of np.dtype
_DTYPE_SETS: dict = {}


def _dtype_set(allowed) -> frozenset:
    """``allowed`` as a frozenset of NumPy dtypes, made once per (hashable) ``allowed``: every
    kernel call checks its inputs, and building the set cost ~1 us a check."""
    try:
        s = _DTYPE_SETS.get(allowed)
    except TypeError:                    # unhashable (a list): not cached
        return frozenset(np.dtype(d) for d in allowed)
    if s is None:
        s = _DTYPE_SETS[allowed] = frozenset(np.dtype(d) for d in allowed)
    return s


def check_float(op: str, name: str, a: Any, allowed: Iterable[DTypeLike] = FLOAT_DTYPES,
                min_ndim: int = 1) -> None:
    """TypeError unless ``a`` is an array of an allowed float dtype with at least ``min_ndim`` dims."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{op}: {name} must be a NumPy/CuPy array, got {type(a).__name__}")
    allowed = _dtype_set(allowed)
    if a.dtype not in allowed and np.dtype(a.dtype) not in allowed:
        raise TypeError(f"{op}: {name} has dtype {dtype_name(a.dtype)}, which {op} does not support; "
                        f"cast it to one of {sorted(dtype_name(d) for d in allowed)}")
    if a.ndim < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dims, got shape {tuple(a.shape)}")


def check_policy(op: str, policy: Any) -> None:
    if policy is not None and not isinstance(policy, NumericPolicy):
        raise TypeError(f"{op}: policy must come from op.numeric(...), got {type(policy).__name__}")


def check_stream(op: str, stream: Any) -> None:
    """A stream is anything with ``synchronize`` (CpuStream, CudaStream, a raw CuPy stream)."""
    if stream is not None and not hasattr(stream, "synchronize"):
        raise TypeError(f"{op}: stream must be a runtime stream (rt.stream('compute')), "
                        f"got {type(stream).__name__}")


def widen(a: Any, dtype: DTypeLike):
    """``a`` as ``dtype`` without a copy when it already is."""
    return a if a.dtype == dtype else a.astype(dtype)


def finish(op: str, result: Any, out: Any | None, dtype: np.dtype):
    """Cast ``result`` to ``dtype`` and, if ``out`` is given, write it there and return ``out``."""
    if out is None:
        return result if result.dtype == dtype else result.astype(dtype)
    if tuple(out.shape) != tuple(result.shape):
        raise ValueError(f"{op}: out has shape {tuple(out.shape)} but the result has shape "
                         f"{tuple(result.shape)}; pass out=None or an array of that shape")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{op}: out has dtype {dtype_name(out.dtype)} but the result is "
                        f"{dtype_name(dtype)}; pass an out of dtype {dtype_name(dtype)}")
    out[...] = result
    return out


def check_out(op: str, out: Any | None, shape: tuple, dtype: DTypeLike, xp=None) -> None:
    """Check ``out`` before a launch (GPU kernels write into it directly, so it must be contiguous)."""
    if out is None:
        return
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{op}: out has dtype {dtype_name(out.dtype)}, expected {dtype_name(dtype)}")
    if xp is not None and not out.flags.c_contiguous:
        raise ValueError(f"{op}: out must be C-contiguous for the GPU kernel; pass a fresh array")



def null_ptr(a: Any):
    """``a`` for a RawKernel pointer argument, or a 64-bit zero standing in for a null pointer."""
    return np.uint64(0) if a is None else a
