"""Memory-bound RawKernels: softmax, layernorm, rmsnorm (one block per row), bias+activation
(FP8 quantize/dequantize: ``fp8_cuda``).

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
from . import mlp, norms
from ._common import check_float, check_out, check_policy, check_stream, null_ptr
from .compile import KernelSource, register_source
from .cuda_common import HALF_IO, IO_CODES, get_function, io_name, launch_stream

# the FP8 kernels moved to fp8_cuda; their names stay importable from here
from .fp8_cuda import dequantize_fp8_bits_cuda, quantize_fp8_cuda, render_fp8

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

_ACTS = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3, "identity": 4}
_MODES = {"softmax": 0, "layernorm": 1, "rmsnorm": 2}


def render_rows(mode: str = "softmax", act: str = "gelu", io: str = "f16") -> str:
    return (f"#define MODE {_MODES[mode]}\n#define ACT {_ACTS[act]}\n#define TS_IO {IO_CODES[io]}\n"
            f"#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n" + ROWS_SOURCE)


register_source(KernelSource("rows", render_rows, ("ts_rows", "ts_bias_act"),
                             configs=[dict(mode=m, io=io) for m in _MODES for io in ("f16", "bf16", "f32")]
                             + [dict(mode="softmax", act=a) for a in _ACTS if a != "gelu"]))
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


register_kernel("softmax", "cuda", softmax_cuda)
for _n in ("layernorm", "layernorm_safe"):
    register_kernel(_n, "cuda", layernorm_cuda)
for _n in ("rmsnorm", "rmsnorm_safe"):
    register_kernel(_n, "cuda", rmsnorm_cuda)
register_kernel("bias_act", "cuda", bias_act_cuda)
