"""Flash attention's CUDA source (FlashAttention-2's structure on sm_80 instructions).

Every tile moves global -> shared by ``cp.async`` into XOR-swizzled shared memory
(``SMEM_TILE``) and shared -> registers by ``ldmatrix``; the MMAs are m16n8k16 with f32
accumulators; P and dS never leave registers (an f32 C fragment becomes the A fragment of the
next MMA).  Per (batch, head) the kernels read q-family tensors with strides (qsb, qsh, qss) and
k-family ones with (ksb, ksh, kss), in elements, head dim contiguous: a (B, S, H*D) projection's
heads are read in place; O and dQ are written in q's layout, dK and dV in k's.

* Forward (``ts_flash_fwd``): a block owns FWD_BM query rows of one (batch, head), FWD_MT m16
  tiles per warp; Q's fragments stay in registers for the whole kernel.  K/V tiles of FWD_BN
  keys stream through two shared-memory stages: tile j+1's cp.async is in flight while the
  warps compute S = Q K^T (K by ldmatrix), the online softmax (log2 domain, f32) and O += P V
  (V by ldmatrix.trans: no transposed copy).  Causal blocks past the diagonal are skipped,
  masks are applied only on the tiles that cross the diagonal or the sequence end, and causal
  query blocks run longest-first.  Writes O and the natural-log ``lse``.
* Backward, deterministic, no atomics, after a ``delta = rowsum(dO * O)`` pre-pass:
  ``ts_flash_bwd_dkdv`` -- a block per KV_BN keys of one kv head, K and V resident in shared
  memory, (Q, dO, lse, delta) tiles of KV_BQ queries streamed through two stages over every
  query head of the group (grouped-query gradients summed in a fixed order): S^T = K Q^T and
  dP^T = V dO^T (Q, dO by ldmatrix), dV += P^T dO and dK += dS^T Q (dO, Q by ldmatrix.trans);
  ``ts_flash_bwd_dq`` -- a block per DQ_BM queries with Q and dO fragments in registers, K/V
  tiles streamed: dQ += dS K (K by ldmatrix.trans).
"""
from __future__ import annotations

from .compile import KernelSource, register_source
from .cuda_common import MMA_HEADER, SMEM_TILE
from .flash_bwd_cuda import FLASH_BWD_SOURCE

__all__ = ["FLASH_CONFIGS", "FLASH_TILES", "FLASH_COMMON", "FLASH_DELTA", "render_flash", "flash_smem_bytes",
           "flash_threads", "flash_rows"]

# Per head dim: forward (warps, m16 tiles per warp, keys per tile), dK/dV (warps -> 16 keys
# each, queries per tile, K/V fragments kept in registers), dQ (warps -> 16 queries each, keys
# per tile).  Chosen for registers (ptxas, no spills at <= 255) and shared-memory traffic.
FLASH_CONFIGS = {
    64: dict(fwd=(4, 2, 64), dkdv=(8, 64, 1), dq=(4, 64)),
    128: dict(fwd=(8, 1, 64), dkdv=(8, 32, 0), dq=(4, 32)),
}
# head dim -> the forward's (query rows, keys) per block
FLASH_TILES = {d: (c["fwd"][0] * 16 * c["fwd"][1], c["fwd"][2]) for d, c in FLASH_CONFIGS.items()}
DELTA_WARPS = 4

# What the f16/bf16 kernels and the f32 ones (flash_f32_cuda) share, on f32 C fragments of a
# warp's 16 rows: the constants, the forward's online softmax, the backward's P and dS, and
# the stores of the results.
FLASH_COMMON = r"""
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// Masks only where the tile crosses the sequence's end or the causal diagonal (row0: the tile's
// first query row; m0: the block's), scales to the log2 domain, takes the new row maxima,
// P = exp2(s - m) in place, l = l alpha + rowsum(P), acc *= alpha.
template <int NT, int NO>
__device__ __forceinline__ void flash_online_softmax(float (*s)[4], float* m_i, float* l_i, float (*acc)[4], int row0,
                                                     int n0, int m0, int SK, int causal, int offset, float scale_log2,
                                                     int g, int t) {
  const bool edge = n0 + NT * 8 > SK || (causal && n0 + NT * 8 - 1 > m0 + offset);
  float mx[2] = {m_i[0], m_i[1]};
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + (e >> 1) * 8, col = n0 + j * 8 + 2 * t + (e & 1);
      const bool ok = !edge || (col < SK && (!causal || col <= row + offset));
      s[j][e] = ok ? s[j][e] * scale_log2 : -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    }
  float alpha[2], ms[2], rs[2] = {0.f, 0.f};
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = ts_quad_max(mx[r]);
    ms[r] = mx[r] == -INFINITY ? 0.f : mx[r];           // a row with no key yet: keep exp2 finite
    alpha[r] = exp2f(m_i[r] - ms[r]);
    m_i[r] = mx[r];
  }
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] - ms[e >> 1]);
      rs[e >> 1] += s[j][e];
    }
  #pragma unroll
  for (int r = 0; r < 2; ++r) l_i[r] = l_i[r] * alpha[r] + ts_quad_sum(rs[r]);
  #pragma unroll
  for (int j = 0; j < NO; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= alpha[e >> 1];
}

// dK/dV: P^T = exp2(S^T scale log2e - lse log2e) over S^T (rows: keys from krow0; columns:
// queries from m0, their lse and delta in ls, ds), and dS^T = P^T (dP^T - delta) over dP^T.
template <int NT>
__device__ __forceinline__ void flash_bwd_ds_t(float (*p)[4], float (*dp)[4], const float* ls, const float* ds,
                                               int krow0, int m0, bool edge, int SQ, int SK, int causal, int offset,
                                               float scale_log2, int g, int t) {
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int krow = krow0 + g + (e >> 1) * 8, qc = j * 8 + 2 * t + (e & 1), qrow = m0 + qc;
      const bool ok = !edge || (qrow < SQ && krow < SK && (!causal || krow <= qrow + offset));
      p[j][e] = ok ? exp2f(p[j][e] * scale_log2 - ls[qc] * LOG2E) : 0.f;
      dp[j][e] = p[j][e] * (dp[j][e] - ds[qc]);
    }
}

// dQ: dS = P (dP - delta) over dP, P = exp2(S scale log2e - lse log2e) (rows: queries from
// row0, lse log2e and delta in lse, dl; columns: keys from n0).
template <int NT>
__device__ __forceinline__ void flash_bwd_ds(const float (*s)[4], float (*dp)[4], const float* lse, const float* dl,
                                             int row0, int n0, bool edge, int SQ, int SK, int causal, int offset,
                                             float scale_log2, int g, int t) {
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + (e >> 1) * 8, col = n0 + j * 8 + 2 * t + (e & 1);
      const bool ok = !edge || (row < SQ && col < SK && (!causal || col <= row + offset));
      const float pv = ok ? exp2f(s[j][e] * scale_log2 - lse[e >> 1]) : 0.f;
      dp[j][e] = pv * (dp[j][e] - dl[e >> 1]);
    }
}

__device__ __forceinline__ void ts_store2(elem_t* p, float a, float b) {
  *reinterpret_cast<elem2_t*>(p) = ts_pack(a, b);
}
__device__ __forceinline__ void ts_store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
// Rows row0 + g and row0 + g + 8 (those below `limit`) of NO n8 accumulator tiles, row r's
// times mul[r], to dst + row * ld: two columns per store.
template <int NO, class T>
__device__ __forceinline__ void flash_store_rows(T* dst, long long ld, int row0, int limit, const float (*acc)[4],
                                                 const float* mul, int g, int t) {
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + r * 8;
    if (row >= limit) continue;
    #pragma unroll
    for (int j = 0; j < NO; ++j)
      ts_store2(dst + row * ld + j * 8 + 2 * t, acc[j][2 * r] * mul[r], acc[j][2 * r + 1] * mul[r]);
  }
}

// The forward's results for a warp's m16 tile: O = acc / l (0 for a row with no visible key)
// and the natural-log lse = (m + log2 l) ln 2 (-inf for such a row).
template <int NO, class T>
__device__ __forceinline__ void flash_store_out(T* o, long long ld, float* lse, int row0, int limit, const float (*acc)[4],
                                                const float* m_i, const float* l_i, int g, int t) {
  const float inv[2] = {l_i[0] > 0.f ? 1.f / l_i[0] : 0.f, l_i[1] > 0.f ? 1.f / l_i[1] : 0.f};
  flash_store_rows<NO>(o, ld, row0, limit, acc, inv, g, t);
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + r * 8;
    if (t == 0 && row < limit) lse[row] = l_i[r] > 0.f ? (m_i[r] + log2f(l_i[r])) * LN2 : -INFINITY;
  }
}
"""

# The backward's pre-pass, shared likewise (DELTA_T: the element type, ts_float its widening).
FLASH_DELTA = r"""
// delta[row] = sum_d dO[row, d] * O[row, d] (rows: (batch, head, position) in order); one warp per row.
extern "C" __global__ void ts_flash_bwd_delta(const DELTA_T* __restrict__ O, const DELTA_T* __restrict__ dO,
                                              float* __restrict__ delta, long long rows, int H, int SQ,
                                              long long qsb, long long qsh, long long qss) {
  const long long row = (long long)blockIdx.x * DELTA_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long bh = row / SQ, at = (bh / H) * qsb + (bh % H) * qsh + (row % SQ) * qss;
  float sum = 0.f;
  for (int d = lane; d < D; d += 32) sum += ts_float(O[at + d]) * ts_float(dO[at + d]);
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane == 0) delta[row] = sum;
}
"""

FLASH_SOURCE = r"""
#define DCH (D / 8)                 // 16-byte chunks per row of a [rows][D] tile

// ldmatrix.x4 row addresses per lane.  "A" (row l % 16, column half l / 16): the A fragment of a
// row-major 16x16 tile; with .trans, the B fragments of two n8 tiles of a row-major [k][n] tile.
// "B" (row (l & 7) + 8 (l / 16), column half (l / 8) & 1): the B fragments of two n8 tiles of a
// row-major [n][k] tile (S = Q K^T reads K so).
__device__ __forceinline__ int ts_arow(int lane) { return lane & 15; }
__device__ __forceinline__ int ts_acol(int lane) { return (lane >> 4) << 3; }
__device__ __forceinline__ int ts_brow(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ts_bcol(int lane) { return ((lane >> 3) & 1) << 3; }

// rows [r0, r0 + ROWS) of a [*, D] matrix (row stride ld) into a swizzled ROWS x D tile; zero rows past `limit`
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(elem_t* s, const elem_t* g, int r0, int limit, long long ld, int tid) {
  ts_load_tile<ROWS, D, 8, THREADS>(s, g, ld, r0, 0, limit, D, tid);
}

// acc[.][2j], acc[.][2j+1] += a (16 x 16, A fragments) times the [k = 16 rows][n = D] tile at
// row k0 of `s` (row-major [k][n]: ldmatrix.trans), for every n pair j.
template <int NT>
__device__ __forceinline__ void mma_rows_t(float (*acc)[4], const unsigned* a, const elem_t* s, int k0, int lane) {
  #pragma unroll
  for (int j = 0; j < NT; j += 2) {
    unsigned bf[4];
    ts_ldsm_x4_t(bf, s + ts_swz<DCH>(k0 + ts_arow(lane), j * 8 + ts_acol(lane)));
    ts_mma(acc[j], a, bf);
    ts_mma(acc[j + 1], a, bf + 2);
  }
}

// ---------------------------------------------------------------------------------- forward
#define FWD_THREADS (FWD_WARPS * 32)
#define FWD_BM (FWD_WARPS * 16 * FWD_MT)
extern "C" __global__ void __launch_bounds__(FWD_THREADS)
ts_flash_fwd(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
             elem_t* __restrict__ O, float* __restrict__ LSE, int H, int HKV, int SQ, int SK,
             float scale_log2, int causal, long long qsb, long long qsh, long long qss, long long ksb,
             long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  elem_t* sQ = reinterpret_cast<elem_t*>(ts_smem);     // FWD_BM x D
  elem_t* sK = sQ + FWD_BM * D;                         // [2][FWD_BN x D]
  elem_t* sV = sK + 2 * FWD_BN * D;                     // [2][FWD_BN x D]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  const elem_t* k = K + kv_base;
  const elem_t* v = V + kv_base;
  // causal: the last query blocks see the most keys; start them first
  const int mblk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = mblk * FWD_BM, wrow = m0 + warp * 16 * FWD_MT, offset = SK - SQ;
  const int n_end = causal ? min(SK, m0 + FWD_BM + offset) : SK;
  const int ntiles = n_end > 0 ? (n_end + FWD_BN - 1) / FWD_BN : 0;
  auto load_kv = [&](int stage, int n0) {
    load_rows<FWD_BN, FWD_THREADS>(sK + stage * FWD_BN * D, k, n0, SK, kss, tid);
    load_rows<FWD_BN, FWD_THREADS>(sV + stage * FWD_BN * D, v, n0, SK, kss, tid);
  };
  load_rows<FWD_BM, FWD_THREADS>(sQ, Q + q_base, m0, SQ, qss, tid);
  ts_cp_async_commit();                                 // group 1: Q
  if (ntiles > 0) load_kv(0, 0);
  ts_cp_async_commit();                                 // group 2: K/V tile 0
  ts_cp_async_wait<1>();
  __syncthreads();
  unsigned qf[FWD_MT][D / 16][4];                       // Q's A fragments, for the whole kernel
  #pragma unroll
  for (int i = 0; i < FWD_MT; ++i)
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ts_ldsm_x4(qf[i][kk], sQ + ts_swz<DCH>(wrow - m0 + i * 16 + ts_arow(lane), kk * 16 + ts_acol(lane)));

  float acc[FWD_MT][D / 8][4], m_i[FWD_MT][2], l_i[FWD_MT][2];
  #pragma unroll
  for (int i = 0; i < FWD_MT; ++i) {
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    m_i[i][0] = m_i[i][1] = -INFINITY;
    l_i[i][0] = l_i[i][1] = 0.f;
  }
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * FWD_BN, st = it & 1;
    if (it + 1 < ntiles) load_kv(st ^ 1, n0 + FWD_BN);  // the stage read in tile it-1: free since its last barrier
    ts_cp_async_commit();
    ts_cp_async_wait<1>();                              // tile it (group it + 2) retired ...
    __syncthreads();                                    // ... for every thread
    const elem_t* ks = sK + st * FWD_BN * D;
    const elem_t* vs = sV + st * FWD_BN * D;
    float s[FWD_MT][FWD_BN / 8][4];
    #pragma unroll
    for (int i = 0; i < FWD_MT; ++i)
      #pragma unroll
      for (int j = 0; j < FWD_BN / 8; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      #pragma unroll
      for (int j = 0; j < FWD_BN / 8; j += 2) {
        unsigned bf[4];
        ts_ldsm_x4(bf, ks + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));
        #pragma unroll
        for (int i = 0; i < FWD_MT; ++i) {
          ts_mma(s[i][j], qf[i][kk], bf);
          ts_mma(s[i][j + 1], qf[i][kk], bf + 2);
        }
      }
    #pragma unroll
    for (int i = 0; i < FWD_MT; ++i)
      flash_online_softmax<FWD_BN / 8, D / 8>(s[i], m_i[i], l_i[i], acc[i], wrow + i * 16, n0, m0, SK, causal, offset,
                                              scale_log2, g, t);
    #pragma unroll
    for (int kc = 0; kc < FWD_BN / 16; ++kc)
      #pragma unroll
      for (int i = 0; i < FWD_MT; ++i) {
        unsigned a[4];
        ts_c_to_a(a, s[i][2 * kc], s[i][2 * kc + 1]);
        mma_rows_t<D / 8>(acc[i], a, vs, kc * 16, lane);
      }
    __syncthreads();                                    // every warp is done with stage st
  }
  #pragma unroll
  for (int i = 0; i < FWD_MT; ++i)
    flash_store_out<D / 8>(O + q_base, qss, LSE + (long long)bh * SQ, wrow + i * 16, SQ, acc[i], m_i[i], l_i[i], g, t);
}
"""


def render_flash(head_dim: int = 64, dtype: str = "f16") -> str:
    c = FLASH_CONFIGS[head_dim]
    (fw, fmt, fbn), (kw, kbq, kregs), (qw, qbn) = c["fwd"], c["dkdv"], c["dq"]
    defs = (f"#define D {head_dim}\n#define TS_BF16 {int(dtype == 'bf16')}\n#define FWD_WARPS {fw}\n"
            f"#define FWD_MT {fmt}\n#define FWD_BN {fbn}\n#define KV_WARPS {kw}\n#define KV_BQ {kbq}\n"
            f"#define KV_REGS {kregs}\n#define DQ_WARPS {qw}\n#define DQ_BN {qbn}\n#define DELTA_WARPS {DELTA_WARPS}\n"
            "#define DELTA_T elem_t\n")
    return defs + MMA_HEADER + SMEM_TILE + FLASH_COMMON + FLASH_SOURCE + FLASH_DELTA + FLASH_BWD_SOURCE


def flash_threads(head_dim: int, kernel: str) -> int:
    """Threads per block of ``kernel``."""
    c = FLASH_CONFIGS[head_dim]
    return 32 * {"ts_flash_fwd": c["fwd"][0], "ts_flash_bwd_dkdv": c["dkdv"][0], "ts_flash_bwd_dq": c["dq"][0],
                 "ts_flash_bwd_delta": DELTA_WARPS}[kernel]


def flash_rows(head_dim: int, kernel: str) -> int:
    """Rows of its sequence (queries; keys for dK/dV) one block of ``kernel`` owns."""
    c = FLASH_CONFIGS[head_dim]
    return {"ts_flash_fwd": FLASH_TILES[head_dim][0], "ts_flash_bwd_dkdv": c["dkdv"][0] * 16,
            "ts_flash_bwd_dq": c["dq"][0] * 16, "ts_flash_bwd_delta": DELTA_WARPS}[kernel]


def flash_smem_bytes(head_dim: int, kernel: str, **_) -> int:
    """Dynamic shared memory of ``kernel`` (bytes)."""
    d, c = head_dim, FLASH_CONFIGS[head_dim]
    if kernel == "ts_flash_fwd":
        bm, bn = FLASH_TILES[d]
        return 2 * d * (bm + 4 * bn)                    # Q, and two stages of K and V
    if kernel == "ts_flash_bwd_dkdv":
        bn, bq = c["dkdv"][0] * 16, c["dkdv"][1]
        return 2 * d * (2 * bn + 4 * bq) + 2 * 2 * bq * 4   # K, V; two stages of Q, dO, lse, delta
    if kernel == "ts_flash_bwd_dq":
        bm, bn = c["dq"][0] * 16, c["dq"][1]
        return 2 * d * (2 * bm + 4 * bn)                # Q, dO; two stages of K and V
    return 0


register_source(KernelSource(
    "flash_attention", render_flash,
    ("ts_flash_fwd", "ts_flash_bwd_delta", "ts_flash_bwd_dkdv", "ts_flash_bwd_dq"),
    configs=[dict(head_dim=d, dtype=dt) for d in (64, 128) for dt in ("f16", "bf16")],
    smem_dynamic=lambda head_dim=64, dtype="f16", kernel="ts_flash_bwd_dkdv": flash_smem_bytes(head_dim, kernel)))
