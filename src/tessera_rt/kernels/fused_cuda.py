"""Fused GPU kernels of a training step: the SwiGLU gate and its backward, the RMSNorm and
LayerNorm backward.

One CUDA source (``FUSED_SOURCE``, compiled per I/O dtype: f32, f16, bf16; the
cross-entropy's is ``xent_cuda``), math and statistics in f32.  Row kernels run a block per
row (or per chunk of rows) with 16-byte loads where a row's width is a multiple of the vector
width and the arrays are aligned, scalar loads otherwise; a strided input is copied dense
first.  Nothing here reads a device value on the host: every launcher returns device arrays
allocated on the launch stream.  The float64 references are in ``kernels.fused_ref``; f64
inputs go to them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from . import fused_ref as ref
from ._common import check_float, check_stream, null_ptr
from .compile import KernelSource, register_source
from .cuda_common import BLOCK_REDUCE, ELEM_IO, all_aligned, get_function, io_defines, io_name, launch_stream
from .norms import NORM_DTYPES

__all__ = ["render_fused", "swiglu_gate_cuda", "swiglu_backward_cuda", "rmsnorm_backward_cuda",
           "layernorm_backward_cuda", "NORM_PARTS", "GPU_DTYPES", "on_gpu", "dense", "empty_like",
           "check_same", "elementwise_grid"]

NT = 256
# The norm backward sums its weight gradient over NORM_PARTS row chunks, then over the chunks:
# a number fixed here, not taken from the device, so the order (and the bits) never change.
NORM_PARTS = 256
# A chunk's partial sums stay in shared memory while they fit beside the kernel's 256 bytes of
# static scratch within the 48 KiB a block gets without opting in; wider rows use global memory.
NORM_SMEM_COLS = (48 * 1024 - 256) // 4

FUSED_SOURCE = r"""
#define NT 256

// Calls f.at<W>(i) for i over [0, total), W = VEC where vec (all pointers 16-byte aligned), else
// 1; the tail past the last whole vector runs one element at a time.
template <class F> __device__ __forceinline__ void ts_elementwise(long long total, int vec, const F& f) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long done = 0;
  if (vec) {
    const long long nv = total / VEC;
    for (long long j = first; j < nv; j += stride) f.template at<VEC>(j * VEC);
    done = nv * VEC;
  }
  for (long long j = done + first; j < total; j += stride) f.template at<1>(j);
}

struct ts_swiglu_gate {
  const io_t* h1; const io_t* h3; io_t* y;
  template <int W> __device__ __forceinline__ void at(long long i) const {
    float a[W], b[W];
    ts_load<W>(h1 + i, a);
    ts_load<W>(h3 + i, b);
    #pragma unroll
    for (int k = 0; k < W; ++k) a[k] = a[k] / (1.f + __expf(-a[k])) * b[k];
    ts_store<W>(y + i, a);
  }
};

// d/dh1 and d/dh3 of silu(h1) * h3 against g (cpu_fused._swiglu_bwd's formula).
struct ts_swiglu_grad {
  const io_t* g; const io_t* h1; const io_t* h3; io_t* dh1; io_t* dh3;
  template <int W> __device__ __forceinline__ void at(long long i) const {
    float gg[W], a[W], b[W], d1[W], d3[W];
    ts_load<W>(g + i, gg);
    ts_load<W>(h1 + i, a);
    ts_load<W>(h3 + i, b);
    #pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = 1.f / (1.f + __expf(-a[k]));
      d3[k] = gg[k] * a[k] * s;
      d1[k] = gg[k] * b[k] * s * (1.f + a[k] * (1.f - s));
    }
    ts_store<W>(dh1 + i, d1);
    ts_store<W>(dh3 + i, d3);
  }
};

extern "C" __global__ void ts_swiglu_fwd(const io_t* __restrict__ h1, const io_t* __restrict__ h3,
                                         io_t* __restrict__ y, long long total, int vec) {
  ts_elementwise(total, vec, ts_swiglu_gate{h1, h3, y});
}

extern "C" __global__ void ts_swiglu_bwd(const io_t* __restrict__ g, const io_t* __restrict__ h1,
                                         const io_t* __restrict__ h3, io_t* __restrict__ dh1,
                                         io_t* __restrict__ dh3, long long total, int vec) {
  ts_elementwise(total, vec, ts_swiglu_grad{g, h1, h3, dh1, dh3});
}

// ---------------------------------------------------------------- norm backward
// Block b takes rows [b * rpb, (b + 1) * rpb): per row, the statistics by block reductions,
// then gx, while each thread adds its own columns' g * xhat (and g) over the block's rows in
// row order into acc (shared memory, or the block's row of the partials when too wide), so
// the weight gradient is the fixed-order sum of the blocks' rows (ts_colsum).
template <int W> __device__ __forceinline__ void ts_norm_load(const io_t* xr, const io_t* gr, const w_t* w, int c,
                                                              float* xv, float* gv, float* wv) {
  ts_load<W>(xr + c, xv);
  ts_load<W>(gr + c, gv);
  if (w) {
    ts_load<W>(w + c, wv);
  } else {
    #pragma unroll
    for (int k = 0; k < W; ++k) wv[k] = 1.f;
  }
}

template <int W> __device__ __forceinline__ void ts_norm_bwd_rows(
    const io_t* g, const io_t* x, const w_t* w, io_t* gx, float* part_w, float* part_b, int rows, int n,
    int rpb, float eps, bool ln, float* smem, bool in_smem, float* scratch) {
  const int r0 = blockIdx.x * rpb, r1 = min(rows, r0 + rpb);
  float* acc_w = part_w ? (in_smem ? smem : part_w + (long long)blockIdx.x * n) : nullptr;
  float* acc_b = part_b ? (in_smem ? smem + (part_w ? n : 0) : part_b + (long long)blockIdx.x * n) : nullptr;
  for (int c = threadIdx.x * W; c < n; c += NT * W) {
    #pragma unroll
    for (int k = 0; k < W; ++k) {
      if (acc_w) acc_w[c + k] = 0.f;
      if (acc_b) acc_b[c + k] = 0.f;
    }
  }
  for (int r = r0; r < r1; ++r) {
    const io_t* xr = x + (long long)r * n;
    const io_t* gr = g + (long long)r * n;
    float xv[W], gv[W], wv[W];
    float mean = 0.f, m1 = 0.f;
    if (ln) {                           // layernorm: the mean first, so the variance is two-pass
      float s[2] = {0.f, 0.f};
      for (int c = threadIdx.x * W; c < n; c += NT * W) {
        ts_norm_load<W>(xr, gr, w, c, xv, gv, wv);
        #pragma unroll
        for (int k = 0; k < W; ++k) { s[0] += xv[k]; s[1] += gv[k] * wv[k]; }
      }
      ts_block_reduce<false, 2>(s, scratch);
      mean = s[0] / n;
      m1 = s[1] / n;
    }
    float q[2] = {0.f, 0.f};            // sum (x - mean)^2, sum g w (x - mean)
    for (int c = threadIdx.x * W; c < n; c += NT * W) {
      ts_norm_load<W>(xr, gr, w, c, xv, gv, wv);
      #pragma unroll
      for (int k = 0; k < W; ++k) {
        const float d = xv[k] - mean;
        q[0] += d * d;
        q[1] += gv[k] * wv[k] * d;
      }
    }
    ts_block_reduce<false, 2>(q, scratch);
    const float rstd = rsqrtf(q[0] / n + eps);
    const float c2 = ln ? q[1] * rstd / n : q[1] / n * rstd * rstd * rstd;
    for (int c = threadIdx.x * W; c < n; c += NT * W) {
      ts_norm_load<W>(xr, gr, w, c, xv, gv, wv);
      float out[W];
      #pragma unroll
      for (int k = 0; k < W; ++k) {
        const float xh = (xv[k] - mean) * rstd;
        out[k] = ln ? rstd * (gv[k] * wv[k] - m1 - xh * c2) : gv[k] * wv[k] * rstd - xv[k] * c2;
        if (acc_w) acc_w[c + k] += gv[k] * xh;
        if (acc_b) acc_b[c + k] += gv[k];
      }
      ts_store<W>(gx + (long long)r * n + c, out);
    }
  }
  if (in_smem) {
    for (int c = threadIdx.x * W; c < n; c += NT * W) {
      #pragma unroll
      for (int k = 0; k < W; ++k) {
        if (part_w) part_w[(long long)blockIdx.x * n + c + k] = acc_w[c + k];
        if (part_b) part_b[(long long)blockIdx.x * n + c + k] = acc_b[c + k];
      }
    }
  }
}

// (no __launch_bounds__: with it ptxas held this kernel to 40 registers and spilled)
extern "C" __global__ void ts_norm_bwd(
    const io_t* __restrict__ g, const io_t* __restrict__ x, const w_t* __restrict__ w, io_t* __restrict__ gx,
    float* __restrict__ part_w, float* __restrict__ part_b, int rows, int n, int rpb, float eps, int ln,
    int vec, int in_smem) {
  extern __shared__ float ts_norm_acc[];
  __shared__ float scratch[64];
  if (vec) ts_norm_bwd_rows<VEC>(g, x, w, gx, part_w, part_b, rows, n, rpb, eps, ln, ts_norm_acc, in_smem, scratch);
  else ts_norm_bwd_rows<1>(g, x, w, gx, part_w, part_b, rows, n, rpb, eps, ln, ts_norm_acc, in_smem, scratch);
}

// gw[c] (gb[c]) = the sum of the blocks' partials of column c, block 0 first.
extern "C" __global__ void ts_colsum(const float* __restrict__ part_w, const float* __restrict__ part_b,
                                     w_t* __restrict__ gw, w_t* __restrict__ gb, int parts, int n) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  if (part_w) {
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += part_w[(long long)p * n + c];
    gw[c] = ts_to<w_t>(s);
  }
  if (part_b) {
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += part_b[(long long)p * n + c];
    gb[c] = ts_to<w_t>(s);
  }
}

"""

GPU_DTYPES = frozenset(("float32", "float16", "bfloat16"))


def render_fused(io: str = "f32", wio: str | None = None) -> str:
    return io_defines(io, wio) + ELEM_IO + BLOCK_REDUCE + FUSED_SOURCE


register_source(KernelSource("fused", render_fused, ("ts_swiglu_fwd", "ts_swiglu_bwd", "ts_norm_bwd", "ts_colsum"),
                             configs=[dict(io=d) for d in ("f32", "f16", "bf16")] + [dict(io="bf16", wio="f32")]))


def _fn(entry: str, dtype, wdtype=None):
    io = io_name(dtype)
    return get_function("fused", entry, dict(io=io, wio=io if wdtype is None else io_name(wdtype)), render_fused)


def on_gpu(*arrays) -> bool:
    """Do the fused kernels take arrays of these dtypes (f32/f16/bf16)?  f64 goes to the references."""
    return all(a is None or np.dtype(a.dtype).name in GPU_DTYPES for a in arrays)


def dense(*arrays) -> tuple:
    """The arrays as the kernels index them, C-contiguous (a copy, in the launch's stream
    context, only for a strided view); None stays None."""
    import cupy
    return tuple(None if a is None else cupy.ascontiguousarray(a) for a in arrays)


def empty_like(a: Any):
    import cupy
    return cupy.empty(a.shape, a.dtype)


def check_same(op: str, ref_name: str, a: Any, b: Any, what: str = "shape and dtype") -> None:
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        raise ValueError(f"{op}: {ref_name} is {tuple(b.shape)} {dtype_name(b.dtype)}, expected the {what} "
                         f"of {tuple(a.shape)} {dtype_name(a.dtype)}")


MAX_BLOCKS = 1 << 19    # elementwise grids stride past this many blocks


def elementwise_grid(total: int, per_thread: int = 1) -> tuple[int]:
    """A grid-stride launch's grid for ``total`` items, ``per_thread`` per thread per pass."""
    return (max(1, min(MAX_BLOCKS, -(-total // (NT * per_thread)))),)


def swiglu_gate_cuda(h1: Any, h3: Any, *, stream: Any = None):
    """``silu(h1) * h3`` in one pass (one launch), h1's dtype."""
    op = "swiglu_gate"
    check_float(op, "h1", h1, NORM_DTYPES, min_ndim=0)
    check_same(op, "h3", h1, h3)
    check_stream(op, stream)
    if not on_gpu(h1, h3):
        with launch_stream(stream):
            return ref.swiglu_gate(h1, h3)
    with launch_stream(stream):
        h1, h3 = dense(h1, h3)
        y = empty_like(h1)
        if h1.size:
            vec = all_aligned(16, h1, h3, y)
            _fn("ts_swiglu_fwd", h1.dtype)(elementwise_grid(h1.size, 4), (NT,),
                                           (h1, h3, y, np.int64(h1.size), np.int32(vec)))
    return y


def swiglu_backward_cuda(g: Any, h1: Any, h3: Any, *, stream: Any = None):
    """``(dh1, dh3)`` of ``silu(h1) * h3`` against ``g`` (one launch), h1's dtype."""
    op = "swiglu_backward"
    check_float(op, "h1", h1, NORM_DTYPES, min_ndim=0)
    check_same(op, "h3", h1, h3)
    check_same(op, "g", h1, g)
    check_stream(op, stream)
    if not on_gpu(g, h1, h3):
        with launch_stream(stream):
            return ref.swiglu_backward(g, h1, h3)
    with launch_stream(stream):
        g, h1, h3 = dense(g, h1, h3)
        dh1, dh3 = empty_like(h1), empty_like(h1)
        if h1.size:
            vec = all_aligned(16, g, h1, h3, dh1, dh3)
            _fn("ts_swiglu_bwd", h1.dtype)(elementwise_grid(h1.size, 4), (NT,),
                                           (g, h1, h3, dh1, dh3, np.int64(h1.size), np.int32(vec)))
    return dh1, dh3


def _norm_backward(op: str, g, x, weight, bias, eps: float, stream):
    import cupy
    check_float(op, "x", x, NORM_DTYPES)
    check_same(op, "g", x, g)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_float(op, name, p, NORM_DTYPES)
            if tuple(p.shape) != (x.shape[-1],):
                raise ValueError(f"{op}: {name} has shape {tuple(p.shape)}, expected ({x.shape[-1]},)")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"{op}: weight and bias must share a dtype, got {dtype_name(weight.dtype)} and "
                        f"{dtype_name(bias.dtype)}")
    check_stream(op, stream)
    if not eps >= 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    ln = op == "layernorm_backward"
    if not on_gpu(g, x, weight, bias):
        with launch_stream(stream):
            if ln:
                return ref.layernorm_backward(g, x, weight, bias, eps=eps)
            return (*ref.rmsnorm_backward(g, x, weight, eps=eps), None)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    param = weight if weight is not None else bias
    wdt = None if param is None else param.dtype
    with launch_stream(stream):
        g, x, weight = dense(g, x, weight)
        gx = empty_like(x)
        gw = None if weight is None else cupy.empty((n,), wdt)
        gb = None if bias is None else cupy.empty((n,), wdt)
        if rows == 0 or n == 0:
            for p in (gw, gb):
                if p is not None:
                    p.fill(0)
            return gx, gw, gb
        wants = (weight is not None) + (bias is not None)
        # without a parameter gradient every row is its own block; with one, NORM_PARTS chunks
        rpb = -(-rows // NORM_PARTS) if wants else 1
        parts = -(-rows // rpb)
        in_smem = wants and wants * n <= NORM_SMEM_COLS
        pw = cupy.empty((parts, n), np.float32) if weight is not None else None
        pb = cupy.empty((parts, n), np.float32) if bias is not None else None
        vec = n % (16 // x.itemsize) == 0 and all_aligned(16, g, x, gx, weight)
        _fn("ts_norm_bwd", x.dtype, wdt)((parts,), (NT,),
                                         (g, x, null_ptr(weight), gx, null_ptr(pw), null_ptr(pb), np.int32(rows),
                                          np.int32(n), np.int32(rpb), np.float32(eps), np.int32(ln), np.int32(vec),
                                          np.int32(in_smem)),
                                         shared_mem=4 * wants * n if in_smem else 0)
        if wants:
            _fn("ts_colsum", x.dtype, wdt)((-(-n // NT),), (NT,),
                                           (null_ptr(pw), null_ptr(pb), null_ptr(gw), null_ptr(gb), np.int32(parts),
                                            np.int32(n)))
    return gx, gw, gb


def rmsnorm_backward_cuda(g: Any, x: Any, weight: Any = None, *, eps: float = 1e-6, stream: Any = None):
    """``(gx, gw)`` of ``rmsnorm`` (gw None without a weight): one launch for gx, a second for
    gw, summed over all rows in f32 in a fixed order (``NORM_PARTS`` row chunks, then the
    chunks' partials in order) and cast to the weight's dtype."""
    gx, gw, _ = _norm_backward("rmsnorm_backward", g, x, weight, None, eps, stream)
    return gx, gw


def layernorm_backward_cuda(g: Any, x: Any, weight: Any = None, bias: Any = None, *, eps: float = 1e-5,
                            stream: Any = None):
    """``(gx, gw, gb)`` of ``layernorm`` (None for an absent parameter), as
    ``rmsnorm_backward_cuda``: gx in one launch, gw and gb in a second, deterministic."""
    return _norm_backward("layernorm_backward", g, x, weight, bias, eps, stream)


for _name, _fn_cuda in (("swiglu_gate", swiglu_gate_cuda), ("swiglu_backward", swiglu_backward_cuda),
                        ("rmsnorm_backward", rmsnorm_backward_cuda), ("layernorm_backward", layernorm_backward_cuda)):
    register_kernel(_name, "cuda", _fn_cuda)
