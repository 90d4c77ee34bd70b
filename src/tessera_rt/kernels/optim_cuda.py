"""Multi-tensor optimizer kernels: AdamW, the sum of squares and the clip, each one launch per
gradient dtype over every tensor of that dtype (plus one small launch for the sum's total).

A launch gets a device table of the tensors' pointers and sizes (uploaded once per call, all
dtypes together) and maps its blocks to (tensor, ``CHUNK``-element chunk) by a binary search
over the tensors' first blocks.  Tensors whose pointers are 16-byte aligned (CuPy's
allocations are) move four f32 at a time.  Nothing is read on the host: the norm, the clip
scale and the optional gradient scale stay device scalars.  AdamW's arithmetic is
``cpu_fused.adamw_step``'s, IEEE-rounded operations with no fused multiply-adds, so a GPU
gives the CPU's bits (denormals may flush to zero under ``--use_fast_math``).  References and
CPU entries: ``kernels.multi_tensor``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from . import multi_tensor as ref
from ._common import check_stream, is_cupy
from .compile import KernelSource, register_source
from .cuda_common import BLOCK_REDUCE, ELEM_IO, get_function, io_code, io_defines, io_name, launch_stream

__all__ = ["adamw_multi_cuda", "sum_squares_multi_cuda", "clip_scale_multi_cuda", "render_optim", "CHUNK"]

NT = 256
CHUNK = 16384           # elements per block (a multiple of 4 * NT)

OPTIM_SOURCE = r"""
#define NT 256
#define CHUNK 16384

// The tensor of this block: the last t whose first block starts[t] <= blockIdx.x (no tensor is empty).
__device__ __forceinline__ int ts_tensor_of(const long long* starts, int T) {
  const long long b = blockIdx.x;
  int lo = 0, hi = T - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// f(e) on each of W elements at p, read and written back in the widest accesses.
template <int W, class T, class F> __device__ __forceinline__ void ts_update(T* p, const F& f) {
  typedef ts_access<W, T> A;
  #pragma unroll
  for (int j = 0; j < W; j += A::elems) {
    typename A::word u = *reinterpret_cast<typename A::word*>(p + j);
    T* e = reinterpret_cast<T*>(&u);
    #pragma unroll
    for (int i = 0; i < A::elems; ++i) f(e[i]);
    *reinterpret_cast<typename A::word*>(p + j) = u;
  }
}

struct ts_adam { float b1, ob1, b2, ob2, ic1, ic2, eps, decay, lr; };

// cpu_fused._adamw's operations in its order, each rounded (no contraction into an FMA).
__device__ __forceinline__ void ts_adamw_step(float& w, float& m, float& v, float g, const ts_adam& h) {
  m = __fadd_rn(__fmul_rn(m, h.b1), __fmul_rn(g, h.ob1));
  v = __fadd_rn(__fmul_rn(v, h.b2), __fmul_rn(__fmul_rn(g, g), h.ob2));
  const float step = __fdiv_rn(__fmul_rn(m, h.ic1), __fadd_rn(__fsqrt_rn(__fmul_rn(v, h.ic2)), h.eps));
  w = __fsub_rn(__fmul_rn(w, h.decay), __fmul_rn(step, h.lr));
}

// table: T masters, T gradients (io_t), T first and T second moments, T outputs (io_t copies of
// the updated masters, 0: none), T sizes, T first blocks.
extern "C" __global__ void __launch_bounds__(NT) ts_adamw(
    const unsigned long long* __restrict__ table, int T, const float* __restrict__ grad_scale, float b1, float ob1,
    float b2, float ob2, float ic1, float ic2, float eps, float decay, float lr) {
  const ts_adam h = {b1, ob1, b2, ob2, ic1, ic2, eps, decay, lr};
  const long long* starts = reinterpret_cast<const long long*>(table + 6 * T);
  const int t = ts_tensor_of(starts, T);
  float* w = reinterpret_cast<float*>(table[t]);
  const io_t* g = reinterpret_cast<const io_t*>(table[T + t]);
  float* m = reinterpret_cast<float*>(table[2 * T + t]);
  float* v = reinterpret_cast<float*>(table[3 * T + t]);
  io_t* out = reinterpret_cast<io_t*>(table[4 * T + t]);
  const long long n = (long long)table[5 * T + t];
  const long long begin = (blockIdx.x - starts[t]) * CHUNK, end = min(n, begin + CHUNK);
  const float gs = grad_scale ? *grad_scale : 1.f;
  const bool vec = ((table[t] | table[2 * T + t] | table[3 * T + t]) & 15) == 0
                   && ((table[T + t] | table[4 * T + t]) & (4 * sizeof(io_t) - 1)) == 0;
  long long scalar_from = begin;
  if (vec) {
    for (long long j = begin + threadIdx.x * 4; j + 4 <= end; j += NT * 4) {
      float wv[4], mv[4], vv[4], gv[4];
      ts_load<4>(w + j, wv);
      ts_load<4>(m + j, mv);
      ts_load<4>(v + j, vv);
      ts_load<4>(g + j, gv);
      #pragma unroll
      for (int k = 0; k < 4; ++k) ts_adamw_step(wv[k], mv[k], vv[k], grad_scale ? __fmul_rn(gv[k], gs) : gv[k], h);
      ts_store<4>(w + j, wv);
      ts_store<4>(m + j, mv);
      ts_store<4>(v + j, vv);
      if (out) ts_store<4>(out + j, wv);
    }
    scalar_from = begin + (end - begin) / 4 * 4;
  }
  for (long long j = scalar_from + threadIdx.x; j < end; j += NT) {
    const float gj = ts_f(g[j]);
    ts_adamw_step(w[j], m[j], v[j], grad_scale ? __fmul_rn(gj, gs) : gj, h);
    if (out) out[j] = ts_to<io_t>(w[j]);
  }
}

// table: T arrays, T sizes, T first blocks; partial[block] = the block's chunk's sum of squares (f64).
extern "C" __global__ void __launch_bounds__(NT) ts_sumsq(const unsigned long long* __restrict__ table, int T,
                                                          double* __restrict__ partial) {
  __shared__ double scratch[32];
  const long long* starts = reinterpret_cast<const long long*>(table + 2 * T);
  const int t = ts_tensor_of(starts, T);
  const io_t* x = reinterpret_cast<const io_t*>(table[t]);
  const long long n = (long long)table[T + t];
  const long long begin = (blockIdx.x - starts[t]) * CHUNK, end = min(n, begin + CHUNK);
  double s[1] = {0.0};
  long long scalar_from = begin;
  if ((table[t] & 15) == 0) {
    for (long long j = begin + threadIdx.x * VEC; j + VEC <= end; j += NT * VEC) {
      double v[VEC];
      ts_load<VEC>(x + j, v);
      #pragma unroll
      for (int k = 0; k < VEC; ++k) s[0] += v[k] * v[k];
    }
    scalar_from = begin + (end - begin) / VEC * VEC;
  }
  for (long long j = scalar_from + threadIdx.x; j < end; j += NT) {
    const double v = ts_d(x[j]);
    s[0] += v * v;
  }
  ts_block_reduce<false, 1>(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// out = partial[0] + ... + partial[n - 1], in a fixed order (one block).
extern "C" __global__ void __launch_bounds__(NT) ts_sum_partials(const double* __restrict__ partial, int n,
                                                                 double* __restrict__ out) {
  __shared__ double scratch[32];
  double s[1] = {0.0};
  for (int i = threadIdx.x; i < n; i += NT) s[0] += partial[i];
  ts_block_reduce<false, 1>(s, scratch);
  if (threadIdx.x == 0) *out = s[0];
}

// x times the clip scale: f64 elements by the f64 scale, the others in f32 by its f32 rounding
// (as NumPy multiplies an array by a Python float)
struct ts_scale_by {
  double sd; float sf;
  __device__ __forceinline__ void operator()(double& x) const { x *= sd; }
  template <class T> __device__ __forceinline__ void operator()(T& x) const { x = ts_to<T>(ts_f(x) * sf); }
};

// scale = max_norm / (sqrt(total_sq) + 1e-6) when that norm is finite and above max_norm, else 1
// (block 0 stores it); every element of the table's arrays times scale when it is below 1.
extern "C" __global__ void __launch_bounds__(NT) ts_clip(const unsigned long long* __restrict__ table, int T,
                                                         const void* __restrict__ total_sq, int sq_kind,
                                                         double max_norm, float* __restrict__ scale_out) {
  const double norm = sqrt(ts_scalar(total_sq, sq_kind));
  const bool clip = isfinite(norm) && norm > max_norm;
  const double sd = clip ? max_norm / (norm + 1e-6) : 1.0;
  const float sf = (float)sd;
  if (scale_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = sf;
  if (!clip || T == 0) return;
  const long long* starts = reinterpret_cast<const long long*>(table + 2 * T);
  const int t = ts_tensor_of(starts, T);
  io_t* x = reinterpret_cast<io_t*>(table[t]);
  const long long n = (long long)table[T + t];
  const long long begin = (blockIdx.x - starts[t]) * CHUNK, end = min(n, begin + CHUNK);
  const ts_scale_by scale{sd, sf};
  long long scalar_from = begin;
  if ((table[t] & 15) == 0) {
    for (long long j = begin + threadIdx.x * VEC; j + VEC <= end; j += NT * VEC) ts_update<VEC>(x + j, scale);
    scalar_from = begin + (end - begin) / VEC * VEC;
  }
  for (long long j = scalar_from + threadIdx.x; j < end; j += NT) scale(x[j]);
}
"""

def render_optim(io: str = "f32") -> str:
    return io_defines(io) + ELEM_IO + BLOCK_REDUCE + OPTIM_SOURCE


register_source(KernelSource("optim", render_optim, ("ts_adamw", "ts_sumsq", "ts_sum_partials", "ts_clip"),
                             configs=[dict(io=d) for d in ("f32", "f16", "bf16", "f64")]))


def _fn(entry: str, dtype):
    return get_function("optim", entry, dict(io=io_name(dtype)), render_optim)


def _device(op: str, name: str, arrays) -> None:
    for i, a in enumerate(arrays):
        if not is_cupy(a) or not a.flags.c_contiguous:
            raise ValueError(f"{op}: {name} {i} must be a C-contiguous device array, got "
                             f"{type(a).__name__} {tuple(getattr(a, 'shape', ()))}")


def _plan(columns: list[list], sizes: list[int]) -> tuple[np.ndarray, int]:
    """One dtype group's table (the columns' pointers, the sizes, each tensor's first block;
    tensors of size 0 left out by the caller) and its number of blocks."""
    blocks = np.array([-(-n // CHUNK) for n in sizes], np.int64)
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    cols = [np.array([0 if a is None else a.data.ptr for a in col], np.uint64) for col in columns]
    return np.concatenate(cols + [np.array(sizes, np.uint64), starts.view(np.uint64)]), int(blocks.sum())


def _groups(keys: list, items: list) -> dict:
    """The items of non-empty tensors by their key (a dtype name), in first-seen order."""
    out: dict = {}
    for k, it in zip(keys, items):
        if it[-1]:
            out.setdefault(k, []).append(it)
    return out


def _upload(plans: list[np.ndarray]):
    """The groups' tables as device views of one upload (a single host-to-device copy)."""
    import cupy
    host = np.concatenate(plans) if plans else np.zeros(1, np.uint64)
    dev = cupy.asarray(host)
    views, off = [], 0
    for p in plans:
        views.append(dev[off:off + p.size])
        off += p.size
    return views


def adamw_multi_cuda(ws, gs, ms, vs, *, lr: float, b1: float, b2: float, eps: float, weight_decay: float,
                     step: int, grad_scale: Any = None, outs: Any = None, stream: Any = None) -> None:
    """AdamW in place on the f32 masters ``ws`` and moments ``ms``, ``vs`` (any shapes, each
    contiguous) with gradients ``gs`` (f32/f16/bf16): one launch per gradient dtype present.
    ``grad_scale``: None, or a 0-d f32 device array every gradient is multiplied by first
    (a clip factor kept on the device).  ``outs``: None, or per tensor None or an array of its
    gradient's dtype that receives the updated master rounded to that dtype (a bf16 model's
    parameters, written in the same pass instead of a cast per parameter)."""
    op = "adamw_multi"
    ref.check_adamw_args(ws, gs, ms, vs, step, outs)
    outs = [None] * len(ws) if outs is None else list(outs)
    for name, arrays in (("master", ws), ("gradient", gs), ("first moment", ms), ("second moment", vs),
                         ("output", [o for o in outs if o is not None])):
        _device(op, name, arrays)
    if grad_scale is not None and (not is_cupy(grad_scale) or grad_scale.shape != () or grad_scale.dtype != np.float32):
        raise ValueError(f"{op}: grad_scale must be None or a 0-d f32 device array, got "
                         f"{dtype_name(getattr(grad_scale, 'dtype', type(grad_scale)))}")
    check_stream(op, stream)
    scalars = ref.adam_scalars(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, step=step)
    groups = _groups([np.dtype(g.dtype).name for g in gs], list(zip(ws, gs, ms, vs, outs, [w.size for w in ws])))
    plans = [_plan([list(c) for c in zip(*[it[:5] for it in items])], [it[5] for it in items])
             for items in groups.values()]
    if not plans:
        return
    with launch_stream(stream):
        for (dtype, items), table, (_, blocks) in zip(groups.items(), _upload([p for p, _ in plans]), plans):
            _fn("ts_adamw", dtype)((blocks,), (NT,), (table, np.int32(len(items)), grad_scale, *scalars))


def _array_groups(op: str, gs) -> tuple[dict, list]:
    _device(op, "array", gs)
    for i, g in enumerate(gs):
        if io_code(g.dtype) is None:
            raise TypeError(f"{op}: array {i} has dtype {dtype_name(g.dtype)}; f32, f16, bf16 or f64 arrays")
    groups = _groups([np.dtype(g.dtype).name for g in gs], [(g, g.size) for g in gs])
    return groups, [_plan([[it[0] for it in items]], [it[1] for it in items]) for items in groups.values()]


def sum_squares_multi_cuda(gs, *, stream: Any = None):
    """The sum of squares of every element of every array (a 0-d f64 device array): squares of
    f64 values, per block in f64, the blocks' sums added in a fixed order.  One launch per
    dtype group, plus one for the total."""
    import cupy
    op = "sum_squares_multi"
    groups, plans = _array_groups(op, gs)
    check_stream(op, stream)
    with launch_stream(stream):
        total = cupy.empty((), np.float64)
        partial = cupy.empty(max(1, sum(b for _, b in plans)), np.float64)
        off = 0
        for (dtype, items), table, (_, blocks) in zip(groups.items(), _upload([p for p, _ in plans]), plans):
            _fn("ts_sumsq", dtype)((blocks,), (NT,), (table, np.int32(len(items)), partial[off:]))
            off += blocks
        _fn("ts_sum_partials", np.float64)((1,), (NT,), (partial, np.int32(off), total))
    return total


def clip_scale_multi_cuda(gs, total_sq: Any, max_norm: float, *, stream: Any = None):
    """``clip_grad_norm``'s scale from the 0-d ``total_sq`` (``sum_squares_multi``'s) on the
    device: every array of ``gs`` multiplied in place by ``max_norm / (norm + 1e-6)`` when the
    norm is finite and above ``max_norm``.  Returns the scale (1 when nothing was scaled) as a
    0-d f32 device array; ``gs=[]`` gives the scale alone (for ``adamw_multi``'s
    ``grad_scale``).  One launch per dtype group (one when ``gs`` is empty)."""
    import cupy
    op = "clip_scale_multi"
    if not max_norm > 0:
        raise ValueError(f"{op}: max_norm must be > 0, got {max_norm}")
    code = io_code(total_sq.dtype) if is_cupy(total_sq) else None
    if code is None or total_sq.shape != ():
        raise ValueError(f"{op}: total_sq must be a 0-d float device array (sum_squares_multi's)")
    groups, plans = _array_groups(op, gs)
    check_stream(op, stream)
    with launch_stream(stream):
        scale = cupy.empty((), np.float32)
        launches = list(zip(groups.items(), _upload([p for p, _ in plans]), plans)) if plans else []
        if not launches:
            launches = [(("float32", []), None, (None, 1))]
        for i, ((dtype, items), table, (_, blocks)) in enumerate(launches):
            _fn("ts_clip", dtype)((blocks,), (NT,), (table, np.int32(len(items)), total_sq,
                                                    np.int32(code), np.float64(max_norm),
                                                    scale if i == 0 else None))
    return scale


register_kernel("adamw_multi", "cuda", adamw_multi_cuda)
register_kernel("sum_squares_multi", "cuda", sum_squares_multi_cuda)
register_kernel("clip_scale_multi", "cuda", clip_scale_multi_cuda)
