"""Memory-bound RawKernels: softmax, layernorm, rmsnorm (one block per row), bias+activation,
FP8 quantize/dequantize.

Row kernels read a row once into registers (up to ``ROW_MAX`` elements), reduce in f32
with warp shuffles and a 32-float shared scratch, and write once: 2 bytes in + 2 bytes out
per element for f16/bf16, which is the roofline for these ops.  Longer rows, other axes and
f64 go to the CuPy reference, which is the same NumPy code.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import resolve_dtype
from ._common import check_float, check_out, check_policy, check_stream, null_ptr
from .compile import KernelSource, register_source
from .cuda_common import HALF_IO, IO_CODES, get_function, io_name, launch_stream
from .fp8 import compute_scale, fp8_max
from . import mlp, norms

__all__ = ["render_rows", "render_fp8", "softmax_cuda", "layernorm_cuda", "rmsnorm_cuda",
           "bias_act_cuda", "quantize_fp8_cuda", "dequantize_fp8_bits_cuda", "ROW_MAX"]

ROW_THREADS = 256
PER_THREAD = 16
ROW_MAX = ROW_THREADS * PER_THREAD      # 4096 elements per row held in registers

ROWS_SOURCE = HALF_IO + r"""
#define NT 256
#define PT 16

template <bool MAX> __device__ __forceinline__ float block_reduce(float v, float* scratch) {
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    float o = __shfl_xor_sync(0xffffffffu, v, w);
    v = MAX ? fmaxf(v, o) : v + o;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();                      // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NT / 32 ? scratch[lane] : (MAX ? -INFINITY : 0.f);
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    float o = __shfl_xor_sync(0xffffffffu, v, w);
    v = MAX ? fmaxf(v, o) : v + o;
  }
  return v;
}

// MODE 0: softmax, 1: layernorm, 2: rmsnorm.  One block per row of length n.
extern "C" __global__ void __launch_bounds__(NT)
ts_rows(const in_t* __restrict__ x, in_t* __restrict__ y, const in_t* __restrict__ w,
        const in_t* __restrict__ b, int n, float eps) {
  __shared__ float scratch[32];
  const long long base = (long long)blockIdx.x * n;
  float v[PT];
  #pragma unroll
  for (int i = 0; i < PT; ++i) {
    const int c = threadIdx.x + i * NT;
    v[i] = c < n ? to_f(x[base + c]) : (MODE == 0 ? -INFINITY : 0.f);
  }
#if MODE == 0
  float m = -INFINITY;
  #pragma unroll
  for (int i = 0; i < PT; ++i) m = fmaxf(m, v[i]);
  m = block_reduce<true>(m, scratch);
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < PT; ++i) { v[i] = __expf(v[i] - m); s += v[i]; }
  const float inv = 1.f / block_reduce<false>(s, scratch);
  #pragma unroll
  for (int i = 0; i < PT; ++i) v[i] *= inv;
#else
  float mean = 0.f;
#if MODE == 1
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < PT; ++i) s += v[i];
  mean = block_reduce<false>(s, scratch) / n;
#endif
  float q = 0.f;
  #pragma unroll
  for (int i = 0; i < PT; ++i) {
    const int c = threadIdx.x + i * NT;
    const float d = c < n ? v[i] - mean : 0.f;   // two-pass variance: no cancellation
    q += d * d;
  }
  const float rstd = rsqrtf(block_reduce<false>(q, scratch) / n + eps);
  #pragma unroll
  for (int i = 0; i < PT; ++i) {
    const int c = threadIdx.x + i * NT;
    if (c < n) v[i] = (v[i] - mean) * rstd * (w ? to_f(w[c]) : 1.f) + (b ? to_f(b[c]) : 0.f);
  }
#endif
  #pragma unroll
  for (int i = 0; i < PT; ++i) {
    const int c = threadIdx.x + i * NT;
    if (c < n) y[base + c] = from_f(v[i]);
  }
}

// ACT 0 gelu(erf), 1 gelu(tanh), 2 silu, 3 relu, 4 identity; bias over the last dim (n).
extern "C" __global__ void ts_bias_act(const in_t* __restrict__ x, const in_t* __restrict__ b,
                                       in_t* __restrict__ y, long long total, int n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    float v = to_f(x[i]) + (b ? to_f(b[i % n]) : 0.f);
#if ACT == 0
    v = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
#elif ACT == 1
    v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
#elif ACT == 2
    v = v / (1.f + __expf(-v));
#elif ACT == 3
    v = fmaxf(v, 0.f);
#endif
    y[i] = from_f(v);
  }
}
"""

FP8_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define FMT (E5M2 ? __NV_E5M2 : __NV_E4M3)

__device__ __forceinline__ unsigned hash_u32(unsigned long long x) {   // splitmix64, low half
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return (unsigned)(x ^ (x >> 31));
}
__device__ __forceinline__ float fp8_to_f(unsigned char q) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, FMT);
  return __half2float(__half(h));
}

// q[i] = fp8(x[i] / scale[(i / inner) % channels]); saturating; stochastic when SR.
extern "C" __global__ void ts_quantize_fp8(const float* __restrict__ x, const float* __restrict__ scale,
                                           unsigned char* __restrict__ q, long long total, long long inner,
                                           int channels, float fmax, unsigned long long seed) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const float s = scale[(i / inner) % channels];
    const float y = fminf(fmaxf(x[i] / s, -fmax), fmax);
    unsigned char r = (unsigned char)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, FMT);
#if SR
    const float d = fp8_to_f(r);
    if (y != d) {                       // step one ulp toward y, then keep r with prob 1-p
      const bool away = (y > d) == (d >= 0.f);
      unsigned char o = (d == 0.f) ? (y >= 0.f ? 0x01 : 0x81) : (unsigned char)(r + (away ? 1 : -1));
      const float od = fp8_to_f(o);
      const float p = fabsf(y - d) / fabsf(od - d);
      const float u = (hash_u32(seed ^ ((unsigned long long)i * 0x2545F4914F6CDD1Dull)) >> 8) * (1.f / 16777216.f);
      if (u < p && isfinite(od)) r = o;
    }
#endif
    q[i] = r;
  }
}

extern "C" __global__ void ts_dequantize_fp8(const unsigned char* __restrict__ q, const float* __restrict__ scale,
                                             float* __restrict__ y, long long total, long long inner, int channels) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = fp8_to_f(q[i]) * scale[(i / inner) % channels];
}
"""

_ACTS = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3, "identity": 4}
_MODES = {"softmax": 0, "layernorm": 1, "rmsnorm": 2}


def render_rows(mode: str = "softmax", act: str = "gelu", io: str = "f16") -> str:
    return (f"#define MODE {_MODES[mode]}\n#define ACT {_ACTS[act]}\n#define TS_IO {IO_CODES[io]}\n"
            f"#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n" + ROWS_SOURCE)


def render_fp8(e5m2: bool = False, sr: bool = False) -> str:
    return f"#define E5M2 {int(e5m2)}\n#define SR {int(sr)}\n" + FP8_SOURCE


register_source(KernelSource("rows", render_rows, ("ts_rows", "ts_bias_act"),
                             configs=[dict(mode=m, io=io) for m in _MODES for io in ("f16", "bf16", "f32")]
                             + [dict(mode="softmax", act=a) for a in _ACTS if a != "gelu"]))
register_source(KernelSource("fp8", render_fp8, ("ts_quantize_fp8", "ts_dequantize_fp8"),
                             configs=[dict(e5m2=e, sr=s) for e in (False, True) for s in (False, True)]))

_GPU_DT = (np.dtype(np.float16), np.dtype(np.float32), resolve_dtype("bf16"))


def _row_kernel_ok(x: Any, policy: Any, *params) -> bool:
    return (np.dtype(x.dtype) in _GPU_DT and policy is None and x.ndim >= 1 and 0 < x.shape[-1] <= ROW_MAX
            and x.flags.c_contiguous and all(p is None or p.dtype == x.dtype for p in params))


def _dense(p: Any):
    """A weight or bias as the kernels read it: dense from element 0 (``w[c]``)."""
    import cupy
    return None if p is None else cupy.ascontiguousarray(p)


def _launch_rows(mode: str, x: Any, w: Any, b: Any, eps: float, out: Any, stream: Any):
    import cupy
    n = x.shape[-1]
    rows = x.size // n
    fn = get_function("rows", "ts_rows", dict(mode=mode, act="gelu", io=io_name(x.dtype)), render_rows)
    with launch_stream(stream):        # the output and the dense copies in the launch's stream
        y = out if out is not None else cupy.empty_like(x)
        if rows:
            fn((rows,), (ROW_THREADS,), (x, y, null_ptr(_dense(w)), null_ptr(_dense(b)), np.int32(n),
                                         np.float32(eps)))
    return y


def softmax_cuda(x: Any, *, axis: int = -1, out: Any | None = None, stream: Any | None = None,
                 policy: Any = None):
    import cupy
    check_float("softmax", "x", x, norms.NORM_DTYPES)
    check_stream("softmax", stream)
    check_policy("softmax", policy)
    check_out("softmax", out, x.shape, x.dtype, xp=cupy)     # the kernel writes out directly
    if axis in (-1, x.ndim - 1) and _row_kernel_ok(x, policy):
        return _launch_rows("softmax", x, None, None, 0.0, out, stream)
    with launch_stream(stream):
        return norms.softmax(x, axis=axis, out=out, policy=policy)


def _norm_cuda(mode: str, x: Any, weight: Any, bias: Any, eps: float, out: Any, stream: Any, policy: Any):
    import cupy
    if hasattr(x, "dtype") and _row_kernel_ok(x, policy, weight, bias):
        norms._check_row_param(mode, "weight", weight, x)
        norms._check_row_param(mode, "bias", bias, x)
        check_stream(mode, stream)
        check_out(mode, out, x.shape, x.dtype, xp=cupy)
        if not eps >= 0:
            raise ValueError(f"{mode}: eps must be >= 0, got {eps}")
        return _launch_rows(mode, x, weight, bias, eps, out, stream)
    with launch_stream(stream):
        if mode == "layernorm":
            return norms.layernorm(x, weight, bias, eps=eps, out=out, stream=stream, policy=policy)
        return norms.rmsnorm(x, weight, eps=eps, out=out, stream=stream, policy=policy)


def layernorm_cuda(x: Any, weight: Any = None, bias: Any = None, *, eps: float = 1e-5, out: Any = None,
                   stream: Any = None, policy: Any = None):
    return _norm_cuda("layernorm", x, weight, bias, eps, out, stream, policy)


def rmsnorm_cuda(x: Any, weight: Any = None, *, eps: float = 1e-6, out: Any = None, stream: Any = None,
                 policy: Any = None):
    return _norm_cuda("rmsnorm", x, weight, None, eps, out, stream, policy)


def bias_act_cuda(x: Any, bias: Any = None, *, act: str = "gelu", out: Any = None, stream: Any = None,
                  policy: Any = None):
    import cupy
    if act in _ACTS and hasattr(x, "dtype") and _row_kernel_ok(x, policy, bias):
        if bias is not None and tuple(bias.shape) != (x.shape[-1],):
            raise ValueError(f"bias_act: bias has shape {tuple(bias.shape)}, expected ({x.shape[-1]},)")
        check_stream("bias_act", stream)
        check_out("bias_act", out, x.shape, x.dtype, xp=cupy)
        fn = get_function("rows", "ts_bias_act", dict(mode="softmax", act=act, io=io_name(x.dtype)),
                          render_rows)
        with launch_stream(stream):
            y = out if out is not None else cupy.empty_like(x)
            fn((min(65535, (x.size + 255) // 256),), (256,),
               (x, null_ptr(_dense(bias)), y, np.int64(x.size), np.int32(x.shape[-1])))
        return y
    with launch_stream(stream):
        return mlp.bias_act(x, bias, act=act, out=out, stream=stream, policy=policy)


def quantize_fp8_cuda(x: Any, dtype="fp8_e4m3", *, scale: Any = "per_tensor", axis: int = -1,
                      stochastic_round: bool = False, seed: int = 0, out: Any = None, stream: Any = None,
                      policy: Any = None):
    """FP8 quantize on the GPU; returns ``(q, scale)`` with ``q`` as uint8 bit patterns (CuPy has
    no FP8 dtype): view them with ``ml_dtypes`` after ``.get()``."""
    import cupy
    if policy is not None:
        dtype = policy.dtype if policy.quantizes else dtype
        scale = policy.scale or scale
        stochastic_round = policy.stochastic_round
    dt = resolve_dtype(dtype)
    check_float("quantize_fp8", "x", x, (np.float32, np.float16), min_ndim=0)
    check_stream("quantize_fp8", stream)
    check_out("quantize_fp8", out, x.shape, np.uint8, xp=cupy)   # FP8 bit patterns, written in place
    with launch_stream(stream):
        xf = cupy.ascontiguousarray(x, dtype=np.float32)
        s = compute_scale(xf, dt, scale, axis) if isinstance(scale, str) else cupy.asarray(scale, np.float32)
        ax = axis % max(x.ndim, 1)
        channels = s.size
        inner = int(np.prod(x.shape[ax + 1:])) if channels > 1 else 1
        q = out if out is not None else cupy.empty(x.shape, np.uint8)
        fn = get_function("fp8", "ts_quantize_fp8", dict(e5m2=dt == resolve_dtype("fp8_e5m2"),
                                                         sr=bool(stochastic_round)), render_fp8)
        fn((min(65535, (x.size + 255) // 256),), (256,),
           (xf, cupy.ascontiguousarray(s.ravel()), q, np.int64(x.size), np.int64(inner), np.int32(channels),
            np.float32(fp8_max(dt)), np.uint64(seed)))
    return q, s


register_kernel("softmax", "cuda", softmax_cuda)
for _n in ("layernorm", "layernorm_safe"):
    register_kernel(_n, "cuda", layernorm_cuda)
for _n in ("rmsnorm", "rmsnorm_safe"):
    register_kernel(_n, "cuda", rmsnorm_cuda)
register_kernel("bias_act", "cuda", bias_act_cuda)
register_kernel("quantize_fp8", "cuda", quantize_fp8_cuda)


def dequantize_fp8_bits_cuda(bits: Any, scale: Any, dtype="fp8_e4m3", *, axis: int = -1, out: Any = None,
                             stream: Any = None):
    """f32 values of FP8 bit patterns on the GPU (``ts_dequantize_fp8``); NumPy reference:
    ``kernels.fp8.dequantize_fp8_bits``.  ``scale``: one value or one per index of ``axis``."""
    import cupy
    dt = resolve_dtype(dtype)
    check_stream("dequantize_fp8_bits", stream)
    if bits.dtype != np.uint8:
        raise TypeError(f"dequantize_fp8_bits: bits must be uint8 FP8 bit patterns, got {bits.dtype}")
    check_out("dequantize_fp8_bits", out, bits.shape, np.float32, xp=cupy)
    with launch_stream(stream):
        q = cupy.ascontiguousarray(bits)
        s = cupy.ascontiguousarray(cupy.asarray(scale, np.float32).ravel())
        channels = int(s.size)
        ax = axis % max(bits.ndim, 1)
        inner = int(np.prod(bits.shape[ax + 1:])) if channels > 1 else 1
        y = out if out is not None else cupy.empty(bits.shape, np.float32)
        fn = get_function("fp8", "ts_dequantize_fp8", dict(e5m2=dt == resolve_dtype("fp8_e5m2"), sr=False),
                          render_fp8)
        fn((min(65535, (q.size + 255) // 256),), (256,),
           (q, s, y, np.int64(q.size), np.int64(inner), np.int32(channels)))
    return y


register_kernel("dequantize_fp8_bits", "cuda", dequantize_fp8_bits_cuda)
