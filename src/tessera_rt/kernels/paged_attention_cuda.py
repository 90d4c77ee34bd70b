"""Paged decode attention as CuPy RawKernels: grouped-query blocks, 16-byte coalesced page
reads and split-K over long contexts (flash-decoding).

``ts_paged_split``: a block owns one kv head and up to ``GB`` of the query heads that read it,
of one sequence, over one partition of ``P`` positions (grid: kv head x head chunk, sequence,
partition), so each page row is read once for all its query heads.  ``TG`` lanes hold a key
row, 16 bytes each (a warp reads whole rows: coalesced), and every lane multiplies its part
by each query head's part held in registers (pre-scaled by ``scale * log2(e)``); a butterfly
reduce-scatter over the ``TG`` lanes leaves each head's score with one lane (``log2(GB)``
exchanges of half the values, then whole ones).  The partition's scores sit in shared
memory: its exact softmax (max, ``exp2``, sum), then the same lanes read the value rows and
accumulate ``p * v``.  The page ids of the partition are staged in shared memory first, so a
row's address needs no dependent global load.

One partition (``S = 1``): the block writes the normalized output.  Several: it writes its
partial state (max ``m``, sum ``l``, unnormalized ``acc``, f32) and ``ts_paged_combine``
merges the partitions in order (``exp2(m_s - M)`` weights): deterministic, no atomics.
Decoding is memory bound (each key and value read once), so no tensor cores: f32 FMAs on
f16, bf16 or f32 pages.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from ._common import check_out, check_policy, check_stream, null_ptr
from .compile import KernelSource, register_source
from .cuda_common import (
    ELEM_IO,
    IO_CODES,
    MAX_GRID_YZ,
    VEC16_TO_F32,
    aligned,
    get_function,
    io_name,
    launch_stream,
    scratch,
    sm_count,
)
from .paged_attention import check_paged, paged_decode_attention as paged_reference
from .precision import note
from .providers import dispatching

__all__ = ["render_paged", "paged_decode_attention_cuda", "paged_plan", "PAGED_HEAD_DIMS", "PMAX", "plan_sm_count"]

PAGED_HEAD_DIMS = (32, 64, 128, 256)
PMAX = 256                      # positions per partition at most (the scores' shared memory)
NWARPS = 4

PAGED_SOURCE = ELEM_IO + VEC16_TO_F32 + r"""
#define NW 4
#define NT (NW * 32)
#define NV (D / VEC)                       // 16-byte vectors per row
#define TG (NV < 32 ? NV : 32)             // lanes per row
#define VPL (NV / TG)                      // vectors per lane
#define EPL (VPL * VEC)                    // elements per lane
#define KPW (32 / TG)                      // rows per warp pass
#define KPB (NW * KPW)                     // rows per block pass
#define UNROLL 4
#define SCAT (GB < TG ? GB : TG)           // lanes a head's scores are scattered over
#define AR_MASK (TG / SCAT - 1)            // low lane bits whose steps add whole values
#define CNT (GB / SCAT)                    // scores a lane holds after the reduce-scatter

// Sum `C` values over the lanes that share the bits below 2*O of their lane index, leaving
// value i of the sum in acc[i] for i < C / (lanes) at the lanes that kept that half: at each
// step the lanes with bit O set keep the upper half and send the lower (log2 exchanges of
// half the values), then whole values cross once one is left.
template <int O, int C> struct TsScatter {
  static __device__ __forceinline__ void run(float* acc, int tl) {
    if constexpr (O > 0) {
      if constexpr (C > 1) {
        const bool hi = (tl & O) != 0;
        #pragma unroll
        for (int i = 0; i < C / 2; ++i) {
          const float give = hi ? acc[i] : acc[i + C / 2];
          const float keep = hi ? acc[i + C / 2] : acc[i];
          acc[i] = keep + __shfl_xor_sync(0xffffffffu, give, O);
        }
        TsScatter<O / 2, C / 2>::run(acc, tl);
      } else {
        acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], O);
        TsScatter<O / 2, 1>::run(acc, tl);
      }
    }
  }
};

// four blocks an SM at least: page loads in flight (below 4, ptxas spills a few registers)
extern "C" __global__ void __launch_bounds__(NT, 4)
ts_paged_split(const io_t* __restrict__ Q, const io_t* __restrict__ KP, const io_t* __restrict__ VP,
               const int* __restrict__ tables, const int* __restrict__ lens, const int* __restrict__ starts,
               io_t* __restrict__ O, float* __restrict__ part_ml, float* __restrict__ part_acc,
               int H, int HKV, int BS, int bs_shift, int MB, int P, int S, float scale_log2) {
  __shared__ int s_page[PMAX + 1];
  __shared__ float s_ml[2][GB];
  // the partition's scores (then probabilities), later the warps' partial outputs
  __shared__ __align__(16) float s_buf[(GB * PMAX > NW * GB * D) ? GB * PMAX : NW * GB * D];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane / TG, tl = lane % TG;
  const int chunks = (H / HKV) / GB;
  const int hk = blockIdx.x / chunks, h0 = hk * (H / HKV) + (blockIdx.x % chunks) * GB;
  const int b = blockIdx.y, s = blockIdx.z;
  const int n = lens[b], lo = starts ? starts[b] : 0;
  const int c0 = lo + s * P;                                  // positions fit an int (seq_lens is int32)
  const int nk = c0 < n ? min(P, n - c0) : 0;                 // keys in this partition

  // the partition's page ids; key j is row (r0 + j) % BS of page slot (r0 + j) / BS
  const int pg0 = c0 / BS, r0 = c0 % BS;
  const int npages = nk > 0 ? (r0 + nk - 1) / BS + 1 : 0;
  for (int i = tid; i < npages; i += NT) s_page[i] = tables[(long long)b * MB + pg0 + i];

  // this lane's part of each query head, pre-scaled
  float q[GB][EPL];
  #pragma unroll
  for (int g = 0; g < GB; ++g)
    #pragma unroll
    for (int v = 0; v < VPL; ++v) {
      const uint4 u = *reinterpret_cast<const uint4*>(Q + ((long long)b * H + h0 + g) * D + (tl + TG * v) * VEC);
      ts_vec16_f(u, &q[g][v * VEC]);
      #pragma unroll
      for (int e = 0; e < VEC; ++e) q[g][v * VEC + e] *= scale_log2;
    }
  __syncthreads();

  auto row_of = [&](int j) -> long long {          // element offset of key j's row in the pages
    const int r = r0 + j;
    const int slot = bs_shift >= 0 ? r >> bs_shift : r / BS, row = bs_shift >= 0 ? r & (BS - 1) : r % BS;
    return (((long long)s_page[slot] * HKV + hk) * BS + row) * D;
  };

  // scores: s = q . k (log2 domain)
  for (int j0 = 0; j0 < nk; j0 += KPB * UNROLL) {
    uint4 kv[UNROLL][VPL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = j0 + u * KPB + warp * KPW + sub;
      #pragma unroll
      for (int v = 0; v < VPL; ++v) {
        if (j < nk) kv[u][v] = *reinterpret_cast<const uint4*>(KP + row_of(j) + (tl + TG * v) * VEC);
        else kv[u][v].x = kv[u][v].y = kv[u][v].z = kv[u][v].w = 0u;
      }
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float acc[GB];
      #pragma unroll
      for (int g = 0; g < GB; ++g) acc[g] = 0.f;
      #pragma unroll
      for (int v = 0; v < VPL; ++v) {
        float k[VEC];
        ts_vec16_f(kv[u][v], k);
        #pragma unroll
        for (int g = 0; g < GB; ++g)
          #pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g] = fmaf(q[g][v * VEC + e], k[e], acc[g]);
      }
      // reduce-scatter over the TG lanes of the row: half of the values cross at each step
      TsScatter<TG / 2, GB>::run(acc, tl);
      const int j = j0 + u * KPB + warp * KPW + sub;
      if ((tl & AR_MASK) == 0 && j < nk) {
        const int head = (tl & ~AR_MASK) * GB / TG;
        #pragma unroll
        for (int i = 0; i < CNT; ++i) s_buf[(head + i) * PMAX + j] = acc[i];
      }
    }
  }
  __syncthreads();

  // the partition's softmax, one warp per head
  for (int g = warp; g < GB; g += NW) {
    float m = -INFINITY;
    for (int j = lane; j < nk; j += 32) m = fmaxf(m, s_buf[g * PMAX + j]);
    #pragma unroll
    for (int w = 16; w > 0; w >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, w));
    float l = 0.f;
    for (int j = lane; j < nk; j += 32) {
      const float p = exp2f(s_buf[g * PMAX + j] - m);
      s_buf[g * PMAX + j] = p;
      l += p;
    }
    #pragma unroll
    for (int w = 16; w > 0; w >>= 1) l += __shfl_xor_sync(0xffffffffu, l, w);
    if (lane == 0) { s_ml[0][g] = m; s_ml[1][g] = l; }
  }
  __syncthreads();

  // acc = sum_j p_j v_j over this lane's rows
  float acc[GB][EPL];
  #pragma unroll
  for (int g = 0; g < GB; ++g)
    #pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  for (int j0 = 0; j0 < nk; j0 += KPB * UNROLL) {
    uint4 vv[UNROLL][VPL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = j0 + u * KPB + warp * KPW + sub;
      #pragma unroll
      for (int v = 0; v < VPL; ++v)
        if (j < nk) vv[u][v] = *reinterpret_cast<const uint4*>(VP + row_of(j) + (tl + TG * v) * VEC);
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = j0 + u * KPB + warp * KPW + sub;
      if (j >= nk) continue;
      #pragma unroll
      for (int v = 0; v < VPL; ++v) {
        float x[VEC];
        ts_vec16_f(vv[u][v], x);
        #pragma unroll
        for (int g = 0; g < GB; ++g) {
          const float p = s_buf[g * PMAX + j];
          #pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][v * VEC + e] = fmaf(p, x[e], acc[g][v * VEC + e]);
        }
      }
    }
  }
  // the warp's rows together (lanes of equal tl), then the warps through shared memory
  #pragma unroll
  for (int o = TG; o < 32; o <<= 1)
    #pragma unroll
    for (int g = 0; g < GB; ++g)
      #pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  __syncthreads();                                   // every warp is done reading the probabilities
  if (sub == 0) {
    #pragma unroll
    for (int g = 0; g < GB; ++g)
      #pragma unroll
      for (int v = 0; v < VPL; ++v)
        #pragma unroll
        for (int e = 0; e < VEC; ++e) s_buf[(warp * GB + g) * D + (tl + TG * v) * VEC + e] = acc[g][v * VEC + e];
  }
  __syncthreads();
  for (int i = tid; i < GB * D; i += NT) {
    const int g = i / D, d = i % D;
    float o = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) o += s_buf[(w * GB + g) * D + d];
    const long long bh = (long long)b * H + h0 + g;
    if (S == 1) {
      const float l = s_ml[1][g];
      O[bh * D + d] = ts_to<io_t>(l > 0.f ? o / l : 0.f);
    } else {
      part_acc[(bh * S + s) * D + d] = o;
      if (d == 0) {
        part_ml[(bh * S + s) * 2] = s_ml[0][g];
        part_ml[(bh * S + s) * 2 + 1] = s_ml[1][g];
      }
    }
  }
}

// Merge the S partitions of one (sequence, head) in order: out = sum_s acc_s 2^(m_s - M) / L.
extern "C" __global__ void __launch_bounds__(128)
ts_paged_combine(const float* __restrict__ part_ml, const float* __restrict__ part_acc, io_t* __restrict__ O,
                 int H, int S) {
  const long long bh = (long long)blockIdx.y * H + blockIdx.x;
  const float* ml = part_ml + bh * S * 2;
  float m = -INFINITY;
  for (int s = 0; s < S; ++s) m = fmaxf(m, ml[2 * s]);
  float l = 0.f;
  if (m > -INFINITY)
    for (int s = 0; s < S; ++s) l += ml[2 * s + 1] * exp2f(ml[2 * s] - m);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    if (l > 0.f)
      for (int s = 0; s < S; ++s)
        if (ml[2 * s + 1] > 0.f) o += part_acc[(bh * S + s) * D + d] * exp2f(ml[2 * s] - m);
    O[bh * D + d] = ts_to<io_t>(l > 0.f ? o / l : 0.f);
  }
}
"""


def render_paged(head_dim: int = 128, io: str = "f16", group: int = 4) -> str:
    """CUDA C of the paged decode kernels for one head dim, page dtype and query heads per block."""
    return (f"#define D {int(head_dim)}\n#define GB {int(group)}\n#define PMAX {PMAX}\n#define TS_IO {IO_CODES[io]}\n"
            + PAGED_SOURCE)


register_source(KernelSource(
    "paged_decode", render_paged, ("ts_paged_split", "ts_paged_combine"),
    configs=[dict(head_dim=d, io=io, group=g) for d in (64, 128) for io in ("f16", "bf16", "f32") for g in (1, 4, 8)]
    + [dict(head_dim=256, io=io, group=8) for io in ("f16", "f32")] + [dict(head_dim=32, io="f16", group=8)]))


def _heads_per_block(g: int) -> int:
    """Query heads a block serves: the largest of 8, 4, 2, 1 dividing the group size."""
    return next(c for c in (8, 4, 2, 1) if g % c == 0)


def plan_sm_count() -> int:
    """The multiprocessor count ``paged_plan`` sizes partitions for (this device's; a seam the
    tests set to plan for other GPUs)."""
    return sm_count()


def paged_plan(b: int, blocks_per_seq: int, max_len: int, sms: int) -> tuple[int, int]:
    """(positions per partition P, partitions S) for ``b * blocks_per_seq`` blocks of work over at
    most ``max_len`` positions: partitions of 256, halved (down to 64) while the grid would not
    give every SM four blocks; one partition (no combine) when it holds the whole context."""
    p = PMAX
    while p > 64 and b * blocks_per_seq * -(-max_len // p) < 4 * sms:
        p //= 2
    s = max(1, -(-max_len // p))
    return p, s


def paged_decode_attention_cuda(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any, *,
                                seq_starts: Any = None, scale: float | None = None, out: Any | None = None,
                                stream: Any | None = None, policy: Any = None):
    """GPU paged decode (f32, f16 or bf16 pages): one launch when a partition holds the context,
    else the partitions and their combine (two); head dims outside ``PAGED_HEAD_DIMS`` take the
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
    gb = _heads_per_block(h // hkv)
    chunks = hkv * (h // hkv // gb)
    p, s = paged_plan(b, chunks, mb * bs, plan_sm_count())
    if s > MAX_GRID_YZ:
        raise ValueError(f"{op}: {mb * bs} positions make {s} partitions, over the grid's limit {MAX_GRID_YZ}")
    cfg = dict(head_dim=d, io=io_name(q.dtype), group=gb)
    fn = get_function("paged_decode", "ts_paged_split", cfg, render_paged)
    note(op, io_name(q.dtype) or dtype_name(q.dtype))
    with launch_stream(stream):
        # 16-byte loads of q and the page rows: dense, 16-byte aligned operands
        qc, kc, vc = (aligned(cupy.ascontiguousarray(t), 16) for t in (q, k_pages, v_pages))
        o = out if out is not None and out.flags.c_contiguous else cupy.empty(q.shape, q.dtype)
        if b:
            part = scratch("paged_decode_partials", b * h * s * (d + 2), np.float32) if s > 1 else None
            ml = None if part is None else part[:b * h * s * 2]
            acc = None if part is None else part[b * h * s * 2:]
            tables, lens = cupy.ascontiguousarray(block_tables), cupy.ascontiguousarray(seq_lens)
            starts = null_ptr(None if seq_starts is None else cupy.ascontiguousarray(seq_starts))
            shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
            fn((chunks, b, s), (NWARPS * 32,), (qc, kc, vc, tables, lens, starts, o, null_ptr(ml), null_ptr(acc),
                                                np.int32(h), np.int32(hkv), np.int32(bs), np.int32(shift),
                                                np.int32(mb), np.int32(p), np.int32(s),
                                                np.float32(scale * math.log2(math.e))))
            if s > 1:
                comb = get_function("paged_decode", "ts_paged_combine", cfg, render_paged)
                comb((h, b), (128,), (ml, acc, o, np.int32(h), np.int32(s)))
        if out is not None and o is not out:
            out[...] = o
            o = out
    return o


# the kernel table's entry tries the vendor providers first (kernels.providers: cuDNN), then this
register_kernel("paged_decode_attention", "cuda", dispatching("paged_decode_attention", paged_decode_attention_cuda))
