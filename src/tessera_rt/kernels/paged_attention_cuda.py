"""Paged decode attention as a CuPy RawKernel (FlashDecoding-style split over warps).

A block owns one (query head, sequence).  Its four warps take every fourth cached key; a
warp holds the query and its running output spread over the lanes (``D / 32`` elements a
lane), reduces each q·k with warp shuffles and keeps the online-softmax state ``m_i`` /
``l_i`` (log2 domain, f32).  Keys are found through the sequence's block table: position
``j`` lives in page ``tables[b, j / block_size]`` at row ``j % block_size``.  The four
partial states are merged through shared memory at the end.  Decoding is memory bound
(each key and value is read once), so no tensor cores: f32 FMAs on f16 or f32 pages.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import check_out, check_policy, check_stream, null_ptr
from .compile import KernelSource, register_source
from .cuda_common import HALF_IO, IO_CODES, MAX_GRID_YZ, get_function, io_name, launch_stream
from .paged_attention import check_paged, paged_decode_attention as paged_reference
from .precision import note
from .providers import dispatching

__all__ = ["render_paged", "paged_decode_attention_cuda", "PAGED_HEAD_DIMS"]

PAGED_HEAD_DIMS = (32, 64, 128, 256)

PAGED_SOURCE = HALF_IO + r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define NWARPS 4
#define PER (D / 32)

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
ts_paged_decode(const in_t* __restrict__ Q, const in_t* __restrict__ KP, const in_t* __restrict__ VP,
                const int* __restrict__ tables, const int* __restrict__ lens, const int* __restrict__ starts,
                in_t* __restrict__ O, int H, int HKV, int BS, int MB, float scale_log2) {
  __shared__ float s_m[NWARPS], s_l[NWARPS];
  __shared__ float s_acc[NWARPS][D];
  const int h = blockIdx.x, b = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hk = h / (H / HKV);
  const in_t* q = Q + ((long long)b * H + h) * D;
  float qr[PER], acc[PER];
  #pragma unroll
  for (int i = 0; i < PER; ++i) { qr[i] = to_f(q[lane + 32 * i]); acc[i] = 0.f; }
  float m_i = -INFINITY, l_i = 0.f;
  const int n = lens[b], lo = starts ? starts[b] : 0;
  for (int j = lo + warp; j < n; j += NWARPS) {          // uniform over the warp: shuffles are safe
    const int page = tables[(long long)b * MB + j / BS];
    const long long base = (((long long)page * HKV + hk) * BS + j % BS) * D;
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < PER; ++i) s += qr[i] * to_f(KP[base + lane + 32 * i]);
    #pragma unroll
    for (int w = 16; w > 0; w >>= 1) s += __shfl_xor_sync(0xffffffffu, s, w);
    s *= scale_log2;
    const float m_new = fmaxf(m_i, s);
    const float alpha = exp2f(m_i - m_new), p = exp2f(s - m_new);
    l_i = l_i * alpha + p;
    #pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = acc[i] * alpha + p * to_f(VP[base + lane + 32 * i]);
    m_i = m_new;
  }
  if (lane == 0) { s_m[warp] = m_i; s_l[warp] = l_i; }
  #pragma unroll
  for (int i = 0; i < PER; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float m = -INFINITY, l = 0.f;
  #pragma unroll
  for (int w = 0; w < NWARPS; ++w) m = fmaxf(m, s_m[w]);
  #pragma unroll
  for (int w = 0; w < NWARPS; ++w) if (s_m[w] > -INFINITY) l += s_l[w] * exp2f(s_m[w] - m);
  for (int c = threadIdx.x; c < D; c += NWARPS * 32) {
    float o = 0.f;
    #pragma unroll
    for (int w = 0; w < NWARPS; ++w) if (s_m[w] > -INFINITY) o += s_acc[w][c] * exp2f(s_m[w] - m);
    O[((long long)b * H + h) * D + c] = from_f(l > 0.f ? o / l : 0.f);
  }
}
"""


def render_paged(head_dim: int = 128, io: str = "f16") -> str:
    return f"#define D {int(head_dim)}\n#define TS_IO {IO_CODES[io]}\n" + PAGED_SOURCE


register_source(KernelSource("paged_decode", render_paged, ("ts_paged_decode",),
                             configs=[dict(head_dim=d, io=io) for d in (64, 128) for io in ("f16", "bf16", "f32")]))


def paged_decode_attention_cuda(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any, *,
                                seq_starts: Any = None, scale: float | None = None, out: Any | None = None,
                                stream: Any | None = None, policy: Any = None):
    """GPU paged decode (f32, f16 or bf16 pages); head dims outside ``PAGED_HEAD_DIMS`` take the
    CuPy reference."""
    import cupy
    op = "paged_decode_attention"
    b, h, hkv, d, bs, mb = check_paged(op, q, k_pages, v_pages, block_tables, seq_lens, seq_starts)
    check_policy(op, policy)
    check_stream(op, stream)
    if d not in PAGED_HEAD_DIMS or io_name(q.dtype) not in ("f16", "bf16", "f32") or policy is not None:
        with launch_stream(stream):
            return paged_reference(q, k_pages, v_pages, block_tables, seq_lens, seq_starts=seq_starts,
                                   scale=scale, out=out, policy=policy)
    if b > MAX_GRID_YZ:
        raise ValueError(f"{op}: batch {b} exceeds the grid's y limit {MAX_GRID_YZ}; decode in smaller batches")
    check_out(op, out, q.shape, q.dtype, xp=cupy)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    fn = get_function("paged_decode", "ts_paged_decode", dict(head_dim=d, io=io_name(q.dtype)), render_paged)
    note(op, io_name(q.dtype))
    with launch_stream(stream):
        qc, kc, vc = (cupy.ascontiguousarray(t) for t in (q, k_pages, v_pages))
        o = out if out is not None and out.flags.c_contiguous else cupy.empty(q.shape, q.dtype)
        if b:
            fn((h, b), (128,), (qc, kc, vc, cupy.ascontiguousarray(block_tables), cupy.ascontiguousarray(seq_lens),
                                null_ptr(None if seq_starts is None else cupy.ascontiguousarray(seq_starts)), o,
                                np.int32(h), np.int32(hkv), np.int32(bs), np.int32(mb),
                                np.float32(scale * math.log2(math.e))))
        if out is not None and o is not out:
            out[...] = o
            o = out
    return o


# the kernel table's entry tries the vendor providers first (kernels.providers: cuDNN), then this
register_kernel("paged_decode_attention", "cuda", dispatching("paged_decode_attention", paged_decode_attention_cuda))
