"""Prefill attention against a paged KV cache (a chunk of a prompt whose earlier positions are
already cached: chunked prefill), the reference and CPU kernel-table entry.

Layout: ``q (T, H, D)`` holds B sequences' new queries back to back, sequence ``b`` at rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (int32, ``(B + 1,)``); its keys and values are
positions ``0 .. context_lens[b] + Lq_b - 1`` of the cache, read through ``block_tables[b]``
(``k_pages, v_pages (pages, Hkv, block_size, D)``, as ``paged_decode_attention``), the new
ones written there before the call.  Query ``i`` of sequence ``b`` sits at position
``context_lens[b] + i`` and sees keys up to it (causal).  Scores and softmax in f32; the
output has q's dtype.  The GPU kernel is ``varlen_attention_cuda``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import array_module, check_float, finish
from .attention import flash_attention
from .norms import NORM_DTYPES

__all__ = ["paged_prefill_attention", "check_paged_prefill"]


def check_paged_prefill(op: str, q, k_pages, v_pages, block_tables, cu_seqlens_q, context_lens) -> tuple:
    """Validate; returns ``(B, T, H, Hkv, D, block_size, width)``."""
    check_float(op, "q", q, NORM_DTYPES)
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be (tokens, heads, head_dim), got {tuple(q.shape)}")
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
        if p.ndim != 4 or p.dtype != q.dtype or p.shape[3] != q.shape[2] or q.shape[1] % p.shape[1]:
            raise ValueError(f"{op}: {name} must be (pages, kv_heads, block_size, {q.shape[2]}) {q.dtype} with the "
                             f"query heads a multiple of the kv heads, got {tuple(p.shape)} {p.dtype}")
    b = cu_seqlens_q.shape[0] - 1
    for name, a, shape in (("cu_seqlens_q", cu_seqlens_q, (b + 1,)), ("context_lens", context_lens, (b,)),
                           ("block_tables", block_tables, (b, block_tables.shape[-1]))):
        if tuple(a.shape) != shape or a.dtype != np.int32:
            raise ValueError(f"{op}: {name} must be int32 of shape {shape}, got {tuple(a.shape)} {a.dtype}")
    return b, q.shape[0], q.shape[1], k_pages.shape[1], q.shape[2], k_pages.shape[2], block_tables.shape[1]


def paged_prefill_attention(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, cu_seqlens_q: Any,
                            context_lens: Any, *, max_seqlen_q: int | None = None, scale: float | None = None,
                            out: Any | None = None, stream: Any | None = None) -> Any:
    """Causal attention of each sequence's new queries over its cached positions.

    Parameters
    ----------
    q : array
        ``(T, H, D)`` the new queries, packed.
    k_pages, v_pages : array
        ``(pages, Hkv, block_size, D)``.
    block_tables : array
        ``(B, width)`` int32 pages of each sequence (-1 past its end).
    cu_seqlens_q : array
        ``(B + 1,)`` int32 query offsets.
    context_lens : array
        ``(B,)`` int32 positions cached before this chunk.
    max_seqlen_q : int, optional
        The longest chunk (the GPU grid's size; read back from the offsets when not given).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    array
        ``(T, H, D)``, q's dtype; rows past ``cu_seqlens_q[-1]`` are 0.
    """
    op = "paged_prefill_attention"
    b, t, h, hkv, d, bs, _ = check_paged_prefill(op, q, k_pages, v_pages, block_tables, cu_seqlens_q, context_lens)
    xp = array_module(q)
    host = (lambda a: a.get() if hasattr(a, "get") else np.asarray(a))
    cu, ctx, tables = host(cu_seqlens_q).astype(np.int64), host(context_lens).astype(np.int64), host(block_tables)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o = xp.zeros(q.shape, np.float32 if q.dtype != np.float64 else np.float64)
    for i in range(b):
        lq = int(cu[i + 1] - cu[i])
        if lq == 0:
            continue
        n = int(ctx[i]) + lq
        pages = tables[i, :-(-n // bs)]
        if (pages < 0).any():
            raise ValueError(f"{op}: sequence {i} needs {-(-n // bs)} pages for {n} positions; its table has -1 there")
        idx = xp.asarray(pages.astype(np.int64))
        k, v = (xp.take(p, idx, axis=0).transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n] for p in (k_pages, v_pages))
        qs = q[cu[i]:cu[i + 1]].transpose(1, 0, 2)[None]
        r = flash_attention(qs, k[None], v[None], causal=True, scale=scale)
        o[cu[i]:cu[i + 1]] = r[0].transpose(1, 0, 2)
    return finish(op, o, out, np.dtype(q.dtype))


register_kernel("paged_prefill_attention", "cpu", paged_prefill_attention)
