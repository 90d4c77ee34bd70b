"""Device helpers shared by the RawKernel sources, and the launcher plumbing around CuPy.

The tensor-core kernels use ``mma.sync.aligned.m16n8k16`` through inline PTX, whose
fragment layouts the PTX ISA documents (unlike WMMA's opaque fragments), so a kernel can
rescale accumulator rows in registers (the online softmax needs that) and feed an f32
accumulator straight back in as the A operand of the next MMA (P·V, FlashAttention-2).
For lane ``l``, ``g = l / 4`` and ``t = l % 4``:

* A (16x16, row-major): regs a0..a3 hold rows {g, g+8, g, g+8}, cols {2t, 2t, 2t+8, 2t+8} (+0/+1).
* B (16x8, "col"): regs b0, b1 hold k = 2t (+0/+1) and 2t+8 (+0/+1) of column n = g.
* C (16x8, f32): c0, c1 are row g, cols 2t, 2t+1; c2, c3 are row g+8.

f32 operands use ``mma.sync.aligned.m16n8k8`` with .tf32 (``ts_mma_tf32``, ``ts_tf32``,
``ts_split_tf32``/``ts_mma_3xtf32`` for f32-accurate products; layouts beside them).

CuPy is imported inside the launch helpers only.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["scratch", "MAX_GRID_YZ", "MMA_HEADER", "SMEM_TILE", "HALF_IO", "ELEM_IO", "BLOCK_REDUCE", "IO_CODES", "io_name", "io_code",
           "io_defines", "get_function", "launch_stream", "device_key", "aligned", "is_aligned", "all_aligned",
           "sm_count", "VEC16_TO_F32"]

# A row kernel's I/O element type: ``in_t`` is float, __half or __nv_bfloat16 as TS_IO is 0, 1
# or 2 (``IO_CODES``); ``to_f``/``from_f`` convert to and from the f32 the kernel computes in.
HALF_IO = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef TS_IO
#define TS_IO 0
#endif
#if TS_IO == 1
typedef __half in_t;
__device__ __forceinline__ float to_f(in_t x) { return __half2float(x); }
__device__ __forceinline__ in_t from_f(float x) { return __float2half(x); }
#elif TS_IO == 2
typedef __nv_bfloat16 in_t;
__device__ __forceinline__ float to_f(in_t x) { return __bfloat162float(x); }
__device__ __forceinline__ in_t from_f(float x) { return __float2bfloat16(x); }
#else
typedef float in_t;
__device__ __forceinline__ float to_f(in_t x) { return x; }
__device__ __forceinline__ in_t from_f(float x) { return x; }
#endif
"""

# The fused kernels' element types, picked by number so one source serves every dtype:
# TS_IO (0 f32, 1 f16, 2 bf16, 3 f64) is ``io_t``, TS_WIO (default TS_IO) is ``w_t`` (a norm's
# weight may be f32 beside bf16 activations).  ``ts_load<W>``/``ts_store<W>`` move W elements
# in the fewest accesses of up to 16 bytes (the caller guarantees the alignment), converting
# to and from the f32 (or f64) the kernels compute in.
ELEM_IO = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef TS_IO
#define TS_IO 0
#endif
#ifndef TS_WIO
#define TS_WIO TS_IO
#endif
template <int K> struct ts_elem { typedef float t; };
template <> struct ts_elem<1> { typedef __half t; };
template <> struct ts_elem<2> { typedef __nv_bfloat16 t; };
template <> struct ts_elem<3> { typedef double t; };
typedef ts_elem<TS_IO>::t io_t;
typedef ts_elem<TS_WIO>::t w_t;
constexpr int VEC = 16 / sizeof(io_t);        // io_t elements per 16-byte access

__device__ __forceinline__ float ts_f(float x) { return x; }
__device__ __forceinline__ float ts_f(double x) { return (float)x; }
__device__ __forceinline__ float ts_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float ts_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ double ts_d(T x) { return (double)ts_f(x); }
template <> __device__ __forceinline__ double ts_d<double>(double x) { return x; }
template <class T> __device__ __forceinline__ T ts_to(float x) { return x; }
template <> __device__ __forceinline__ __half ts_to<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 ts_to<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <class T> __device__ __forceinline__ void ts_set(float& f, T e) { f = ts_f(e); }
template <class T> __device__ __forceinline__ void ts_set(double& f, T e) { f = ts_d(e); }

template <int B> struct ts_word;              // an unsigned type of B bytes: one access
template <> struct ts_word<2> { typedef unsigned short t; };
template <> struct ts_word<4> { typedef unsigned t; };
template <> struct ts_word<8> { typedef uint2 t; };
template <> struct ts_word<16> { typedef uint4 t; };
template <int W, class T> struct ts_access {  // bytes and elements per access of a W-wide run
  static constexpr int bytes = W * sizeof(T) < 16 ? W * sizeof(T) : 16;
  static constexpr int elems = bytes / sizeof(T);
  typedef typename ts_word<bytes>::t word;
};

template <int W, class T, class F> __device__ __forceinline__ void ts_load(const T* p, F* f) {
  typedef ts_access<W, T> A;
  #pragma unroll
  for (int j = 0; j < W; j += A::elems) {
    const typename A::word u = *reinterpret_cast<const typename A::word*>(p + j);
    const T* e = reinterpret_cast<const T*>(&u);
    #pragma unroll
    for (int i = 0; i < A::elems; ++i) ts_set(f[j + i], e[i]);
  }
}
template <int W, class T> __device__ __forceinline__ void ts_store(T* p, const float* f) {
  typedef ts_access<W, T> A;
  #pragma unroll
  for (int j = 0; j < W; j += A::elems) {
    typename A::word u;
    T* e = reinterpret_cast<T*>(&u);
    #pragma unroll
    for (int i = 0; i < A::elems; ++i) e[i] = ts_to<T>(f[j + i]);
    *reinterpret_cast<typename A::word*>(p + j) = u;
  }
}

// A 0-d device scalar of element type `kind` (0 f32, 1 f16, 2 bf16, 3 f64).
__device__ __forceinline__ double ts_scalar(const void* p, int kind) {
  switch (kind) {
    case 1: return ts_d(*static_cast<const __half*>(p));
    case 2: return ts_d(*static_cast<const __nv_bfloat16*>(p));
    case 3: return *static_cast<const double*>(p);
    default: return *static_cast<const float*>(p);
  }
}
// Element i of an int32 (ids64 == 0) or int64 id array.
__device__ __forceinline__ long long ts_id(const void* ids, long long i, int ids64) {
  return ids64 ? static_cast<const long long*>(ids)[i] : (long long)static_cast<const int*>(ids)[i];
}

#ifdef TS_CUDA_EMULATOR
// IEEE operations that never contract into a fused multiply-add (the host compiler, for x86-64
// without FMA, contracts nothing; on a GPU these keep --use_fast_math's contraction out)
__device__ __forceinline__ float __fadd_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float __fsub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float __fmul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float __fdiv_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float __fsqrt_rn(float a) { return sqrtf(a); }
#endif
"""

# Reductions over a block whose every thread takes part (blockDim.x a multiple of 32, at most
# 1024): each warp reduces by a butterfly (every lane ends with the same bits), then one warp
# reduces the warps' values in a fixed tree, so a result never depends on scheduling.
BLOCK_REDUCE = r"""
template <bool MAX, class T> __device__ __forceinline__ T ts_warp_reduce(T v) {
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, w);
    v = MAX ? (o > v ? o : v) : v + o;
  }
  return v;
}
// K sums (or maxima) over the block, returned to every thread in v; scratch: 32 * K values.
template <bool MAX, int K, class T> __device__ __forceinline__ void ts_block_reduce(T* v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  #pragma unroll
  for (int k = 0; k < K; ++k) v[k] = ts_warp_reduce<MAX>(v[k]);
  __syncthreads();                      // the scratch may still be read by the previous reduction
  if (lane == 0) {
    #pragma unroll
    for (int k = 0; k < K; ++k) scratch[k * 32 + warp] = v[k];
  }
  __syncthreads();
  #pragma unroll
  for (int k = 0; k < K; ++k)
    v[k] = ts_warp_reduce<MAX>(lane < warps ? scratch[k * 32 + lane] : (MAX ? (T)-INFINITY : (T)0));
}
"""

MMA_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef TS_BF16
#define TS_BF16 0
#endif
#if TS_BF16
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define TS_MMA_TYPE "bf16"
__device__ __forceinline__ elem2_t ts_pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float ts_float(elem_t x) { return __bfloat162float(x); }
__device__ __forceinline__ elem_t ts_elem(float x) { return __float2bfloat16(x); }
#else
typedef __half elem_t;
typedef __half2 elem2_t;
#define TS_MMA_TYPE "f16"
__device__ __forceinline__ elem2_t ts_pack(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float ts_float(elem_t x) { return __half2float(x); }
__device__ __forceinline__ elem_t ts_elem(float x) { return __float2half(x); }
#endif

__device__ __forceinline__ unsigned ts_u32(elem2_t v) { return *reinterpret_cast<unsigned*>(&v); }

// d += a * b for one m16n8k16 tile, f32 accumulators.
__device__ __forceinline__ void ts_mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef TS_CUDA_EMULATOR
  // the CPU emulation harness (tests/gpu_emu) computes the MMA from the PTX ISA's fragment tables
  ts_emu_mma_m16n8k16(d, a, b, TS_BF16);
#else
  asm volatile(
    "mma.sync.aligned.m16n8k16.row.col.f32." TS_MMA_TYPE "." TS_MMA_TYPE ".f32 "
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- TF32 tensor cores for f32 operands: mma.sync m16n8k8 .tf32 (sm_80+).  Fragments, for lane l,
// g = l / 4, t = l % 4, one element per 32-bit register: A (16x8) a0..a3 = A[g][t], A[g+8][t],
// A[g][t+4], A[g+8][t+4]; B (8x8, "col") b0, b1 = B[t][g], B[t+4][g]; C as m16n8k16's.
// ts_tf32: cvt.rna.tf32.f32, x rounded to 10 mantissa bits (nearest, ties away from zero), as
// the f32 bit pattern with the low 13 bits zero.  An operand passed without it is truncated by
// the tensor core (the ISA leaves the use of the low 13 bits to the implementation).
__device__ __forceinline__ unsigned ts_tf32(float x) {
#ifdef TS_CUDA_EMULATOR
  return ts_emu_cvt_rna_tf32(x);
#else
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#endif
}

// d += a * b for one m16n8k8 tile of tf32 operands, f32 accumulators.
__device__ __forceinline__ void ts_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_mma_m16n8k8_tf32(d, a, b);
#else
  asm volatile(
    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// 3xTF32: x = hi + lo with hi = tf32(x), lo = tf32(x - hi) (x - hi is exact in f32), so that
// a b = hi_a hi_b + hi_a lo_b + lo_a hi_b + lo_a lo_b, where the dropped last term is below
// 2^-22 |a b| and each kept one is an exact f32 product in the tensor core.
__device__ __forceinline__ void ts_split_tf32(float x, unsigned& hi, unsigned& lo) {
  hi = ts_tf32(x);
  lo = ts_tf32(x - __uint_as_float(hi));
}
// d += a * b in 3xTF32 from split fragments: the two small cross terms first, so that they
// are added to the accumulator before the large term can swamp their low bits.
__device__ __forceinline__ void ts_mma_3xtf32(float* d, const unsigned* a_hi, const unsigned* a_lo,
                                              const unsigned* b_hi, const unsigned* b_lo) {
  ts_mma_tf32(d, a_lo, b_hi);
  ts_mma_tf32(d, a_hi, b_lo);
  ts_mma_tf32(d, a_hi, b_hi);
}

// A fragment of a 16x16 tile at `s` (row-major, leading dim `ld` elements, ld even).
__device__ __forceinline__ void ts_load_a(unsigned* a, const elem_t* s, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  a[0] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t);
  a[1] = *reinterpret_cast<const unsigned*>(s + (g + 8) * ld + 2 * t);
  a[2] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t + 8);
  a[3] = *reinterpret_cast<const unsigned*>(s + (g + 8) * ld + 2 * t + 8);
}

// B fragment of a 16(k)x8(n) tile stored n-major at `s` (element (k, n) at s[n * ld + k]).
__device__ __forceinline__ void ts_load_b(unsigned* b, const elem_t* s, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  b[0] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t);
  b[1] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t + 8);
}

// Two f32 C tiles (cols 0-7 and 8-15 of a 16x16 block) as the A fragment of the next MMA.
__device__ __forceinline__ void ts_c_to_a(unsigned* a, const float* c0, const float* c1) {
  a[0] = ts_u32(ts_pack(c0[0], c0[1]));
  a[1] = ts_u32(ts_pack(c0[2], c0[3]));
  a[2] = ts_u32(ts_pack(c1[0], c1[1]));
  a[3] = ts_u32(ts_pack(c1[2], c1[3]));
}

// ---- sm_80 data movement: ldmatrix (shared -> fragments) and cp.async (global -> shared)
// ldmatrix.m8n8.x{1,2,4}{.trans}.b16: lane 8i + j passes the shared address of row j (16 bytes,
// 16-byte aligned) of 8x8 matrix i; lane l receives in r[i] row l/4, elements 2(l%4), +1 of
// matrix i (.trans: of its transpose).  So for a 16x16 A tile at row-major `p`, lane l passes
// row l % 16, column 8 (l / 16) and gets a0..a3 in mma order; the same lane pattern with .trans
// on a row-major [k][n] tile gives the B fragments of two n8 tiles.
__device__ __forceinline__ void ts_ldsm_x4(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 4, 0);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}
__device__ __forceinline__ void ts_ldsm_x4_t(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 4, 1);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}
__device__ __forceinline__ void ts_ldsm_x2(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 2, 0);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}
__device__ __forceinline__ void ts_ldsm_x2_t(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 2, 1);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}
__device__ __forceinline__ void ts_ldsm_x1(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 1, 0);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}
__device__ __forceinline__ void ts_ldsm_x1_t(unsigned* r, const void* p) {
#ifdef TS_CUDA_EMULATOR
  ts_emu_ldmatrix(r, p, 1, 1);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0]) : "r"((unsigned)__cvta_generic_to_shared(p)));
#endif
}

// cp.async of BYTES (4, 8, 16) from global `src` to shared `dst`, both BYTES-aligned; only the
// first `src_bytes` are read, the rest of dst is zero-filled (src_bytes = 0: a zero row past a
// matrix edge; `src` must still be a valid address).  16 bytes go .cg (L2 only: a streamed tile
// is not reused from L1), smaller ones .ca.  Not visible until ts_cp_async_wait retires the
// group (and, for other threads, a __syncthreads after it).
template <int BYTES> __device__ __forceinline__ void ts_cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#ifdef TS_CUDA_EMULATOR
  ts_emu_cp_async(dst, src, BYTES, src_bytes, BYTES == 16);
#else
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "n"(BYTES), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void ts_cp_async_commit() {
#ifdef TS_CUDA_EMULATOR
  ts_emu_cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Wait until at most N of this thread's most recently committed groups are still in flight.
template <int N> __device__ __forceinline__ void ts_cp_async_wait() {
#ifdef TS_CUDA_EMULATOR
  ts_emu_cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}
__device__ __forceinline__ void ts_cp_async_wait_all() {
#ifdef TS_CUDA_EMULATOR
  ts_emu_cp_async_wait_all();
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Reductions over the 4 lanes that share a C row (lanes 4g .. 4g+3).
__device__ __forceinline__ float ts_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float ts_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
"""

# Shared-memory tiles of 16-bit elements for ldmatrix, filled by cp.async (MMA_HEADER first).
# A tile is ROWS x COLS elements, COLS a multiple of 8, stored row after row with no padding; its
# 16-byte chunks are XOR-swizzled (chunk c of row r stored at c ^ f(r)) so that the eight rows one
# ldmatrix reads at one chunk column, and the eight chunks a quarter-warp's cp.async writes along a
# row, lie in eight different 16-byte bank groups: both conflict-free (CUTLASS's Swizzle<3,3,3>
# for rows of 8+ chunks; for 4-chunk rows, pairs of rows share one 128-byte line).
SMEM_TILE = r"""
template <int CH> __device__ __forceinline__ int ts_swz_chunk(int r, int c) {
  return CH >= 8 ? (c ^ (r & 7)) : (c ^ ((r / (8 / CH)) & (CH - 1)));
}
// element offset of (r, col) in a swizzled tile of CH chunks per row
template <int CH> __device__ __forceinline__ int ts_swz(int r, int col) {
  return r * CH * 8 + ts_swz_chunk<CH>(r, col >> 3) * 8 + (col & 7);
}

// Rows [r0, r0 + ROWS_) x cols [c0, c0 + COLS_) of a row-major matrix (leading dim `ld`, `rows` x
// `cols`) into the swizzled tile `s`, VEC_ elements per copy (8: 16-byte cp.async.cg; 4, 2: 8-,
// 4-byte cp.async.ca; 1: a plain load and store, for odd widths).  Past the matrix the tile gets
// zeros (cp.async's src-size 0: nothing is read; the source address stays the matrix's base).
// The caller guarantees that VEC_ divides `cols` and `ld`, and that `g` is 2 VEC_-byte aligned.
template <int ROWS_, int COLS_, int VEC_, int THREADS_>
__device__ __forceinline__ void ts_load_tile(elem_t* s, const elem_t* g, long long ld, int r0, int c0, int rows,
                                             int cols, int tid) {
  constexpr int PER_ROW = COLS_ / VEC_, COPIES = ROWS_ * PER_ROW;
  auto copy = [&](int i) {
    const int r = i / PER_ROW, c = (i % PER_ROW) * VEC_;
    const bool ok = r0 + r < rows && c0 + c < cols;
    const elem_t* src = g + (ok ? (long long)(r0 + r) * ld + c0 + c : 0);
    elem_t* dst = s + ts_swz<COLS_ / 8>(r, c);
    if constexpr (VEC_ == 1)
      *reinterpret_cast<unsigned short*>(dst) = ok ? *reinterpret_cast<const unsigned short*>(src) : (unsigned short)0;
    else
      ts_cp_async<VEC_ * 2>(dst, src, ok ? VEC_ * 2 : 0);
  };
  if constexpr (VEC_ == 1) {
    // synchronous loads, four in flight (fully unrolled, each would hold a register until its store)
    #pragma unroll 4
    for (int i = tid; i < COPIES; i += THREADS_) copy(i);
  } else {
    #pragma unroll
    for (int j = 0; j < (COPIES + THREADS_ - 1) / THREADS_; ++j)
      if (COPIES % THREADS_ == 0 || tid + j * THREADS_ < COPIES) copy(tid + j * THREADS_);
  }
}
"""

MAX_GRID_YZ = 65535     # CUDA caps gridDim.y and gridDim.z here (gridDim.x at 2**31 - 1)

# cache: (source, name, options, device) -> the compiled RawKernel function
_FUNCS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def device_key() -> tuple[int, str]:
    """(device id, compute capability) of the current CuPy device: part of every cache key."""
    import cupy
    dev = cupy.cuda.Device()
    return dev.id, dev.compute_capability


def get_function(name: str, entry: str, config: dict, render: Callable[..., str],
                 dynamic_smem: int = 0, fast_math: bool = True):
    """The compiled ``entry`` of ``render(**config)``, cached by (name, config, device).

    ``config`` carries the dtype and tile, so the key is the convention's
    (name, dtype, tile, device).  Kernels asking for more than 48 KiB of dynamic shared
    memory get the opt-in attribute set once here.  ``fast_math=False`` compiles without
    ``--use_fast_math`` (exact ``expf``/``logf``: the f32 attention kernels).
    """
    import cupy
    key = (name, entry, tuple(sorted(config.items())), device_key())
    with _LOCK:
        fn = _FUNCS.get(key)
        if fn is None:
            options = ("-std=c++17", "--use_fast_math") if fast_math else ("-std=c++17",)
            module = cupy.RawModule(code=render(**config), options=options)
            fn = module.get_function(entry)
            _FUNCS[key] = fn
        if dynamic_smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < dynamic_smem:
            fn.max_dynamic_shared_size_bytes = dynamic_smem
    return fn


def launch_stream(stream: Any):
    """A CuPy stream context for ``stream`` (a runtime CudaStream, a CuPy stream, or None)."""
    import contextlib

    import cupy
    if stream is None:
        return contextlib.nullcontext()
    raw = getattr(stream, "raw", stream)
    if isinstance(raw, cupy.cuda.Stream):
        return raw
    if hasattr(stream, "ptr"):
        return cupy.cuda.ExternalStream(stream.ptr)
    raise TypeError(f"expected a CUDA stream, got {type(stream).__name__}")


IO_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}
IO_CODES = {"f32": 0, "f16": 1, "bf16": 2, "f64": 3}          # ELEM_IO's numbers


def io_name(dtype) -> str | None:
    """The config name of ``dtype`` for ELEM_IO sources ("f32", "f16", "bf16", "f64"; None for others)."""
    import numpy as np
    return IO_NAMES.get(np.dtype(dtype).name)


def io_code(dtype) -> int | None:
    """ELEM_IO's number for ``dtype`` (a kernel's scalar ``kind`` argument), None for others."""
    name = io_name(dtype)
    return None if name is None else IO_CODES[name]


def io_defines(io: str = "f32", wio: str | None = None) -> str:
    """The ``#define``s that pick ELEM_IO's ``io_t`` (and ``w_t``, default ``io_t``)."""
    return f"#define TS_IO {IO_CODES[io]}\n#define TS_WIO {IO_CODES[wio or io]}\n"


def all_aligned(nbytes: int, *arrays: Any) -> bool:
    """Do all the device arrays given (None skipped) start on an ``nbytes`` boundary?"""
    return all(a is None or a.data.ptr % nbytes == 0 for a in arrays)


def is_aligned(a: Any, nbytes: int) -> bool:
    """Does device array ``a`` start on an ``nbytes`` boundary (what a vector load needs)?"""
    return a.data.ptr % nbytes == 0


def aligned(a: Any, nbytes: int):
    """``a``, or an aligned copy where ``a`` is a view starting mid-word (e.g. ``x[1:]``).

    The kernels read two halves as one 32-bit word or eight as one 16-byte ``uint4``; on a
    GPU such a load from a misaligned address faults.  CuPy's allocations are 256-byte
    aligned, so a copy always is.  Call inside the launch's stream context.
    """
    return a if is_aligned(a, nbytes) else a.copy()


# cache: device id -> its multiprocessor count
_SMS: dict = {}


def sm_count() -> int:
    """Streaming multiprocessors of the current CuPy device (asked once per device): what a
    launcher sizes a grid by to give every SM enough blocks."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return _SMS[dev]


# cache: (device, stream, name, elements, dtype) -> a scratch array the launcher reuses
_SCRATCH: dict = {}


def scratch(name: str, size: int, dtype) -> Any:
    """A kernel's scratch array of ``size`` elements, allocated once per device, stream and size
    and then reused (call inside the launch's stream context).

    Launches on one stream run in order, so reusing the array between calls is safe.  Kept for
    the process's life: a CUDA graph captured with it (decode steps) replays into the same
    bytes, and an allocation made while capturing would be freed under the graph.
    """
    import cupy
    import numpy as np
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr, name, int(size), np.dtype(dtype).str)
    if key not in _SCRATCH:
        _SCRATCH[key] = cupy.empty(int(size), dtype)
    return _SCRATCH[key]


# A 16-byte word of ELEM_IO's io_t (f32, f16 or bf16) to f32 by bit operations only: taking
# the word's address to read it as io_t (ts_load) can put it in local memory (a stack frame).
VEC16_TO_F32 = r"""
__device__ __forceinline__ float ts_half_bits_f(unsigned h) {
#if TS_IO == 1
  return __half2float(__ushort_as_half((unsigned short)h));
#else
  return __uint_as_float(h << 16);                  // bf16 is the top half of an f32
#endif
}
__device__ __forceinline__ void ts_vec16_f(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
#if TS_IO == 0
    f[i] = __uint_as_float(w[i]);
#else
    f[2 * i] = ts_half_bits_f(w[i] & 0xffffu);
    f[2 * i + 1] = ts_half_bits_f(w[i] >> 16);
#endif
  }
}
"""
