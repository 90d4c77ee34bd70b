// Host emulation of CUDA's __nv_bfloat16: the top half of an IEEE f32, converted with
// round-to-nearest-even (CUDA's __float2bfloat16), NaN kept a NaN.
#pragma once
#include <stdint.h>
#include <bit>

inline unsigned short ts_emu_f32_to_bf16_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;         // NaN: CUDA's canonical bf16 NaN
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);   // overflow carries into infinity
}
inline float ts_emu_bf16_bits_to_f32(unsigned short b) { return std::bit_cast<float>((uint32_t)b << 16); }

struct __nv_bfloat16_raw { unsigned short x; };

struct __attribute__((aligned(2))) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(ts_emu_f32_to_bf16_bits(f)) {}
  operator float() const { return ts_emu_bf16_bits_to_f32(__x); }
  operator __nv_bfloat16_raw() const { return {__x}; }
};

struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return ts_emu_bf16_bits_to_f32(b.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162(__nv_bfloat16(lo), __nv_bfloat16(hi));
}
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __nv_bfloat162(__nv_bfloat16(f), __nv_bfloat16(f)); }
