"""CUDA C of the grouped GEMM kernels (launchers: ``grouped_gemm_cuda``).

The tensor-core kernel is the tile GEMM's machinery (``gemm_tile_cuda``: its tiles, stage
counts, shared-memory formula and grouped block order; ``MMA_HEADER``'s ``mma.sync`` /
``ldmatrix`` / ``cp.async`` helpers and ``SMEM_TILE``'s swizzled ``ts_load_tile``) with a
scheduler in front that finds each block's group on the device:

* forward (``WGRAD 0``): ``C[r] = A[r] @ B[g]`` for the rows ``r`` of group ``g``.  Row tiles
  are counted group after group (``ceil(rows_g / BM)`` each), so no tile straddles a group
  boundary; their number is at most ``ceil(R / BM) + G`` (each group wastes at most one partial
  tile), which sizes the grid without reading a count on the host.  A block maps its linear
  index to (row tile, column tile) in the tile GEMM's grouped order, then one warp-wide scan
  over the device offsets (32 groups a step: shuffles only) finds the tile's group and rows;
  blocks past the last tile return.
* weight gradient (``WGRAD 1``): ``C[g] = A[rows of g].T @ B[rows of g]``; grid z is the group,
  x its (M tile, N tile) in grouped order; the K loop runs over the group's rows, so the
  reduction is the same k-ascending pipeline (an empty group's tile is zeros).

Every stage is filled by ``ts_load_tile`` (16-byte ``cp.async.cg`` into XOR-swizzled tiles; 8-,
4-byte ``.ca`` or plain loads where widths or pointers are not 16-byte multiples: ``VEC``),
zero past the group's rows, K, M and N.  Each operand is copied in its stored layout and
``ldmatrix`` makes the fragments: A ``[m][k]`` by ``.x4`` (the forward's ``x``), ``[k][m]`` by
``.x4.trans`` (the gradient's ``x.T``); B ``[k][n]`` by ``.x4.trans`` (a ``(K, N)`` weight, ``dy``),
``[n][k]`` by ``.x4`` (``trans_w``'s ``(N, K)`` weight).  One commit group per k tile, always
committed, ``wait_group STAGES-2`` + one barrier per k tile, as in the tile GEMM.  Each output
is one block's f32 sum in k order: the same bits on every run.

``MODE``: 0 plain, 1 two products of A (``C = A@B``, ``C2 = A@B2``), 2 SwiGLU
(``silu(A@B) * (A@B2)``), 3 a sum of two products (``A@B + A2@B2``, 2 x K k tiles).  The SIMT
kernel is the f32 path (exact FMAs, 64x64 tiles, 4x4 outputs a thread) on the same scheduler.
"""
from __future__ import annotations

from .cuda_common import MMA_HEADER, SMEM_TILE
from .gemm_tile_cuda import DUAL_CONFIGS, GEMM_CONFIGS, GEMM_STAGES, GROUP_M, gemm_smem_bytes

__all__ = ["GROUPED_COMMON", "GROUPED_MMA_SOURCE", "GROUPED_SIMT_SOURCE", "render_grouped_mma", "render_grouped_simt",
           "grouped_smem_bytes", "grouped_threads", "grouped_tiles_m", "SIMT_TILE"]

SIMT_TILE = 64            # the f32 kernel's BM = BN

# the group scheduling both kernels share
GROUPED_COMMON = r"""
// Forward: the group, first row and end row of row tile `t` (tiles counted group after group,
// ceil(rows / bm) each), or false past the last tile.  A warp scans 32 groups a step: lane l
// counts group base + l's tiles, a shuffle scan sums them, and the number of lanes whose
// running total is still <= t is the tile's group within the step.  Every warp of the block
// computes the same answer; all 32 lanes must be present.
__device__ __forceinline__ bool ts_find_tile(const long long* __restrict__ off, int groups, int t, int bm,
                                             int* g_out, long long* row0, long long* row_end) {
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  int before = 0;                                  // tiles of the groups already passed (rows < 2^31)
  for (int base = 0; base < groups; base += 32) {
    const int g = base + lane;
    const int lo = g < groups ? (int)off[g] : 0, hi = g < groups ? (int)off[g + 1] : 0;
    const int tiles = hi > lo ? (hi - lo + bm - 1) / bm : 0;
    int incl = tiles;                              // tiles of groups base .. g
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(full, incl, d);
      if (lane >= d) incl += v;
    }
    int done = before + incl <= t ? 1 : 0;         // group g ends before tile t (a prefix of lanes)
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) done += __shfl_xor_sync(full, done, d);
    const int first = __shfl_sync(full, incl - tiles, done & 31), lo_g = __shfl_sync(full, lo, done & 31),
              hi_g = __shfl_sync(full, hi, done & 31);
    if (done < 32) {                               // tile t lies in group base + done
      *g_out = base + done;
      *row0 = lo_g + (long long)(t - before - first) * bm;
      *row_end = hi_g;
      return true;
    }
    before += __shfl_sync(full, incl, 31);
  }
  return false;
}

// The block's problem: group g, rows [m0, m_end) of C, the reduction range [k_lo, k_hi), the
// operands' leading dims and group g's B matrices; false for a forward block past the last tile.
// `t` is the forward's row tile, or the gradient's M tile (its group is blockIdx.z).
template <class T> struct TsJob { int g; long long m0, m_end, k_lo, k_hi, a_ld, b_ld; const T* b; const T* b2; };
template <class T> __device__ __forceinline__ bool ts_job(TsJob<T>& j, const long long* __restrict__ off, int groups,
                                                          int M, int N, int K, int bm, int t, const T* B,
                                                          const T* B2) {
#if WGRAD
  // C[g] (M x N) = A[rows of g]^T @ B[rows of g]: A is (rows, M), B (rows, N)
  j.g = blockIdx.z;
  j.m0 = (long long)t * bm;
  j.m_end = M;
  j.k_lo = off[j.g];
  j.k_hi = off[j.g + 1];
  j.a_ld = M;
  j.b_ld = N;
  j.b = B;
  j.b2 = B2 ? B2 : B;
#else
  if (!ts_find_tile(off, groups, t, bm, &j.g, &j.m0, &j.m_end)) return false;
  j.k_lo = 0;
  j.k_hi = K;
  j.a_ld = K;
  j.b_ld = B_KN ? N : K;
  j.b = B + (long long)j.g * K * N;
  j.b2 = B2 ? B2 + (long long)j.g * K * N : j.b;
#endif
  return true;
}

// Row tiles of the grid: the forward's upper bound, or the gradient's M tiles.
__device__ __forceinline__ int ts_tiles_m(int M, int groups, int bm) {
  return WGRAD ? (M + bm - 1) / bm : (M + bm - 1) / bm + groups;
}
"""

GROUPED_MMA_SOURCE = r"""
#define NTHREADS (WM * WN * 32)
#define WTM (BM / WM)
#define WTN (BN / WN)
#define MT (WTM / 16)
#define NT (WTN / 8)
#define NB ((MODE == 1 || MODE == 2) ? 2 : 1)
#define KSTEPS (BK / 16)
#define A_TILE (BM * BK)
#define B_TILE (BK * BN)

extern "C" __global__ void __launch_bounds__(NTHREADS)
ts_grouped_mma(const elem_t* __restrict__ A, const elem_t* __restrict__ B, const elem_t* __restrict__ A2,
               const elem_t* __restrict__ B2, void* __restrict__ C, void* __restrict__ C2,
               const long long* __restrict__ off, int groups, int M, int N, int K) {
  static_assert(NT % 2 == 0, "B fragments load in pairs of n8 tiles");
  extern __shared__ __align__(128) unsigned char ts_smem[];
  elem_t* sA = reinterpret_cast<elem_t*>(ts_smem);           // [STAGES][BM x BK] or [STAGES][BK x BM]
  elem_t* sB = sA + STAGES * A_TILE;                           // [STAGES][NB][BK x BN] or [..][BN x BK]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / WN) * WTM, wn0 = (warp % WN) * WTN;
  // grouped block order (the tile GEMM's): GROUP_M row tiles x all column tiles, column-major inside
  const int tiles_m = ts_tiles_m(M, groups, BM), tiles_n = (N + BN - 1) / BN, per_group = GROUP_M * tiles_n;
  const int bgroup = blockIdx.x / per_group, first_m = bgroup * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M), in_group = blockIdx.x % per_group;
  const int n0 = (in_group / group_m) * BN;
  TsJob<elem_t> job;
  if (!ts_job(job, off, groups, M, N, K, BM, first_m + in_group % group_m, B, B2)) return;
  const int m0 = (int)job.m0, m_end = (int)job.m_end, k_lo = (int)job.k_lo, k_hi = (int)job.k_hi;
  const long long a_ld = job.a_ld, b_ld = job.b_ld;

  float acc[NB][MT][NT][4];
  #pragma unroll
  for (int b = 0; b < NB; ++b)
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        acc[b][i][j][0] = acc[b][i][j][1] = acc[b][i][j][2] = acc[b][i][j][3] = 0.f;

  const int ktiles = (k_hi - k_lo + BK - 1) / BK;
  const int total = MODE == 3 ? 2 * ktiles : ktiles;
  auto load_stage = [&](int stage, int kt) {     // one commit group per k tile, empty past the end
    if (kt < total) {
      const bool second = MODE == 3 && kt >= ktiles;
      const int k0 = k_lo + (second ? kt - ktiles : kt) * BK;
#if A_KM
      ts_load_tile<BK, BM, VEC, NTHREADS>(sA + stage * A_TILE, A, a_ld, k0, m0, k_hi, m_end, tid);
#else
      ts_load_tile<BM, BK, VEC, NTHREADS>(sA + stage * A_TILE, second ? A2 : A, a_ld, m0, k0, m_end, k_hi, tid);
#endif
      #pragma unroll
      for (int b = 0; b < NB; ++b) {
        const elem_t* src = (b == 1 || second) ? job.b2 : job.b;
#if B_KN
        ts_load_tile<BK, BN, VEC, NTHREADS>(sB + (stage * NB + b) * B_TILE, src, b_ld, k0, n0, k_hi, N, tid);
#else
        ts_load_tile<BN, BK, VEC, NTHREADS>(sB + (stage * NB + b) * B_TILE, src, b_ld, n0, k0, N, k_hi, tid);
#endif
      }
    }
    ts_cp_async_commit();
  };
  // one k16 slice of the stage.  A [m][k]: ldmatrix.x4, lane l passes row l % 16, k half l / 16;
  // A [k][m]: .x4.trans, matrix l / 8 = (k half l / 16, m half (l / 8) % 2), row l % 8.
  // B [k][n]: .x4.trans, lane l passes k row l % 16, n half l / 16 (n tiles j, j+1);
  // B [n][k]: .x4, matrix l / 8 = (n tile j + l / 16, k half (l / 8) % 2), n row l % 8.
  auto mma_slice = [&](int stage, int kk) {
    unsigned af[MT][4];
    #pragma unroll
    for (int i = 0; i < MT; ++i)
#if A_KM
      ts_ldsm_x4_t(af[i], sA + stage * A_TILE + ts_swz<BM / 8>(kk * 16 + (lane & 7) + (lane >> 4) * 8,
                                                                wm0 + i * 16 + ((lane >> 3) & 1) * 8));
#else
      ts_ldsm_x4(af[i], sA + stage * A_TILE + ts_swz<BK / 8>(wm0 + i * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
#endif
    #pragma unroll
    for (int b = 0; b < NB; ++b)
      #pragma unroll
      for (int j = 0; j < NT; j += 2) {
        unsigned bf[4];
#if B_KN
        ts_ldsm_x4_t(bf, sB + (stage * NB + b) * B_TILE + ts_swz<BN / 8>(kk * 16 + (lane & 15), wn0 + j * 8 + (lane >> 4) * 8));
#else
        ts_ldsm_x4(bf, sB + (stage * NB + b) * B_TILE + ts_swz<BK / 8>(wn0 + j * 8 + (lane & 7) + (lane >> 4) * 8,
                                                                        kk * 16 + ((lane >> 3) & 1) * 8));
#endif
        #pragma unroll
        for (int i = 0; i < MT; ++i) {
          ts_mma(acc[b][i][j], af[i], bf);
          ts_mma(acc[b][i][j + 1], af[i], bf + 2);
        }
      }
  };

  #pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_stage(s, s);
  for (int kt = 0; kt < total; ++kt) {
    ts_cp_async_wait<STAGES - 2>();       // tile kt landed for this thread (groups 1..kt+1 retired) ...
    __syncthreads();                      // ... and for every thread; every warp is done with tile kt-1
    load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);   // refill tile kt-1's stage
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) mma_slice(kt % STAGES, kk);
  }
  ts_cp_async_wait<0>();                  // no copy outlives the block (only empty groups remain)

  const int gq = lane >> 2, tq = lane & 3;
  const bool pairs = (N & 1) == 0;        // (row, col) and (row, col+1) then share one aligned store
  const long long c_base = WGRAD ? (long long)job.g * M * N : 0;
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm0 + i * 16 + gq + h * 8, col = n0 + wn0 + j * 8 + 2 * tq;
        if (row >= m_end || col >= N) continue;
        float v[2] = {acc[0][i][j][2 * h], acc[0][i][j][2 * h + 1]};
        float u[2] = {acc[NB - 1][i][j][2 * h], acc[NB - 1][i][j][2 * h + 1]};
#if MODE == 2
        v[0] = v[0] / (1.f + __expf(-v[0])) * u[0];
        v[1] = v[1] / (1.f + __expf(-v[1])) * u[1];
#endif
        const long long o = c_base + (long long)row * N + col;
#if OUT_F32
        float* c = reinterpret_cast<float*>(C) + o;
        float* c2 = reinterpret_cast<float*>(C2) + o;
        if (pairs) {
          *reinterpret_cast<float2*>(c) = make_float2(v[0], v[1]);
          if (MODE == 1) *reinterpret_cast<float2*>(c2) = make_float2(u[0], u[1]);
        } else {
          c[0] = v[0];
          if (MODE == 1) c2[0] = u[0];
          if (col + 1 < N) { c[1] = v[1]; if (MODE == 1) c2[1] = u[1]; }
        }
#else
        elem_t* c = reinterpret_cast<elem_t*>(C) + o;
        elem_t* c2 = reinterpret_cast<elem_t*>(C2) + o;
        if (pairs) {
          *reinterpret_cast<elem2_t*>(c) = ts_pack(v[0], v[1]);
          if (MODE == 1) *reinterpret_cast<elem2_t*>(c2) = ts_pack(u[0], u[1]);
        } else {
          c[0] = ts_elem(v[0]);
          if (MODE == 1) c2[0] = ts_elem(u[0]);
          if (col + 1 < N) { c[1] = ts_elem(v[1]); if (MODE == 1) c2[1] = ts_elem(u[1]); }
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

// two blocks an SM (<= 128 registers): given only the thread count, ptxas chose 80 and spilled the sum form
extern "C" __global__ void __launch_bounds__(NT, 2)
ts_grouped_simt(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ A2,
                const float* __restrict__ B2, float* __restrict__ C, float* __restrict__ C2,
                const long long* __restrict__ off, int groups, int M, int N, int K) {
  __shared__ float sA[BK][BM + 4];
  __shared__ float sB[NB][BK][BN + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int tiles_n = (N + BN - 1) / BN;          // blocks along x: row tile after row tile
  const int n0 = (blockIdx.x % tiles_n) * BN;
  TsJob<float> job;
  if (!ts_job(job, off, groups, M, N, K, BM, blockIdx.x / tiles_n, B, B2)) return;
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
        sB[b][k][n] = gn < N && gk < k_hi ? B_AT((b == 1 || second) ? B2g : Bg, gk, gn) : 0.f;
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
  const long long c_base = WGRAD ? (long long)g * M * N : 0;
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
    # forward: A = x (rows, K) row-major; B = w[g] (K, N), or (N, K) with trans_w.
    # wgrad: A = x^T (x is (rows, M): k-major) and B = dy (rows, N) (k-major too).
    return (f"#define MODE {_MODES[mode]}\n#define WGRAD {int(wgrad)}\n#define A_KM {int(wgrad)}\n"
            f"#define B_KN {int(wgrad or not trans_w)}\n")


def _dual(mode: str) -> bool:
    return mode in ("dual", "swiglu")


def grouped_threads(BM: int, BN: int, BK: int, mode: str = "plain", **_) -> int:
    """Threads per block of a tensor-core config (the tile GEMM's warps for that tile)."""
    wm, wn = (DUAL_CONFIGS if _dual(mode) else GEMM_CONFIGS)[(BM, BN, BK)]
    return wm * wn * 32


def grouped_smem_bytes(BM: int, BN: int, BK: int, mode: str = "plain", **_) -> int:
    """Dynamic shared memory of a tensor-core config: the tile GEMM's (same tiles, any layout)."""
    return gemm_smem_bytes(BM, BN, BK, dual=_dual(mode))


def grouped_tiles_m(rows: int, groups: int, bm: int, wgrad: bool) -> int:
    """Row tiles of the grid: ``ceil(rows / bm) + groups`` for a forward, the M tiles for a gradient."""
    return -(-rows // bm) + (0 if wgrad else groups)


def render_grouped_mma(BM: int = 128, BN: int = 128, BK: int = 32, mode: str = "plain", wgrad: bool = False,
                       trans_w: bool = False, dtype: str = "f16", vec: int = 8, out_f32: bool = False) -> str:
    """CUDA C of the tensor-core grouped GEMM for one configuration: a tile of the tile GEMM's
    tables (``GEMM_CONFIGS``, or ``DUAL_CONFIGS`` for "dual"/"swiglu"), ``vec`` elements a copy."""
    tile = (BM, BN, BK)
    wm, wn = (DUAL_CONFIGS if _dual(mode) else GEMM_CONFIGS)[tile]
    return (f"#define BM {BM}\n#define BN {BN}\n#define BK {BK}\n#define WM {wm}\n#define WN {wn}\n"
            f"#define STAGES {GEMM_STAGES[tile]}\n#define VEC {vec}\n#define GROUP_M {GROUP_M}\n"
            f"#define OUT_F32 {int(out_f32)}\n#define TS_BF16 {int(dtype == 'bf16')}\n"
            + _defs(mode, wgrad, trans_w) + MMA_HEADER + SMEM_TILE + GROUPED_COMMON + GROUPED_MMA_SOURCE)


def render_grouped_simt(mode: str = "plain", wgrad: bool = False, trans_w: bool = False) -> str:
    """CUDA C of the f32 (SIMT) grouped GEMM for one configuration."""
    return _defs(mode, wgrad, trans_w) + GROUPED_COMMON + GROUPED_SIMT_SOURCE
