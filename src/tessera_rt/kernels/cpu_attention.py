"""Blocked (flash-style) attention on the CPU: BLAS for the block products, Numba for the
online softmax between them, NumPy's SIMD ``exp`` in place.

The layout and semantics are ``attention.flash_attention``'s (the NumPy reference, which
stays the oracle): grouped-query heads, bottom-right causal alignment, f32 ``lse``.  Query
heads are viewed as ``(B*Hkv, G, S, D)`` so that the G query heads sharing a kv head
broadcast against it (no repeated K/V).  Queries go in blocks of ``BLOCK_Q`` rows, keys in
blocks of ``block_kv`` (``BLOCK_KV`` by default); a causal query block skips the key blocks
it cannot see.  The forward keeps the running max, sum and output per query block (online
softmax) and returns the logsumexp; the backward recomputes each block's probabilities from
it (FlashAttention-2), so no score matrix larger than a block pair is ever held.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from . import attention
from ._common import check_policy, check_stream, finish, is_cupy, widen
from .cpu_fused import exp_inplace, kernel
from .numerics import NumericPolicy, accum_dtype, result_dtype

__all__ = ["flash_attention", "flash_attention_backward", "BLOCK_Q", "BLOCK_KV"]

BLOCK_Q = 128
BLOCK_KV = 256


@kernel
def _online(s, m, l, acc, has_acc, scale, causal, row0, col0):
    """Scale and mask a score block (N, G, bq, bn), fold its row max into m, rescale the
    running sum l and output acc by exp(m_old - m_new), and leave s - m_new in s."""
    for n in range(s.shape[0]):
        for g in range(s.shape[1]):
            for r in range(s.shape[2]):
                m_old = m[n, g, r]
                mx = m_old
                for c in range(s.shape[3]):
                    val = s[n, g, r, c] * scale
                    if causal and col0 + c > row0 + r:
                        val = -np.inf
                    s[n, g, r, c] = val
                    mx = max(mx, val)
                if mx == -np.inf:               # nothing visible yet: s stays -inf, exp gives 0
                    continue
                for c in range(s.shape[3]):
                    s[n, g, r, c] -= mx
                if m_old > -np.inf:
                    alpha = np.exp(m_old - mx)
                    l[n, g, r] *= alpha
                    if has_acc:
                        for c in range(acc.shape[3]):
                            acc[n, g, r, c] *= alpha
                m[n, g, r] = mx


@kernel
def _rowsum_add(p, l):
    for n in range(p.shape[0]):
        for g in range(p.shape[1]):
            for r in range(p.shape[2]):
                s = l[n, g, r]
                for c in range(p.shape[3]):
                    s += p[n, g, r, c]
                l[n, g, r] = s


@kernel
def _finish(acc, m, l, lse):
    """acc /= l (rows with no visible key stay 0); lse = m + log(l), -inf for those rows."""
    for n in range(acc.shape[0]):
        for g in range(acc.shape[1]):
            for r in range(acc.shape[2]):
                s = l[n, g, r]
                if s > 0:
                    inv = 1 / s
                    for c in range(acc.shape[3]):
                        acc[n, g, r, c] *= inv
                    lse[n, g, r] = m[n, g, r] + np.log(s)
                else:
                    lse[n, g, r] = -np.inf


@kernel
def _probs_arg(s, lse, scale, causal, row0, col0):
    """s = scores * scale - lse, masked (and rows with lse = -inf) to -inf: exp(s) is P."""
    for n in range(s.shape[0]):
        for g in range(s.shape[1]):
            for r in range(s.shape[2]):
                z = lse[n, g, r]
                for c in range(s.shape[3]):
                    if z == -np.inf or (causal and col0 + c > row0 + r):
                        s[n, g, r, c] = -np.inf
                    else:
                        s[n, g, r, c] = s[n, g, r, c] * scale - z


@kernel
def _dscores(p, dp, delta, scale):
    """dp = P * (dP - delta) * scale: the scaled score cotangent."""
    for n in range(p.shape[0]):
        for g in range(p.shape[1]):
            for r in range(p.shape[2]):
                dl = delta[n, g, r]
                for c in range(p.shape[3]):
                    dp[n, g, r, c] = p[n, g, r, c] * (dp[n, g, r, c] - dl) * scale


@kernel
def _rowdot(a, b, out):
    for i in range(a.shape[0]):
        s = a[i, 0] * 0
        for j in range(a.shape[1]):
            s += a[i, j] * b[i, j]
        out[i] = s


def _views(acc, b, hkv, *arrays):
    """Each (B, H, S, D) array as a contiguous (B*Hkv, H/Hkv, S, D) array of dtype acc."""
    return [np.ascontiguousarray(widen(a, acc)).reshape(b * hkv, -1, a.shape[2], a.shape[3]) for a in arrays]


def _group_sum(t: np.ndarray) -> np.ndarray:
    """A kv head's gradient: the sum over its G query heads (axis 1); a view when G is 1."""
    return t[:, 0] if t.shape[1] == 1 else t.sum(axis=1)


def _key_end(causal: bool, i1: int, shift: int, sk: int) -> int:
    """How many keys a query block ending at row i1 (exclusive) can see."""
    return max(0, min(sk, i1 + shift)) if causal else sk


def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                    return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
                    stream: Any | None = None, policy: NumericPolicy | None = None):
    """``softmax(q kᵀ · scale) v`` (the reference: ``attention.flash_attention``)."""
    op = "flash_attention"
    # CuPy arrays, and the empty pieces of an uneven head split, go to the reference
    if any(is_cupy(a) for a in (q, k, v)) or not (np.size(q) and np.size(k)):
        return attention.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                                         block_kv=block_kv, out=out, stream=stream, policy=policy)
    b, h, hkv, sq, sk, d = attention.check_attention(op, q, k, v)
    check_policy(op, policy)
    check_stream(op, stream)
    if block_kv is not None and int(block_kv) <= 0:
        raise ValueError(f"{op}: block_kv must be a positive int, got {block_kv}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    acc = accum_dtype(q.dtype, policy)
    bk = int(block_kv or BLOCK_KV)
    q4, k4, v4 = _views(acc, b, hkv, q, k, v)
    o = np.empty_like(q4)
    lse = np.empty(q4.shape[:3], acc)
    shift, sc = sk - sq, acc.type(scale)
    for i0 in range(0, sq, BLOCK_Q):
        i1 = min(sq, i0 + BLOCK_Q)
        qb = q4[:, :, i0:i1]
        m = np.full(qb.shape[:3], -np.inf, acc)
        l = np.zeros_like(m)
        run = None
        for j0 in range(0, _key_end(causal, i1, shift, sk), bk):
            j1 = min(sk, j0 + bk)
            s = np.matmul(qb, np.swapaxes(k4[:, :, j0:j1], -1, -2))
            _online(s, m, l, o if run is None else run, run is not None, sc, causal, i0 + shift, j0)
            _rowsum_add(exp_inplace(s), l)
            pv = np.matmul(s, v4[:, :, j0:j1])
            run = pv if run is None else np.add(run, pv, out=run)
        if run is None:
            run = np.zeros(qb.shape, acc)
        lse_b = np.empty_like(m)
        _finish(run, m, l, lse_b)
        o[:, :, i0:i1] = run
        lse[:, :, i0:i1] = lse_b
    o = finish(op, o.reshape(b, h, sq, d), out, result_dtype(q.dtype, policy))
    return (o, lse.reshape(b, h, sq).astype(np.float32)) if return_lse else o


def flash_attention_backward(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *,
                             causal: bool = False, scale: float | None = None,
                             out: tuple | None = None, stream: Any | None = None,
                             policy: NumericPolicy | None = None):
    """``(dq, dk, dv)`` of ``flash_attention`` (the reference: ``attention.flash_attention_backward``)."""
    op = "flash_attention_backward"
    if any(is_cupy(a) for a in (q, k, v, o, do, lse)) or not (np.size(q) and np.size(k)):
        return attention.flash_attention_backward(q, k, v, o, do, lse, causal=causal, scale=scale, out=out,
                                                  stream=stream, policy=policy)
    b, h, hkv, sq, sk, d = attention.check_attention_backward(op, q, k, v, o, do, lse, stream, policy)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    acc = accum_dtype(q.dtype, policy)
    q4, k4, v4, o4, do4 = _views(acc, b, hkv, q, k, v, o, do)
    lse3 = np.asarray(lse, acc).reshape(q4.shape[:3])
    delta = np.empty(q4.shape[:3], acc)
    _rowdot(do4.reshape(-1, d), o4.reshape(-1, d), delta.reshape(-1))
    dq, dk, dv = np.zeros_like(q4), np.zeros_like(k4[:, 0]), np.zeros_like(v4[:, 0])
    shift, sc = sk - sq, acc.type(scale)
    for i0 in range(0, sq, BLOCK_Q):
        i1 = min(sq, i0 + BLOCK_Q)
        qb, dob = q4[:, :, i0:i1], do4[:, :, i0:i1]
        lse_b, delta_b = np.ascontiguousarray(lse3[:, :, i0:i1]), np.ascontiguousarray(delta[:, :, i0:i1])
        for j0 in range(0, _key_end(causal, i1, shift, sk), BLOCK_KV):
            j1 = min(sk, j0 + BLOCK_KV)
            kb, vb = k4[:, :, j0:j1], v4[:, :, j0:j1]
            p = np.matmul(qb, np.swapaxes(kb, -1, -2))
            _probs_arg(p, lse_b, sc, causal, i0 + shift, j0)
            exp_inplace(p)
            dv[:, j0:j1] += _group_sum(np.matmul(np.swapaxes(p, -1, -2), dob))
            ds = np.matmul(dob, np.swapaxes(vb, -1, -2))
            _dscores(p, ds, delta_b, sc)
            dq[:, :, i0:i1] += np.matmul(ds, kb)
            dk[:, j0:j1] += _group_sum(np.matmul(np.swapaxes(ds, -1, -2), qb))
    res = result_dtype(q.dtype, policy)
    outs = out if out is not None else (None, None, None)
    shapes = (q.shape, k.shape, v.shape)
    return tuple(finish(op, r.reshape(s), o_, res) for r, s, o_ in zip((dq, dk, dv), shapes, outs))


register_kernel("flash_attention", "cpu", flash_attention)
register_kernel("flash_attention_backward", "cpu", flash_attention_backward)
