"""Flash attention forward/backward as tensor-core RawKernels (FlashAttention-2 structure).

Forward: a block owns BLOCK_M=64 query rows (4 warps × 16) of one (batch, head); it walks
the key/value blocks once, keeping the online-softmax state per row in registers: the
running max ``m_i`` and sum ``l_i`` (f32, log2 domain) and the un-normalized output
``acc``.  S = Q Kᵀ and acc += P V are m16n8k16 MMAs; P never leaves registers (an f32 C
fragment is reused as the A fragment of P·V).  Causal blocks past the diagonal are
skipped.  The kernel writes O and the natural-log ``lse`` the backward needs.

Backward recomputes P from ``lse`` (FlashAttention-2) in two kernels with no atomics, so
the result is deterministic: ``dkdv`` (a block per 64 keys of one kv head, looping over
the query blocks of every query head in its group, which sums grouped-query gradients in
a fixed order) and ``dq`` (a block per 64 queries looping over key blocks), after a
``delta = rowsum(dO ∘ O)`` pre-pass.  head_dim is 64 or 128, fixed at compile time.

The kernels compute on f16 or bf16 operands (the element type is a compile-time choice), and
f16 and bf16 inputs run at their own type.  f32 inputs are never rounded to 16 bits unasked:
they run as f32 GEMMs (``attention_gemm_cuda``), unless the float32 matmul precision is
"medium", which allows bf16 (``kernels.precision``).
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
from .compile import KernelSource, register_source
from .cuda_common import MAX_GRID_YZ, MMA_HEADER, aligned, get_function, is_aligned, launch_stream
from .precision import f32_compute, note
from .providers import dispatching

__all__ = ["render_flash", "flash_smem_bytes", "flash_attention_cuda", "flash_attention_backward_cuda",
           "FLASH_TILES"]

# head_dim -> (BLOCK_M, BLOCK_N) of the forward; the backward uses (64, BQ) / (64, BN) below.
FLASH_TILES = {64: (64, 64), 128: (64, 32)}
BWD_TILES = {64: 64, 128: 32}   # query block of dkdv == key block of dq

FLASH_SOURCE = r"""
#define NWARPS 4
#define LDD (D + 8)
#define LDN (BLOCK_N + 8)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// rows [r0, r0+rows) of a [*, D] matrix with row stride `ld` (elements) into smem (row
// stride LDD), zeros past `limit`.
__device__ __forceinline__ void load_rows(elem_t* s, const elem_t* g, int r0, int rows, int limit, int tid,
                                          long long ld) {
  for (int i = tid; i < rows * (D / 8); i += NWARPS * 32) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + r < limit) v = *reinterpret_cast<const uint4*>(g + (long long)(r0 + r) * ld + c);
    *reinterpret_cast<uint4*>(s + r * LDD + c) = v;
  }
}
// the same rows transposed: smem [D][rows + 8]
__device__ __forceinline__ void load_rows_t(elem_t* s, const elem_t* g, int r0, int rows, int limit, int tid,
                                            long long gld) {
  const int ld = rows + 8;
  for (int i = tid; i < rows * (D / 8); i += NWARPS * 32) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + r < limit) v = *reinterpret_cast<const uint4*>(g + (long long)(r0 + r) * gld + c);
    const elem_t* e = reinterpret_cast<const elem_t*>(&v);
    #pragma unroll
    for (int k = 0; k < 8; ++k) s[(c + k) * ld + r] = e[k];
  }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
ts_flash_fwd(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
             elem_t* __restrict__ O, float* __restrict__ LSE, int H, int HKV, int SQ, int SK,
             float scale_log2, int causal, long long qsb, long long qsh, long long qss, long long ksb,
             long long ksh, long long kss) {
  __shared__ __align__(16) elem_t sQ[BLOCK_M * LDD];
  __shared__ __align__(16) elem_t sK[BLOCK_N * LDD];
  __shared__ __align__(16) elem_t sVt[D * LDN];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  const elem_t* q = Q + q_base;
  const elem_t* k = K + kv_base;
  const elem_t* v = V + kv_base;
  const int m0 = blockIdx.x * BLOCK_M, row0 = m0 + warp * 16, offset = SK - SQ;
  load_rows(sQ, q, m0, BLOCK_M, SQ, tid, qss);

  float acc[D / 8][4];
  #pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};

  int n_end = causal ? min(SK, m0 + BLOCK_M + offset) : SK;
  for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
    __syncthreads();                      // the previous block's K/V reads are done
    load_rows(sK, k, n0, BLOCK_N, SK, tid, kss);
    load_rows_t(sVt, v, n0, BLOCK_N, SK, tid, kss);
    __syncthreads();
    float s[BLOCK_N / 8][4];
    #pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      unsigned a[4];
      ts_load_a(a, &sQ[(warp * 16) * LDD + kk], LDD, lane);
      #pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        unsigned bf[2];
        ts_load_b(bf, &sK[(j * 8) * LDD + kk], LDD, lane);
        ts_mma(s[j], a, bf);
      }
    }
    float mx[2] = {m_i[0], m_i[1]};
    #pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + (e >> 1) * 8, col = n0 + j * 8 + 2 * t + (e & 1);
        const bool ok = col < SK && (!causal || col <= row + offset);
        s[j][e] = ok ? s[j][e] * scale_log2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    float alpha[2], ms[2], rs[2] = {0.f, 0.f};
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = ts_quad_max(mx[r]);
      ms[r] = mx[r] == -INFINITY ? 0.f : mx[r];      // a row with no key yet: keep exp2 finite
      alpha[r] = exp2f(m_i[r] - ms[r]);
      m_i[r] = mx[r];
    }
    #pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - ms[e >> 1]);
        rs[e >> 1] += s[j][e];
      }
    #pragma unroll
    for (int r = 0; r < 2; ++r) l_i[r] = l_i[r] * alpha[r] + ts_quad_sum(rs[r]);
    #pragma unroll
    for (int j = 0; j < D / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= alpha[e >> 1];
    #pragma unroll
    for (int kc = 0; kc < BLOCK_N / 16; ++kc) {
      unsigned a[4];
      ts_c_to_a(a, s[2 * kc], s[2 * kc + 1]);
      #pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        unsigned bf[2];
        ts_load_b(bf, &sVt[(j * 8) * LDN + kc * 16], LDN, lane);
        ts_mma(acc[j], a, bf);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + r * 8;
    if (row >= SQ) continue;
    const float inv = l_i[r] > 0.f ? 1.f / l_i[r] : 0.f;
    elem_t* o = O + q_base + row * qss;
    #pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<elem2_t*>(o + j * 8 + 2 * t) = ts_pack(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
    if (t == 0) LSE[(long long)bh * SQ + row] = l_i[r] > 0.f ? (m_i[r] + log2f(l_i[r])) * LN2 : -INFINITY;
  }
}

// delta[row] = sum_d dO[row, d] * O[row, d] (rows: (batch, head, position) in order); one warp per row.
extern "C" __global__ void ts_flash_bwd_delta(const elem_t* __restrict__ O, const elem_t* __restrict__ dO,
                                              float* __restrict__ delta, long long rows, int H, int SQ,
                                              long long qsb, long long qsh, long long qss) {
  const long long row = (long long)blockIdx.x * NWARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long bh = row / SQ, at = (bh / H) * qsb + (bh % H) * qsh + (row % SQ) * qss;
  float sum = 0.f;
  for (int d = lane; d < D; d += 32) sum += ts_float(O[at + d]) * ts_float(dO[at + d]);
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane == 0) delta[row] = sum;
}

#define BQ BWD_BLOCK
#define LDQ (BQ + 8)
// dK, dV for 64 keys of one kv head: S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
ts_flash_bwd_dkdv(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                  const elem_t* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                  elem_t* __restrict__ dK, elem_t* __restrict__ dV, int H, int HKV, int SQ, int SK,
                  float scale, int causal, long long qsb, long long qsh, long long qss, long long ksb,
                  long long ksh, long long kss) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* sK = reinterpret_cast<elem_t*>(smem);
  elem_t* sV = sK + 64 * LDD;
  elem_t* sQ = sV + 64 * LDD;
  elem_t* sQt = sQ + BQ * LDD;
  elem_t* sdO = sQt + D * LDQ;
  elem_t* sdOt = sdO + BQ * LDD;
  float* sL = reinterpret_cast<float*>(sdOt + D * LDQ);
  float* sDl = sL + BQ;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bhk = blockIdx.y, b = bhk / HKV, hk = bhk % HKV, groups = H / HKV;
  const int n0 = blockIdx.x * 64, krow0 = n0 + warp * 16, offset = SK - SQ;
  const float scale_log2 = scale * LOG2E;
  const long long kv_base = b * ksb + hk * ksh;
  load_rows(sK, K + kv_base, n0, 64, SK, tid, kss);
  load_rows(sV, V + kv_base, n0, 64, SK, tid, kss);
  float dk[D / 8][4], dv[D / 8][4];
  #pragma unroll
  for (int j = 0; j < D / 8; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  const int m_start = causal ? max(0, ((n0 - offset) / BQ) * BQ) : 0;
  for (int gi = 0; gi < groups; ++gi) {
    const long long qbh = (long long)b * H + hk * groups + gi;
    const long long q_base = b * qsb + (hk * groups + gi) * qsh;
    const elem_t* q = Q + q_base;
    const elem_t* dout = dO + q_base;
    for (int m0 = m_start; m0 < SQ; m0 += BQ) {
      __syncthreads();
      load_rows(sQ, q, m0, BQ, SQ, tid, qss);
      load_rows_t(sQt, q, m0, BQ, SQ, tid, qss);
      load_rows(sdO, dout, m0, BQ, SQ, tid, qss);
      load_rows_t(sdOt, dout, m0, BQ, SQ, tid, qss);
      for (int i = tid; i < BQ; i += NWARPS * 32) {
        const bool in = m0 + i < SQ;
        sL[i] = in ? LSE[qbh * SQ + m0 + i] * LOG2E : 0.f;
        sDl[i] = in ? DELTA[qbh * SQ + m0 + i] : 0.f;
      }
      __syncthreads();
      float p[BQ / 8][4], dp[BQ / 8][4];
      #pragma unroll
      for (int j = 0; j < BQ / 8; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) p[j][e] = dp[j][e] = 0.f;
      #pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        unsigned ak[4], av[4];
        ts_load_a(ak, &sK[(warp * 16) * LDD + kk], LDD, lane);
        ts_load_a(av, &sV[(warp * 16) * LDD + kk], LDD, lane);
        #pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
          unsigned bq[2], bo[2];
          ts_load_b(bq, &sQ[(j * 8) * LDD + kk], LDD, lane);
          ts_load_b(bo, &sdO[(j * 8) * LDD + kk], LDD, lane);
          ts_mma(p[j], ak, bq);
          ts_mma(dp[j], av, bo);
        }
      }
      #pragma unroll
      for (int j = 0; j < BQ / 8; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int krow = krow0 + g + (e >> 1) * 8, qc = j * 8 + 2 * t + (e & 1), qrow = m0 + qc;
          const bool ok = qrow < SQ && krow < SK && (!causal || krow <= qrow + offset);
          p[j][e] = ok ? exp2f(p[j][e] * scale_log2 - sL[qc]) : 0.f;
          dp[j][e] = p[j][e] * (dp[j][e] - sDl[qc]);          // dS^T
        }
      #pragma unroll
      for (int kc = 0; kc < BQ / 16; ++kc) {
        unsigned ap[4], ads[4];
        ts_c_to_a(ap, p[2 * kc], p[2 * kc + 1]);
        ts_c_to_a(ads, dp[2 * kc], dp[2 * kc + 1]);
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          unsigned bo[2], bq[2];
          ts_load_b(bo, &sdOt[(j * 8) * LDQ + kc * 16], LDQ, lane);
          ts_load_b(bq, &sQt[(j * 8) * LDQ + kc * 16], LDQ, lane);
          ts_mma(dv[j], ap, bo);
          ts_mma(dk[j], ads, bq);
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int krow = krow0 + g + r * 8;
    if (krow >= SK) continue;
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const long long off = kv_base + (long long)krow * kss + j * 8 + 2 * t;
      *reinterpret_cast<elem2_t*>(dK + off) = ts_pack(dk[j][2 * r] * scale, dk[j][2 * r + 1] * scale);
      *reinterpret_cast<elem2_t*>(dV + off) = ts_pack(dv[j][2 * r], dv[j][2 * r + 1]);
    }
  }
}

#define BK_ BWD_BLOCK
#define LDK (BK_ + 8)
// dQ for 64 query rows: S = Q K^T, P = exp2(S - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
ts_flash_bwd_dq(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                const elem_t* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                elem_t* __restrict__ dQ, int H, int HKV, int SQ, int SK, float scale, int causal,
                long long qsb, long long qsh, long long qss, long long ksb, long long ksh, long long kss) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* sQ = reinterpret_cast<elem_t*>(smem);
  elem_t* sdO = sQ + 64 * LDD;
  elem_t* sK = sdO + 64 * LDD;
  elem_t* sKt = sK + BK_ * LDD;
  elem_t* sV = sKt + D * LDK;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const int m0 = blockIdx.x * 64, row0 = m0 + warp * 16, offset = SK - SQ;
  const float scale_log2 = scale * LOG2E;
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  load_rows(sQ, Q + q_base, m0, 64, SQ, tid, qss);
  load_rows(sdO, dO + q_base, m0, 64, SQ, tid, qss);
  float lse[2], dl[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + r * 8;
    lse[r] = row < SQ ? LSE[(long long)bh * SQ + row] * LOG2E : 0.f;
    dl[r] = row < SQ ? DELTA[(long long)bh * SQ + row] : 0.f;
  }
  float dq[D / 8][4];
  #pragma unroll
  for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
  const int n_end = causal ? min(SK, m0 + 64 + offset) : SK;
  for (int n0 = 0; n0 < n_end; n0 += BK_) {
    __syncthreads();
    load_rows(sK, K + kv_base, n0, BK_, SK, tid, kss);
    load_rows_t(sKt, K + kv_base, n0, BK_, SK, tid, kss);
    load_rows(sV, V + kv_base, n0, BK_, SK, tid, kss);
    __syncthreads();
    float s[BK_ / 8][4], dp[BK_ / 8][4];
    #pragma unroll
    for (int j = 0; j < BK_ / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      unsigned aq[4], ao[4];
      ts_load_a(aq, &sQ[(warp * 16) * LDD + kk], LDD, lane);
      ts_load_a(ao, &sdO[(warp * 16) * LDD + kk], LDD, lane);
      #pragma unroll
      for (int j = 0; j < BK_ / 8; ++j) {
        unsigned bk[2], bv[2];
        ts_load_b(bk, &sK[(j * 8) * LDD + kk], LDD, lane);
        ts_load_b(bv, &sV[(j * 8) * LDD + kk], LDD, lane);
        ts_mma(s[j], aq, bk);
        ts_mma(dp[j], ao, bv);
      }
    }
    #pragma unroll
    for (int j = 0; j < BK_ / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + (e >> 1) * 8, col = n0 + j * 8 + 2 * t + (e & 1);
        const bool ok = row < SQ && col < SK && (!causal || col <= row + offset);
        const float pv = ok ? exp2f(s[j][e] * scale_log2 - lse[e >> 1]) : 0.f;
        dp[j][e] = pv * (dp[j][e] - dl[e >> 1]);            // dS
      }
    #pragma unroll
    for (int kc = 0; kc < BK_ / 16; ++kc) {
      unsigned a[4];
      ts_c_to_a(a, dp[2 * kc], dp[2 * kc + 1]);
      #pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        unsigned bf[2];
        ts_load_b(bf, &sKt[(j * 8) * LDK + kc * 16], LDK, lane);
        ts_mma(dq[j], a, bf);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + r * 8;
    if (row >= SQ) continue;
    #pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<elem2_t*>(dQ + q_base + (long long)row * qss + j * 8 + 2 * t) =
          ts_pack(dq[j][2 * r] * scale, dq[j][2 * r + 1] * scale);
  }
}
"""


def render_flash(head_dim: int = 64, dtype: str = "f16") -> str:
    bm, bn = FLASH_TILES[head_dim]
    defs = (f"#define D {head_dim}\n#define BLOCK_M {bm}\n#define BLOCK_N {bn}\n"
            f"#define BWD_BLOCK {BWD_TILES[head_dim]}\n#define TS_BF16 {int(dtype == 'bf16')}\n")
    return defs + MMA_HEADER + FLASH_SOURCE


def flash_smem_bytes(head_dim: int, kernel: str) -> int:
    """Dynamic shared memory of the backward kernels (the forward's is static)."""
    d, bq = head_dim, BWD_TILES[head_dim]
    ldd = d + 8
    if kernel == "ts_flash_bwd_dkdv":
        return 2 * (2 * 64 * ldd + 2 * bq * ldd + 2 * d * (bq + 8)) + 8 * bq
    if kernel == "ts_flash_bwd_dq":
        return 2 * (2 * 64 * ldd + 2 * bq * ldd + d * (bq + 8))
    return 0


register_source(KernelSource(
    "flash_attention", render_flash,
    ("ts_flash_fwd", "ts_flash_bwd_delta", "ts_flash_bwd_dkdv", "ts_flash_bwd_dq"),
    configs=[dict(head_dim=d, dtype=dt) for d in (64, 128) for dt in ("f16", "bf16")],
    smem_dynamic=lambda head_dim=64, dtype="f16", kernel="ts_flash_bwd_dkdv": flash_smem_bytes(head_dim, kernel)))


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
    fn = get_function("flash_attention", "ts_flash_fwd", dict(head_dim=d, dtype=kind), render_flash)
    with launch_stream(stream):
        qh, kh = _operand(cupy, elem, q), _operand(cupy, elem, k)
        vh = _same_layout(cupy, kh, v)
        direct = out is not None and out.dtype == elem and out.strides == qh.strides and is_aligned(out, 16)
        o = out if direct else _laid_like(cupy, qh, elem)          # O in q's layout: (B, S, H, D) stays so
        lse = cupy.empty((b, h, sq), np.float32)
        strides = tuple(np.int64(x) for x in _strides(qh) + _strides(kh))
        for bs in _batch_slices(b, h):
            grid = ((sq + FLASH_TILES[d][0] - 1) // FLASH_TILES[d][0], (bs.stop - bs.start) * h)
            fn(grid, (128,), (qh[bs], kh[bs], vh[bs], o[bs], lse[bs], np.int32(h), np.int32(hkv), np.int32(sq),
                              np.int32(sk), np.float32(scale * math.log2(math.e)), np.int32(bool(causal))) + strides)
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
        delta_fn(((rows + 3) // 4,), (128,), (oh, doh, delta, np.int64(rows), np.int32(h), np.int32(sq)) + qs)
        for bs in _batch_slices(b, h):     # h >= hkv: slices that fit the dq grid fit dkdv's too
            nb = bs.stop - bs.start
            dkdv_fn(((sk + 63) // 64, nb * hkv), (128,),
                    (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dk[bs], dv[bs]) + args + qs + ks,
                    shared_mem=smem_kv)
            dq_fn(((sq + 63) // 64, nb * h), (128,),
                  (qh[bs], kh[bs], vh[bs], doh[bs], lse32[bs], delta[bs], dq[bs]) + args + qs + ks, shared_mem=smem_q)
        return tuple(t.astype(q.dtype, copy=False) for t in (dq, dk, dv))


# the kernel table's entries try the vendor providers first (kernels.providers: cuDNN), then these
_forward = dispatching("flash_attention", flash_attention_cuda)
_forward.contiguous_inputs = contiguous_inputs
register_kernel("flash_attention", "cuda", _forward)
register_kernel("flash_attention_backward", "cuda",
                dispatching("flash_attention_backward", flash_attention_backward_cuda))
