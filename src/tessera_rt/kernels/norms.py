"""softmax, layernorm_safe, rmsnorm_safe: NumPy references with f32 statistics.

"Safe" (seed 002 §2.8) means the statistics (max, sum, mean, variance, mean square) are
computed in f32 even for bf16/fp16 inputs: a bf16 sum of 4096 values has 8 bits of
mantissa left for the increments and stops growing.  Inputs are widened once, the op runs
in the accumulation dtype and the result is cast back to the input dtype (or the policy's).
``rmsnorm_backward`` is rmsnorm's gradient in one pass (autodiff's rule calls it: one op
in place of the seventeen elementwise ops and reductions of the formula).  The GPU
launchers (one block per row, f32 warp reductions) live in ``rows_cuda.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .numerics import FP8_DTYPES, FLOAT_DTYPES, NumericPolicy, accum_dtype, result_dtype

__all__ = ["softmax", "layernorm", "rmsnorm", "layernorm_safe", "rmsnorm_safe", "rmsnorm_backward", "NORM_DTYPES"]

NORM_DTYPES = FLOAT_DTYPES - FP8_DTYPES


def _check_row_param(op: str, name: str, p: Any, x: Any) -> None:
    if p is None:
        return
    check_float(op, name, p, NORM_DTYPES)
    if tuple(p.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: {name} has shape {tuple(p.shape)} but x {tuple(x.shape)} is "
                         f"normalized over its last dim; pass a {name} of shape ({x.shape[-1]},)")


def softmax(x: Any, *, axis: int = -1, out: Any | None = None, stream: Any | None = None,
            policy: NumericPolicy | None = None):
    """Max-subtracted softmax along ``axis``: exp never overflows, the largest term is exp(0)=1."""
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
              out: Any | None = None, stream: Any | None = None, policy: NumericPolicy | None = None):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, f32 statistics."""
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
            stream: Any | None = None, policy: NumericPolicy | None = None):
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dim, f32 statistics."""
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


def rmsnorm_backward(x: Any, g: Any, weight: Any | None = None, *, eps: float = 1e-6,
                     stream: Any | None = None):
    """The gradients of ``rmsnorm(x, weight, eps=eps)`` for the cotangent ``g`` of its output:
    ``(gx, gw)``.  With ``x̂ = x·r``, ``r = 1/sqrt(mean(x²) + eps)`` and ``gy = g·weight``:
    ``gx = r·(gy - x̂·mean(gy·x̂))`` in x's dtype; ``gw`` (None without a weight) is the sum
    of ``g·x̂`` over every row, left in the statistics dtype (f32; f64 for f64 inputs) for
    the caller to cast or to add to other ranks' sums first."""
    op = "rmsnorm_backward"
    _check_norm_args(op, x, eps, None, stream, weight=weight)
    check_float(op, "g", g, NORM_DTYPES)
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"{op}: g has shape {tuple(g.shape)} but x {tuple(x.shape)}; the cotangent has "
                         "the output's shape, which is x's")
    acc = accum_dtype(x.dtype)
    xp = array_module(x)
    xf, gf = widen(x, acc), widen(g, acc)
    n = x.shape[-1]
    # row dot products by einsum: no n-wide temporaries for x², gy·x̂ or the weight's sum
    r = 1.0 / xp.sqrt(xp.einsum("...i,...i->...", xf, xf)[..., None] / max(n, 1) + acc.type(eps))
    xhat = xf * r
    gy = gf * widen(weight, acc) if weight is not None else gf
    gx = xhat * (xp.einsum("...i,...i->...", gy, xhat)[..., None] / -max(n, 1))
    gx += gy
    gx *= r
    gw = None
    if weight is not None:
        gw = xp.einsum("ri,ri->i", gf.reshape(-1, n), xhat.reshape(-1, n)) if n else xp.zeros((0,), acc)
    return finish(op, gx, None, np.dtype(x.dtype)), gw


layernorm_safe = layernorm
rmsnorm_safe = rmsnorm

for _name, _fn in (("softmax", softmax), ("layernorm", layernorm), ("layernorm_safe", layernorm),
                   ("rmsnorm", rmsnorm), ("rmsnorm_safe", rmsnorm)):
    register_kernel(_name, "cpu", _fn)
register_kernel("rmsnorm_backward", "cpu", rmsnorm_backward)
