"""Flash attention forward/backward on the GPU: the launchers of the tensor-core kernels.

Two kernel families with one interface (entries, parameters, launch geometry): ``flash_cuda``
(FlashAttention-2's structure with ldmatrix and cp.async pipelines on f16 or bf16 operands;
forward, and a deterministic backward with no atomics: a delta pre-pass, a dK/dV kernel and a
dQ kernel) and ``flash_f32_cuda`` (the same structure on f32 operands and TF32 tensor cores).
They read per-(batch, head, row) strides, so the heads of a projection are read in place
(``_operand``); O and dQ come back in q's layout, dK and dV in k's.  f16 and bf16 inputs run at
their own type (head dim 64 or 128).  f32 inputs follow the float32 matmul precision
(``kernels.precision``): "highest" runs the f32 kernels in 3xTF32 (f32-accurate), "high" in
1xTF32, "medium" the bf16 kernel; never fp16.  The f32 kernels take head dims that are
multiples of 8 up to 128; other shapes, f64 and numeric policies run the CuPy reference.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..backend import register_kernel
from ..dtypes import resolve_dtype
from ._common import check_out, check_policy, check_stream
from .attention import check_attention, flash_attention as fa_reference, flash_attention_backward as fa_bwd_reference
from .cuda_common import MAX_GRID_YZ, aligned, get_function, is_aligned, launch_stream
from .flash_cuda import FLASH_TILES, flash_rows, flash_smem_bytes, flash_threads, render_flash
from .flash_f32_cuda import flash32_rows, flash32_smem_bytes, flash32_supports, flash32_threads, render_flash32
from .precision import f32_compute, note
from .providers import dispatching

__all__ = ["render_flash", "flash_smem_bytes", "flash_attention_cuda", "flash_attention_backward_cuda",
           "FLASH_TILES"]

_F32 = np.dtype(np.float32)
_ELEM = {np.dtype(np.float16): "f16", resolve_dtype("bf16"): "bf16"}


def _kernel_for(q: Any, d: int, policy: Any) -> str:
    """What attention of ``q``'s dtype runs on the GPU: "f16"/"bf16" (the 16-bit flash kernels
    at that element type), "f32"/"tf32" (the f32 kernels in 3xTF32 / 1xTF32), or "reference"
    (the CuPy reference: f64, policies, head dims the kernels lack).  f32 follows the float32
    matmul precision: "highest" f32, "high" tf32, "medium" bf16 where the bf16 kernel has the
    head dim (else tf32, still within what "medium" allows)."""
    dt = np.dtype(q.dtype)
    if policy is not None:
        return "reference"
    if dt in _ELEM:
        return _ELEM[dt] if d in FLASH_TILES else "reference"
    if dt == _F32:
        compute = f32_compute()
        if compute == "bf16" and d in FLASH_TILES:
            return "bf16"
        if flash32_supports(d):
            return "f32" if compute == "f32" else "tf32"
    return "reference"


class _Kernels(NamedTuple):
    """One kernel family at one (kind, head dim): its element type and, per entry, the compiled
    function, threads per block, rows per block and dynamic shared memory."""
    kind: str
    d: int
    elem: np.dtype

    def fn(self, entry: str):
        if self.kind in ("f32", "tf32"):      # exp2f/log2f to 2 ulp: compiled without fast math
            return get_function("flash_attention_f32", entry, dict(head_dim=self.d, precision=self.kind),
                                render_flash32, dynamic_smem=self.smem(entry), fast_math=False)
        return get_function("flash_attention", entry, dict(head_dim=self.d, dtype=self.kind), render_flash,
                            dynamic_smem=self.smem(entry))

    def threads(self, entry: str) -> int:
        return (flash32_threads if self.elem == _F32 else flash_threads)(self.d, entry)

    def rows(self, entry: str) -> int:
        return (flash32_rows if self.elem == _F32 else flash_rows)(self.d, entry)

    def smem(self, entry: str) -> int:
        return (flash32_smem_bytes if self.elem == _F32 else flash_smem_bytes)(self.d, entry)


def _kernels(kind: str, d: int) -> _Kernels:
    return _Kernels(kind, d, _F32 if kind in ("f32", "tf32") else np.dtype(resolve_dtype(kind)))


def _strides(a) -> tuple:
    """(batch, head, row) strides of a (B, H, S, D) array, in elements."""
    return tuple(x // a.itemsize for x in a.strides[:3])


def _readable(a) -> bool:
    """Whether the kernels read ``a`` as it is: D contiguous, every row on a 16-byte boundary
    (their cp.async copies 16 bytes)."""
    return a.strides[-1] == a.itemsize and all(x % 16 == 0 for x in a.strides[:3]) and is_aligned(a, 16)


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


def _batch_slices(b: int, heads: int):
    """Batch ranges whose ``(batch x heads)`` fits grid.y, which CUDA caps at 65535."""
    per = max(1, MAX_GRID_YZ // heads)
    return [slice(b0, min(b, b0 + per)) for b0 in range(0, b, per)]


def flash_attention_cuda(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                         return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
                         stream: Any | None = None, policy: Any = None):
    """GPU forward: the flash kernels (f16/bf16 at their type; f32 in 3xTF32, TF32 or bf16 per
    the float32 matmul precision), the CuPy reference otherwise."""
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
    kern = _kernels(kind, d)
    elem, entry = kern.elem, "ts_flash_fwd"
    fn = kern.fn(entry)
    with launch_stream(stream):
        qh, kh = _operand(cupy, elem, q), _operand(cupy, elem, k)
        vh = _same_layout(cupy, kh, v)
        direct = out is not None and out.dtype == elem and out.strides == qh.strides and is_aligned(out, 16)
        o: Any = out if direct else _laid_like(cupy, qh, elem)     # O in q's layout: (B, S, H, D) stays so
        lse = cupy.empty((b, h, sq), np.float32)
        strides = tuple(np.int64(x) for x in _strides(qh) + _strides(kh))
        for bs in _batch_slices(b, h):
            grid = (-(-sq // kern.rows(entry)), (bs.stop - bs.start) * h)
            fn(grid, (kern.threads(entry),),
               (qh[bs], kh[bs], vh[bs], o[bs], lse[bs], np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk),
                np.float32(scale * math.log2(math.e)), np.int32(bool(causal))) + strides, shared_mem=kern.smem(entry))
        if out is not None and o is not out:
            out[...] = o
            o = out
        elif o.dtype != q.dtype:        # f32 inputs at "medium" ran in bf16: the caller's dtype back
            o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def flash_attention_backward_cuda(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *,
                                  causal: bool = False, scale: float | None = None,
                                  out: tuple | None = None, stream: Any | None = None, policy: Any = None):
    """GPU backward (delta pre-pass, dK/dV kernel, dQ kernel; deterministic, no atomics) in the
    forward's precision; the CuPy reference otherwise."""
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
    kern = _kernels(kind, d)
    elem = kern.elem
    args = (np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk), np.float32(scale), np.int32(bool(causal)))
    delta_fn, dkdv_fn, dq_fn = (kern.fn(e) for e in ("ts_flash_bwd_delta", "ts_flash_bwd_dkdv", "ts_flash_bwd_dq"))
    with launch_stream(stream):
        qh, kh = _operand(cupy, elem, q), _operand(cupy, elem, k)
        vh, oh, doh = _same_layout(cupy, kh, v), _same_layout(cupy, qh, o), _same_layout(cupy, qh, do)
        lse32 = cupy.ascontiguousarray(lse, dtype=np.float32)
        delta = cupy.empty((b, h, sq), np.float32)
        dq, dk, dv = _laid_like(cupy, qh, elem), _laid_like(cupy, kh, elem), _laid_like(cupy, kh, elem)
        qs, ks = tuple(np.int64(x) for x in _strides(qh)), tuple(np.int64(x) for x in _strides(kh))
        rows = b * h * sq
        per = kern.rows("ts_flash_bwd_delta")
        delta_fn((-(-rows // per),), (kern.threads("ts_flash_bwd_delta"),),
                 (oh, doh, delta, np.int64(rows), np.int32(h), np.int32(sq)) + qs)
        kv_rows, q_rows = kern.rows("ts_flash_bwd_dkdv"), kern.rows("ts_flash_bwd_dq")
        for bs in _batch_slices(b, h):     # h >= hkv: slices that fit the dq grid fit dkdv's too
            nb = bs.stop - bs.start
            dkdv_fn((-(-sk // kv_rows), nb * hkv), (kern.threads("ts_flash_bwd_dkdv"),),
                    (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dk[bs], dv[bs]) + args + qs + ks,
                    shared_mem=kern.smem("ts_flash_bwd_dkdv"))
            dq_fn((-(-sq // q_rows), nb * h), (kern.threads("ts_flash_bwd_dq"),),
                  (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dq[bs]) + args + qs + ks,
                  shared_mem=kern.smem("ts_flash_bwd_dq"))
        return tuple(t.astype(q.dtype, copy=False) for t in (dq, dk, dv))


# the kernel table's entries try the vendor providers first (kernels.providers: cuDNN), then these
register_kernel("flash_attention", "cuda", dispatching("flash_attention", flash_attention_cuda))
register_kernel("flash_attention_backward", "cuda",
                dispatching("flash_attention_backward", flash_attention_backward_cuda))
