"""The project's own GPU attention over packed variable-length sequences, one launch for all of
them: ``flash_attention_varlen`` (keys packed beside the queries, block-diagonal) and
``paged_prefill_attention`` (keys read from the paged cache through block tables: a chunked
prefill's earlier positions), both causal or not as asked.

One CUDA source (FlashAttention-2's online softmax on CUDA cores): a block of four warps owns
16 query rows of one (sequence, head); it walks the sequence's keys a tile at a time (32 keys,
16 for head dims over 128), loading K (padded rows: conflict-free) and V into shared memory
as f32.  Lane j scores key j of the tile against a warp's query row (q from shared memory,
pre-scaled into the log2 domain), the warp reduces the row's max and sum by shuffles, and
each lane accumulates its ``D / 32`` output columns from the broadcast probabilities.  Rows
past their sequence, and keys past a causal row's diagonal, are skipped tile by tile.  The
offsets come from device arrays (``cu_seqlens``, ``context_lens``): nothing is read back when
``max_seqlen_q`` (the grid) is given, so a prefill is one launch a layer whatever its batch.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import check_stream
from .compile import KernelSource, register_source
from .cuda_common import ELEM_IO, MAX_GRID_YZ, get_function, io_defines, io_name, launch_stream

__all__ = ["render_varlen", "varlen_smem_bytes", "varlen_attention_launch", "paged_prefill_attention_cuda", "QB"]

QB = 16            # query rows a block (4 warps x 4)

VARLEN_SOURCE = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define QW 4
#define QB (4 * QW)
#define KT (D > 128 ? 16 : 32)
#define DPL ((D + 31) / 32)

// One query row (the same for the whole warp, so every branch is uniform) against one key tile.
__device__ __forceinline__ void ts_varlen_row(const float* qr, const float* sK, const float* sV, int i, int lq, int lk,
                                              int off, int kt, int causal, int lane, float& m, float& l,
                                              float (&acc)[DPL]) {
  if (i >= lq) return;
  const int jmax = causal ? min(lk, i + off + 1) : lk;
  if (kt >= jmax) return;
  const int j = kt + lane;
  float s = -INFINITY;
  if (lane < KT && j < jmax) {
    const float* kr = sK + lane * (D + 1);
    float d = 0.f;
    #pragma unroll 8
    for (int c = 0; c < D; ++c) d += qr[c] * kr[c];
    s = d;
  }
  float mt = s;
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, w));
  const float m_new = fmaxf(m, mt);
  const float alpha = exp2f(m - m_new);
  const float p = s == -INFINITY ? 0.f : exp2f(s - m_new);
  float ps = p;
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, w);
  l = l * alpha + ps;
  #pragma unroll
  for (int e = 0; e < DPL; ++e) acc[e] *= alpha;
  for (int jj = 0; jj < KT; ++jj) {
    const float pj = __shfl_sync(0xffffffffu, p, jj);
    #pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int c = lane + 32 * e;
      if (c < D) acc[e] += pj * sV[jj * D + c];
    }
  }
  m = m_new;
}

// (no __launch_bounds__: with it ptxas held the kernel to 56 registers and spilled)
extern "C" __global__ void
ts_varlen_attn(const io_t* __restrict__ Q, long long q_ld, const io_t* __restrict__ K, const io_t* __restrict__ V,
               long long k_ld, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
               const int* __restrict__ ctx, const int* __restrict__ tables, int W, int bs,
               io_t* __restrict__ O, long long o_ld, long long Tq, int B, int H, int HKV, int causal, float scale_log2) {
  extern __shared__ float ts_smem[];
  float* sK = ts_smem;                       // [KT][D + 1]
  float* sV = sK + KT * (D + 1);             // [KT][D]
  float* sQ = sV + KT * D;                   // [QB][D]
  const int h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (b == B) {                              // the rows past the last sequence come back 0
    for (long long row = (long long)cu_q[B] + blockIdx.x; row < Tq; row += gridDim.x)
      for (int c = threadIdx.x; c < D; c += 128) O[row * o_ld + (long long)h * D + c] = ts_to<io_t>(0.f);
    return;
  }
  const int q0 = cu_q[b], lq = cu_q[b + 1] - q0;
  const int i0 = blockIdx.x * QB;
  if (i0 >= lq) return;
  const int paged = tables != nullptr;
  const int lk = paged ? ctx[b] + lq : cu_k[b + 1] - cu_k[b];
  const int k0 = paged ? 0 : cu_k[b];
  const int off = lk - lq;                   // query i sees keys j <= i + off (causal, bottom-right)
  const int hk = h / (H / HKV);
  for (int e = threadIdx.x; e < QB * D; e += 128) {
    const int r = e / D, c = e % D;
    sQ[e] = i0 + r < lq ? ts_f(Q[(long long)(q0 + i0 + r) * q_ld + (long long)h * D + c]) * scale_log2 : 0.f;
  }
  float m[QW], l[QW], acc[QW][DPL];
  #pragma unroll
  for (int r = 0; r < QW; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    #pragma unroll
    for (int e = 0; e < DPL; ++e) acc[r][e] = 0.f;
  }
  const int last = min(lq, i0 + QB) - 1;
  const int kend = causal ? min(lk, last + off + 1) : lk;
  for (int kt = 0; kt < kend; kt += KT) {
    __syncthreads();                         // the previous tile's readers are done
    for (int e = threadIdx.x; e < KT * D; e += 128) {
      const int jj = e / D, c = e % D, j = kt + jj;
      float kv = 0.f, vv = 0.f;
      if (j < lk) {
        long long base;
        if (paged) {
          const int page = tables[(long long)b * W + j / bs];
          base = (((long long)page * HKV + hk) * bs + j % bs) * D + c;
        } else {
          base = (long long)(k0 + j) * k_ld + (long long)hk * D + c;
        }
        kv = ts_f(K[base]);
        vv = ts_f(V[base]);
      }
      sK[jj * (D + 1) + c] = kv;
      sV[jj * D + c] = vv;
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < QW; ++r)
      ts_varlen_row(sQ + (warp * QW + r) * D, sK, sV, i0 + warp * QW + r, lq, lk, off, kt, causal, lane,
                    m[r], l[r], acc[r]);
  }
  #pragma unroll
  for (int r = 0; r < QW; ++r) {
    const int i = i0 + warp * QW + r;
    if (i >= lq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    #pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int c = lane + 32 * e;
      if (c < D) O[(long long)(q0 + i) * o_ld + (long long)h * D + c] = ts_to<io_t>(acc[r][e] * inv);
    }
  }
}
"""


def varlen_smem_bytes(head_dim: int, **_) -> int:
    kt = 16 if head_dim > 128 else 32
    return 4 * (kt * (head_dim + 1) + kt * head_dim + QB * head_dim)


def render_varlen(head_dim: int = 128, io: str = "f16") -> str:
    return f"#define D {int(head_dim)}\n" + io_defines(io) + ELEM_IO + VARLEN_SOURCE


register_source(KernelSource("varlen_attention", render_varlen, ("ts_varlen_attn",),
                             configs=[dict(head_dim=d, io=io) for d in (64, 128) for io in ("f16", "bf16", "f32")],
                             smem_dynamic=varlen_smem_bytes, fast_math=False))

MAX_HEAD_DIM = 256


def _row_ld(op: str, name: str, a: Any) -> int:
    """Elements between consecutive tokens of ``a (T, heads, D)``, whose heads and columns must be dense."""
    if a.strides[2] != a.itemsize or a.strides[1] != a.shape[2] * a.itemsize or a.strides[0] % a.itemsize:
        raise ValueError(f"{op}: {name} must have dense heads and columns (a token's row may be strided), got "
                         f"strides {a.strides}")
    return a.strides[0] // a.itemsize


def varlen_attention_launch(op: str, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, ctx: Any, tables: Any,
                            max_seqlen_q: int, causal: bool, scale: float | None, out: Any, stream: Any) -> Any:
    """One launch of ``ts_varlen_attn``: packed keys (``cu_k``) or paged ones (``ctx``, ``tables``,
    ``k``/``v`` the page pools).  ``max_seqlen_q`` sizes the grid."""
    import cupy
    check_stream(op, stream)
    io = io_name(q.dtype)
    d, h = q.shape[2], q.shape[1]
    hkv = k.shape[1]
    if io not in ("f32", "f16", "bf16") or d > MAX_HEAD_DIM or h % hkv:
        raise ValueError(f"{op}: the GPU kernel takes f32/f16/bf16 head dims up to {MAX_HEAD_DIM} with the query "
                         f"heads a multiple of the kv heads; got {q.dtype}, D={d}, H={h}, Hkv={hkv}")
    b = cu_q.shape[0] - 1
    if h > MAX_GRID_YZ or b + 1 > MAX_GRID_YZ:
        raise ValueError(f"{op}: {h} heads or {b} sequences exceed the grid")
    q_ld = _row_ld(op, "q", q)
    paged = tables is not None
    k_ld = 0 if paged else _row_ld(op, "k", k)
    if not paged and (v.strides != k.strides):
        raise ValueError(f"{op}: k and v must be laid out alike, got strides {k.strides} and {v.strides}")
    smem = varlen_smem_bytes(d)
    fn = get_function("varlen_attention", "ts_varlen_attn", dict(head_dim=d, io=io), render_varlen,
                      dynamic_smem=smem, fast_math=False)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with launch_stream(stream):
        o = out if out is not None else cupy.empty(q.shape, q.dtype)
        if tuple(o.shape) != tuple(q.shape) or o.dtype != q.dtype or not o.flags.c_contiguous:
            raise ValueError(f"{op}: out must be contiguous {tuple(q.shape)} {q.dtype}")
        tiles = max(1, -(-int(max_seqlen_q) // QB))
        if q.shape[0]:
            fn((tiles, h, b + 1), (128,), (
                q, np.int64(q_ld), k, v, np.int64(k_ld), cu_q, None if paged else cu_k, ctx if paged else None,
                tables if paged else None, np.int32(tables.shape[1] if paged else 0),
                np.int32(k.shape[2] if paged else 1), o, np.int64(h * d), np.int64(q.shape[0]), np.int32(b), np.int32(h), np.int32(hkv),
                np.int32(bool(causal)), np.float32(scale * math.log2(math.e))), shared_mem=smem)
    return o


def paged_prefill_attention_cuda(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, cu_seqlens_q: Any,
                                 context_lens: Any, *, max_seqlen_q: int | None = None, scale: float | None = None,
                                 out: Any | None = None, stream: Any | None = None) -> Any:
    """``prefill_attention.paged_prefill_attention`` on the GPU: one launch for the batch (the
    offsets are read back, one sync, only when ``max_seqlen_q`` is not given)."""
    from .precision import note
    from .prefill_attention import check_paged_prefill
    op = "paged_prefill_attention"
    check_paged_prefill(op, q, k_pages, v_pages, block_tables, cu_seqlens_q, context_lens)
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages), ("block_tables", block_tables)):
        if not p.flags.c_contiguous:
            raise ValueError(f"{op}: {name} must be contiguous")
    if max_seqlen_q is None:
        cu = cu_seqlens_q.get()
        max_seqlen_q = int(np.diff(cu).max()) if cu.size > 1 else 0
    note(op, io_name(q.dtype) or str(q.dtype), "own")
    return varlen_attention_launch(op, q, k_pages, v_pages, cu_seqlens_q, None, context_lens, block_tables,
                                   max_seqlen_q, True, scale, out, stream)


register_kernel("paged_prefill_attention", "cuda", paged_prefill_attention_cuda)
