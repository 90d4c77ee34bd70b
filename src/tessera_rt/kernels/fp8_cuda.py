"""FP8 quantize and dequantize as CuPy RawKernels: scales computed on the device, in at most two
launches (NumPy reference: ``kernels.fp8``).

``x`` is read as a matrix ``(R, W)``, 16 bytes a thread where the rows allow it, and the scale
belongs to the whole tensor, to a column (per-channel along the last axis) or to a row's
channel (per-channel along another axis: rows ``o*C + c`` of the ``(O*C, I)`` view share
channel ``c``).  Given scales: one launch (``ts_fp8_quant``).  Computed scales:

* ``ts_fp8_amax`` writes partial maxima of ``|x|`` (one per block; per column and row chunk;
  per row), then ``ts_fp8_quant`` reduces the partials it needs (a few KiB, from L2) into the
  scale ``amax / fp8_max`` (1 for an all-zero channel), writes it out and quantizes: two
  launches, ``x`` read twice.  The quantize pass walks the blocks in reverse, so it starts on
  the rows the amax pass read last, which are still in L2.
* per-channel along the first axis of a 2-D ``x`` (one scale per row, the MoE wire's), or any
  axis with nothing before it: one launch; a block reduces its rows' maxima itself, then
  quantizes them while they are in L1/L2.

Divisions and the scale are IEEE (compiled without fast math), so the bits equal the NumPy
reference's; stochastic rounding hashes (seed, flat index) as before.  The format (e4m3/e5m2) and the
rounding are launch arguments, the dtype, access width and scale geometry compile-time.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import resolve_dtype
from ._common import check_float, check_out, check_stream
from .compile import KernelSource, register_source
from .cuda_common import ELEM_IO, IO_CODES, VEC16_TO_F32, get_function, io_name, launch_stream, sm_count
from .fp8 import fp8_max

__all__ = ["render_fp8", "quantize_fp8_cuda", "dequantize_fp8_bits_cuda", "fp8_geometry", "fp8_grids"]

NT = 256

FP8_SOURCE = ELEM_IO + VEC16_TO_F32 + r"""
#include <cuda_fp8.h>
#define NT 256
// VE (from the launcher): elements a thread reads at once, 16 bytes' worth or 1

__device__ __forceinline__ unsigned hash_u32(unsigned long long x) {   // splitmix64, low half
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return (unsigned)(x ^ (x >> 31));
}
__device__ __forceinline__ float fp8_to_f(unsigned char q, __nv_fp8_interpretation_t fmt) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, fmt);
  return __half2float(__half(h));
}
__device__ __forceinline__ void ts_load_ve(const io_t* p, float* f) {
#if VEC16
  ts_vec16_f(*reinterpret_cast<const uint4*>(p), f);
#else
  f[0] = ts_f(p[0]);
#endif
}
// max over the `seg` lanes of a row (seg a power of two <= 32; the lanes share a warp)
__device__ __forceinline__ float ts_seg_max(float v, int seg) {
  for (int o = 1; o < seg; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// max over the block (every thread calls it)
__device__ __forceinline__ float ts_block_max(float v, float* scratch) {
  v = ts_seg_max(v, 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NT / 32 ? scratch[lane] : 0.f;
  return ts_seg_max(v, 32);
}
__device__ __forceinline__ float ts_scale_of(float amax, float fmax) {
  const float s = amax / fmax;
  return s > 0.f ? s : 1.f;            // an all-zero channel: 1, so dequantize is exact
}

// (Both kernels ask for 4 blocks an SM: with 8, ptxas keeps 32 registers and spills.)
// Partial maxima of |x| for x viewed as (R, W), VW = W / VE vectors a row, vwp lanes a row
// (a power of two <= 32), NT / vwp rows a block.  MODE 0: one per block; 1: part[by * W + col]
// (one column tile per block column); 2: part[row] (grid.x == 1).
extern "C" __global__ void __launch_bounds__(NT, 4)
ts_fp8_amax(const io_t* __restrict__ x, float* __restrict__ part, long long R, int W, int vwp) {
  __shared__ float red[NT * VE];
  const int t = threadIdx.x, rl = t / vwp, vl = t % vwp, rpb = NT / vwp, VW = W / VE;
  float m[VE];
  #pragma unroll
  for (int e = 0; e < VE; ++e) m[e] = 0.f;
  const long long rstep = (long long)gridDim.y * rpb;
  for (long long r0 = (long long)blockIdx.y * rpb; r0 < R; r0 += rstep) {
    const long long r = r0 + rl;
#if MODE == 1
    const int v0 = blockIdx.x * vwp + vl, vstep = VW;      // one column tile per block column
#elif MODE == 0
    const int v0 = blockIdx.x * vwp + vl, vstep = gridDim.x * vwp;
#else
    const int v0 = vl, vstep = vwp;
    float rm = 0.f;
#endif
    for (int v = v0; r < R && v < VW; v += vstep) {
      float f[VE];
      ts_load_ve(x + r * W + (long long)v * VE, f);
      #pragma unroll
      for (int e = 0; e < VE; ++e) {
#if MODE == 2
        rm = fmaxf(rm, fabsf(f[e]));
#else
        m[e] = fmaxf(m[e], fabsf(f[e]));
#endif
      }
    }
#if MODE == 2
    rm = ts_seg_max(rm, vwp);                               // every lane of the warp takes part
    if (r < R && vl == 0) part[r] = rm;
#endif
  }
#if MODE == 0
  float bm = 0.f;
  #pragma unroll
  for (int e = 0; e < VE; ++e) bm = fmaxf(bm, m[e]);
  bm = ts_block_max(bm, red);
  if (t == 0) part[(long long)blockIdx.y * gridDim.x + blockIdx.x] = bm;
#elif MODE == 1
  #pragma unroll
  for (int e = 0; e < VE; ++e) red[(rl * vwp + vl) * VE + e] = m[e];
  __syncthreads();
  const int col0 = (blockIdx.x * vwp + vl) * VE;
  if (rl == 0 && col0 < W) {
    for (int i = 1; i < rpb; ++i)
      #pragma unroll
      for (int e = 0; e < VE; ++e) m[e] = fmaxf(m[e], red[(i * vwp + vl) * VE + e]);
    #pragma unroll
    for (int e = 0; e < VE; ++e) part[(long long)blockIdx.y * W + col0 + e] = m[e];
  }
#endif
}

// q = fp8(x / scale), saturating; e4m3 or e5m2 (e5m2 != 0), stochastic when sr != 0.  MODE as ts_fp8_amax (the scale's
// geometry; in MODE 2 row r has channel r % C).  SRC 0: the scales are given (sc); 1: from
// ts_fp8_amax's nparts partials; 2 (MODE 2, C == R): the block's rows' maxima.  Computed
// scales are written to sc_out.  Blocks run in reverse order (the rows read last first).
extern "C" __global__ void __launch_bounds__(NT, 4)
ts_fp8_quant(const io_t* __restrict__ x, const float* __restrict__ sc, const float* __restrict__ part, int nparts,
             float* __restrict__ sc_out, unsigned char* __restrict__ q, long long R, int W, int C, int vwp,
             float fmax, int e5m2, int sr, unsigned long long seed) {
  __shared__ float red[32];
  const __nv_fp8_interpretation_t fmt = e5m2 ? __NV_E5M2 : __NV_E4M3;
  const int t = threadIdx.x, rl = t / vwp, vl = t % vwp, rpb = NT / vwp, VW = W / VE;
  const int bx = gridDim.x - 1 - blockIdx.x, by = gridDim.y - 1 - blockIdx.y;
#if MODE == 0
  float s;
#if SRC == 0
  s = sc[0];
#else
  float am = 0.f;
  for (int i = t; i < nparts; i += NT) am = fmaxf(am, part[i]);
  s = ts_scale_of(ts_block_max(am, red), fmax);
  if (bx == 0 && by == 0 && t == 0) sc_out[0] = s;
#endif
#elif MODE == 1
  // this thread's columns (one vector of them) and their scales, for every row it visits
  const int vc = bx * vwp + vl;
  float sv[VE];
  #pragma unroll
  for (int e = 0; e < VE; ++e) {
    sv[e] = 1.f;
    if (vc < VW) {
#if SRC == 0
      sv[e] = sc[vc * VE + e];
#else
      float am = 0.f;
      for (int k = 0; k < nparts; ++k) am = fmaxf(am, part[(long long)k * W + vc * VE + e]);
      sv[e] = ts_scale_of(am, fmax);
      if (by == 0 && rl == 0) sc_out[vc * VE + e] = sv[e];
#endif
    }
  }
#endif
  const long long rstep = (long long)gridDim.y * rpb;
  for (long long r0 = (long long)by * rpb; r0 < R; r0 += rstep) {
    const long long r = r0 + rl;
#if MODE == 2
    const int c = (int)(r % C);
    float s;
#if SRC == 0
    s = r < R ? sc[c] : 1.f;
#elif SRC == 1
    float am = 0.f;
    for (long long o = c; r < R && o < R; o += C) am = fmaxf(am, part[o]);
    s = ts_scale_of(am, fmax);
#else
    float am = 0.f;
    for (int v = vl; r < R && v < VW; v += vwp) {
      float f[VE];
      ts_load_ve(x + r * W + (long long)v * VE, f);
      #pragma unroll
      for (int e = 0; e < VE; ++e) am = fmaxf(am, fabsf(f[e]));
    }
    s = ts_scale_of(ts_seg_max(am, vwp), fmax);
#endif
#if SRC != 0
    if (r < C && vl == 0) sc_out[c] = s;
#endif
    const int v0 = vl, vstep = vwp;
#elif MODE == 1
    const int v0 = vc, vstep = VW;
#else
    const int v0 = bx * vwp + vl, vstep = gridDim.x * vwp;
#endif
    for (int v = v0; r < R && v < VW; v += vstep) {
      float f[VE];
      const long long i0 = r * W + (long long)v * VE;
      ts_load_ve(x + i0, f);
      unsigned char b[VE];
      #pragma unroll
      for (int e = 0; e < VE; ++e) {
#if MODE == 1
        const float se = sv[e];
#else
        const float se = s;
#endif
        const float y = fminf(fmaxf(f[e] / se, -fmax), fmax);
        unsigned char rq = (unsigned char)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, fmt);
        const float d = sr ? fp8_to_f(rq, fmt) : y;
        if (y != d) {                       // step one ulp toward y, then keep rq with prob 1-p
          const bool away = (y > d) == (d >= 0.f);
          unsigned char o = (d == 0.f) ? (y >= 0.f ? 0x01 : 0x81) : (unsigned char)(rq + (away ? 1 : -1));
          const float od = fp8_to_f(o, fmt);
          const float p = fabsf(y - d) / fabsf(od - d);
          const unsigned long long i = (unsigned long long)(i0 + e);
          const float u = (hash_u32(seed ^ (i * 0x2545F4914F6CDD1Dull)) >> 8) * (1.f / 16777216.f);
          if (u < p && isfinite(od)) rq = o;
        }
        b[e] = rq;
      }
#if VE == 8
      uint2 w;
      w.x = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned)b[3] << 24);
      w.y = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned)b[7] << 24);
      *reinterpret_cast<uint2*>(q + i0) = w;
#elif VE == 4
      *reinterpret_cast<unsigned*>(q + i0) = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned)b[3] << 24);
#else
      q[i0] = b[0];
#endif
    }
  }
}

extern "C" __global__ void ts_dequantize_fp8(const unsigned char* __restrict__ q, const float* __restrict__ scale,
                                             float* __restrict__ y, long long total, long long inner, int channels,
                                             int e5m2) {
  const __nv_fp8_interpretation_t fmt = e5m2 ? __NV_E5M2 : __NV_E4M3;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = fp8_to_f(q[i], fmt) * scale[(i / inner) % channels];
}
"""

_MODES = {"tensor": 0, "column": 1, "row": 2}
_SRCS = {"given": 0, "partials": 1, "fused": 2}


def render_fp8(io: str = "f32", vec: bool = True, mode: str = "tensor", src: str = "given") -> str:
    """CUDA C of the FP8 kernels for one input dtype, access width and scale geometry (the format
    and the rounding are launch arguments: fewer modules to compile)."""
    ve = (16 // {"f32": 4, "f16": 2, "bf16": 2}[io]) if vec else 1
    return (f"#define VEC16 {int(vec)}\n#define VE {ve}\n#define MODE {_MODES[mode]}\n"
            f"#define SRC {_SRCS[src]}\n#define TS_IO {IO_CODES[io]}\n"
            + FP8_SOURCE)


register_source(KernelSource(
    "fp8", render_fp8, ("ts_fp8_amax", "ts_fp8_quant", "ts_dequantize_fp8"),
    configs=[dict(), dict(vec=False, mode="column", src="partials")]
    + [dict(io=io, mode=m, src=src) for io in ("f32", "f16", "bf16") for m, src in
       (("tensor", "partials"), ("column", "partials"), ("row", "partials"), ("row", "fused"), ("column", "given"))],
    fast_math=False))

_IN = (np.dtype(np.float32), np.dtype(np.float16), resolve_dtype("bf16"))


def fp8_geometry(shape: tuple, scale: str, axis: int) -> tuple[str, int, int, int]:
    """``(mode, R, W, C)``: how ``x`` of ``shape`` is read for the scale's geometry."""
    n = int(np.prod(shape))
    if scale == "per_tensor" or len(shape) == 0:
        w = shape[-1] if shape and shape[-1] else 1
        return "tensor", n // w, w, 1
    ax = axis % len(shape)
    c, inner = shape[ax], int(np.prod(shape[ax + 1:]))
    if inner == 1:
        return "column", n // c, c, c
    return "row", n // inner, inner, c


def fp8_grids(mode: str, r: int, w: int, ve: int, sms: int) -> tuple[int, tuple, tuple]:
    """``(vwp, amax grid, quantize grid)`` for a ``(r, w)`` view read ``ve`` elements at a time."""
    vw = max(1, w // ve)
    vwp = min(32, 1 << (vw - 1).bit_length())
    rpb = NT // vwp
    rows = -(-r // rpb)
    target = 4 * sms
    if mode == "row":
        return vwp, (1, min(rows, 65535)), (1, min(rows, 65535))
    gx = -(-vw // vwp)
    if mode == "column":
        # partials: at most sqrt(rows) chunks (the quantize blocks reread them), <= 64
        na = max(1, min(-(-target // gx), int(rows ** 0.5), 64))
        return vwp, (gx, na), (gx, min(rows, 65535, max(1, -(-target // gx))))
    gx = min(gx, target)
    na = max(1, min(-(-target // gx), rows, 65535))
    return vwp, (gx, na), (gx, na)


def quantize_fp8_cuda(x: Any, dtype="fp8_e4m3", *, scale: Any = "per_tensor", axis: int = -1,
                      stochastic_round: bool = False, seed: int = 0, out: Any = None, stream: Any = None,
                      policy: Any = None):
    """FP8 quantize on the GPU; returns ``(q, scale)`` with ``q`` as uint8 bit patterns (CuPy has
    no FP8 dtype): view them with ``ml_dtypes`` after ``.get()``.  One launch with a given
    scale or one scale per row of a 2-D ``x`` (``axis=0``), else two (partial maxima, then the
    scale and the quantization); f32, f16 or bf16 ``x`` read as it is."""
    import cupy

    from .fp8 import _fp8
    op = "quantize_fp8"
    if policy is not None:
        dtype = policy.dtype if policy.quantizes else dtype
        scale = policy.scale or scale
        stochastic_round = policy.stochastic_round
    dt = _fp8(op, dtype)
    check_float(op, "x", x, _IN, min_ndim=0)
    check_stream(op, stream)
    check_out(op, out, x.shape, np.uint8, xp=cupy)   # FP8 bit patterns, written in place
    given = not isinstance(scale, str)
    if not given and scale not in ("per_tensor", "per_channel"):
        raise ValueError(f"{op}: scale={scale!r}; use 'per_tensor', 'per_channel' or a given f32 scale array")
    fmax = fp8_max(dt)
    with launch_stream(stream):
        xc = cupy.ascontiguousarray(x)
        shape = tuple(x.shape)
        s_given = cupy.ascontiguousarray(cupy.asarray(scale, np.float32).ravel()) if given else None
        geo = "per_tensor" if s_given is not None and s_given.size == 1 else ("per_channel" if given else scale)
        mode, r, w, c = fp8_geometry(shape, geo, axis)
        if s_given is not None and mode != "tensor" and s_given.size != c:
            raise ValueError(f"{op}: {s_given.size} given scales for {c} channels along axis {axis} of {shape}")
        q = out if out is not None else cupy.empty(shape, np.uint8)
        if given:
            s_out = cupy.asarray(scale, np.float32)
        elif mode == "tensor":
            s_out = cupy.empty((), np.float32)
        else:
            kshape = [1] * len(shape)
            kshape[axis % len(shape)] = c
            s_out = cupy.empty(tuple(kshape), np.float32)
        if x.size == 0:
            if not given:
                s_out.fill(1)
            return q, s_out
        ve = 16 // xc.itemsize
        vec = w % ve == 0 and xc.data.ptr % 16 == 0 and q.data.ptr % ve == 0
        vwp, agrid, qgrid = fp8_grids(mode, r, w, ve if vec else 1, sm_count())
        src = "given" if given else ("fused" if mode == "row" and r == c else "partials")
        cfg = dict(io=io_name(xc.dtype), vec=vec, mode=mode, src=src)
        part, nparts = None, 0
        if src == "partials":
            nparts = {"tensor": agrid[0] * agrid[1], "column": agrid[1], "row": r}[mode]
            part = cupy.empty(nparts * (w if mode == "column" else 1), np.float32)
            amax = get_function("fp8", "ts_fp8_amax", cfg, render_fp8, fast_math=False)
            amax(agrid, (NT,), (xc, part, np.int64(r), np.int32(w), np.int32(vwp)))
        quant = get_function("fp8", "ts_fp8_quant", cfg, render_fp8, fast_math=False)
        null = np.uint64(0)
        quant(qgrid, (NT,), (xc, null if s_given is None else s_given, null if part is None else part,
                             np.int32(nparts), null if given else s_out, q, np.int64(r), np.int32(w), np.int32(c),
                             np.int32(vwp), np.float32(fmax), np.int32(dt == resolve_dtype("fp8_e5m2")),
                             np.int32(bool(stochastic_round)), np.uint64(seed)))
    return q, s_out


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
        fn = get_function("fp8", "ts_dequantize_fp8", {}, render_fp8, fast_math=False)
        fn((min(65535, (q.size + 255) // 256),), (256,),
           (q, s, y, np.int64(q.size), np.int64(inner), np.int32(channels), np.int32(dt == resolve_dtype("fp8_e5m2"))))
    return y


register_kernel("quantize_fp8", "cuda", quantize_fp8_cuda)
register_kernel("dequantize_fp8_bits", "cuda", dequantize_fp8_bits_cuda)
