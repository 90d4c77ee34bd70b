"""f32 flash attention on TF32 tensor cores, f32-accurate by 3xTF32 (FlashAttention-2's structure).

The same kernels, launch geometry and strided interface as the f16/bf16 ones (``flash_cuda``:
entries ``ts_flash_fwd``, ``ts_flash_bwd_delta``, ``ts_flash_bwd_dkdv``, ``ts_flash_bwd_dq`` with
the same parameters), on f32 inputs and outputs, with every product an ``mma.sync`` m16n8k8
.tf32.  ``precision="f32"`` computes each product in 3xTF32: an f32 operand x is split into
hi = tf32(x) and lo = tf32(x - hi) (both rounded to nearest by cvt.rna; x - hi is exact), and
a b = hi_a hi_b + hi_a lo_b + lo_a hi_b, three MMAs accumulated in f32.

Why that is f32-accurate here: hi keeps 11 significant bits and lo the next 11, so hi + lo
equals x to 2^-22 relative; the dropped lo_a lo_b is below 2^-22 |a b|; the three kept
products are exact in f32 and summed in f32.  So each product is within a few 2^-23 of
a b -- f32's own rounding of a product is 2^-24 -- and the errors of a dot product over the
head dim (or a tile of keys) are random in sign: scores, P V and the gradients come out within
~1e-6 of float64, like the f32 GEMMs this replaces.  The cost is three MMAs per product:
TF32 runs at half the f16 rate, so 3xTF32 takes 6x the f16 kernel's tensor time per product;
by the datasheets' peaks that is still ~2.5x f32 FMA on the SIMT units (A100 52 vs 19.5
TFLOPS, H100 SXM 165 vs 67).  Plus the splits: two cvt.rna and a subtraction per fragment
element loaded (about 1.7 cvt per MMA in the PTX), on the ALUs beside the tensor pipe.  ``precision="tf32"`` (the
float32 matmul precision "high") keeps hi only: one MMA, TF32's ~1e-3 relative error.

Tiles are f32 in shared memory, rows padded to LD = D + 4 floats: 16-byte cp.async chunks,
ldmatrix on 32-bit data (a 16-byte ldmatrix row is four floats, so lane l receives element
(l / 4, l % 4) of each 8x4 block: exactly a tf32 A fragment, or two B fragments of a row-major
[n][k] tile) and the transposed loads below all hit 32 distinct banks.  TF32's fragments have
no transposing load (ldmatrix.trans moves 16-bit elements), and an f32 C fragment (columns 2t,
2t+1) is not an A fragment (columns t, t+4); so products with the contraction along a tile's
rows (P V, P^T dO, dS^T Q, dS K) permute k within each group of eight: A column t stands for k
2t and column t + 4 for 2t + 1.  A is then the C fragment's registers reordered (no shuffles),
and B is two plain 32-bit shared loads per lane, rows 2t and 2t + 1.  Softmax statistics, the
online rescaling and the exponentials are f32, compiled without fast math.

Accumulation: a tensor core rounds once per MMA as it adds the products to the accumulator
(the A100 aligns them to the largest term without guard bits and truncates toward zero: Fasi
et al., "Numerical behavior of NVIDIA tensor cores", 2021), and 3xTF32 triples the MMAs.
Chained on a long-lived accumulator (O over every key, dK and dV over every query) those
roundings would be the largest error.  So products are summed from zero, then added to the
accumulator in f32: per k8 step for the scores and dP (``mma_add``), per tile for P V,
P^T dO, dS^T Q and dS K (head-dim column outer, the tile's keys or queries inner: one add per
tile).  In the emulation harness (tests/gpu/test_cuda_emu_flash32.py) forward, lse and
gradients come out 1-5e-7 of float64 with round-to-nearest sums (NumPy's f32 attention on
the same inputs: 3-6e-7) and under 8e-7 with the truncating model, where chained MMAs gave
up to 1.7e-6.
"""
from __future__ import annotations

from .compile import KernelSource, register_source
from .cuda_common import MMA_HEADER
from .flash_cuda import FLASH_COMMON, FLASH_DELTA
from .flash_f32_bwd_cuda import FLASH32_BWD_SOURCE

__all__ = ["FLASH32_CONFIGS", "flash32_config", "flash32_supports", "render_flash32", "flash32_smem_bytes",
           "flash32_threads", "flash32_rows"]

# Per head-dim bucket (a head dim d runs the config of the smallest bucket >= d): forward
# (warps, m16 tiles per warp, keys per tile), dK/dV (warps -> 16 keys each, queries per tile),
# dQ (warps -> 16 queries each, keys per tile).  f32 tiles are twice the bytes of 16-bit ones:
# chosen for registers (ptxas, no spills) and so that every kernel fits sm_80's 163 KiB.
FLASH32_CONFIGS = {
    64: dict(fwd=(4, 1, 64), dkdv=(4, 32), dq=(4, 32)),
    128: dict(fwd=(4, 1, 32), dkdv=(4, 16), dq=(4, 32)),
}
DELTA_WARPS = 4


def flash32_supports(head_dim: int) -> bool:
    """Head dims the f32 kernels take: multiples of 8 (whole k8 steps) up to 128."""
    return head_dim % 8 == 0 and 8 <= head_dim <= max(FLASH32_CONFIGS)


def flash32_config(head_dim: int) -> dict:
    return FLASH32_CONFIGS[min(b for b in FLASH32_CONFIGS if b >= head_dim)]


FLASH32_SOURCE = r"""
#define LD (D + 4)              // a padded f32 row of a shared tile (see the module doc)
__device__ __forceinline__ float ts_float(float x) { return x; }

// rows [r0, r0 + ROWS) of a [*, D] f32 matrix (row stride ld) into a ROWS x LD tile; zero rows past `limit`
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(float* s, const float* g, int r0, int limit, long long ld, int tid) {
  constexpr int PER = D / 4, COPIES = ROWS * PER;
  #pragma unroll
  for (int j = 0; j < (COPIES + THREADS - 1) / THREADS; ++j) {
    const int i = tid + j * THREADS;
    if (COPIES % THREADS == 0 || i < COPIES) {
      const int r = i / PER, c = (i % PER) * 4;
      const bool ok = r0 + r < limit;
      ts_cp_async<16>(s + r * LD + c, g + (ok ? (long long)(r0 + r) * ld + c : 0), ok ? 16 : 0);
    }
  }
}

// An MMA operand as tf32 parts: hi, and lo for 3xTF32 (TF32X 3); N f32 values.
template <int N> struct tf32_frag { unsigned hi[N], lo[N]; };
template <int N> __device__ __forceinline__ tf32_frag<N> split(const float* x) {
  tf32_frag<N> f;
  #pragma unroll
  for (int i = 0; i < N; ++i) {
#if TF32X == 3
    ts_split_tf32(x[i], f.hi[i], f.lo[i]);
#else
    f.hi[i] = ts_tf32(x[i]);
#endif
  }
  return f;
}
__device__ __forceinline__ void mma(float* d, const tf32_frag<4>& a, const unsigned* b_hi, const unsigned* b_lo) {
#if TF32X == 3
  ts_mma_3xtf32(d, a.hi, a.lo, b_hi, b_lo);
#else
  ts_mma_tf32(d, a.hi, b_hi);
#endif
}
__device__ __forceinline__ void mma(float* d, const tf32_frag<4>& a, const tf32_frag<2>& b) { mma(d, a, b.hi, b.lo); }
__device__ __forceinline__ void add4(float* d, const float* x) {
  d[0] += x[0]; d[1] += x[1]; d[2] += x[2]; d[3] += x[3];
}
// d += a b, the product summed from zero first (see "Accumulation" in the module doc).
__device__ __forceinline__ void mma_add(float* d, const tf32_frag<4>& a, const unsigned* b_hi, const unsigned* b_lo) {
  float x[4] = {0.f, 0.f, 0.f, 0.f};
  mma(x, a, b_hi, b_lo);
  add4(d, x);
}

// A fragment of the 16x8 block at (r0, c0) of a padded tile: lane l addresses row l % 16,
// floats 4 (l / 16) .. +3 (ldmatrix matrices: rows 0-7 / 8-15 x cols 0-3 / 4-7 = a0..a3).
__device__ __forceinline__ tf32_frag<4> ldsm_a(const float* s, int r0, int c0, int lane) {
  float r[4];
  ts_ldsm_x4(reinterpret_cast<unsigned*>(r), s + (r0 + (lane & 15)) * LD + c0 + ((lane >> 4) << 2));
  return split<4>(r);
}
// B fragments of the n8 tiles at rows n0 and n0 + 8 of a padded [n][k] tile, k at c0 (S = Q K^T
// reads K so): lane l addresses row n0 + l % 8 + 8 (l / 16), floats c0 + 4 ((l / 8) % 2).
__device__ __forceinline__ tf32_frag<4> ldsm_b2(const float* s, int n0, int c0, int lane) {
  float r[4];
  ts_ldsm_x4(reinterpret_cast<unsigned*>(r), s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + c0 + (((lane >> 3) & 1) << 2));
  return split<4>(r);
}
// B fragment of the 8x8 block at (k0, n0) of a padded row-major [k][n] tile, k permuted as the
// A side's c_to_a: b0 = row k0 + 2t, b1 = row k0 + 2t + 1, column n0 + g.
__device__ __forceinline__ tf32_frag<2> lds_bt(const float* s, int k0, int n0, int lane) {
  const float* p = s + (k0 + 2 * (lane & 3)) * LD + n0 + (lane >> 2);
  const float r[2] = {p[0], p[LD]};
  return split<2>(r);
}
// An f32 C tile (16 x 8: columns 2t, 2t+1) as the A fragment of the next product, k permuted.
__device__ __forceinline__ tf32_frag<4> c_to_a(const float* c) {
  const float r[4] = {c[0], c[2], c[1], c[3]};
  return split<4>(r);
}

// ---------------------------------------------------------------------------------- forward
// A block: FWD_BM query rows of one (batch, head) (16 FWD_MT per warp); Q stays in shared
// memory, K/V tiles of FWD_BN keys stream through two stages (tile j+1's cp.async in flight
// while the warps compute tile j): S = Q K^T, the online softmax, O += P V.
#define FWD_THREADS (FWD_WARPS * 32)
#define FWD_BM (FWD_WARPS * 16 * FWD_MT)
extern "C" __global__ void __launch_bounds__(FWD_THREADS, 1)
ts_flash_fwd(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
             float* __restrict__ O, float* __restrict__ LSE, int H, int HKV, int SQ, int SK,
             float scale_log2, int causal, long long qsb, long long qsh, long long qss, long long ksb,
             long long ksh, long long kss) {
  extern __shared__ __align__(128) unsigned char ts_smem[];
  float* sQ = reinterpret_cast<float*>(ts_smem);       // FWD_BM x LD
  float* sK = sQ + FWD_BM * LD;                         // [2][FWD_BN x LD]
  float* sV = sK + 2 * FWD_BN * LD;                     // [2][FWD_BN x LD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / HKV);
  const long long q_base = b * qsb + h * qsh, kv_base = b * ksb + hk * ksh;
  // causal: the last query blocks see the most keys; start them first
  const int mblk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = mblk * FWD_BM, wrow = m0 + warp * 16 * FWD_MT, offset = SK - SQ;
  const int n_end = causal ? min(SK, m0 + FWD_BM + offset) : SK;
  const int ntiles = n_end > 0 ? (n_end + FWD_BN - 1) / FWD_BN : 0;
  auto load_kv = [&](int stage, int n0) {
    load_rows<FWD_BN, FWD_THREADS>(sK + stage * FWD_BN * LD, K + kv_base, n0, SK, kss, tid);
    load_rows<FWD_BN, FWD_THREADS>(sV + stage * FWD_BN * LD, V + kv_base, n0, SK, kss, tid);
  };
  load_rows<FWD_BM, FWD_THREADS>(sQ, Q + q_base, m0, SQ, qss, tid);
  ts_cp_async_commit();                                 // group 1: Q
  if (ntiles > 0) load_kv(0, 0);
  ts_cp_async_commit();                                 // group 2: K/V tile 0
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
    ts_cp_async_wait<1>();                              // tile it (and Q) retired ...
    __syncthreads();                                    // ... for every thread
    const float* ks = sK + st * FWD_BN * LD;
    const float* vs = sV + st * FWD_BN * LD;
    float s[FWD_MT][FWD_BN / 8][4];
    #pragma unroll
    for (int i = 0; i < FWD_MT; ++i)
      #pragma unroll
      for (int j = 0; j < FWD_BN / 8; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.f;
    #pragma unroll 1
    for (int kk = 0; kk < D / 8; ++kk) {
      tf32_frag<4> qa[FWD_MT];
      #pragma unroll
      for (int i = 0; i < FWD_MT; ++i) qa[i] = ldsm_a(sQ, wrow - m0 + i * 16, kk * 8, lane);
      #pragma unroll
      for (int j = 0; j < FWD_BN / 8; j += 2) {
        const tf32_frag<4> kb = ldsm_b2(ks, j * 8, kk * 8, lane);
        #pragma unroll
        for (int i = 0; i < FWD_MT; ++i) {
          mma_add(s[i][j], qa[i], kb.hi, kb.lo);
          mma_add(s[i][j + 1], qa[i], kb.hi + 2, kb.lo + 2);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < FWD_MT; ++i)
      flash_online_softmax<FWD_BN / 8, D / 8>(s[i], m_i[i], l_i[i], acc[i], wrow + i * 16, n0, m0, SK, causal, offset,
                                              scale_log2, g, t);
    // O += P V: the tile's products summed from zero, then added to O
    tf32_frag<4> pa[FWD_MT][FWD_BN / 8];
    #pragma unroll
    for (int i = 0; i < FWD_MT; ++i)
      #pragma unroll
      for (int kc = 0; kc < FWD_BN / 8; ++kc) pa[i][kc] = c_to_a(s[i][kc]);
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float pv[FWD_MT][4] = {};
      #pragma unroll
      for (int kc = 0; kc < FWD_BN / 8; ++kc) {
        const tf32_frag<2> vb = lds_bt(vs, kc * 8, j * 8, lane);
        #pragma unroll
        for (int i = 0; i < FWD_MT; ++i) mma(pv[i], pa[i][kc], vb);
      }
      #pragma unroll
      for (int i = 0; i < FWD_MT; ++i) add4(acc[i][j], pv[i]);
    }
    __syncthreads();                                    // every warp is done with stage st
  }
  ts_cp_async_wait<0>();                                // with no K/V tile, Q is still in flight
  #pragma unroll
  for (int i = 0; i < FWD_MT; ++i)
    flash_store_out<D / 8>(O + q_base, qss, LSE + (long long)bh * SQ, wrow + i * 16, SQ, acc[i], m_i[i], l_i[i], g, t);
}
"""


def render_flash32(head_dim: int = 64, precision: str = "f32") -> str:
    """The f32 kernels' source for ``head_dim``; ``precision`` "f32" (3xTF32) or "tf32" (1xTF32)."""
    if precision not in ("f32", "tf32") or not flash32_supports(head_dim):
        raise ValueError(f"render_flash32: head_dim {head_dim}, precision {precision!r}")
    c = flash32_config(head_dim)
    (fw, fmt, fbn), (kw, kbq), (qw, qbn) = c["fwd"], c["dkdv"], c["dq"]
    defs = (f"#define D {head_dim}\n#define TF32X {3 if precision == 'f32' else 1}\n#define FWD_WARPS {fw}\n"
            f"#define FWD_MT {fmt}\n#define FWD_BN {fbn}\n#define KV_WARPS {kw}\n#define KV_BQ {kbq}\n"
            f"#define DQ_WARPS {qw}\n#define DQ_BN {qbn}\n#define DELTA_WARPS {DELTA_WARPS}\n#define DELTA_T float\n")
    return defs + MMA_HEADER + FLASH_COMMON + FLASH32_SOURCE + FLASH_DELTA + FLASH32_BWD_SOURCE


def flash32_threads(head_dim: int, kernel: str) -> int:
    """Threads per block of ``kernel``."""
    c = flash32_config(head_dim)
    return 32 * {"ts_flash_fwd": c["fwd"][0], "ts_flash_bwd_dkdv": c["dkdv"][0], "ts_flash_bwd_dq": c["dq"][0],
                 "ts_flash_bwd_delta": DELTA_WARPS}[kernel]


def flash32_rows(head_dim: int, kernel: str) -> int:
    """Rows of its sequence (queries; keys for dK/dV) one block of ``kernel`` owns."""
    c = flash32_config(head_dim)
    return {"ts_flash_fwd": c["fwd"][0] * 16 * c["fwd"][1], "ts_flash_bwd_dkdv": c["dkdv"][0] * 16,
            "ts_flash_bwd_dq": c["dq"][0] * 16, "ts_flash_bwd_delta": DELTA_WARPS}[kernel]


def flash32_smem_bytes(head_dim: int, kernel: str, **_) -> int:
    """Dynamic shared memory of ``kernel`` (bytes): f32 rows of LD = head_dim + 4 floats."""
    row, c = 4 * (head_dim + 4), flash32_config(head_dim)
    if kernel == "ts_flash_fwd":
        return row * (flash32_rows(head_dim, kernel) + 4 * c["fwd"][2])       # Q; two stages of K and V
    if kernel == "ts_flash_bwd_dkdv":
        bq = c["dkdv"][1]
        return row * (2 * flash32_rows(head_dim, kernel) + 4 * bq) + 2 * 2 * bq * 4   # K, V; 2 stages of Q, dO, lse, delta
    if kernel == "ts_flash_bwd_dq":
        return row * (2 * flash32_rows(head_dim, kernel) + 4 * c["dq"][1])    # Q, dO; two stages of K and V
    return 0


register_source(KernelSource(
    "flash_attention_f32", render_flash32,
    ("ts_flash_fwd", "ts_flash_bwd_delta", "ts_flash_bwd_dkdv", "ts_flash_bwd_dq"),
    configs=[dict(head_dim=d, precision=p) for d in (64, 128) for p in ("f32", "tf32")] + [dict(head_dim=96)],
    smem_dynamic=lambda head_dim=64, precision="f32", kernel="ts_flash_bwd_dkdv": flash32_smem_bytes(head_dim, kernel),
    fast_math=False))          # exp2f/log2f to 2 ulp: f32 means f32
