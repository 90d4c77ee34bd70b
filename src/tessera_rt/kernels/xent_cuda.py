"""Softmax cross-entropy on the GPU without a one-hot: the forward (one pass over each row,
then a fixed-order mean) and the logits' cotangent (one pass), f32 statistics for f32, f16
and bf16 logits; f64 logits go to the float64 references
(``kernels.fused_ref``).  No host sync: the loss stays a 0-d device array, and ``g`` may be
one, read on the device.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from . import fused_ref as ref
from ._common import check_float, check_stream, is_cupy
from .compile import KernelSource, register_source
from .cuda_common import BLOCK_REDUCE, ELEM_IO, all_aligned, get_function, io_code, io_defines, io_name, launch_stream
from .fused_cuda import dense, empty_like, on_gpu
from .norms import NORM_DTYPES

__all__ = ["softmax_cross_entropy_cuda", "cross_entropy_backward_cuda", "render_xent"]

NT = 256

XENT_SOURCE = r"""
#define NT 256

template <int W> __device__ __forceinline__ void ts_xent_row(const io_t* x, int V, float& m, float& s) {
  for (int c = threadIdx.x * W; c < V; c += NT * W) {      // one pass: an online max and sum
    float v[W];
    ts_load<W>(x + c, v);
    float vm = v[0];
    #pragma unroll
    for (int k = 1; k < W; ++k) vm = fmaxf(vm, v[k]);
    const float mn = fmaxf(m, vm);
    if (mn == -INFINITY) continue;                          // (all -inf so far: nothing to add)
    s = m == mn ? s : s * __expf(m - mn);
    #pragma unroll
    for (int k = 0; k < W; ++k) s += __expf(v[k] - mn);
    m = mn;
  }
}

// Row b: lse = logsumexp(x), loss = lse - x[target] (NaN for a target outside [0, V)).
extern "C" __global__ void __launch_bounds__(NT) ts_xent_fwd(const io_t* __restrict__ logits,
                                                             const void* __restrict__ targets,
                                                             float* __restrict__ loss, float* __restrict__ lse,
                                                             int V, int ids64, int vec) {
  __shared__ float scratch[32];
  const io_t* x = logits + (long long)blockIdx.x * V;
  float m = -INFINITY, s = 0.f;
  if (vec) ts_xent_row<VEC>(x, V, m, s);
  else ts_xent_row<1>(x, V, m, s);
  float mx[1] = {m};
  ts_block_reduce<true, 1>(mx, scratch);
  float sum[1] = {m == -INFINITY ? 0.f : s * __expf(m - mx[0])};
  ts_block_reduce<false, 1>(sum, scratch);
  if (threadIdx.x == 0) {
    const float l = mx[0] == -INFINITY ? -INFINITY : mx[0] + __logf(sum[0]);
    const long long t = ts_id(targets, blockIdx.x, ids64);
    lse[blockIdx.x] = l;
    loss[blockIdx.x] = t >= 0 && t < V ? l - ts_f(x[t]) : __int_as_float(0x7fc00000);
  }
}

// out = mean of v[0..n) (f64 accumulation in a fixed order; one block).
extern "C" __global__ void __launch_bounds__(NT) ts_mean(const float* __restrict__ v, float* __restrict__ out, int n) {
  __shared__ double scratch[32];
  double s[1] = {0.0};
  for (int i = threadIdx.x; i < n; i += NT) s[0] += v[i];
  ts_block_reduce<false, 1>(s, scratch);
  if (threadIdx.x == 0) *out = (float)(s[0] / n);
}

// dx = (exp(x - lse) - onehot(target)) * g / rows; g read on the device when g_ptr is given.
template <int W> __device__ __forceinline__ void ts_xent_bwd_row(const io_t* x, io_t* dx, int V, long long t,
                                                                float l, float scale) {
  const bool bad = t < 0 || t >= V;
  for (int c = threadIdx.x * W; c < V; c += NT * W) {
    float v[W];
    ts_load<W>(x + c, v);
    #pragma unroll
    for (int k = 0; k < W; ++k)
      v[k] = bad ? __int_as_float(0x7fc00000) : __expf(v[k] - l) * scale - (c + k == t ? scale : 0.f);
    ts_store<W>(dx + c, v);
  }
}

extern "C" __global__ void __launch_bounds__(NT) ts_xent_bwd(
    const io_t* __restrict__ logits, const void* __restrict__ targets, const float* __restrict__ lse,
    const void* __restrict__ g_ptr, io_t* __restrict__ dx, int V, int rows, double g_value, int g_kind,
    int ids64, int vec) {
  const double g = g_ptr ? ts_scalar(g_ptr, g_kind) : g_value;
  const float scale = (float)(g / rows);
  const long long off = (long long)blockIdx.x * V, t = ts_id(targets, blockIdx.x, ids64);
  if (vec) ts_xent_bwd_row<VEC>(logits + off, dx + off, V, t, lse[blockIdx.x], scale);
  else ts_xent_bwd_row<1>(logits + off, dx + off, V, t, lse[blockIdx.x], scale);
}
"""


def render_xent(io: str = "f32") -> str:
    return io_defines(io) + ELEM_IO + BLOCK_REDUCE + XENT_SOURCE


register_source(KernelSource("xent", render_xent, ("ts_xent_fwd", "ts_mean", "ts_xent_bwd"),
                             configs=[dict(io=d) for d in ("f32", "f16", "bf16")]))


def _fn(entry: str, dtype):
    return get_function("xent", entry, dict(io=io_name(dtype)), render_xent)


def _targets(op: str, logits: Any, targets: Any) -> int:
    if tuple(targets.shape) != tuple(logits.shape[:-1]) or np.dtype(targets.dtype) not in (np.int32, np.int64):
        raise ValueError(f"{op}: targets must be int32 or int64 ids of shape {tuple(logits.shape[:-1])} (logits "
                         f"{tuple(logits.shape)} without the class dim), got {dtype_name(targets.dtype)} "
                         f"{tuple(targets.shape)}")
    return int(targets.dtype == np.int64)


def _check_logits(op: str, logits: Any) -> None:
    check_float(op, "logits", logits, NORM_DTYPES)
    if logits.shape[-1] == 0:
        raise ValueError(f"{op}: logits {tuple(logits.shape)} have no classes")


def softmax_cross_entropy_cuda(logits: Any, targets: Any, *, return_lse: bool = False, stream: Any = None):
    """Mean over rows of ``logsumexp(row) - row[target]``: a 0-d f32 device array (for f16/bf16
    logits too, as autocast computes a loss), and ``lse`` (f32, ``logits.shape[:-1]``) when
    ``return_lse``.

    Two launches: one pass over each row (online max and sum, f32) writing its loss and
    logsumexp, then one block averaging the rows' losses in f64 in a fixed order.  A target
    outside ``[0, V)`` cannot raise without reading the device, so its row's loss is NaN
    and so is the mean (the CPU kernel raises).  Targets: int32 or int64.
    """
    import cupy
    op = "softmax_cross_entropy"
    _check_logits(op, logits)
    ids64 = _targets(op, logits, targets)
    check_stream(op, stream)
    if not on_gpu(logits):
        with launch_stream(stream):
            return ref.softmax_cross_entropy(logits, targets, return_lse=return_lse)
    V = logits.shape[-1]
    rows = logits.size // V
    with launch_stream(stream):
        logits, targets = dense(logits, targets)
        loss, lse = cupy.empty(rows, np.float32), cupy.empty(logits.shape[:-1], np.float32)
        mean = cupy.empty((), np.float32)          # the statistics' dtype: f32 for 16-bit logits too
        if rows:
            vec = V % (16 // logits.itemsize) == 0 and all_aligned(16, logits)
            _fn("ts_xent_fwd", logits.dtype)((rows,), (NT,), (logits, targets, loss, lse, np.int32(V), np.int32(ids64),
                                                              np.int32(vec)))
        _fn("ts_mean", logits.dtype)((1,), (NT,), (loss, mean, np.int32(rows)))
    return (mean, lse) if return_lse else mean


def cross_entropy_backward_cuda(g: Any, logits: Any, targets: Any, lse: Any, *, stream: Any = None):
    """The logits' cotangent ``(softmax - onehot(target)) * g / rows`` in one launch.  ``g``: a
    Python float or a 0-d device array (f32/f16/bf16/f64), read on the device.  A row whose
    target is outside ``[0, V)`` gets NaN (its loss was NaN)."""
    op = "cross_entropy_backward"
    _check_logits(op, logits)
    ids64 = _targets(op, logits, targets)
    check_stream(op, stream)
    if tuple(lse.shape) != tuple(logits.shape[:-1]) or (on_gpu(logits) and lse.dtype != np.float32):
        raise ValueError(f"{op}: lse must be the forward's {tuple(logits.shape[:-1])} (f32 for f32/f16/bf16 logits), "
                         f"got {dtype_name(lse.dtype)} {tuple(lse.shape)}")
    device_g = is_cupy(g)
    g_code = io_code(g.dtype) if device_g else 0
    if g_code is None or (device_g and g.ndim != 0):
        raise ValueError(f"{op}: g must be a Python float or a 0-d float device array, got {dtype_name(g.dtype)} "
                         f"{tuple(g.shape)}")
    if not on_gpu(logits):
        with launch_stream(stream):
            return ref.cross_entropy_backward(g, logits, targets, lse)
    V = logits.shape[-1]
    rows = logits.size // V
    with launch_stream(stream):
        logits, targets, lse = dense(logits, targets, lse)
        dx = empty_like(logits)
        if rows:
            vec = V % (16 // logits.itemsize) == 0 and all_aligned(16, logits, dx)
            _fn("ts_xent_bwd", logits.dtype)(
                (rows,), (NT,), (logits, targets, lse, g if device_g else None, dx, np.int32(V), np.int32(rows),
                                 np.float64(0.0 if device_g else float(g)),
                                 np.int32(g_code), np.int32(ids64), np.int32(vec)))
    return dx


register_kernel("softmax_cross_entropy", "cuda", softmax_cross_entropy_cuda)
register_kernel("cross_entropy_backward", "cuda", cross_entropy_backward_cuda)
