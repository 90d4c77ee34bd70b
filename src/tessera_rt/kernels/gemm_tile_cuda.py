"""The tensor-core tile GEMM's CUDA source: mma.sync fed by ldmatrix from a cp.async pipeline.

``C[b] = A[b] @ B[b]`` (A ``M x K``, B ``K x N``, both row-major f16 or bf16; f32 accumulators;
C in f16/bf16 or f32) with CUTLASS's sm80 multistage structure:

* A block computes a BM x BN tile of C with WM x WN warps; each warp owns a
  (BM/WM) x (BN/WN) sub-tile of m16n8k16 MMAs (64 x 64 in the large configs: 128 f32
  accumulators per thread, and 32 FLOP per byte read from shared memory, which is what keeps
  the tensor cores, not the shared-memory pipe, the limit).
* A and B tiles of depth BK stream into STAGES shared-memory buffers by ``cp.async`` (16-byte
  ``.cg``: L2 only, no register staging); the copies of tile ``k + STAGES - 1`` are in flight
  while the warps multiply tile ``k``.  One commit group per tile, always committed (empty past
  the last tile), so ``cp.async.wait_group STAGES-2`` always means "tile k+1 has landed".
* Tiles are stored unpadded with XOR-swizzled 16-byte chunks (``SMEM_TILE``): cp.async writes
  and ldmatrix reads are both free of bank conflicts.  A fragments come from ``ldmatrix.x4``,
  B fragments (two n8 tiles at once) from ``ldmatrix.x4.trans`` on the row-major ``[k][n]`` tile.
* Each k16 slice reads its fragments right before its MMAs (a B pair per ldmatrix.x4.trans feeds
  2 MT MMAs); ptxas overlaps the next slice's ldmatrix with these MMAs within the k tile, and
  one wait + barrier per k tile separates the stages.  (Explicit register double-buffering, as
  CUTLASS does, cost the 64 x 64 warp tile its last registers: it spilled.)
* Blocks are numbered along M in groups of 8 (Triton's "grouped ordering"): the blocks running
  together share B column panels and A row panels in L2.

``DUAL=1`` multiplies each A tile by two B matrices (SwiGLU's x@w1 and x@w3 share the A reads)
and writes ``silu(A@B1) * (A@B2)``, or with ``DUAL_OUT`` both products.  ``VEC`` (8, 4, 2, 1
elements per copy) follows K's and N's divisibility and the operands' alignment; 8 is the fast
path, 1 (odd widths) loads synchronously through registers.
"""
from __future__ import annotations

from .compile import KernelSource, register_source
from .cuda_common import MMA_HEADER, SMEM_TILE

__all__ = ["GEMM_CONFIGS", "DUAL_CONFIGS", "GEMM_STAGES", "render_gemm", "gemm_smem_bytes", "gemm_threads",
           "gemm_grid", "GROUP_M"]

# (BM, BN, BK) -> warps (WM, WN) of the plain GEMM.  Warp tiles are multiples of 16 x 16.
GEMM_CONFIGS = {(128, 256, 32): (2, 4), (128, 128, 32): (2, 2), (128, 64, 32): (2, 2),
                (64, 128, 32): (2, 2), (64, 64, 32): (2, 2), (64, 64, 64): (2, 2)}
# the dual form keeps two accumulator sets: half the warp tile along N for the same registers
DUAL_CONFIGS = {(128, 128, 32): (2, 4), (128, 64, 32): (2, 2), (64, 64, 32): (2, 2)}
# shared-memory buffers per config: deep enough to cover global latency, within 227 KiB
GEMM_STAGES = {(128, 256, 32): 3, (128, 128, 32): 4, (128, 64, 32): 4, (64, 128, 32): 4,
               (64, 64, 32): 4, (64, 64, 64): 3}
GROUP_M = 8

GEMM_SOURCE = r"""
#define NTHREADS (WM * WN * 32)
#define WTM (BM / WM)
#define WTN (BN / WN)
#define MT (WTM / 16)
#define NT (WTN / 8)
#define NB (DUAL ? 2 : 1)
#define KSTEPS (BK / 16)
#define A_TILE (BM * BK)
#define B_TILE (BK * BN)

extern "C" __global__ void __launch_bounds__(NTHREADS)
ts_gemm(const elem_t* __restrict__ A, const elem_t* __restrict__ B0, const elem_t* __restrict__ B1,
        void* __restrict__ C, void* __restrict__ C2, int M, int N, int K,
        long long a_batch, long long b_batch, long long c_batch) {
  static_assert(NT % 2 == 0, "B fragments load in pairs of n8 tiles");
  extern __shared__ __align__(128) unsigned char ts_smem[];
  elem_t* sA = reinterpret_cast<elem_t*>(ts_smem);           // [STAGES][BM x BK]
  elem_t* sB = sA + STAGES * A_TILE;                           // [STAGES][NB][BK x BN]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / WN) * WTM, wn0 = (warp % WN) * WTN;
  // grouped block order: GROUP_M row tiles x all column tiles, column-major inside the group
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, per_group = GROUP_M * tiles_n;
  const int group = blockIdx.x / per_group, first_m = group * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M), in_group = blockIdx.x % per_group;
  const int m0 = (first_m + in_group % group_m) * BM, n0 = (in_group / group_m) * BN;
  A += blockIdx.z * a_batch;
  const elem_t* Bs[2] = {B0 + blockIdx.z * b_batch, (DUAL ? B1 : B0) + blockIdx.z * b_batch};

  float acc[NB][MT][NT][4];
  #pragma unroll
  for (int b = 0; b < NB; ++b)
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        acc[b][i][j][0] = acc[b][i][j][1] = acc[b][i][j][2] = acc[b][i][j][3] = 0.f;

  const int ktiles = (K + BK - 1) / BK;
  auto load_stage = [&](int stage, int kt) {     // one commit group per k tile, empty past the end
    if (kt < ktiles) {
      ts_load_tile<BM, BK, VEC, NTHREADS>(sA + stage * A_TILE, A, K, m0, kt * BK, M, K, tid);
      #pragma unroll
      for (int b = 0; b < NB; ++b)
        ts_load_tile<BK, BN, VEC, NTHREADS>(sB + (stage * NB + b) * B_TILE, Bs[b], N, kt * BK, n0, K, N, tid);
    }
    ts_cp_async_commit();
  };
  // one k16 slice of the stage: A fragments by ldmatrix.x4 (lane l: row l % 16, k half l / 16),
  // B fragments of n tiles j, j+1 by ldmatrix.x4.trans (lane l: k row l % 16, n half l / 16)
  auto mma_slice = [&](int stage, int kk) {
    unsigned af[MT][4];
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      ts_ldsm_x4(af[i], sA + stage * A_TILE + ts_swz<BK / 8>(wm0 + i * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
    #pragma unroll
    for (int b = 0; b < NB; ++b)
      #pragma unroll
      for (int j = 0; j < NT; j += 2) {
        unsigned bf[4];
        ts_ldsm_x4_t(bf, sB + (stage * NB + b) * B_TILE + ts_swz<BN / 8>(kk * 16 + (lane & 15), wn0 + j * 8 + (lane >> 4) * 8));
        #pragma unroll
        for (int i = 0; i < MT; ++i) {
          ts_mma(acc[b][i][j], af[i], bf);
          ts_mma(acc[b][i][j + 1], af[i], bf + 2);
        }
      }
  };

  #pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_stage(s, s);
  for (int kt = 0; kt < ktiles; ++kt) {
    ts_cp_async_wait<STAGES - 2>();       // tile kt landed for this thread (groups 1..kt+1 retired) ...
    __syncthreads();                      // ... and for every thread; every warp is done with tile kt-1
    load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);   // refill tile kt-1's stage
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) mma_slice(kt % STAGES, kk);
  }
  ts_cp_async_wait<0>();                  // no copy outlives the block (only empty groups remain)

  const int g = lane >> 2, t = lane & 3;
  const bool pairs = (N & 1) == 0;        // (row, col) and (row, col+1) then share one aligned store
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm0 + i * 16 + g + h * 8, col = n0 + wn0 + j * 8 + 2 * t;
        if (row >= M || col >= N) continue;
        float v[2] = {acc[0][i][j][2 * h], acc[0][i][j][2 * h + 1]};
        float u[2] = {acc[NB - 1][i][j][2 * h], acc[NB - 1][i][j][2 * h + 1]};
#if DUAL && !DUAL_OUT
        v[0] = v[0] / (1.f + __expf(-v[0])) * u[0];
        v[1] = v[1] / (1.f + __expf(-v[1])) * u[1];
#endif
        const long long off = blockIdx.z * c_batch + (long long)row * N + col;
#if OUT_F32
        float* c = reinterpret_cast<float*>(C) + off;
        float* c2 = reinterpret_cast<float*>(C2) + off;
        if (pairs) {
          *reinterpret_cast<float2*>(c) = make_float2(v[0], v[1]);
          if (DUAL_OUT) *reinterpret_cast<float2*>(c2) = make_float2(u[0], u[1]);
        } else {
          c[0] = v[0];
          if (DUAL_OUT) c2[0] = u[0];
          if (col + 1 < N) { c[1] = v[1]; if (DUAL_OUT) c2[1] = u[1]; }
        }
#else
        elem_t* c = reinterpret_cast<elem_t*>(C) + off;
        elem_t* c2 = reinterpret_cast<elem_t*>(C2) + off;
        if (pairs) {
          *reinterpret_cast<elem2_t*>(c) = ts_pack(v[0], v[1]);
          if (DUAL_OUT) *reinterpret_cast<elem2_t*>(c2) = ts_pack(u[0], u[1]);
        } else {
          c[0] = ts_elem(v[0]);
          if (DUAL_OUT) c2[0] = ts_elem(u[0]);
          if (col + 1 < N) { c[1] = ts_elem(v[1]); if (DUAL_OUT) c2[1] = ts_elem(u[1]); }
        }
#endif
      }
}
"""


def _warps(tile: tuple, dual: bool) -> tuple[int, int]:
    return (DUAL_CONFIGS if dual else GEMM_CONFIGS)[tuple(tile)]


def gemm_threads(tile: tuple, dual: bool = False) -> int:
    """Threads per block of a config."""
    wm, wn = _warps(tile, dual)
    return wm * wn * 32


def gemm_grid(m: int, n: int, tile: tuple, batch: int = 1) -> tuple[int, int, int]:
    """The launch grid: every (row tile, column tile) on x (the kernel orders them in groups), batch on z."""
    return (-(-m // tile[0])) * (-(-n // tile[1])), 1, batch


def render_gemm(BM: int = 128, BN: int = 128, BK: int = 32, dtype: str = "f16", out_f32: bool = False,
                dual: bool = False, dual_out: bool = False, vec: int = 8) -> str:
    """CUDA C for one GEMM config; the macros are the compile-time tile.  ``dual_out`` (with
    ``dual``) writes both products, ``A@B1`` to C and ``A@B2`` to C2, instead of SwiGLU; ``vec``
    is the elements per global->shared copy (8: 16-byte cp.async; 1: plain loads)."""
    wm, wn = _warps((BM, BN, BK), dual)
    defs = (f"#define BM {BM}\n#define BN {BN}\n#define BK {BK}\n#define WM {wm}\n#define WN {wn}\n"
            f"#define STAGES {GEMM_STAGES[(BM, BN, BK)]}\n#define VEC {vec}\n#define GROUP_M {GROUP_M}\n"
            f"#define OUT_F32 {int(out_f32)}\n#define DUAL {int(dual)}\n#define DUAL_OUT {int(dual and dual_out)}\n"
            f"#define TS_BF16 {int(dtype == 'bf16')}\n")
    return defs + MMA_HEADER + SMEM_TILE + GEMM_SOURCE


def gemm_smem_bytes(BM: int, BN: int, BK: int, dual: bool = False, **_) -> int:
    """Dynamic shared memory of a config: STAGES buffers of the A tile and one or two B tiles."""
    return GEMM_STAGES[(BM, BN, BK)] * (BM * BK + (2 if dual else 1) * BK * BN) * 2


register_source(KernelSource(
    "tile_gemm", render_gemm, ("ts_gemm",),
    configs=[*(dict(BM=bm, BN=bn, BK=bk) for (bm, bn, bk) in GEMM_CONFIGS),
             dict(BM=128, BN=256, BK=32, dtype="bf16"), dict(BM=128, BN=128, BK=32, out_f32=True),
             dict(BM=64, BN=64, BK=32, vec=1), dict(BM=64, BN=64, BK=32, vec=4, dtype="bf16"),
             *(dict(BM=bm, BN=bn, BK=bk, dual=True) for (bm, bn, bk) in DUAL_CONFIGS),
             *(dict(BM=bm, BN=bn, BK=bk, dual=True, dual_out=True) for (bm, bn, bk) in DUAL_CONFIGS)],
    smem_dynamic=gemm_smem_bytes))
