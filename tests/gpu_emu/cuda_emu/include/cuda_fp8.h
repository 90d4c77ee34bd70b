// Host emulation of CUDA's FP8 conversion intrinsics (cuda_fp8.h):
// E4M3 (bias 7, no infinity, S.1111.111 is NaN, max 448) and E5M2 (bias 15, IEEE-like,
// max 57344).  f32 -> fp8 rounds to nearest even; out-of-range values saturate to the
// largest finite value under __NV_SATFINITE, else become NaN (E4M3) / infinity (E5M2).
#pragma once
#include <math.h>
#include <cuda_fp16.h>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

struct TsEmuFp8Format { int man_bits, bias; unsigned char max_finite, overflow; };
inline TsEmuFp8Format ts_emu_fp8_format(__nv_fp8_interpretation_t fmt) {
  return fmt == __NV_E5M2 ? TsEmuFp8Format{2, 15, 0x7b, 0x7c} : TsEmuFp8Format{3, 7, 0x7e, 0x7f};
}

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t fmt) {
  const TsEmuFp8Format f = ts_emu_fp8_format(fmt);
  if (isnan(x)) return 0x7f;
  const unsigned char sign = signbit(x) ? 0x80 : 0x00;
  const float a = fabsf(x);
  const float one_ulp_scale = ldexpf(1.f, f.man_bits);
  unsigned code;
  if (isinf(a)) {
    code = f.max_finite + 1u;                          // handled as an overflow below
  } else if (a < ldexpf(1.f, 1 - f.bias)) {
    // subnormal range: the code is the value in units of the smallest subnormal, rounded
    // to nearest even (the exact scaling cannot round); reaching 2^man_bits is the smallest normal.
    code = (unsigned)rintf(ldexpf(a, f.bias - 1 + f.man_bits));
  } else {
    int e;
    const float m = frexpf(a, &e);                     // a = m * 2^e, m in [0.5, 1)
    const unsigned q = (unsigned)rintf((2.f * m - 1.f) * one_ulp_scale);   // exact product, RNE
    code = ((unsigned)(e - 1 + f.bias) << f.man_bits) + q;   // q == 2^man_bits carries into the exponent
  }
  if (code > f.max_finite) code = sat == __NV_SATFINITE ? f.max_finite : f.overflow;
  return (__nv_fp8_storage_t)(sign | code);
}

inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t q, __nv_fp8_interpretation_t fmt) {
  if (fmt == __NV_E5M2) return __half_raw{(unsigned short)(q << 8)};   // E5M2 is the top byte of an f16
  const unsigned short sign = (unsigned short)((q & 0x80) << 8);
  const unsigned exp = (q >> 3) & 0xf, man = q & 0x7;
  if (exp == 0xf && man == 0x7) return __half_raw{(unsigned short)(sign | 0x7fff)};
  // every E4M3 value is exact in f16
  const float mag = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.f + man / 8.f, (int)exp - 7);
  return __half_raw{(unsigned short)(sign | ts_emu_f32_to_f16_bits(mag))};
}
