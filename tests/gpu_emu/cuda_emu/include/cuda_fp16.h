// Host emulation of CUDA's __half: the bit layout, and conversions that round like the
// hardware (f32 -> f16 round-to-nearest-even, overflow to infinity, gradual underflow).
// Only conversions are provided, not __half arithmetic operators.
#pragma once
#include <math.h>
#include <stdint.h>
#include <bit>

inline unsigned short ts_emu_f32_to_f16_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
  const uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7fffu;                        // NaN: CUDA's canonical f16 NaN
  if (mag >= 0x477ff000u) return sign | 0x7c00u;                // >= 65520 rounds to infinity
  if (mag < 0x38800000u) {                                      // below 2^-14: f16 subnormal (or zero)
    // |f| * 2^24 is exact, and rintf rounds to nearest even; 1024 is the smallest normal's code.
    return sign | (unsigned short)rintf(std::bit_cast<float>(mag) * 16777216.f);
  }
  const uint32_t rebiased = mag - 0x38000000u;                  // exponent bias 127 -> 15
  return sign | (unsigned short)((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13);
}

inline float ts_emu_f16_bits_to_f32(unsigned short h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {                                               // zero / subnormal: man * 2^-24
    const float v = (float)man * (1.f / 16777216.f);
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

struct __attribute__((aligned(2))) __half {
  unsigned short __x;
  __half() = default;                      // trivial, like CUDA's: __shared__ arrays need no constructor
  __half(__half_raw r) : __x(r.x) {}
  __half(float f) : __x(ts_emu_f32_to_f16_bits(f)) {}
  operator float() const { return ts_emu_f16_bits_to_f32(__x); }
  operator __half_raw() const { return {__x}; }
};

struct __attribute__((aligned(4))) __half2 {
  __half x, y;
  __half2() = default;
  __half2(__half a, __half b) : x(a), y(b) {}
};

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return ts_emu_f16_bits_to_f32(h.__x); }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2(__half(lo), __half(hi)); }
inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
inline __half2 __halves2half2(__half lo, __half hi) { return __half2(lo, hi); }
inline float __low2float(__half2 v) { return __half2float(v.x); }
inline float __high2float(__half2 v) { return __half2float(v.y); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short x) { return __half(__half_raw{x}); }
