"""Fused CPU kernels (Numba): SwiGLU, RMSNorm, LayerNorm, softmax and cross-entropy, forward
and backward, each one pass over a row (two where an exponential is due) writing into given
outputs.

The NumPy references (``mlp``, ``norms``) stay the oracle; these are what the CPU backend's
kernel table returns for them.  Each wrapper runs the fast path for NumPy arrays, computing
in the reference's accumulation dtype (f32, or f64 for f64 inputs and f64 policies): 16-bit
inputs are widened once, as the references do, and the result is cast once.  Anything else
(CuPy arrays, softmax over another axis) goes to the reference.

Exponentials are ``cpu_math.fast_exp`` inside the loops (vectorizable f32, so the
exponential fuses with the arithmetic around it), or ``exp_inplace`` over a whole block.  The
kernels are compiled on first use for the dtype they see (f32, f64) and cached on disk
(``cache=True``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..backend import register_kernel
from . import mlp, norms
from ._common import check_float, check_policy, check_stream, finish, is_cupy, widen
from .cpu_math import exp_inplace, fast_exp
from .numerics import NumericPolicy, accum_dtype, result_dtype

__all__ = ["swiglu", "swiglu_forward", "swiglu_gate", "swiglu_backward", "rmsnorm", "rmsnorm_backward", "layernorm",
           "layernorm_backward", "softmax", "softmax_backward", "softmax_cross_entropy",
           "cross_entropy_backward", "adamw_step", "exp_inplace", "rows"]

# fast-math without "no NaN/inf" (masked scores are -inf) and without reciprocal tricks on
# the statistics: reassociation lets LLVM vectorize the row sums
FM = {"reassoc", "contract", "nsz"}
# NumPy's error model: a division by zero gives inf/nan as the references do, and no
# per-division check keeps LLVM from vectorizing a loop (Python's raises, which costs ~4x)
kernel = njit(cache=True, fastmath=FM, error_model="numpy")
# loops without a reduction, around ``fast_exp``: no reassociation, which would undo its
# two-part ln2 subtraction
elementwise = njit(cache=True, fastmath={"contract", "nsz"}, error_model="numpy")


def rows(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous (rows, last dim) array (a view when it already is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


def _numpy(*arrays) -> bool:
    return not any(a is not None and is_cupy(a) for a in arrays)


# --------------------------------------------------------------------------- SwiGLU

@elementwise
def _swiglu_fwd(h1, h3, y):
    """y = silu(h1) * h3."""
    one = h1.dtype.type(1)               # (a literal 1 would make the loop compute in f64)
    for i in range(h1.shape[0]):
        for j in range(h1.shape[1]):
            a = h1[i, j]
            y[i, j] = a / (one + fast_exp(-a)) * h3[i, j]


@elementwise
def _swiglu_bwd(g, h1, h3, dh1, dh3):
    """d/dh1 and d/dh3 of silu(h1) * h3 against g."""
    one = h1.dtype.type(1)
    for i in range(h1.shape[0]):
        for j in range(h1.shape[1]):
            a = h1[i, j]
            s = one / (one + fast_exp(-a))
            gg = g[i, j]
            dh3[i, j] = gg * a * s
            dh1[i, j] = gg * h3[i, j] * s * (one + a * (one - s))


def swiglu_forward(x: Any, w1: Any, w3: Any, policy: NumericPolicy | None = None):
    """``(silu(h1) * h3, h1, h3)`` with ``h1 = x @ w1``, ``h3 = x @ w3`` in the accumulation
    dtype: the pre-activations are what the backward needs (it then recomputes no GEMM)."""
    acc = accum_dtype(x.dtype, policy)
    x2 = rows(widen(x, acc))
    h1, h3 = x2 @ widen(w1, acc), x2 @ widen(w3, acc)
    shape = tuple(x.shape[:-1]) + (w1.shape[1],)
    return swiglu_gate(h1, h3).reshape(shape), h1.reshape(shape), h3.reshape(shape)


def swiglu_gate(h1: np.ndarray, h3: np.ndarray) -> np.ndarray:
    """``silu(h1) * h3`` of the pre-activations (NumPy f32/f64 of one shape), one pass."""
    h1r, h3r = rows(h1), rows(h3)
    y = np.empty_like(h1r)
    _swiglu_fwd(h1r, h3r, y)
    return y.reshape(h1.shape)


def swiglu_backward(g: Any, h1: Any, h3: Any):
    """``(dh1, dh3)``: the cotangents of the pre-activations, in their dtype."""
    h1r, h3r, gr = rows(h1), rows(h3), rows(widen(g, h1.dtype))
    dh1, dh3 = np.empty_like(h1r), np.empty_like(h1r)
    _swiglu_bwd(gr, h1r, h3r, dh1, dh3)
    return dh1.reshape(h1.shape), dh3.reshape(h1.shape)


def swiglu(x: Any, w1: Any, w3: Any, *, out: Any | None = None, stream: Any | None = None,
           policy: NumericPolicy | None = None):
    """``silu(x @ w1) * (x @ w3)`` (the reference: ``mlp.swiglu``)."""
    if not _numpy(x, w1, w3):
        return mlp.swiglu(x, w1, w3, out=out, stream=stream, policy=policy)
    mlp.check_pair("swiglu", x, w1, w3, stream, policy)
    y = swiglu_forward(x, w1, w3, policy)[0]
    return finish("swiglu", y, out, result_dtype(x.dtype, policy))


# --------------------------------------------------------------------------- norms

@kernel
def _rmsnorm_fwd(x, w, eps, y):
    n = x.shape[1]
    for i in range(x.shape[0]):
        ss = x[i, 0] * 0
        for j in range(n):
            ss += x[i, j] * x[i, j]
        r = 1 / np.sqrt(ss / n + eps)
        for j in range(n):
            y[i, j] = x[i, j] * r * w[j]


@kernel
def _rmsnorm_bwd(x, w, g, eps, gx, gw):
    """gx = r*(g*w) - x * mean(g*w*x) * r^3; gw (f64) += sum over rows of g * x * r."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        ss = x[i, 0] * 0
        dot = x[i, 0] * 0
        for j in range(n):
            ss += x[i, j] * x[i, j]
            dot += g[i, j] * w[j] * x[i, j]
        r = 1 / np.sqrt(ss / n + eps)
        c = dot / n * r * r * r
        for j in range(n):
            gx[i, j] = g[i, j] * w[j] * r - x[i, j] * c
            gw[j] += g[i, j] * x[i, j] * r


@kernel
def _mean_rstd(x, i, eps):
    """Row i's mean and 1/sqrt(var + eps), the variance in two passes as the reference's."""
    n = x.shape[1]
    s = x[i, 0] * 0
    for j in range(n):
        s += x[i, j]
    mean = s / n
    v = x[i, 0] * 0
    for j in range(n):
        d = x[i, j] - mean
        v += d * d
    return mean, 1 / np.sqrt(v / n + eps)


@kernel
def _layernorm_fwd(x, w, b, eps, y):
    n = x.shape[1]
    for i in range(x.shape[0]):
        mean, r = _mean_rstd(x, i, eps)
        for j in range(n):
            y[i, j] = (x[i, j] - mean) * r * w[j] + b[j]


@kernel
def _layernorm_bwd(x, w, g, eps, gx, gw, gb):
    """gx = r * (gw - mean(gw) - xhat * mean(gw * xhat)) with gw = g*w; gw, gb (f64) accumulate."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        mean, r = _mean_rstd(x, i, eps)
        m1 = x[i, 0] * 0
        m2 = x[i, 0] * 0
        for j in range(n):
            gg = g[i, j] * w[j]
            m1 += gg
            m2 += gg * (x[i, j] - mean) * r
        m1 /= n
        m2 /= n
        for j in range(n):
            xh = (x[i, j] - mean) * r
            gx[i, j] = r * (g[i, j] * w[j] - m1 - xh * m2)
            gw[j] += g[i, j] * xh
            gb[j] += g[i, j]


def _row_param(p, n: int, acc):
    return np.ones(n, acc) if p is None else np.ascontiguousarray(widen(p, acc))


def rmsnorm(x: Any, weight: Any | None = None, *, eps: float = 1e-6, out: Any | None = None,
            stream: Any | None = None, policy: NumericPolicy | None = None):
    """RMSNorm over the last dim (the reference: ``norms.rmsnorm``)."""
    if not _numpy(x, weight):
        return norms.rmsnorm(x, weight, eps=eps, out=out, stream=stream, policy=policy)
    norms._check_norm_args("rmsnorm", x, eps, policy, stream, weight=weight)
    acc = accum_dtype(x.dtype, policy)
    x2 = rows(widen(x, acc))
    y = np.empty_like(x2)
    if x2.size:
        _rmsnorm_fwd(x2, _row_param(weight, x2.shape[1], acc), acc.type(eps), y)
    return finish("rmsnorm", y.reshape(x.shape), out, result_dtype(x.dtype, policy))


def rmsnorm_backward(g: Any, x: Any, weight: Any | None = None, *, eps: float = 1e-6):
    """``(gx, gweight)`` of ``rmsnorm`` (gweight None without a weight), in x's/weight's dtypes."""
    acc = accum_dtype(x.dtype)
    x2, g2 = rows(widen(x, acc)), rows(widen(g, acc))
    gx, gw = np.empty_like(x2), np.zeros(x2.shape[1], np.float64)
    if x2.size:
        _rmsnorm_bwd(x2, _row_param(weight, x2.shape[1], acc), g2, acc.type(eps), gx, gw)
    return (gx.reshape(x.shape).astype(x.dtype, copy=False),
            None if weight is None else gw.astype(weight.dtype))


def layernorm(x: Any, weight: Any | None = None, bias: Any | None = None, *, eps: float = 1e-5,
              out: Any | None = None, stream: Any | None = None, policy: NumericPolicy | None = None):
    """LayerNorm over the last dim (the reference: ``norms.layernorm``)."""
    if not _numpy(x, weight, bias):
        return norms.layernorm(x, weight, bias, eps=eps, out=out, stream=stream, policy=policy)
    norms._check_norm_args("layernorm", x, eps, policy, stream, weight=weight, bias=bias)
    acc = accum_dtype(x.dtype, policy)
    x2 = rows(widen(x, acc))
    y = np.empty_like(x2)
    n = x2.shape[1]
    if x2.size:
        b = np.zeros(n, acc) if bias is None else np.ascontiguousarray(widen(bias, acc))
        _layernorm_fwd(x2, _row_param(weight, n, acc), b, acc.type(eps), y)
    return finish("layernorm", y.reshape(x.shape), out, result_dtype(x.dtype, policy))


def layernorm_backward(g: Any, x: Any, weight: Any | None = None, bias: Any | None = None, *,
                       eps: float = 1e-5):
    """``(gx, gweight, gbias)`` of ``layernorm`` (None for an absent parameter)."""
    acc = accum_dtype(x.dtype)
    x2, g2 = rows(widen(x, acc)), rows(widen(g, acc))
    n = x2.shape[1]
    gx, gw, gb = np.empty_like(x2), np.zeros(n, np.float64), np.zeros(n, np.float64)
    if x2.size:
        _layernorm_bwd(x2, _row_param(weight, n, acc), g2, acc.type(eps), gx, gw, gb)
    return (gx.reshape(x.shape).astype(x.dtype, copy=False),
            None if weight is None else gw.astype(weight.dtype),
            None if bias is None else gb.astype(bias.dtype))


# --------------------------------------------------------------------------- softmax, cross-entropy

@kernel
def _shift_rows(x, y, m):
    """y = x - rowmax(x), m = rowmax (a row of -inf keeps its -inf max and gives y = -inf)."""
    for i in range(x.shape[0]):
        mx = -np.inf
        for j in range(x.shape[1]):
            mx = max(mx, x[i, j])
        m[i] = mx
        c = mx if mx > -np.inf else 0
        for j in range(x.shape[1]):
            y[i, j] = x[i, j] - c


@kernel
def _normalize_rows(e, lse, m):
    """e = e / rowsum(e); lse = m + log(rowsum(e))."""
    for i in range(e.shape[0]):
        s = e[i, 0] * 0
        for j in range(e.shape[1]):
            s += e[i, j]
        inv = 1 / s if s > 0 else s
        for j in range(e.shape[1]):
            e[i, j] *= inv
        lse[i] = m[i] + np.log(s) if s > 0 else -np.inf


@kernel
def _softmax_bwd(g, y, gx):
    for i in range(y.shape[0]):
        d = y[i, 0] * 0
        for j in range(y.shape[1]):
            d += g[i, j] * y[i, j]
        for j in range(y.shape[1]):
            gx[i, j] = y[i, j] * (g[i, j] - d)


def _softmax_rows(x2: np.ndarray):
    """(probabilities, logsumexp per row) of a (rows, n) array, in x2's dtype."""
    p, m = np.empty_like(x2), np.empty(x2.shape[0], x2.dtype)
    lse = np.empty_like(m)
    if x2.size:
        _shift_rows(x2, p, m)
        _normalize_rows(exp_inplace(p), lse, m)
    return p, lse


def softmax(x: Any, *, axis: int = -1, out: Any | None = None, stream: Any | None = None,
            policy: NumericPolicy | None = None):
    """Softmax over the last axis (the reference: ``norms.softmax``, which also serves other axes)."""
    if not _numpy(x) or not hasattr(x, "ndim") or x.ndim == 0 or axis not in (-1, x.ndim - 1):
        return norms.softmax(x, axis=axis, out=out, stream=stream, policy=policy)
    check_float("softmax", "x", x, norms.NORM_DTYPES)
    check_policy("softmax", policy)
    check_stream("softmax", stream)
    p = _softmax_rows(rows(widen(x, accum_dtype(x.dtype, policy))))[0]
    return finish("softmax", p.reshape(x.shape), out, result_dtype(x.dtype, policy))


def softmax_backward(g: Any, y: Any):
    """``y * (g - sum(g * y))`` over the last dim: the cotangent of softmax's input from its output."""
    acc = accum_dtype(y.dtype)
    y2, g2 = rows(widen(y, acc)), rows(widen(g, acc))
    gx = np.empty_like(y2)
    if y2.size:
        _softmax_bwd(g2, y2, gx)
    return gx.reshape(y.shape).astype(y.dtype, copy=False)


@njit(cache=True)
def _pick(x, t, lse, loss):
    """loss[i] = lse[i] - x[i, t[i]]; -1 if a target is out of range (the caller raises)."""
    for i in range(x.shape[0]):
        k = t[i]
        if k < 0 or k >= x.shape[1]:
            return i
        loss[i] = lse[i] - x[i, k]
    return -1


@kernel
def _xent_bwd(p, t, scale):
    """p (softmax rows) becomes (p - onehot(t)) * scale."""
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            p[i, j] *= scale
        p[i, t[i]] -= scale


def _check_targets(op: str, logits: Any, targets: Any):
    if tuple(targets.shape) != tuple(logits.shape[:-1]) or np.dtype(targets.dtype).kind not in "iu":
        raise ValueError(f"{op}: targets must be integers of shape {tuple(logits.shape[:-1])} (logits "
                         f"{tuple(logits.shape)} without the class dim), got {np.dtype(targets.dtype)} "
                         f"{tuple(targets.shape)}")
    return np.ascontiguousarray(targets, dtype=np.int64).reshape(-1)


def softmax_cross_entropy(logits: Any, targets: Any, *, return_lse: bool = False) -> Any:
    """Mean over rows of ``logsumexp(logits) - logits[target]`` (f32 statistics; f64 for f64),
    a scalar of that statistics dtype (f32 for 16-bit logits, as autocast computes a loss);
    ``(loss, lse)`` when ``return_lse`` (the backward's).

    Parameters
    ----------
    logits : array
        ``(..., V)``.
    targets : array
        Integer ids ``(...)``.
    return_lse : bool
        Also return the rows' log-sum-exp.

    Returns
    -------
    array or (array, array)
        The scalar loss, and ``lse`` when ``return_lse``.
    """
    op = "softmax_cross_entropy"
    check_float(op, "logits", logits, norms.NORM_DTYPES)
    t = _check_targets(op, logits, targets)
    acc = accum_dtype(logits.dtype)
    x2 = rows(widen(logits, acc))
    m, loss = np.empty(x2.shape[0], acc), np.empty(x2.shape[0], acc)
    e = np.empty_like(x2)
    lse = np.empty_like(m)
    if x2.size:
        _shift_rows(x2, e, m)
        _normalize_rows(exp_inplace(e), lse, m)
        bad = _pick(x2, t, lse, loss)
        if bad >= 0:
            raise ValueError(f"{op}: target {t[bad]} at row {bad} is outside [0, {x2.shape[1]})")
    mean = acc.type(loss.mean(dtype=acc) if loss.size else np.nan)     # f32 for 16-bit logits too
    return (mean, lse.reshape(logits.shape[:-1])) if return_lse else mean


def cross_entropy_backward(g: Any, logits: Any, targets: Any, lse: Any):
    """The logits' cotangent of ``softmax_cross_entropy``: ``(softmax - onehot) * g / rows``."""
    acc = accum_dtype(logits.dtype)
    x2, t = rows(widen(logits, acc)), _check_targets("cross_entropy_backward", logits, targets)
    p = x2 - rows(np.asarray(lse, acc)[..., None])
    if p.size:
        _xent_bwd(exp_inplace(p), t, acc.type(float(g) / x2.shape[0]))
    return p.reshape(logits.shape).astype(logits.dtype, copy=False)


# --------------------------------------------------------------------------- optimizer

@njit(cache=True, error_model="numpy")      # no fast-math (see the doc)
def _adamw(w, g, m, v, b1, ob1, b2, ob2, ic1, ic2, eps, decay, lr):
    """AdamW's in-place update in one pass, each element by NumPy's out-of-place formula's
    operations in its order (no fast-math: no fused multiply-adds), so the same bits."""
    for i in range(w.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + gi * ob1
        vi = v[i] * b2 + (gi * gi) * ob2
        m[i], v[i] = mi, vi
        step = (mi * ic1) / (np.sqrt(vi * ic2) + eps)
        w[i] = w[i] * decay - step * lr


def adamw_step(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, b1: float, b2: float,
               c1: float, c2: float, eps: float, decay: float | None, lr: float) -> bool:
    """AdamW on the f32 NumPy arrays ``w``, ``m``, ``v`` in place with the f32 gradient ``g``
    (``c1``, ``c2``: the bias corrections; ``decay``: ``1 - lr * wd``, None for no weight
    decay), one pass and no temporaries.  False (nothing done) where the arrays are not
    contiguous f32 NumPy arrays of one shape: the caller's NumPy formula runs instead."""
    f32 = np.float32
    for a in (w, g, m, v):
        if type(a) is not np.ndarray or a.dtype != f32 or not a.flags.c_contiguous or a.shape != w.shape:
            return False
    if not w.flags.writeable or not m.flags.writeable or not v.flags.writeable:
        return False
    # the scalars as NumPy rounds a Python float next to an f32 array (to f32); decay 1 is exact
    _adamw(w.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), f32(b1), f32(1 - b1), f32(b2), f32(1 - b2),
           f32(1.0 / c1), f32(1.0 / c2), f32(eps), f32(1.0 if decay is None else decay), f32(lr))
    return True


for _name, _fn in (("swiglu", swiglu), ("softmax", softmax), ("layernorm", layernorm),
                   ("layernorm_safe", layernorm), ("rmsnorm", rmsnorm), ("rmsnorm_safe", rmsnorm)):
    register_kernel(_name, "cpu", _fn)
