"""Paged decode attention (vLLM's PagedAttention): one new query per sequence against the
keys and values a KV cache holds in fixed-size blocks, read through per-sequence block tables.

Layout: ``q (B, H, D)``; ``k_pages, v_pages (num_blocks, Hkv, block_size, D)``;
``block_tables (B, max_blocks)`` int32, entry ``j`` the page holding positions
``j*block_size ... (j+1)*block_size - 1`` of sequence ``b`` (entries past the sequence are
ignored, -1 allowed); ``seq_lens (B,)`` keys per sequence; ``seq_starts (B,)`` (optional) the
first visible position, for a sliding window (blocks before it may be -1: dropped).
Grouped-query: query head ``h`` reads kv head ``h // (H // Hkv)``.  Scores and the softmax
accumulate in f32; the output has q's dtype.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .norms import NORM_DTYPES
from .numerics import NumericPolicy, accum_dtype, result_dtype

__all__ = ["paged_decode_attention", "check_paged"]


def check_paged(op: str, q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any,
                seq_starts: Any = None) -> tuple[int, ...]:
    """Validate shapes and dtypes; returns ``(B, H, Hkv, D, block_size, max_blocks)``."""
    check_float(op, "q", q, NORM_DTYPES)
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_float(op, name, t, NORM_DTYPES)
        if t.ndim != 4:
            raise ValueError(f"{op}: {name} must be 4-D (num_blocks, kv_heads, block_size, head_dim), "
                             f"got {tuple(t.shape)}")
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be 3-D (batch, heads, head_dim), got {tuple(q.shape)}")
    if tuple(k_pages.shape) != tuple(v_pages.shape) or not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"{op}: k_pages {tuple(k_pages.shape)} {k_pages.dtype} and v_pages "
                         f"{tuple(v_pages.shape)} {v_pages.dtype} must match each other and q's dtype {q.dtype}")
    b, h, d = q.shape
    _, hkv, bs, dk = k_pages.shape
    if dk != d or hkv == 0 or h % hkv:
        raise ValueError(f"{op}: q {tuple(q.shape)} and pages {tuple(k_pages.shape)}: head_dim must agree and "
                         "the query heads be a multiple of the kv heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != np.int32:
        raise ValueError(f"{op}: block_tables must be int32 (batch={b}, max_blocks), got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    for name, t in (("seq_lens", seq_lens), ("seq_starts", seq_starts)):
        if t is not None and (tuple(t.shape) != (b,) or t.dtype != np.int32):
            raise ValueError(f"{op}: {name} must be int32 of shape ({b},), got {tuple(t.shape)} {t.dtype}")
    return b, h, hkv, d, bs, block_tables.shape[1]


def paged_decode_attention(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any, *,
                           seq_starts: Any = None, scale: float | None = None, out: Any | None = None,
                           stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``softmax(q kᵀ · scale) v`` over each sequence's cached keys, gathered through its block table.

    Parameters
    ----------
    q : array
        ``(B, H, D)``: one new query per sequence.
    k_pages, v_pages : array
        ``(num_blocks, Hkv, block_size, D)``.
    block_tables : array
        ``(B, max_blocks)`` int32: entry j the page of positions ``j*block_size ...`` (-1 past the
        sequence).
    seq_lens : array
        ``(B,)`` keys per sequence.
    seq_starts : array, optional
        ``(B,)`` first visible position (a sliding window).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        ``(B, H, D)``, q's dtype.
    """
    op = "paged_decode_attention"
    b, h, hkv, d, bs, mb = check_paged(op, q, k_pages, v_pages, block_tables, seq_lens, seq_starts)
    check_policy(op, policy)
    check_stream(op, stream)
    xp = array_module(q, k_pages, v_pages)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    acc = accum_dtype(q.dtype, policy)
    g = h // hkv
    tables = xp.maximum(block_tables, 0)                         # dropped / unused entries: masked below
    k = xp.take(k_pages, tables, axis=0).transpose(0, 2, 1, 3, 4).reshape(b, hkv, mb * bs, d)   # (B, Hkv, L, D)
    v = xp.take(v_pages, tables, axis=0).transpose(0, 2, 1, 3, 4).reshape(b, hkv, mb * bs, d)
    qf = widen(q, acc).reshape(b, hkv, g, d)
    s = xp.matmul(qf, xp.swapaxes(widen(k, acc), -1, -2)) * acc.type(scale)   # (B, Hkv, G, L)
    pos = xp.arange(mb * bs)[None, :]
    lo = xp.zeros((b,), np.int32) if seq_starts is None else seq_starts
    seen = (pos < seq_lens[:, None]) & (pos >= lo[:, None])
    s = xp.where(seen[:, None, None, :], s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = xp.exp(s - xp.where(xp.isfinite(m), m, 0))
    lsum = p.sum(axis=-1, keepdims=True)
    o = xp.matmul(p, widen(v, acc)) / xp.where(lsum > 0, lsum, 1)
    return finish(op, o.reshape(b, h, d), out, result_dtype(q.dtype, policy))


register_kernel("paged_decode_attention", "cpu", paged_decode_attention)
