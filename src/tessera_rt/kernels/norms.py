"""softmax, layernorm_safe, rmsnorm_safe: NumPy references with f32 statistics.

"Safe" (seed 002 §2.8) means the statistics (max, sum, mean, variance, mean square) are
computed in f32 even for bf16/fp16 inputs: a bf16 sum of 4096 values has 8 bits of
mantissa left for the increments and stops growing.  Inputs are widened once, the op runs
in the accumulation dtype and the result is cast back to the input dtype (or the policy's).
The GPU launchers (one block per row, f32 warp reductions) live in ``norms_cuda.py``.
"""
from __future__ import annotations

from typing import Any

from ..backend import register_kernel
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .numerics import FLOAT_DTYPES, FP8_DTYPES, NumericPolicy, accum_dtype, result_dtype

__all__ = ["softmax", "layernorm", "rmsnorm", "layernorm_safe", "rmsnorm_safe", "NORM_DTYPES"]

NORM_DTYPES = FLOAT_DTYPES - FP8_DTYPES


def _check_row_param(op: str, name: str, p: Any, x: Any) -> None:
    if p is None:
        return
    check_float(op, name, p, NORM_DTYPES)
    if tuple(p.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: {name} has shape {tuple(p.shape)} but x {tuple(x.shape)} is "
                         f"normalized over its last dim; pass a {name} of shape ({x.shape[-1]},)")


def softmax(x: Any, *, axis: int = -1, out: Any | None = None, stream: Any | None = None,
            policy: NumericPolicy | None = None) -> Any:
    """Max-subtracted softmax along ``axis``: exp never overflows, the largest term is exp(0)=1.

    Parameters
    ----------
    x : array
        The input.
    axis : int
        The dim normalized over.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        The softmax, x's dtype.
    """
    op = "softmax"
    check_float(op, "x", x, NORM_DTYPES)
    check_policy(op, policy)
    check_stream(op, stream)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for x of shape {tuple(x.shape)}")
    xp = array_module(x)
    xf = widen(x, accum_dtype(x.dtype, policy))
    e = xp.exp(xf - xf.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return finish(op, e, out, result_dtype(x.dtype, policy))


def _check_norm_args(op: str, x: Any, eps: float, policy, stream, **row_params) -> None:
    check_float(op, "x", x, NORM_DTYPES)
    for name, param in row_params.items():
        _check_row_param(op, name, param, x)
    check_policy(op, policy)
    check_stream(op, stream)
    if not eps >= 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")


def layernorm(x: Any, weight: Any | None = None, bias: Any | None = None, *, eps: float = 1e-5,
              out: Any | None = None, stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, f32 statistics.

    Parameters
    ----------
    x : array
        The input, normalized over its last dim.
    weight, bias : array, optional
        Scale and shift (last dim's length); None: 1 and 0.
    eps : float
        Added to the variance.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        The normalized array, x's dtype.
    """
    op = "layernorm"
    _check_norm_args(op, x, eps, policy, stream, weight=weight, bias=bias)
    acc = accum_dtype(x.dtype, policy)
    xp = array_module(x)
    xf = widen(x, acc)
    mean = xf.mean(axis=-1, keepdims=True)
    centered = xf - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)   # two-pass: no E[x²]-E[x]² cancellation
    y = centered * (1.0 / xp.sqrt(var + acc.type(eps)))
    if weight is not None:
        y *= widen(weight, acc)
    if bias is not None:
        y += widen(bias, acc)
    return finish(op, y, out, result_dtype(x.dtype, policy))


def rmsnorm(x: Any, weight: Any | None = None, *, eps: float = 1e-6, out: Any | None = None,
            stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dim, f32 statistics.

    Parameters
    ----------
    x : array
        The input, normalized over its last dim.
    weight : array, optional
        The scale (last dim's length); None: 1.
    eps : float
        Added to the mean square.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        The normalized array, x's dtype.
    """
    op = "rmsnorm"
    _check_norm_args(op, x, eps, policy, stream, weight=weight)
    acc = accum_dtype(x.dtype, policy)
    xp = array_module(x)
    xf = widen(x, acc)
    ms = (xf * xf).mean(axis=-1, keepdims=True)
    y = xf * (1.0 / xp.sqrt(ms + acc.type(eps)))
    if weight is not None:
        y *= widen(weight, acc)
    return finish(op, y, out, result_dtype(x.dtype, policy))


layernorm_safe = layernorm
rmsnorm_safe = rmsnorm

for _name, _fn in (("softmax", softmax), ("layernorm", layernorm), ("layernorm_safe", layernorm),
                   ("rmsnorm", rmsnorm), ("rmsnorm_safe", rmsnorm)):
    register_kernel(_name, "cpu", _fn)
