"""Flash attention forward/backward on the GPU: the launchers of the tensor-core kernels.

The kernels (``flash_cuda``: FlashAttention-2's structure with ldmatrix and cp.async
pipelines; forward, and a deterministic backward with no atomics: a delta pre-pass, a dK/dV
kernel and a dQ kernel) compute on f16 or bf16 operands, and f16 and bf16 inputs run at their
own type.  They read per-(batch, head, row) strides, so the heads of a projection are read in
place (``_operand``); O and dQ come back in q's layout, dK and dV in k's.  f32 inputs are never
rounded to 16 bits unasked: they run as f32 GEMMs (``attention_gemm_cuda``), unless the float32
matmul precision is "medium", which allows bf16 (``kernels.precision``).  head_dim is 64 or 128.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import resolve_dtype
from ._common import check_out, check_policy, check_stream
from .attention import check_attention, flash_attention as fa_reference, \
    flash_attention_backward as fa_bwd_reference
from .attention_gemm_cuda import attention_f32, attention_f32_backward
from .cuda_common import MAX_GRID_YZ, aligned, get_function, is_aligned, launch_stream
from .flash_cuda import FLASH_TILES, flash_rows, flash_smem_bytes, flash_threads, render_flash
from .precision import f32_compute, note
from .providers import dispatching

__all__ = ["render_flash", "flash_smem_bytes", "flash_attention_cuda", "flash_attention_backward_cuda",
           "FLASH_TILES"]

_F32 = np.dtype(np.float32)
_ELEM = {np.dtype(np.float16): "f16", resolve_dtype("bf16"): "bf16"}


def _kernel_for(q: Any, d: int, policy: Any) -> str:
    """What attention of ``q``'s dtype runs on the GPU: "f16"/"bf16" (the flash kernel at that
    element type), "f32" (attention_gemm_cuda: cuBLAS GEMMs around f32 softmax), or
    "reference" (the CuPy reference: f64, policies, head dims the flash kernel lacks).
    f32 follows the float32 matmul precision; "medium" runs the bf16 flash kernel."""
    dt = np.dtype(q.dtype)
    if policy is not None:
        return "reference"
    if dt in _ELEM:
        return _ELEM[dt] if d in FLASH_TILES else "reference"
    if dt == _F32:
        # "high" allows TF32, but CuPy's batched GEMM (the scores and P·V) has no TF32 mode
        # (gemmStridedBatchedEx runs COMPUTE_32F): attention stays f32 there
        return "bf16" if f32_compute() == "bf16" and d in FLASH_TILES else "f32"
    return "reference"


def _strides(a) -> tuple:
    """(batch, head, row) strides of a (B, H, S, D) array, in elements."""
    return tuple(x // a.itemsize for x in a.strides[:3])


def _readable(a) -> bool:
    """Whether the kernel reads ``a`` as it is: D contiguous, every row on a 16-byte boundary
    (load_rows reads ``uint4``s), strides whole elements."""
    return (a.strides[-1] == a.itemsize and all(x % (8 * a.itemsize) == 0 for x in a.strides[:3])
            and is_aligned(a, 16))


def _operand(xp, elem: np.dtype, a):
    """``a`` as ``elem``, read in place where its layout allows: the heads of a projection,
    (B, S, H, D) memory seen as (B, H, S, D), need no copy; anything else is made contiguous."""
    a = a.astype(elem, copy=False)
    return a if _readable(a) else aligned(xp.ascontiguousarray(a), 16)


def _laid_like(xp, like, dtype, src=None):
    """A new array of ``like``'s shape and memory order (its strides, for the kernel's one set
    of q-family / kv-family strides), holding ``src`` when given."""
    order = sorted(range(like.ndim), key=lambda i: -like.strides[i])
    buf = xp.empty(tuple(like.shape[i] for i in order), dtype)
    out = buf.transpose(tuple(order.index(i) for i in range(like.ndim)))
    if src is not None:
        out[...] = src
    return out


def _same_layout(xp, like, a):
    """``a`` (as ``like``'s dtype) with ``like``'s strides: a copy only where they differ."""
    a = a.astype(like.dtype, copy=False)
    return a if a.strides == like.strides and is_aligned(a, 16) else _laid_like(xp, like, like.dtype, a)


def contiguous_inputs(q: Any) -> bool:
    """Whether attention of ``q``'s dtype copies its inputs contiguous (the f32 GEMM path): then
    autodiff copies once and keeps the copies for the backward."""
    return np.dtype(q.dtype) == _F32 and f32_compute() != "bf16"


def _batch_slices(b: int, heads: int):
    """Batch ranges whose ``(batch x heads)`` fits grid.y, which CUDA caps at 65535."""
    per = max(1, MAX_GRID_YZ // heads)
    return [slice(b0, min(b, b0 + per)) for b0 in range(0, b, per)]


def flash_attention_cuda(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                         return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
                         stream: Any | None = None, policy: Any = None):
    """GPU forward: the flash kernel for f16/bf16 (head dim 64/128), f32 exactly through cuBLAS
    (or TF32 / bf16 per the float32 matmul precision), the CuPy reference otherwise."""
    import cupy
    op = "flash_attention"
    shape = check_attention(op, q, k, v)
    b, h, hkv, sq, sk, d = shape
    check_policy(op, policy)
    check_stream(op, stream)
    kind = _kernel_for(q, d, policy)
    if kind == "reference":
        with launch_stream(stream):
            return fa_reference(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                                block_kv=block_kv, out=out, policy=policy)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    check_out(op, out, q.shape, q.dtype, xp=cupy)
    note(op, kind)
    if kind == "f32":
        o, lse = attention_f32(q, k, v, shape, causal=causal, scale=scale, out=out, stream=stream)
        return (o, lse) if return_lse else o
    elem = resolve_dtype(kind)
    smem = flash_smem_bytes(d, "ts_flash_fwd")
    fn = get_function("flash_attention", "ts_flash_fwd", dict(head_dim=d, dtype=kind), render_flash, dynamic_smem=smem)
    with launch_stream(stream):
        qh, kh = _operand(cupy, elem, q), _operand(cupy, elem, k)
        vh = _same_layout(cupy, kh, v)
        direct = out is not None and out.dtype == elem and out.strides == qh.strides and is_aligned(out, 16)
        o = out if direct else _laid_like(cupy, qh, elem)          # O in q's layout: (B, S, H, D) stays so
        lse = cupy.empty((b, h, sq), np.float32)
        strides = tuple(np.int64(x) for x in _strides(qh) + _strides(kh))
        for bs in _batch_slices(b, h):
            grid = (-(-sq // FLASH_TILES[d][0]), (bs.stop - bs.start) * h)
            fn(grid, (flash_threads(d, "ts_flash_fwd"),),
               (qh[bs], kh[bs], vh[bs], o[bs], lse[bs], np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk),
                np.float32(scale * math.log2(math.e)), np.int32(bool(causal))) + strides, shared_mem=smem)
        if out is not None and o is not out:
            out[...] = o
            o = out
        elif o.dtype != q.dtype:        # f32 inputs at "medium" ran in bf16: the caller's dtype back
            o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def flash_attention_backward_cuda(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *,
                                  causal: bool = False, scale: float | None = None,
                                  out: tuple | None = None, stream: Any | None = None, policy: Any = None):
    """GPU backward (delta pre-pass, dK/dV kernel, dQ kernel; deterministic, no atomics) for
    f16/bf16; f32 through cuBLAS as the forward; the CuPy reference otherwise."""
    import cupy
    op = "flash_attention_backward"
    shape = check_attention(op, q, k, v)
    b, h, hkv, sq, sk, d = shape
    kind = _kernel_for(q, d, policy)
    if kind == "reference" or out is not None:
        with launch_stream(stream):
            return fa_bwd_reference(q, k, v, o, do, lse, causal=causal, scale=scale, out=out, policy=policy)
    check_stream(op, stream)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    note(op, kind)
    if kind == "f32":
        return attention_f32_backward(q, k, v, o, do, lse, shape, causal=causal, scale=scale, stream=stream)
    elem = resolve_dtype(kind)
    cfg = dict(head_dim=d, dtype=kind)
    args = (np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk), np.float32(scale), np.int32(bool(causal)))
    delta_fn = get_function("flash_attention", "ts_flash_bwd_delta", cfg, render_flash)
    smem_kv, smem_q = flash_smem_bytes(d, "ts_flash_bwd_dkdv"), flash_smem_bytes(d, "ts_flash_bwd_dq")
    dkdv_fn = get_function("flash_attention", "ts_flash_bwd_dkdv", cfg, render_flash, dynamic_smem=smem_kv)
    dq_fn = get_function("flash_attention", "ts_flash_bwd_dq", cfg, render_flash, dynamic_smem=smem_q)
    with launch_stream(stream):
        qh, kh = _operand(cupy, elem, q), _operand(cupy, elem, k)
        vh, oh, doh = _same_layout(cupy, kh, v), _same_layout(cupy, qh, o), _same_layout(cupy, qh, do)
        lse32 = cupy.ascontiguousarray(lse, dtype=np.float32)
        delta = cupy.empty((b, h, sq), np.float32)
        dq, dk, dv = _laid_like(cupy, qh, elem), _laid_like(cupy, kh, elem), _laid_like(cupy, kh, elem)
        qs, ks = tuple(np.int64(x) for x in _strides(qh)), tuple(np.int64(x) for x in _strides(kh))
        rows = b * h * sq
        per = flash_rows(d, "ts_flash_bwd_delta")
        delta_fn((-(-rows // per),), (flash_threads(d, "ts_flash_bwd_delta"),),
                 (oh, doh, delta, np.int64(rows), np.int32(h), np.int32(sq)) + qs)
        kv_rows, q_rows = flash_rows(d, "ts_flash_bwd_dkdv"), flash_rows(d, "ts_flash_bwd_dq")
        for bs in _batch_slices(b, h):     # h >= hkv: slices that fit the dq grid fit dkdv's too
            nb = bs.stop - bs.start
            dkdv_fn((-(-sk // kv_rows), nb * hkv), (flash_threads(d, "ts_flash_bwd_dkdv"),),
                    (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dk[bs], dv[bs]) + args + qs + ks,
                    shared_mem=smem_kv)
            dq_fn((-(-sq // q_rows), nb * h), (flash_threads(d, "ts_flash_bwd_dq"),),
                  (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dq[bs]) + args + qs + ks, shared_mem=smem_q)
        return tuple(t.astype(q.dtype, copy=False) for t in (dq, dk, dv))


# the kernel table's entries try the vendor providers first (kernels.providers: cuDNN), then these
_forward = dispatching("flash_attention", flash_attention_cuda)
_forward.contiguous_inputs = contiguous_inputs
register_kernel("flash_attention", "cuda", _forward)
register_kernel("flash_attention_backward", "cuda",
                dispatching("flash_attention_backward", flash_attention_backward_cuda))
