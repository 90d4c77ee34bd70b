"""The fused training-step ops' float64 references and their CPU kernel-table entries:
``swiglu_gate``, ``swiglu_backward``, ``rmsnorm_backward``, ``layernorm_backward``,
``softmax_cross_entropy``, ``cross_entropy_backward``.

The references compute in float64 whatever the input (written against ``xp``, so a CuPy f64
input runs them on the device with no host sync) and return the input's dtype; they are the
oracle the tests compare the GPU kernels (``fused_cuda``) and the CPU entries with.  The CPU
entries are the Numba kernels of ``cpu_fused``; 16-bit inputs are widened to f32 for them
and the results cast back, as the references do.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from . import cpu_fused
from ._common import array_module, widen

__all__ = ["swiglu_gate", "swiglu_backward", "rmsnorm_backward", "layernorm_backward", "softmax_cross_entropy",
           "cross_entropy_backward", "sigmoid"]

F64 = np.dtype(np.float64)


def sigmoid(a: Any) -> Any:
    """1 / (1 + exp(-a)) with no overflow for large |a|."""
    xp = array_module(a)
    z = xp.exp(-xp.abs(a))
    return xp.where(a >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def swiglu_gate(h1: Any, h3: Any) -> Any:
    """``silu(h1) * h3`` in float64, h1's dtype."""
    a = widen(h1, F64)
    return (a * sigmoid(a) * widen(h3, F64)).astype(h1.dtype, copy=False)


def swiglu_backward(g: Any, h1: Any, h3: Any) -> tuple[Any, Any]:
    """``(dh1, dh3)`` of ``silu(h1) * h3`` against ``g`` in float64, h1's dtype."""
    a, b, gg = widen(h1, F64), widen(h3, F64), widen(g, F64)
    s = sigmoid(a)
    return ((gg * b * s * (1 + a * (1 - s))).astype(h1.dtype, copy=False),
            (gg * a * s).astype(h1.dtype, copy=False))


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1])


def _param_grad(total: Any, p: Any | None):
    return None if p is None else total.astype(p.dtype, copy=False)


def rmsnorm_backward(g: Any, x: Any, weight: Any | None = None, *, eps: float = 1e-6):
    """``(gx, gw)`` of ``x / sqrt(mean(x^2) + eps) * weight`` in float64 (gw None without a weight)."""
    x2, g2 = _rows(widen(x, F64)), _rows(widen(g, F64))
    w = 1.0 if weight is None else widen(weight, F64)
    r = 1.0 / array_module(x).sqrt((x2 * x2).mean(axis=-1, keepdims=True) + eps)
    dot = (g2 * w * x2).mean(axis=-1, keepdims=True)
    gx = g2 * w * r - x2 * dot * r ** 3
    return gx.reshape(x.shape).astype(x.dtype, copy=False), _param_grad((g2 * x2 * r).sum(axis=0), weight)


def layernorm_backward(g: Any, x: Any, weight: Any | None = None, bias: Any | None = None, *, eps: float = 1e-5):
    """``(gx, gw, gb)`` of ``(x - mean) / sqrt(var + eps) * weight + bias`` in float64 (None for an
    absent parameter)."""
    x2, g2 = _rows(widen(x, F64)), _rows(widen(g, F64))
    w = 1.0 if weight is None else widen(weight, F64)
    d = x2 - x2.mean(axis=-1, keepdims=True)
    r = 1.0 / array_module(x).sqrt((d * d).mean(axis=-1, keepdims=True) + eps)
    xh = d * r
    gw_row = g2 * w
    gx = r * (gw_row - gw_row.mean(axis=-1, keepdims=True) - xh * (gw_row * xh).mean(axis=-1, keepdims=True))
    return (gx.reshape(x.shape).astype(x.dtype, copy=False), _param_grad((g2 * xh).sum(axis=0), weight),
            _param_grad(g2.sum(axis=0), bias))


def _picked(xp, x2: Any, targets: Any):
    """(the target columns' values, which rows have a target in [0, V), the clipped targets)."""
    t = targets.reshape(-1)
    valid = (t >= 0) & (t < x2.shape[1])
    tc = xp.where(valid, t, 0)
    return xp.take_along_axis(x2, tc[:, None], axis=1)[:, 0], valid, tc


def softmax_cross_entropy(logits: Any, targets: Any, *, return_lse: bool = False):
    """Mean over rows of ``logsumexp(row) - row[target]`` in float64: a 0-d array of the kernels'
    statistics dtype (f64 for f64 logits, else f32; NaN rows for targets outside ``[0, V)``), and
    the float64 ``lse`` when ``return_lse``."""
    xp = array_module(logits)
    x2 = _rows(widen(logits, F64))
    m = x2.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    lse = xp.log(xp.exp(x2 - m).sum(axis=-1)) + m[:, 0]
    picked, valid, _ = _picked(xp, x2, targets)
    loss = xp.where(valid, lse - picked, np.nan)
    mean = xp.asarray(loss.mean() if loss.size else np.nan, F64).astype(F64 if logits.dtype == F64 else np.float32)
    lse = lse.reshape(logits.shape[:-1])
    return (mean, lse) if return_lse else mean


def cross_entropy_backward(g: Any, logits: Any, targets: Any, lse: Any):
    """``(softmax - onehot(target)) * g / rows`` in float64, the logits' dtype; NaN rows for
    targets outside ``[0, V)``.  ``g``: a float or a 0-d array."""
    xp = array_module(logits)
    x2 = _rows(widen(logits, F64))
    rows = x2.shape[0]
    p = xp.exp(x2 - widen(lse, F64).reshape(-1, 1))
    _, valid, tc = _picked(xp, x2, targets)
    p[xp.arange(rows), tc] -= valid.astype(F64)
    p = xp.where(valid[:, None], p, np.nan) * (widen(g, F64) if hasattr(g, "dtype") else float(g)) / max(rows, 1)
    return p.reshape(logits.shape).astype(logits.dtype, copy=False)


# --------------------------------------------------------------------------- CPU kernel-table entries

def _numba_dtype(*arrays):
    """The dtype cpu_fused's kernels take for these arrays: theirs for f32/f64, f32 otherwise."""
    dt = np.dtype(arrays[0].dtype)
    return dt if dt in (np.float32, np.float64) else np.dtype(np.float32)


def swiglu_gate_cpu(h1: Any, h3: Any, *, stream: Any = None):
    """``silu(h1) * h3`` (cpu_fused's one-pass kernel), h1's dtype."""
    acc = _numba_dtype(h1)
    return cpu_fused.swiglu_gate(widen(h1, acc), widen(h3, acc)).astype(h1.dtype, copy=False)


def swiglu_backward_cpu(g: Any, h1: Any, h3: Any, *, stream: Any = None):
    """``(dh1, dh3)`` (cpu_fused's one-pass kernel), h1's dtype."""
    acc = _numba_dtype(h1)
    dh1, dh3 = cpu_fused.swiglu_backward(widen(g, acc), widen(h1, acc), widen(h3, acc))
    return dh1.astype(h1.dtype, copy=False), dh3.astype(h1.dtype, copy=False)


def rmsnorm_backward_cpu(g: Any, x: Any, weight: Any = None, *, eps: float = 1e-6, stream: Any = None):
    return cpu_fused.rmsnorm_backward(g, x, weight, eps=eps)


def layernorm_backward_cpu(g: Any, x: Any, weight: Any = None, bias: Any = None, *, eps: float = 1e-5,
                           stream: Any = None):
    return cpu_fused.layernorm_backward(g, x, weight, bias, eps=eps)


def softmax_cross_entropy_cpu(logits: Any, targets: Any, *, return_lse: bool = False, stream: Any = None):
    """cpu_fused's kernel: an f32 scalar (f64 for f64 logits); a target outside ``[0, V)`` raises."""
    return cpu_fused.softmax_cross_entropy(logits, targets, return_lse=return_lse)


def cross_entropy_backward_cpu(g: Any, logits: Any, targets: Any, lse: Any, *, stream: Any = None):
    return cpu_fused.cross_entropy_backward(g, logits, targets, lse)


for _name, _fn in (("swiglu_gate", swiglu_gate_cpu), ("swiglu_backward", swiglu_backward_cpu),
                   ("rmsnorm_backward", rmsnorm_backward_cpu), ("layernorm_backward", layernorm_backward_cpu),
                   ("softmax_cross_entropy", softmax_cross_entropy_cpu),
                   ("cross_entropy_backward", cross_entropy_backward_cpu)):
    register_kernel(_name, "cpu", _fn)
