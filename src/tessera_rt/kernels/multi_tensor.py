"""Multi-tensor optimizer ops over lists of arrays: ``adamw_multi``, ``sum_squares_multi`` and
``clip_scale_multi``, their float64 references and CPU kernel-table entries.

The CPU entries run ``cpu_fused.adamw_step`` per tensor (the NumPy formula where it declines)
and NumPy sums; the GPU ones (``optim_cuda``) cover every tensor of a dtype in one launch and
keep the norm and the clip scale on the device.  The formulas are ``optim.AdamW._update``'s
and ``optim.clip_grad_norm``'s: clipping scales by ``max_norm / (norm + 1e-6)`` only when the
norm is finite and above ``max_norm``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from . import cpu_fused
from ._common import widen

__all__ = ["adamw_multi", "sum_squares_multi", "clip_scale", "adamw_multi_cpu", "sum_squares_multi_cpu",
           "clip_scale_multi_cpu", "check_adamw_args", "adam_scalars"]

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
GRAD_DTYPES = ("float32", "float16", "bfloat16")


def check_adamw_args(ws, gs, ms, vs, step: int, outs=None) -> None:
    """The lists' lengths and each tensor's sizes and dtypes (masters and moments f32; an
    output, where given, of its gradient's dtype)."""
    if outs is not None:
        if len(outs) != len(ws):
            raise ValueError(f"adamw_multi: {len(outs)} outputs for {len(ws)} masters; pass one (or None) per parameter")
        for i, (o, g) in enumerate(zip(outs, gs)):
            if o is not None and (o.dtype != g.dtype or o.size != g.size):
                raise ValueError(f"adamw_multi: output {i} is {dtype_name(o.dtype)} {tuple(o.shape)}; an output "
                                 f"takes its gradient's dtype ({dtype_name(g.dtype)}) and size ({g.size})")
    if not len(ws) == len(gs) == len(ms) == len(vs):
        raise ValueError(f"adamw_multi: {len(ws)} masters, {len(gs)} gradients, {len(ms)} first and {len(vs)} "
                         "second moments; pass one of each per parameter")
    if step < 1:
        raise ValueError(f"adamw_multi: step must be >= 1 (the bias corrections divide by 1 - beta**step), got {step}")
    for i, (w, g, m, v) in enumerate(zip(ws, gs, ms, vs)):
        for name, a in (("master", w), ("first moment", m), ("second moment", v)):
            if np.dtype(a.dtype) != F32 or a.size != w.size:
                raise ValueError(f"adamw_multi: {name} {i} is {dtype_name(a.dtype)} {tuple(a.shape)}; masters and "
                                 f"moments are f32 of one size ({w.size})")
        if np.dtype(g.dtype).name not in GRAD_DTYPES or g.size != w.size:
            raise ValueError(f"adamw_multi: gradient {i} is {dtype_name(g.dtype)} {tuple(g.shape)}, expected "
                             f"f32/f16/bf16 of {w.size} elements")


def adam_scalars(*, lr: float, b1: float, b2: float, eps: float, weight_decay: float, step: int):
    """The update's f32 constants, as ``cpu_fused.adamw_step`` rounds them: b1, 1 - b1, b2,
    1 - b2, 1 / c1, 1 / c2, eps, the decay factor (1 - lr * wd; 1 without decay) and lr."""
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    f = np.float32
    return (f(b1), f(1 - b1), f(b2), f(1 - b2), f(1.0 / c1), f(1.0 / c2), f(eps),
            f(1 - lr * weight_decay if weight_decay else 1.0), f(lr))


# --------------------------------------------------------------------------- references (float64)

def adamw_multi(ws, gs, ms, vs, *, lr: float, b1: float, b2: float, eps: float, weight_decay: float, step: int,
                grad_scale: Any = None):
    """The AdamW step in float64 on copies: ``(new ws, new ms, new vs)``, lists of float64."""
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    scale = 1.0 if grad_scale is None else float(np.asarray(grad_scale, F64))
    out_w, out_m, out_v = [], [], []
    for w, g, m, v in zip(ws, gs, ms, vs):
        g = widen(g, F64) * scale
        m = b1 * widen(m, F64) + (1 - b1) * g
        v = b2 * widen(v, F64) + (1 - b2) * g * g
        w = widen(w, F64) * (1 - lr * weight_decay) - lr * (m / c1) / (np.sqrt(v / c2) + eps)
        out_w.append(w)
        out_m.append(m)
        out_v.append(v)
    return out_w, out_m, out_v


def sum_squares_multi(gs) -> np.ndarray:
    """The sum of the squares of every element of every array, in float64 (0-d)."""
    return np.asarray(sum(float(np.sum(widen(np.asarray(g), F64) ** 2)) for g in gs), F64)


def clip_scale(total_sq: float, max_norm: float) -> float:
    """``clip_grad_norm``'s factor for the squared norm ``total_sq``: ``max_norm / (norm + 1e-6)``
    when the norm is finite and above ``max_norm``, else 1."""
    norm = math.sqrt(total_sq) if total_sq >= 0 else math.nan
    return max_norm / (norm + 1e-6) if math.isfinite(norm) and norm > max_norm else 1.0


# --------------------------------------------------------------------------- CPU kernel-table entries

def adamw_multi_cpu(ws, gs, ms, vs, *, lr: float, b1: float, b2: float, eps: float, weight_decay: float, step: int,
                    grad_scale: Any = None, outs: Any = None, stream: Any = None) -> None:
    """AdamW in place on f32 NumPy masters and moments, per tensor through ``cpu_fused.adamw_step``
    (``optim.AdamW._update``'s formula) with the gradient widened to f32 and multiplied by
    ``grad_scale`` (a 0-d f32 array) first when given; ``outs`` (None, or per tensor None or an
    array of the gradient's dtype) receive the updated masters rounded."""
    check_adamw_args(ws, gs, ms, vs, step, outs)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    decay = 1 - lr * weight_decay if weight_decay else None
    scale = None if grad_scale is None else np.asarray(grad_scale, F32)
    for w, g, m, v in zip(ws, gs, ms, vs):
        g = widen(g, F32).reshape(w.shape)
        if scale is not None:
            g = g * scale
        if not cpu_fused.adamw_step(w, g, m, v, b1=b1, b2=b2, c1=c1, c2=c2, eps=eps, decay=decay, lr=lr):
            _adamw_numpy(w, g, m, v, b1, b2, c1, c2, eps, decay, lr)
    for w, o in zip(ws, outs or ()):
        if o is not None:
            o.reshape(-1)[...] = w.reshape(-1)


def _adamw_numpy(w, g, m, v, b1, b2, c1, c2, eps, decay, lr) -> None:
    """The update with NumPy ufuncs in place (views and other layouts), the same operations in
    the same order as ``optim.AdamW._update``'s."""
    m *= b1
    m += g * (1 - b1)
    v *= b2
    v += (g * g) * (1 - b2)
    t = np.sqrt(v * (1.0 / c2))
    t += eps
    step = (m * (1.0 / c1)) / t
    if decay is not None:
        w *= decay
    w -= step * lr


_CHUNK = 1 << 20
_SQUARES: list = []          # one f64 scratch buffer of up to _CHUNK elements, kept


def sum_squares_multi_cpu(gs, *, stream: Any = None) -> np.ndarray:
    """The sum of squares of every element of every array, squares of float64 values summed by
    NumPy (pairwise, a fixed order): a 0-d float64 array.  Chunks are widened and squared in
    place in one kept buffer, so a training step's clip allocates nothing."""
    total = 0.0
    for g in gs:
        flat = np.asarray(g).reshape(-1)
        if not _SQUARES or _SQUARES[0].size < min(flat.size, _CHUNK):
            _SQUARES[:] = [np.empty(min(max(flat.size, 1), _CHUNK), F64)]
        buf = _SQUARES[0]
        for i in range(0, flat.size, _CHUNK):
            part = flat[i:i + _CHUNK]
            sq = buf[:part.size]
            sq[...] = part
            np.multiply(sq, sq, out=sq)
            total += float(np.sum(sq))
    return np.asarray(total, F64)


def clip_scale_multi_cpu(gs, total_sq: Any, max_norm: float, *, stream: Any = None) -> np.ndarray:
    """Scale every array of ``gs`` in place by ``clip_scale(total_sq, max_norm)`` when it is below 1;
    returns the factor as a 0-d f32 array."""
    if not max_norm > 0:
        raise ValueError(f"clip_scale_multi: max_norm must be > 0, got {max_norm}")
    scale = clip_scale(float(np.asarray(total_sq)), max_norm)
    if scale < 1:
        for g in gs:
            np.multiply(g, scale, out=g)
    return np.asarray(scale, F32)


register_kernel("adamw_multi", "cpu", adamw_multi_cpu)
register_kernel("sum_squares_multi", "cpu", sum_squares_multi_cpu)
register_kernel("clip_scale_multi", "cpu", clip_scale_multi_cpu)
