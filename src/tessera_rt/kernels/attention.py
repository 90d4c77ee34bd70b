"""Flash attention forward and backward: NumPy references and argument checks.

Layout ``q (B, H, Sq, D)``, ``k, v (B, Hkv, Sk, D)`` with ``H % Hkv == 0`` (grouped-query
heads: query head ``h`` reads kv head ``h // (H // Hkv)``).  ``causal`` aligns the mask to
the bottom-right corner as FlashAttention-2 does: query ``i`` sees keys ``j <= i + Sk - Sq``,
so decoding one query against a cache sees every key.  ``lse`` is the natural-log
logsumexp of each scaled score row, f32 ``(B, H, Sq)``; a row with no visible key has
``lse = -inf`` and output 0.

Two forward references: ``block_kv=None`` forms the whole score matrix (the plain oracle);
``block_kv=n`` walks K/V in blocks with the online softmax (``m_i``, ``l_i``, ``acc``),
the algorithm the CUDA kernel runs.  The backward recomputes ``P = exp(S - lse)`` from
the saved ``lse`` instead of storing ``P``, as FlashAttention-2 does.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .norms import NORM_DTYPES
from .numerics import NumericPolicy, accum_dtype, result_dtype

__all__ = ["flash_attention", "flash_attention_backward", "check_attention", "check_attention_backward", "GPU_HEAD_DIMS"]

GPU_HEAD_DIMS = (64, 128)          # the 16-bit flash kernels'; the f32 ones take multiples of 8 up to 128
_GPU_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32)) | {np.dtype(resolve_dtype("bf16"))}


def check_attention(op: str, q: Any, k: Any, v: Any, gpu: bool = False) -> tuple[int, ...]:
    """Validate shapes/dtypes; returns ``(B, H, Hkv, Sq, Sk, D)``.  ``gpu`` adds the kernel's limits."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t, NORM_DTYPES)
        if t.ndim != 4:
            raise ValueError(f"{op}: {name} must be 4-D (batch, heads, seq, head_dim), got shape "
                             f"{tuple(t.shape)}; add a batch dim with x[None] or split heads first")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share a dtype, got {dtype_name(q.dtype)}, "
                        f"{dtype_name(k.dtype)}, {dtype_name(v.dtype)}")
    b, h, sq, d = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    bk, hkv, sk, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and "
                         "head_dim")
    if hkv == 0 or h % hkv:
        raise ValueError(f"{op}: q has {h} heads and k/v {hkv}; grouped-query attention needs the "
                         "query heads to be a multiple of the kv heads")
    if gpu:
        if d not in GPU_HEAD_DIMS:
            raise ValueError(f"{op}: head_dim {d} is not supported by the GPU kernel; use one of "
                             f"{GPU_HEAD_DIMS} (pad the head dim) or call the CPU reference")
        if np.dtype(q.dtype) not in _GPU_DTYPES:
            raise TypeError(f"{op}: the GPU kernels take float16, bf16 or float32 (float32 runs on TF32 "
                            f"tensor cores in 3xTF32), got {dtype_name(q.dtype)}")
    return b, h, hkv, sq, sk, d


def check_attention_backward(op: str, q, k, v, o, do, lse, stream, policy) -> tuple[int, ...]:
    """``check_attention`` plus the backward's own arguments: o and do shaped like q, lse (B, H, Sq)."""
    b, h, hkv, sq, sk, d = check_attention(op, q, k, v)
    check_policy(op, policy)
    check_stream(op, stream)
    for name, t in (("o", o), ("do", do)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected q's {tuple(q.shape)}")
    if tuple(lse.shape) != (b, h, sq):
        raise ValueError(f"{op}: lse has shape {tuple(lse.shape)}, expected {(b, h, sq)} "
                         "(from flash_attention(..., return_lse=True))")
    return b, h, hkv, sq, sk, d


def _scores(xp, q, k, groups: int, scale: float, causal: bool, sk: int, k0: int = 0):
    """Scaled scores of q against keys ``k0:k0+k.shape[2]`` (of ``sk`` in all), causally masked."""
    kk = xp.repeat(k, groups, axis=1) if groups > 1 else k
    s = xp.matmul(q, xp.swapaxes(kk, -1, -2)) * q.dtype.type(scale)
    if causal:
        sq = q.shape[2]
        i = xp.arange(sq)[:, None] + (sk - sq)
        j = xp.arange(k0, k0 + k.shape[2])[None, :]
        s = xp.where(j <= i, s, -xp.inf)
    return s


def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                    return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
                    stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``softmax(q kᵀ · scale) v`` with f32 accumulation; ``(o, lse)`` when ``return_lse``.

    Parameters
    ----------
    q : array
        Queries ``(B, H, Sq, D)``.
    k, v : array
        Keys and values ``(B, Hkv, Sk, D)`` (H divisible by Hkv).
    causal : bool
        Mask keys after each query (aligned at the end when Sq < Sk).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp ``(B, H, Sq)``, f32.
    block_kv : int, optional
        Keys per tile.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array or (array, array)
        ``o (B, H, Sq, D)`` of q's dtype, and ``lse`` when ``return_lse``.
    """
    op = "flash_attention"
    b, h, hkv, sq, sk, d = check_attention(op, q, k, v)
    check_policy(op, policy)
    check_stream(op, stream)
    if block_kv is not None and int(block_kv) <= 0:
        raise ValueError(f"{op}: block_kv must be a positive int, got {block_kv}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    xp = array_module(q, k, v)
    acc_dt = accum_dtype(q.dtype, policy)
    qf, kf, vf = widen(q, acc_dt), widen(k, acc_dt), widen(v, acc_dt)
    groups = h // hkv
    if block_kv is None:
        s = _scores(xp, qf, kf, groups, scale, causal, sk)
        m = s.max(axis=-1, keepdims=True) if sk else xp.full((b, h, sq, 1), -xp.inf, acc_dt)
        m_safe = xp.where(xp.isfinite(m), m, 0)
        p = xp.exp(s - m_safe)
        l_i = p.sum(axis=-1, keepdims=True)
        acc = xp.matmul(p, xp.repeat(vf, groups, axis=1) if groups > 1 else vf)
    else:
        bn = int(block_kv)
        m = xp.full((b, h, sq, 1), -xp.inf, acc_dt)       # running row max
        l_i = xp.zeros((b, h, sq, 1), acc_dt)              # running sum of exp(s - m)
        acc = xp.zeros((b, h, sq, d), acc_dt)              # running un-normalized output
        for k0 in range(0, sk, bn):
            s = _scores(xp, qf, kf[:, :, k0:k0 + bn], groups, scale, causal, sk, k0)
            m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = xp.where(xp.isfinite(m_new), m_new, 0)
            alpha = xp.exp(xp.where(xp.isfinite(m), m, 0) - m_safe) * xp.isfinite(m)
            p = xp.exp(s - m_safe)
            vb = vf[:, :, k0:k0 + bn]
            l_i = l_i * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + xp.matmul(p, xp.repeat(vb, groups, axis=1) if groups > 1 else vb)
            m = m_new
        m_safe = xp.where(xp.isfinite(m), m, 0)
    o = acc / xp.where(l_i > 0, l_i, 1)
    o = finish(op, o, out, result_dtype(q.dtype, policy))
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = (m_safe + xp.log(l_i))[..., 0].astype(np.float32)
    return o, lse


def flash_attention_backward(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *,
                             causal: bool = False, scale: float | None = None,
                             out: tuple | None = None, stream: Any | None = None,
                             policy: NumericPolicy | None = None) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of ``flash_attention``, recomputing P from ``lse`` (FlashAttention-2).

    ``dS = P ∘ (dP - rowsum(dO ∘ O))``; ``dk``/``dv`` sum over each kv head's query group.

    Parameters
    ----------
    q, k, v : array
        The forward's inputs.
    o : array
        The forward's output.
    do : array
        The output's cotangent.
    lse : array
        The forward's log-sum-exp.
    causal : bool
        As in the forward.
    scale : float, optional
        As in the forward.
    out : tuple of array, optional
        Receive ``(dq, dk, dv)``.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    tuple of array
        ``(dq, dk, dv)``.
    """
    op = "flash_attention_backward"
    b, h, hkv, sq, sk, d = check_attention_backward(op, q, k, v, o, do, lse, stream, policy)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    xp = array_module(q, k, v, o, do, lse)
    acc_dt = accum_dtype(q.dtype, policy)
    qf, kf, vf, of, dof = (widen(t, acc_dt) for t in (q, k, v, o, do))
    groups = h // hkv
    s = _scores(xp, qf, kf, groups, scale, causal, sk)
    lse_f = widen(lse, acc_dt)[..., None]
    p = xp.exp(s - xp.where(xp.isfinite(lse_f), lse_f, xp.inf))   # rows with no key: P = 0
    vv = xp.repeat(vf, groups, axis=1) if groups > 1 else vf
    kk = xp.repeat(kf, groups, axis=1) if groups > 1 else kf
    dv_h = xp.matmul(xp.swapaxes(p, -1, -2), dof)
    dp = xp.matmul(dof, xp.swapaxes(vv, -1, -2))
    delta = (dof * of).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = xp.matmul(ds, kk) * scale
    dk_h = xp.matmul(xp.swapaxes(ds, -1, -2), qf) * scale
    if groups > 1:
        dk_h = dk_h.reshape(b, hkv, groups, sk, d).sum(axis=2)
        dv_h = dv_h.reshape(b, hkv, groups, sk, d).sum(axis=2)
    res_dt = result_dtype(q.dtype, policy)
    outs = out if out is not None else (None, None, None)
    return tuple(finish(op, r, o_, res_dt) for r, o_ in zip((dq, dk_h, dv_h), outs))


register_kernel("flash_attention", "cpu", flash_attention)
register_kernel("flash_attention_backward", "cpu", flash_attention_backward)
