"""CUDA C of the grouped GEMM kernels (launchers: ``grouped_gemm_cuda``).

Two kernels share one scheduling scheme, picked by ``WGRAD``:

* forward (``WGRAD 0``): ``C[r] = A[r] @ B[g]`` for the rows ``r`` of group ``g``.  The grid's
  y axis counts row tiles over all groups, ``ceil(R / BM) + G`` of them (an upper bound: each
  group wastes at most one partial tile), so the launch needs no counts on the host.  A block
  walks the device offsets to find its group and rows; blocks past the last tile return.
* weight gradient (``WGRAD 1``): ``C[g] = A[rows of g].T @ B[rows of g]``: grid z is the
  group, x/y tile ``C[g]``; the reduction runs over the group's rows.

Operands reach shared memory in one of two layouts.  The MMA wants A as ``sA[m][k]`` and B
as ``sB[n][k]`` (pairs along k: one 32-bit word per fragment register).  A row-major A and
a ``(N, K)`` B are copied as they are, 16 bytes a thread (``ts_direct``).  A ``(K, M)``
operand (the gradient's ``x.T``, or a ``(K, N)`` weight) is read 16 bytes from each of two
consecutive k rows and interleaved into pairs (``ts_pairs``), eight 32-bit stores.  Both are
fetched into registers one K tile ahead and stored into the other half of a double buffer
after the MMAs (no cp.async: the harness does not model it yet; see docs/kernels.md).

The tensor-core kernel computes f16/bf16 with f32 accumulators (``mma.sync m16n8k16`` from
``MMA_HEADER``); the SIMT kernel is the f32 path (FMA, 64x64 tiles, 4x4 outputs a thread).
``MODE``: 0 plain, 1 two products of A (``C = A@B``, ``C2 = A@B2``), 2 SwiGLU
(``silu(A@B) * (A@B2)``), 3 a sum of two products (``A@B + A2@B2``).
"""
from __future__ import annotations

from .cuda_common import MMA_HEADER

__all__ = ["GROUPED_COMMON", "GROUPED_MMA_SOURCE", "GROUPED_SIMT_SOURCE", "MMA_CONFIGS", "render_grouped_mma",
           "render_grouped_simt"]

# name -> (BM, BN, BK, WM, WN); warp tiles are multiples of 16x8, static shared memory <= 48 KiB
MMA_CONFIGS = {"m128": (128, 128, 32, 2, 4), "m64": (64, 128, 32, 2, 4),
               "dual128": (128, 64, 32, 4, 2), "dual64": (64, 64, 32, 2, 2)}

# the group scheduling both kernels share
GROUPED_COMMON = r"""
// Forward: the group and first row of row tile `t` (tiles counted group after group), or
// false past the last tile.  Every thread of the block walks the same offsets.
__device__ __forceinline__ bool ts_find_tile(const long long* __restrict__ off, int groups, long long t, int bm,
                                             int* g_out, long long* row0, long long* row_end) {
  long long before = 0;
  for (int g = 0; g < groups; ++g) {
    const long long lo = off[g], hi = off[g + 1];
    const long long tiles = hi > lo ? (hi - lo + bm - 1) / bm : 0;
    if (t < before + tiles) {
      *g_out = g;
      *row0 = lo + (t - before) * bm;
      *row_end = hi;
      return true;
    }
    before += tiles;
  }
  return false;
}

// The block's problem: group g, rows [m0, m_end) of C, the reduction range [k_lo, k_hi), the
// operands' leading dims and group g's B matrices; false for a forward block past the last tile.
template <class T> struct TsJob { int g; long long m0, m_end, k_lo, k_hi, a_ld, b_ld; const T* b; const T* b2; };
template <class T> __device__ __forceinline__ bool ts_job(TsJob<T>& j, const long long* __restrict__ off, int groups,
                                                          int M, int N, int K, int bm, long long tile0, const T* B,
                                                          const T* B2) {
#if WGRAD
  // C[g] (M x N) = A[rows of g]^T @ B[rows of g]: A is (rows, M), B (rows, N)
  j.g = blockIdx.z;
  j.m0 = (long long)blockIdx.y * bm;
  j.m_end = M;
  j.k_lo = off[j.g];
  j.k_hi = off[j.g + 1];
  j.a_ld = M;
  j.b_ld = N;
  j.b = B;
  j.b2 = B2 ? B2 : B;
#else
  if (!ts_find_tile(off, groups, tile0 + blockIdx.y, bm, &j.g, &j.m0, &j.m_end)) return false;
  j.k_lo = 0;
  j.k_hi = K;
  j.a_ld = K;
  j.b_ld = B_KN ? N : K;
  j.b = B + (long long)j.g * K * N;
  j.b2 = B2 ? B2 + (long long)j.g * K * N : j.b;
#endif
  return true;
}
"""

GROUPED_MMA_SOURCE = r"""
#define NT (WM * WN * 32)
// resident blocks per SM asked of the register allocator (sm_80's 8 warps need > 128 registers)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MINB (NT == 256 ? 1 : 3)
#else
#define MINB (NT == 256 ? 2 : 3)
#endif
#define LDS (BK + 8)                 // smem row: 16-byte aligned, fragment loads conflict-free
#define WTM (BM / WM)
#define WTN (BN / WN)
#define MT (WTM / 16)
#define NTL (WTN / 8)
#define NB ((MODE == 1 || MODE == 2) ? 2 : 1)
// 16-byte units of a tile: (row, 8 k's) when copied directly, (k pair, 8 rows) when interleaved
#define A_TOTAL (A_KM ? (BK / 2) * (BM / 8) : BM * (BK / 8))
#define B_TOTAL (B_KN ? (BK / 2) * (BN / 8) : BN * (BK / 8))
#define A_UNITS ((A_TOTAL + NT - 1) / NT)
#define B_UNITS ((B_TOTAL + NT - 1) / NT)

__device__ __forceinline__ uint4 ts_zero4() { uint4 v; v.x = v.y = v.z = v.w = 0u; return v; }

// Elements (row, col .. col+7) of a row-major matrix (leading dim ld), zeros outside
// rows < row_end, cols < col_end.  One 16-byte load when the run is whole and ALIGNED.
__device__ __forceinline__ uint4 ts_ld8(const elem_t* __restrict__ p, long long ld, long long row, int col,
                                        long long row_end, int col_end) {
  if (row >= row_end || col >= col_end) return ts_zero4();
  const elem_t* q = p + row * ld + col;
#if ALIGNED
  if (col + 8 <= col_end) return *reinterpret_cast<const uint4*>(q);
#endif
  const unsigned short* s = reinterpret_cast<const unsigned short*>(q);
  unsigned e[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = col + i < col_end ? (unsigned)s[i] : 0u;
  uint4 v;
  v.x = e[0] | (e[1] << 16); v.y = e[2] | (e[3] << 16); v.z = e[4] | (e[5] << 16); v.w = e[6] | (e[7] << 16);
  return v;
}

// An operand tile for smem layout [rows][LDS] with pairs along k.
//  direct: the source is [row][k] (row-major along k): unit u = (row, 8 k's).
//  pairs:  the source is [k][row]: unit u = (k pair, 8 rows): two 16-byte loads, interleaved.
struct TsSrc { const elem_t* p; long long ld; long long row0, row_end; long long k0, k_end; };

template <int ROWS, int UNITS> __device__ __forceinline__ void ts_fetch_direct(uint4* r, const TsSrc& s, int tid) {
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const int idx = tid + u * NT, row = idx / (BK / 8), kc = (idx % (BK / 8)) * 8;
    if (idx >= ROWS * (BK / 8)) break;
    // k is the column: bounds are relative to k0 so that col + 8 <= col_end keeps its meaning
    r[u] = ts_ld8(s.p + s.k0, s.ld, s.row0 + row, kc, s.row_end, (int)(s.k_end - s.k0 < BK ? s.k_end - s.k0 : BK));
  }
}
template <int ROWS, int UNITS> __device__ __forceinline__ void ts_stash_direct(elem_t* dst, const uint4* r, int tid) {
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const int idx = tid + u * NT, row = idx / (BK / 8), kc = (idx % (BK / 8)) * 8;
    if (idx >= ROWS * (BK / 8)) break;
    *reinterpret_cast<uint4*>(dst + row * LDS + kc) = r[u];
  }
}
template <int ROWS, int UNITS> __device__ __forceinline__ void ts_fetch_pairs(uint4* r, const TsSrc& s, int tid) {
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const int idx = tid + u * NT, kp = idx % (BK / 2), rc = (idx / (BK / 2)) * 8;
    if (idx >= (BK / 2) * (ROWS / 8)) break;
    const long long k = s.k0 + 2 * kp;
    const int cols = (int)(s.row_end - s.row0 < ROWS ? s.row_end - s.row0 : ROWS);
    r[2 * u] = ts_ld8(s.p + s.row0, s.ld, k, rc, s.k_end, cols);
    r[2 * u + 1] = ts_ld8(s.p + s.row0, s.ld, k + 1, rc, s.k_end, cols);
  }
}
template <int ROWS, int UNITS> __device__ __forceinline__ void ts_stash_pairs(elem_t* dst, const uint4* r, int tid) {
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const int idx = tid + u * NT, kp = idx % (BK / 2), rc = (idx / (BK / 2)) * 8;
    if (idx >= (BK / 2) * (ROWS / 8)) break;
    const unsigned lo[4] = {r[2 * u].x, r[2 * u].y, r[2 * u].z, r[2 * u].w};
    const unsigned hi[4] = {r[2 * u + 1].x, r[2 * u + 1].y, r[2 * u + 1].z, r[2 * u + 1].w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {     // rows rc+2i, rc+2i+1: (k, k+1) of each as one word
      *reinterpret_cast<unsigned*>(dst + (rc + 2 * i) * LDS + 2 * kp) = (lo[i] & 0xffffu) | (hi[i] << 16);
      *reinterpret_cast<unsigned*>(dst + (rc + 2 * i + 1) * LDS + 2 * kp) = (lo[i] >> 16) | (hi[i] & 0xffff0000u);
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT, MINB)
ts_grouped_mma(const elem_t* __restrict__ A, const elem_t* __restrict__ B, const elem_t* __restrict__ A2,
               const elem_t* __restrict__ B2, void* __restrict__ C, void* __restrict__ C2,
               const long long* __restrict__ off, int groups, int M, int N, int K,
               long long tile0) {
  __shared__ __align__(16) elem_t sA[2][BM * LDS];
  __shared__ __align__(16) elem_t sB[2][NB][BN * LDS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / WN) * WTM, wn0 = (warp % WN) * WTN;
  const int n0 = blockIdx.x * BN;
  TsJob<elem_t> job;
  if (!ts_job(job, off, groups, M, N, K, BM, tile0, B, B2)) return;
  const int g = job.g;
  const long long m0 = job.m0, m_end = job.m_end, k_lo = job.k_lo, k_hi = job.k_hi, a_ld = job.a_ld, b_ld = job.b_ld;
  const elem_t *Bg = job.b, *B2g = job.b2;

  float acc[NB][MT][NTL][4];
  #pragma unroll
  for (int b = 0; b < NB; ++b)
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NTL; ++j) acc[b][i][j][0] = acc[b][i][j][1] = acc[b][i][j][2] = acc[b][i][j][3] = 0.f;

  uint4 ra[A_UNITS * (A_KM ? 2 : 1)], rb[NB][B_UNITS * (B_KN ? 2 : 1)];
  const long long ktiles = (k_hi - k_lo + BK - 1) / BK;
  const long long total = MODE == 3 ? 2 * ktiles : ktiles;
  auto fetch = [&](long long kt) {
    const bool second = MODE == 3 && kt >= ktiles;
    const long long k0 = k_lo + (second ? kt - ktiles : kt) * BK;
    const elem_t* a = second ? A2 : A;
    const elem_t* bs[2] = {second ? B2g : Bg, B2g};
#if A_KM
    TsSrc sa = {a, a_ld, m0, m_end, k0, k_hi};
    ts_fetch_pairs<BM, A_UNITS>(ra, sa, tid);
#else
    TsSrc sa = {a, a_ld, m0, m_end, k0, k_hi};
    ts_fetch_direct<BM, A_UNITS>(ra, sa, tid);
#endif
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
      TsSrc sb = {bs[b], b_ld, n0, N, k0, k_hi};
#if B_KN
      ts_fetch_pairs<BN, B_UNITS>(rb[b], sb, tid);
#else
      ts_fetch_direct<BN, B_UNITS>(rb[b], sb, tid);
#endif
    }
  };
  auto stash = [&](int s) {
#if A_KM
    ts_stash_pairs<BM, A_UNITS>(sA[s], ra, tid);
#else
    ts_stash_direct<BM, A_UNITS>(sA[s], ra, tid);
#endif
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
#if B_KN
      ts_stash_pairs<BN, B_UNITS>(sB[s][b], rb[b], tid);
#else
      ts_stash_direct<BN, B_UNITS>(sB[s][b], rb[b], tid);
#endif
    }
  };

  if (total > 0) {
    fetch(0);
    stash(0);
  }
  __syncthreads();
  for (long long kt = 0; kt < total; ++kt) {
    const int s = (int)(kt & 1);
    if (kt + 1 < total) fetch(kt + 1);         // the next tile's loads in flight during the MMAs
    #pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MT][4];
      #pragma unroll
      for (int i = 0; i < MT; ++i) ts_load_a(af[i], &sA[s][(wm0 + i * 16) * LDS + kk], LDS, lane);
      #pragma unroll
      for (int b = 0; b < NB; ++b)
        #pragma unroll
        for (int j = 0; j < NTL; ++j) {
          unsigned bf[2];
          ts_load_b(bf, &sB[s][b][(wn0 + j * 8) * LDS + kk], LDS, lane);
          #pragma unroll
          for (int i = 0; i < MT; ++i) ts_mma(acc[b][i][j], af[i], bf);
        }
    }
    if (kt + 1 < total) stash(s ^ 1);
    __syncthreads();
  }

  const int gq = lane >> 2, tq = lane & 3;
#if WGRAD
  const long long c_base = (long long)g * M * N;
#else
  const long long c_base = 0;
#endif
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NTL; ++j)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long row = m0 + wm0 + i * 16 + gq + 8 * h;
        const int col = n0 + wn0 + j * 8 + 2 * tq;
        if (row >= m_end || col >= N) continue;
        float v[2], v2[2];
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[e] = acc[0][i][j][2 * h + e];
          v2[e] = acc[NB - 1][i][j][2 * h + e];
#if MODE == 2
          v[e] = v[e] / (1.f + __expf(-v[e])) * v2[e];
#endif
        }
        const long long o = c_base + row * N + col;
#if OUT_F32
        float* c = reinterpret_cast<float*>(C);
        c[o] = v[0];
        if (col + 1 < N) c[o + 1] = v[1];
#else
        elem_t* c = reinterpret_cast<elem_t*>(C);
        if (col + 1 < N && (N & 1) == 0) {
          *reinterpret_cast<elem2_t*>(c + o) = ts_pack(v[0], v[1]);
        } else {
          c[o] = ts_elem(v[0]);
          if (col + 1 < N) c[o + 1] = ts_elem(v[1]);
        }
#endif
#if MODE == 1
        elem_t* c2 = reinterpret_cast<elem_t*>(C2);
        if (col + 1 < N && (N & 1) == 0) {
          *reinterpret_cast<elem2_t*>(c2 + o) = ts_pack(v2[0], v2[1]);
        } else {
          c2[o] = ts_elem(v2[0]);
          if (col + 1 < N) c2[o + 1] = ts_elem(v2[1]);
        }
#endif
      }
}
"""

GROUPED_SIMT_SOURCE = r"""
#define BM 64
#define BN 64
#define BK 16
#define NT 256
#define NB ((MODE == 1 || MODE == 2) ? 2 : 1)

// element (m, k) of A and (k, n) of B in their stored layouts
#define A_AT(p, m, k) (A_KM ? (p)[(k) * a_ld + (m)] : (p)[(m) * a_ld + (k)])
#define B_AT(p, k, n) (B_KN ? (p)[(k) * b_ld + (n)] : (p)[(n) * b_ld + (k)])

extern "C" __global__ void __launch_bounds__(NT)
ts_grouped_simt(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ A2,
                const float* __restrict__ B2, float* __restrict__ C, float* __restrict__ C2,
                const long long* __restrict__ off, int groups, int M, int N, int K,
                long long tile0) {
  __shared__ float sA[BK][BM + 4];
  __shared__ float sB[NB][BK][BN + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int n0 = blockIdx.x * BN;
  TsJob<float> job;
  if (!ts_job(job, off, groups, M, N, K, BM, tile0, B, B2)) return;
  const int g = job.g;
  const long long m0 = job.m0, m_end = job.m_end, k_lo = job.k_lo, k_hi = job.k_hi, a_ld = job.a_ld, b_ld = job.b_ld;
  const float *Bg = job.b, *B2g = job.b2;
  float acc[NB][4][4];
  #pragma unroll
  for (int b = 0; b < NB; ++b)
    #pragma unroll
    for (int i = 0; i < 4; ++i)
      #pragma unroll
      for (int j = 0; j < 4; ++j) acc[b][i][j] = 0.f;
  const long long ktiles = (k_hi - k_lo + BK - 1) / BK;
  const long long total = MODE == 3 ? 2 * ktiles : ktiles;
  for (long long kt = 0; kt < total; ++kt) {
    const bool second = MODE == 3 && kt >= ktiles;
    const long long k0 = k_lo + (second ? kt - ktiles : kt) * BK;
    const float* a = second ? A2 : A;
    const float* bs[2] = {second ? B2g : Bg, B2g};
    #pragma unroll
    for (int u = 0; u < BM * BK / NT; ++u) {      // the contiguous index fastest: coalesced reads
      const int idx = tid + u * NT;
      const int m = A_KM ? idx % BM : idx / BK, k = A_KM ? idx / BM : idx % BK;
      const long long gm = m0 + m, gk = k0 + k;
      sA[k][m] = gm < m_end && gk < k_hi ? A_AT(a, gm, gk) : 0.f;
    }
    #pragma unroll
    for (int b = 0; b < NB; ++b)
      #pragma unroll
      for (int u = 0; u < BN * BK / NT; ++u) {
        const int idx = tid + u * NT;
        const int n = B_KN ? idx % BN : idx / BK, k = B_KN ? idx / BN : idx % BK;
        const long long gn = n0 + n, gk = k0 + k;
        sB[b][k][n] = gn < N && gk < k_hi ? B_AT(bs[b], gk, gn) : 0.f;
      }
    __syncthreads();
    #pragma unroll
    for (int k = 0; k < BK; ++k) {
      float av[4];
      #pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sA[k][ty * 4 + i];
      #pragma unroll
      for (int b = 0; b < NB; ++b)
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float bv = sB[b][k][tx * 4 + j];
          #pragma unroll
          for (int i = 0; i < 4; ++i) acc[b][i][j] = fmaf(av[i], bv, acc[b][i][j]);
        }
    }
    __syncthreads();
  }
#if WGRAD
  const long long c_base = (long long)g * M * N;
#else
  const long long c_base = 0;
#endif
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long row = m0 + ty * 4 + i;
    if (row >= m_end) continue;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = n0 + tx * 4 + j;
      if (col >= N) continue;
      float v = acc[0][i][j];
#if MODE == 2
      v = v / (1.f + expf(-v)) * acc[NB - 1][i][j];
#endif
      C[c_base + row * N + col] = v;
#if MODE == 1
      C2[c_base + row * N + col] = acc[NB - 1][i][j];
#endif
    }
  }
}
"""

_MODES = {"plain": 0, "dual": 1, "swiglu": 2, "sum2": 3}


def _defs(mode: str, wgrad: bool, trans_w: bool) -> str:
    # forward: A = x (rows, K) row-major; B = w[g] (K, N) read in pairs, or (N, K) with trans_w.
    # wgrad: A = x^T (x is (rows, M): k-major) and B = dy (rows, N): both read in pairs.
    a_km = int(wgrad)
    b_kn = int(wgrad or not trans_w)
    return (f"#define MODE {_MODES[mode]}\n#define WGRAD {int(wgrad)}\n#define A_KM {a_km}\n"
            f"#define B_KN {b_kn}\n")


def render_grouped_mma(tile: str = "m128", mode: str = "plain", wgrad: bool = False, trans_w: bool = False,
                       dtype: str = "f16", aligned: bool = True, out_f32: bool = False) -> str:
    """CUDA C of the tensor-core grouped GEMM for one configuration."""
    bm, bn, bk, wm, wn = MMA_CONFIGS[tile]
    return (f"#define BM {bm}\n#define BN {bn}\n#define BK {bk}\n#define WM {wm}\n#define WN {wn}\n"
            f"#define ALIGNED {int(aligned)}\n#define OUT_F32 {int(out_f32)}\n#define TS_BF16 {int(dtype == 'bf16')}\n"
            + _defs(mode, wgrad, trans_w) + MMA_HEADER + GROUPED_COMMON + GROUPED_MMA_SOURCE)


def render_grouped_simt(mode: str = "plain", wgrad: bool = False, trans_w: bool = False) -> str:
    """CUDA C of the f32 (SIMT) grouped GEMM for one configuration."""
    return _defs(mode, wgrad, trans_w) + GROUPED_COMMON + GROUPED_SIMT_SOURCE
