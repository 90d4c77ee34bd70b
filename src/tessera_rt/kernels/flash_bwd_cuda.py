"""Flash attention backward's CUDA source: the dK/dV and dQ kernels (``flash_cuda`` renders it
after the forward's helpers; see that module's doc for the structure).

Both recompute P from the forward's natural-log ``lse`` (FlashAttention-2) and write every
gradient from one block, so the results are deterministic without atomics.  Queries past the
end of the sequence are zero rows whose lse and delta are zero; they and the keys past the end
are masked on the tiles that cross an edge or the causal diagonal only.
"""
from __future__ import annotations

__all__ = ["FLASH_BWD_SOURCE"]

FLASH_BWD_SOURCE = r"""
// ---------------------------------------------------------------------------------- dK, dV
// A block: KV_BN = 16 KV_WARPS keys of one kv head (16 per warp).  For every query head of the
// group and every tile of KV_BQ queries from the first one a key of the block can see:
// S^T = K Q^T, P^T = exp2(S^T scale log2e - lse log2e), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
// dV += P^T dO, dK += dS^T Q; dK is scaled once at the end.
#define KV_THREADS (KV_WARPS * 32)
#define KV_BN (KV_WARPS * 16)
extern "C" __global__ void __launch_bounds__(KV_THREADS)
ts_flash_bwd_dkdv(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                  const elem_t* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                  elem_t* __restrict__ dK, elem_t* __restrict__ dV, int H, int HKV, int SQ, int SK,
                  float scale, int causal, long long qsb, long long qsh, long long qss, long long ksb,
                  long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  elem_t* sK = reinterpret_cast<elem_t*>(ts_smem);     // KV_BN x D
  elem_t* sV = sK + KV_BN * D;                          // KV_BN x D
  elem_t* sQ = sV + KV_BN * D;                          // [2][KV_BQ x D]
  elem_t* sdO = sQ + 2 * KV_BQ * D;                     // [2][KV_BQ x D]
  float* sL = reinterpret_cast<float*>(sdO + 2 * KV_BQ * D);   // [2][KV_BQ]: lse, then delta
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
    load_rows<KV_BQ, KV_THREADS>(sQ + stage * KV_BQ * D, Q + q_base, m0, SQ, qss, tid);
    load_rows<KV_BQ, KV_THREADS>(sdO + stage * KV_BQ * D, dO + q_base, m0, SQ, qss, tid);
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
#if KV_REGS
  ts_cp_async_wait<1>();
  __syncthreads();
  unsigned kf[D / 16][4], vf[D / 16][4];                // this warp's K and V rows as A fragments
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    ts_ldsm_x4(kf[kk], sK + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
    ts_ldsm_x4(vf[kk], sV + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
  }
#endif
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
    const elem_t* qs = sQ + st * KV_BQ * D;
    const elem_t* dos = sdO + st * KV_BQ * D;
    float p[KV_BQ / 8][4], dp[KV_BQ / 8][4];
    #pragma unroll
    for (int j = 0; j < KV_BQ / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) p[j][e] = dp[j][e] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#if KV_REGS
      const unsigned* ak = kf[kk];
      const unsigned* av = vf[kk];
#else
      unsigned ak[4], av[4];
      ts_ldsm_x4(ak, sK + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
      ts_ldsm_x4(av, sV + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
#endif
      #pragma unroll
      for (int j = 0; j < KV_BQ / 8; j += 2) {
        unsigned bq[4], bo[4];
        ts_ldsm_x4(bq, qs + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));
        ts_ldsm_x4(bo, dos + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));
        ts_mma(p[j], ak, bq);
        ts_mma(p[j + 1], ak, bq + 2);
        ts_mma(dp[j], av, bo);
        ts_mma(dp[j + 1], av, bo + 2);
      }
    }
    const float* ls = sL + st * KV_BQ;
    const float* ds = sDl + st * KV_BQ;
    const bool edge = m0 + KV_BQ > SQ || n0 + KV_BN > SK || (causal && n0 + KV_BN - 1 > m0 + offset);
    flash_bwd_ds_t<KV_BQ / 8>(p, dp, ls, ds, krow0, m0, edge, SQ, SK, causal, offset, scale_log2, g, t);
    #pragma unroll
    for (int kc = 0; kc < KV_BQ / 16; ++kc) {
      unsigned ap[4], ads[4];
      ts_c_to_a(ap, p[2 * kc], p[2 * kc + 1]);
      ts_c_to_a(ads, dp[2 * kc], dp[2 * kc + 1]);
      mma_rows_t<D / 8>(dv, ap, dos, kc * 16, lane);
      mma_rows_t<D / 8>(dk, ads, qs, kc * 16, lane);
    }
    __syncthreads();                                    // every warp is done with stage st
  }
  ts_cp_async_wait<0>();                                // with no query tile, K and V are still in flight
  const float scales[2] = {scale, scale}, ones[2] = {1.f, 1.f};
  flash_store_rows<D / 8>(dK + kv_base, kss, krow0, SK, dk, scales, g, t);
  flash_store_rows<D / 8>(dV + kv_base, kss, krow0, SK, dv, ones, g, t);
}

// ---------------------------------------------------------------------------------- dQ
// A block: DQ_BM = 16 DQ_WARPS queries of one head; Q and dO fragments stay in registers, K/V
// tiles of DQ_BN keys stream through two stages: S = Q K^T, P = exp2(S scale log2e - lse log2e),
// dP = dO V^T, dS = P (dP - delta), dQ += dS K (K by ldmatrix.trans); dQ scaled at the end.
#define DQ_THREADS (DQ_WARPS * 32)
#define DQ_BM (DQ_WARPS * 16)
extern "C" __global__ void __launch_bounds__(DQ_THREADS)
ts_flash_bwd_dq(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                const elem_t* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ DELTA,
                elem_t* __restrict__ dQ, int H, int HKV, int SQ, int SK, float scale, int causal,
                long long qsb, long long qsh, long long qss, long long ksb, long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  elem_t* sQ = reinterpret_cast<elem_t*>(ts_smem);     // DQ_BM x D
  elem_t* sdO = sQ + DQ_BM * D;                         // DQ_BM x D
  elem_t* sK = sdO + DQ_BM * D;                         // [2][DQ_BN x D]
  elem_t* sV = sK + 2 * DQ_BN * D;                      // [2][DQ_BN x D]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const int mblk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = mblk * DQ_BM, row0 = m0 + warp * 16, offset = SK - SQ;
  const float scale_log2 = scale * LOG2E;
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  const int n_end = causal ? min(SK, m0 + DQ_BM + offset) : SK;
  const int ntiles = n_end > 0 ? (n_end + DQ_BN - 1) / DQ_BN : 0;
  auto load_kv = [&](int stage, int n0) {
    load_rows<DQ_BN, DQ_THREADS>(sK + stage * DQ_BN * D, K + kv_base, n0, SK, kss, tid);
    load_rows<DQ_BN, DQ_THREADS>(sV + stage * DQ_BN * D, V + kv_base, n0, SK, kss, tid);
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
  ts_cp_async_wait<1>();
  __syncthreads();
  unsigned qf[D / 16][4], of[D / 16][4];
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    ts_ldsm_x4(qf[kk], sQ + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
    ts_ldsm_x4(of[kk], sdO + ts_swz<DCH>(warp * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));
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
    const elem_t* ks = sK + st * DQ_BN * D;
    const elem_t* vs = sV + st * DQ_BN * D;
    float s[DQ_BN / 8][4], dp[DQ_BN / 8][4];
    #pragma unroll
    for (int j = 0; j < DQ_BN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      #pragma unroll
      for (int j = 0; j < DQ_BN / 8; j += 2) {
        unsigned bk[4], bv[4];
        ts_ldsm_x4(bk, ks + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));
        ts_ldsm_x4(bv, vs + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));
        ts_mma(s[j], qf[kk], bk);
        ts_mma(s[j + 1], qf[kk], bk + 2);
        ts_mma(dp[j], of[kk], bv);
        ts_mma(dp[j + 1], of[kk], bv + 2);
      }
    const bool edge = m0 + DQ_BM > SQ || n0 + DQ_BN > SK || (causal && n0 + DQ_BN - 1 > m0 + offset);
    flash_bwd_ds<DQ_BN / 8>(s, dp, lse, dl, row0, n0, edge, SQ, SK, causal, offset, scale_log2, g, t);
    #pragma unroll
    for (int kc = 0; kc < DQ_BN / 16; ++kc) {
      unsigned a[4];
      ts_c_to_a(a, dp[2 * kc], dp[2 * kc + 1]);
      mma_rows_t<D / 8>(dq, a, ks, kc * 16, lane);
    }
    __syncthreads();
  }
  const float scales[2] = {scale, scale};
  flash_store_rows<D / 8>(dQ + q_base, qss, row0, SQ, dq, scales, g, t);
}
"""
