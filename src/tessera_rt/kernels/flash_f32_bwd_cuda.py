"""f32 flash attention backward's CUDA source: the dK/dV and dQ kernels on TF32 tensor cores
(``flash_f32_cuda`` renders it after its fragment helpers; see that module for the 3xTF32
products and the fragment layouts).

The structure of the f16/bf16 backward (``flash_bwd_cuda``): both kernels recompute P from the
forward's natural-log ``lse`` and write every gradient from one block, so the results are
deterministic without atomics; queries past the end of the sequence are zero rows whose lse
and delta are zero; they and the keys past the end are masked on the tiles that cross an edge
or the causal diagonal only.  Here every tile is f32 in padded shared memory, and the
fragments of K, V (dK/dV) and Q, dO (dQ) are read from it per tile: f32 fragments held for the
whole kernel would take the registers the accumulators need.
"""
from __future__ import annotations

__all__ = ["FLASH32_BWD_SOURCE"]

FLASH32_BWD_SOURCE = r"""
// x = A1 B1^T and y = A2 B2^T for a warp's 16 rows (from `row`) of the padded tiles A1, A2
// against the NT n8 tiles of rows of B1, B2, over the head dim: both kernels' two products.
template <int NT>
__device__ __forceinline__ void scores2(float (*x)[4], float (*y)[4], const float* a1, const float* b1,
                                        const float* a2, const float* b2, int row, int lane) {
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) x[j][e] = y[j][e] = 0.f;
  #pragma unroll 1
  for (int kk = 0; kk < D / 8; ++kk) {
    const tf32_frag<4> f1 = ldsm_a(a1, row, kk * 8, lane), f2 = ldsm_a(a2, row, kk * 8, lane);
    #pragma unroll
    for (int j = 0; j < NT; j += 2) {
      const tf32_frag<4> g1 = ldsm_b2(b1, j * 8, kk * 8, lane), g2 = ldsm_b2(b2, j * 8, kk * 8, lane);
      mma_add(x[j], f1, g1.hi, g1.lo);
      mma_add(x[j + 1], f1, g1.hi + 2, g1.lo + 2);
      mma_add(y[j], f2, g2.hi, g2.lo);
      mma_add(y[j + 1], f2, g2.hi + 2, g2.lo + 2);
    }
  }
}

// ---------------------------------------------------------------------------------- dK, dV
// A block: KV_BN = 16 KV_WARPS keys of one kv head (16 per warp), K and V in shared memory.
// For every query head of the group and every tile of KV_BQ queries from the first one a key
// of the block can see: S^T = K Q^T, P^T = exp2(S^T scale log2e - lse log2e), dP^T = V dO^T,
// dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q; dK is scaled once at the end.
#define KV_THREADS (KV_WARPS * 32)
#define KV_BN (KV_WARPS * 16)
extern "C" __global__ void __launch_bounds__(KV_THREADS, 1)
ts_flash_bwd_dkdv(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
                  const float* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                  float* __restrict__ dK, float* __restrict__ dV, int H, int HKV, int SQ, int SK,
                  float scale, int causal, long long qsb, long long qsh, long long qss, long long ksb,
                  long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  float* sK = reinterpret_cast<float*>(ts_smem);       // KV_BN x LD
  float* sV = sK + KV_BN * LD;                          // KV_BN x LD
  float* sQ = sV + KV_BN * LD;                          // [2][KV_BQ x LD]
  float* sdO = sQ + 2 * KV_BQ * LD;                     // [2][KV_BQ x LD]
  float* sL = sdO + 2 * KV_BQ * LD;                     // [2][KV_BQ]: lse, then delta
  float* sDl = sL + 2 * KV_BQ;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bhk = blockIdx.y, b = bhk / HKV, hk = bhk % HKV, groups = H / HKV;
  const int n0 = blockIdx.x * KV_BN, krow0 = n0 + warp * 16, offset = SK - SQ;
  const float scale_log2 = scale * LOG2E;
  const long long kv_base = b * ksb + hk * ksh;
  // the first query tile a key of this block sees (key j sees queries i >= j - offset)
  const int m_start = causal ? max(0, ((n0 - offset) / KV_BQ) * KV_BQ) : 0;
  const int ntq = m_start < SQ ? (SQ - m_start + KV_BQ - 1) / KV_BQ : 0, tiles = groups * ntq;
  auto load_q = [&](int stage, int it) {                // query tile `it`: head hk*groups + it/ntq
    const int qh = hk * groups + it / ntq, m0 = m_start + (it % ntq) * KV_BQ;
    const long long q_base = b * qsb + qh * qsh, row = ((long long)b * H + qh) * SQ + m0;
    load_rows<KV_BQ, KV_THREADS>(sQ + stage * KV_BQ * LD, Q + q_base, m0, SQ, qss, tid);
    load_rows<KV_BQ, KV_THREADS>(sdO + stage * KV_BQ * LD, dO + q_base, m0, SQ, qss, tid);
    for (int i = tid; i < 2 * KV_BQ; i += KV_THREADS) {
      const int q = i % KV_BQ;
      const bool in = m0 + q < SQ;
      const float* src = (i < KV_BQ ? LSE : DELTA) + (in ? row + q : 0);
      ts_cp_async<4>((i < KV_BQ ? sL : sDl) + stage * KV_BQ + q, src, in ? 4 : 0);
    }
  };
  load_rows<KV_BN, KV_THREADS>(sK, K + kv_base, n0, SK, kss, tid);
  load_rows<KV_BN, KV_THREADS>(sV, V + kv_base, n0, SK, kss, tid);
  ts_cp_async_commit();                                 // group 1: K, V
  if (tiles > 0) load_q(0, 0);
  ts_cp_async_commit();                                 // group 2: query tile 0
  float dk[D / 8][4], dv[D / 8][4];
  #pragma unroll
  for (int j = 0; j < D / 8; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  for (int it = 0; it < tiles; ++it) {
    const int st = it & 1, m0 = m_start + (it % ntq) * KV_BQ;
    if (it + 1 < tiles) load_q(st ^ 1, it + 1);         // the stage read in tile it-1: free since its last barrier
    ts_cp_async_commit();
    ts_cp_async_wait<1>();                              // tile it (group it + 2) retired ...
    __syncthreads();                                    // ... for every thread
    const float* qs = sQ + st * KV_BQ * LD;
    const float* dos = sdO + st * KV_BQ * LD;
    float p[KV_BQ / 8][4], dp[KV_BQ / 8][4];
    scores2<KV_BQ / 8>(p, dp, sK, qs, sV, dos, warp * 16, lane);      // S^T = K Q^T, dP^T = V dO^T
    const float* ls = sL + st * KV_BQ;
    const float* ds = sDl + st * KV_BQ;
    const bool edge = m0 + KV_BQ > SQ || n0 + KV_BN > SK || (causal && n0 + KV_BN - 1 > m0 + offset);
    flash_bwd_ds_t<KV_BQ / 8>(p, dp, ls, ds, krow0, m0, edge, SQ, SK, causal, offset, scale_log2, g, t);
    // dV += P^T dO, dK += dS^T Q: the tile's products summed from zero, then added
    tf32_frag<4> ap[KV_BQ / 8], ads[KV_BQ / 8];
    #pragma unroll
    for (int kc = 0; kc < KV_BQ / 8; ++kc) {
      ap[kc] = c_to_a(p[kc]);
      ads[kc] = c_to_a(dp[kc]);
    }
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float tv[4] = {}, tk[4] = {};
      #pragma unroll
      for (int kc = 0; kc < KV_BQ / 8; ++kc) {
        mma(tv, ap[kc], lds_bt(dos, kc * 8, j * 8, lane));
        mma(tk, ads[kc], lds_bt(qs, kc * 8, j * 8, lane));
      }
      add4(dv[j], tv);
      add4(dk[j], tk);
    }
    __syncthreads();                                    // every warp is done with stage st
  }
  ts_cp_async_wait<0>();                                // with no query tile, K and V are still in flight
  const float scales[2] = {scale, scale}, ones[2] = {1.f, 1.f};
  flash_store_rows<D / 8>(dK + kv_base, kss, krow0, SK, dk, scales, g, t);
  flash_store_rows<D / 8>(dV + kv_base, kss, krow0, SK, dv, ones, g, t);
}

// ---------------------------------------------------------------------------------- dQ
// A block: DQ_BM = 16 DQ_WARPS queries of one head, Q and dO in shared memory; K/V tiles of
// DQ_BN keys stream through two stages: S = Q K^T, P = exp2(S scale log2e - lse log2e),
// dP = dO V^T, dS = P (dP - delta), dQ += dS K; dQ scaled at the end.
#define DQ_THREADS (DQ_WARPS * 32)
#define DQ_BM (DQ_WARPS * 16)
extern "C" __global__ void __launch_bounds__(DQ_THREADS, 1)
ts_flash_bwd_dq(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
                const float* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                float* __restrict__ dQ, int H, int HKV, int SQ, int SK, float scale, int causal,
                long long qsb, long long qsh, long long qss, long long ksb, long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  float* sQ = reinterpret_cast<float*>(ts_smem);       // DQ_BM x LD
  float* sdO = sQ + DQ_BM * LD;                         // DQ_BM x LD
  float* sK = sdO + DQ_BM * LD;                         // [2][DQ_BN x LD]
  float* sV = sK + 2 * DQ_BN * LD;                      // [2][DQ_BN x LD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const int mblk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = mblk * DQ_BM, row0 = m0 + warp * 16, offset = SK - SQ;
  const float scale_log2 = scale * LOG2E;
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  const int n_end = causal ? min(SK, m0 + DQ_BM + offset) : SK;
  const int ntiles = n_end > 0 ? (n_end + DQ_BN - 1) / DQ_BN : 0;
  auto load_kv = [&](int stage, int n0) {
    load_rows<DQ_BN, DQ_THREADS>(sK + stage * DQ_BN * LD, K + kv_base, n0, SK, kss, tid);
    load_rows<DQ_BN, DQ_THREADS>(sV + stage * DQ_BN * LD, V + kv_base, n0, SK, kss, tid);
  };
  load_rows<DQ_BM, DQ_THREADS>(sQ, Q + q_base, m0, SQ, qss, tid);
  load_rows<DQ_BM, DQ_THREADS>(sdO, dO + q_base, m0, SQ, qss, tid);
  ts_cp_async_commit();                                 // group 1: Q, dO
  if (ntiles > 0) load_kv(0, 0);
  ts_cp_async_commit();                                 // group 2: K/V tile 0
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
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * DQ_BN, st = it & 1;
    if (it + 1 < ntiles) load_kv(st ^ 1, n0 + DQ_BN);
    ts_cp_async_commit();
    ts_cp_async_wait<1>();
    __syncthreads();
    const float* ks = sK + st * DQ_BN * LD;
    const float* vs = sV + st * DQ_BN * LD;
    float s[DQ_BN / 8][4], dp[DQ_BN / 8][4];
    scores2<DQ_BN / 8>(s, dp, sQ, ks, sdO, vs, warp * 16, lane);      // S = Q K^T, dP = dO V^T
    const bool edge = m0 + DQ_BM > SQ || n0 + DQ_BN > SK || (causal && n0 + DQ_BN - 1 > m0 + offset);
    flash_bwd_ds<DQ_BN / 8>(s, dp, lse, dl, row0, n0, edge, SQ, SK, causal, offset, scale_log2, g, t);
    // dQ += dS K: the tile's products summed from zero, then added
    tf32_frag<4> a[DQ_BN / 8];
    #pragma unroll
    for (int kc = 0; kc < DQ_BN / 8; ++kc) a[kc] = c_to_a(dp[kc]);
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float tq[4] = {};
      #pragma unroll
      for (int kc = 0; kc < DQ_BN / 8; ++kc) mma(tq, a[kc], lds_bt(ks, kc * 8, j * 8, lane));
      add4(dq[j], tq);
    }
    __syncthreads();
  }
  ts_cp_async_wait<0>();                                // with no K/V tile, Q and dO are still in flight
  const float scales[2] = {scale, scale};
  flash_store_rows<D / 8>(dQ + q_base, qss, row0, SQ, dq, scales, g, t);
}
"""
