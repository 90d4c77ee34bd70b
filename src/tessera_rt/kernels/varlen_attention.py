"""Attention over packed variable-length sequences (issue 39's batched prefill).

Layout: ``q (Tq, H, D)``, ``k, v (Tk, Hkv, D)`` hold B sequences back to back; sequence
``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
of k and v (int32, ``(B + 1,)``, starting at 0, non-decreasing).  Each sequence attends only
to its own keys (block-diagonal); ``causal`` aligns each sequence's mask bottom-right as
``flash_attention`` does (query ``i`` of a sequence sees its keys ``j <= i + Lk - Lq``).
Rows of q past ``cu_seqlens_q[-1]`` are not attended and come back 0.

The GPU entry runs cuDNN's ragged attention where installed (``cudnn_varlen``), else the
project's own kernel (``varlen_attention_cuda``): one launch for all the sequences.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from ._common import array_module, check_float, check_stream, finish, is_cupy
from .attention import flash_attention
from .norms import NORM_DTYPES
from .providers import dispatching

__all__ = ["flash_attention_varlen", "check_varlen", "host_lengths", "flash_attention_varlen_cuda"]


def check_varlen(op: str, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any) -> tuple[int, ...]:
    """Validate shapes and dtypes; returns ``(B, H, Hkv, Tq, Tk, D)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t, NORM_DTYPES)
        if t.ndim != 3:
            raise ValueError(f"{op}: {name} must be 3-D packed (tokens, heads, head_dim), got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share a dtype, got {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, "
                        f"{dtype_name(v.dtype)}")
    tq, h, d = q.shape
    tk, hkv, dk = k.shape
    if tuple(k.shape) != tuple(v.shape) or dk != d or hkv == 0 or h % hkv:
        raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, "
                         "head_dim agree and the query heads be a multiple of the kv heads")
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not hasattr(c, "dtype") or c.ndim != 1 or c.dtype != np.int32 or c.shape[0] < 1:
            raise ValueError(f"{op}: {name} must be a 1-D int32 array of B + 1 offsets, got "
                             f"{getattr(c, 'shape', type(c).__name__)} {getattr(c, 'dtype', '')}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{op}: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must both have B + 1 entries")
    return cu_seqlens_q.shape[0] - 1, h, hkv, tq, tk, d


def host_lengths(op: str, cu_seqlens_q: Any, cu_seqlens_k: Any, tq: int, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence query and key counts on the host, checked (a CuPy ``cu`` is read back:
    one device sync; pass NumPy offsets, or ``max_seqlen_*``, to avoid it)."""
    out = []
    for name, c, t in (("cu_seqlens_q", cu_seqlens_q, tq), ("cu_seqlens_k", cu_seqlens_k, tk)):
        c = c.get() if is_cupy(c) else np.asarray(c)
        lens = np.diff(c.astype(np.int64))
        if c[0] != 0 or (lens < 0).any() or c[-1] > t:
            raise ValueError(f"{op}: {name} must start at 0, never decrease and end at most at the {t} packed "
                             f"tokens; got {c.tolist()[:8]}{' ...' if c.size > 8 else ''}")
        out.append(lens)
    return out[0], out[1]


def flash_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                           max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
                           scale: float | None = None, out: Any | None = None, stream: Any | None = None) -> Any:
    """Attention of packed variable-length sequences, each against its own keys only.

    Parameters
    ----------
    q : array
        ``(Tq, H, D)``: every sequence's queries back to back.
    k, v : array
        ``(Tk, Hkv, D)`` (H divisible by Hkv).
    cu_seqlens_q, cu_seqlens_k : array
        ``(B + 1,)`` int32: sequence ``b`` is rows ``cu[b]:cu[b+1]``.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence (the GPU path reads the offsets back when not given).
    causal : bool
        Mask each sequence's later keys (aligned at its end when it has fewer queries than keys).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        ``(Tq, H, D)`` of q's dtype; rows past ``cu_seqlens_q[-1]`` are 0.
    """
    op = "flash_attention_varlen"
    b, h, hkv, tq, tk, d = check_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_stream(op, stream)
    lq, lk = host_lengths(op, cu_seqlens_q, cu_seqlens_k, tq, tk)
    xp = array_module(q, k, v)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    o = xp.zeros(q.shape, np.float32 if q.dtype != np.float64 else np.float64)
    for i in range(b):
        if lq[i] == 0:
            continue
        qs = q[cq[i]:cq[i + 1]].transpose(1, 0, 2)[None]
        ks, vs = (t[ck[i]:ck[i + 1]].transpose(1, 0, 2)[None] for t in (k, v))
        r = flash_attention(qs, ks, vs, causal=causal, scale=scale)
        o[cq[i]:cq[i + 1]] = r[0].transpose(1, 0, 2)
    return finish(op, o, out, np.dtype(q.dtype))


def flash_attention_varlen_cuda(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                                max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                causal: bool = False, scale: float | None = None, out: Any | None = None,
                                stream: Any | None = None) -> Any:
    """The project's own GPU path: one launch for every sequence (``varlen_attention_cuda``),
    the boundaries read on the device; q, k and v may be strided token rows (the heads of a
    fused projection read in place).  Without ``max_seqlen_q`` the offsets are read back (one
    sync) to size the grid and check them."""
    from .cuda_common import io_name, launch_stream
    from .precision import note
    from .varlen_attention_cuda import varlen_attention_launch
    op = "flash_attention_varlen"
    b, h, hkv, tq, tk, d = check_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k)
    if max_seqlen_q is None or not (is_cupy(cu_seqlens_q) and is_cupy(cu_seqlens_k)):
        lq, _ = host_lengths(op, cu_seqlens_q, cu_seqlens_k, tq, tk)
        max_seqlen_q = int(lq.max()) if lq.size else 0
        import cupy
        with launch_stream(stream):           # host offsets: copied in (the kernel reads them on the device)
            cu_seqlens_q, cu_seqlens_k = cupy.asarray(cu_seqlens_q), cupy.asarray(cu_seqlens_k)
    note(op, io_name(q.dtype) or dtype_name(q.dtype))
    return varlen_attention_launch(op, q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q, causal, scale,
                                   out, stream)


register_kernel("flash_attention_varlen", "cpu", flash_attention_varlen)
register_kernel("flash_attention_varlen", "cuda", dispatching("flash_attention_varlen", flash_attention_varlen_cuda))
