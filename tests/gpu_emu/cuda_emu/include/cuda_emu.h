// Host emulation of the CUDA device language for tessera_rt's RawKernel sources.
//
// Force-included (g++ -include cuda_emu.h) ahead of a kernel source, so that the source
// compiles unchanged with the host compiler.  The execution model lives in runtime.cpp
// (a separate, uninstrumented translation unit): one fiber per CUDA thread, blocks run
// one after another, warp collectives and __syncthreads are scheduler rendezvous.  The
// kernel translation unit is compiled with -fsanitize=thread and runtime.cpp supplies the
// __tsan_* callbacks, which is how every global/shared memory access gets checked.
//
// Everything here that a kernel calls and that touches emulator state is an out-of-line
// function of the runtime: inline code in this header is instrumented like the kernel,
// and the runtime's own memory would otherwise look like an out-of-bounds access.
#pragma once
#define TS_CUDA_EMULATOR 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <bit>
#include <type_traits>
#include <utility>

// ----------------------------------------------------------------------------- keywords
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
// no __noinline__: as a macro it breaks libstdc++ 13+, whose headers spell the attribute
// __attribute__((__noinline__)) (seen with g++ on the GPU machine's image); no kernel uses it
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ variables live in one named section, whose bounds the linker exports
// as __start_/__stop_ts_emu_shared: that range is the block's static shared memory.  Blocks
// run sequentially, so one copy per module is one copy per block.  (GCC ignores the section
// for statics of inline/template functions; the Python side detects and rejects that.)
// constinit: CUDA forbids initializers on __shared__, and without it GCC guards the
// (trivial) default-initialization of class-type arrays such as __half with a lock.
// `extern __shared__ T name[];` is rewritten by the Python side before compilation.
#define __shared__ static constinit __attribute__((section("ts_emu_shared")))

// ----------------------------------------------------------------------------- built-in vector types
struct uint3 { unsigned x, y, z; };
typedef uint3 dim3;

// 16-byte vector types copy through a GCC vector so that a load or store of one is a
// single 16-byte access (reaching the checker as __tsan_read16/__tsan_write16), like the
// GPU's 128-bit ld/st that faults unless 16-byte aligned.  With implicit copies GCC splits
// `uint4 v = *p; use(v.x, v.y)` into separate 4-byte loads, hiding a misaligned pointer.
#define TS_EMU_VEC4(name, T)                                                              \
  struct __attribute__((aligned(16))) name {                                              \
    union { T v __attribute__((vector_size(16))); struct { T x, y, z, w; }; };            \
    name() = default;                                                                     \
    name(const name& o) : v(o.v) {}                                                       \
    name& operator=(const name& o) { v = o.v; return *this; }                            \
  };                                                                                      \
  inline name make_##name(T x, T y, T z, T w) { name r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
TS_EMU_VEC4(uint4, unsigned)
TS_EMU_VEC4(int4, int)
TS_EMU_VEC4(float4, float)
#undef TS_EMU_VEC4
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(8))) float2 { float x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

// ----------------------------------------------------------------------------- runtime entry points
extern "C" {
uint3 ts_emu_thread_idx(void);
uint3 ts_emu_block_idx(void);
uint3 ts_emu_block_dim(void);
uint3 ts_emu_grid_dim(void);
void ts_emu_syncthreads(void);
void* ts_emu_dynamic_smem(void);
// One warp-wide shuffle: `kind` is a TsEmuShfl, `arg` the lane / delta / lane mask.
unsigned long long ts_emu_shfl(unsigned mask, unsigned long long bits, int kind, int arg, int width);
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, d = a*b + d, as a
// warp collective; fragment layouts as in the PTX ISA (see runtime.cpp).
void ts_emu_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, int is_bf16);
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, d = a*b + d (runtime.cpp): A 16x8 in four
// 32-bit registers, B 8x8 in two, C/D 16x8 f32 in four; an operand's low 13 bits are ignored.
void ts_emu_mma_m16n8k8_tf32(float* d, const unsigned* a, const unsigned* b);
// ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16 r, [p], as a warp collective (runtime.cpp).
void ts_emu_ldmatrix(unsigned* r, const void* p, int num, int trans);
// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size; commit_group; wait_group n;
// wait_all: per thread, the destination in flight until a wait retires its group (runtime.cpp).
void ts_emu_cp_async(void* dst, const void* src, int cp_size, int src_size, int cg);
void ts_emu_cp_async_commit(void);
void ts_emu_cp_async_wait(int n);
void ts_emu_cp_async_wait_all(void);
}
#define threadIdx (ts_emu_thread_idx())
#define blockIdx (ts_emu_block_idx())
#define blockDim (ts_emu_block_dim())
#define gridDim (ts_emu_grid_dim())
constexpr int warpSize = 32;
inline void __syncthreads() { ts_emu_syncthreads(); }

enum TsEmuShfl { TS_EMU_SHFL_IDX, TS_EMU_SHFL_UP, TS_EMU_SHFL_DOWN, TS_EMU_SHFL_XOR };

template <class T> inline T ts_emu_shfl_value(unsigned mask, T value, TsEmuShfl kind, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move up to 64 bits");
  unsigned long long bits = 0;
  __builtin_memcpy(&bits, &value, sizeof(T));
  bits = ts_emu_shfl(mask, bits, kind, arg, width);
  __builtin_memcpy(&value, &bits, sizeof(T));
  return value;
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ts_emu_shfl_value(mask, v, TS_EMU_SHFL_IDX, src_lane, width);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ts_emu_shfl_value(mask, v, TS_EMU_SHFL_UP, (int)delta, width);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ts_emu_shfl_value(mask, v, TS_EMU_SHFL_DOWN, (int)delta, width);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ts_emu_shfl_value(mask, v, TS_EMU_SHFL_XOR, lane_mask, width);
}

// ----------------------------------------------------------------------------- math
// --use_fast_math intrinsics are computed with the precise libm functions.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }

// cvt.rna.tf32.f32 (PTX ISA, cvt): f32 to tf32, rounded to nearest with ties away from zero, to
// 10 explicit mantissa bits.  The result is an f32 bit pattern whose low 13 bits are zero (how
// the tensor cores read a .tf32 register).  Adding half a tf32 ulp (0x1000) to the magnitude
// bits and clearing the low 13 rounds ties away from zero, carries into the exponent (the
// largest finite values round to infinity, as rna does without .satfinite) and treats
// subnormals the same way; infinities stay infinite, a NaN stays a NaN (canonical 0x7fffffff).
inline unsigned ts_emu_cvt_rna_tf32(float x) {
  const unsigned u = std::bit_cast<unsigned>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffffffu;
  if ((u & 0x7fffffffu) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
}

// ----------------------------------------------------------------------------- entry trampolines
// The Python side appends TS_EMU_ENTRY(name) for every `extern "C" __global__` kernel:
// ts_emu_entry_<name> unpacks CuPy-style `void** args` (args[i] points at parameter i's
// bytes) into the typed parameters; ts_emu_params_<name> reports sizeof of each parameter
// so that the launcher can check the caller's argument list.  The unpacking reads the
// caller's argument block, so it must not be instrumented; GCC then also keeps the kernel
// out of line (it does not inline across differing sanitizer attributes).
template <class... P, size_t... I>
__attribute__((no_sanitize_thread)) inline void ts_emu_call_unpacked(void (*kernel)(P...), void** args,
                                                                     std::index_sequence<I...>) {
  kernel(*static_cast<P*>(args[I])...);
}
template <class... P> constexpr size_t ts_emu_arity(void (*)(P...)) { return sizeof...(P); }
template <class... P> inline int ts_emu_param_sizes(void (*)(P...), unsigned long long* sizes, int capacity) {
  const unsigned long long all[] = {sizeof(P)..., 0};
  for (int i = 0; i < (int)sizeof...(P) && i < capacity; ++i) sizes[i] = all[i];
  return (int)sizeof...(P);
}
#define TS_EMU_ENTRY(name)                                                                           \
  extern "C" __attribute__((no_sanitize_thread)) void ts_emu_entry_##name(void** args) {             \
    ts_emu_call_unpacked(name, args, std::make_index_sequence<ts_emu_arity(name)>());                 \
  }                                                                                                  \
  extern "C" int ts_emu_params_##name(unsigned long long* sizes, int capacity) {                     \
    return ts_emu_param_sizes(name, sizes, capacity);                                                \
  }
