"""The fused ops of a decoder step as RawKernels (references and semantics: ``decoder_ops``).

One CUDA source, compiled per I/O dtype (f32, f16, bf16), statistics in f32 and sampling in
f64.  Every launcher writes into arrays it is given (``out=``), reads nothing back to the host
and allocates nothing, so a decode step made of them can be captured in a CUDA graph:

* ``ts_add_rmsnorm``: a block per row: ``x += delta`` (rounded to the dtype, as the residual
  stream is), the mean square by a block reduction, then ``out = round(x * rstd) * w``;
* ``ts_rope_kv``: a grid-stride loop over (token, head, pair) for q and k (angles
  ``pos * inv_freq`` in f32 with precise ``sincosf``: this source is compiled without
  ``--use_fast_math``) and over (token, kv head, column) for v: roped q to ``q_out``, roped k
  in place, k and v into their page row by the slot mapping;
* ``ts_silu_mul``: ``silu(g) * u`` over a fused (T, 2F) gate/up product;
* ``ts_decode_prepare``: a decode step's key counts, window starts and slots (one thread a row);
* ``ts_sample_argmax``: a block per row: the best ``z`` of the row (greedy or Gumbel-max with
  the splitmix64 hash of ``decoder_ops.gumbel_hash``), the lowest id among equals;
* ``ts_sample_pick``: one block: the best over the tp ranks' candidates into the token ids,
  then positions, step counters and the token history advanced.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from . import decoder_ops as ref
from ._common import null_ptr
from .compile import KernelSource, register_source
from .cuda_common import BLOCK_REDUCE, ELEM_IO, MAX_GRID_YZ, get_function, io_defines, io_name, launch_stream

__all__ = ["render_decoder", "add_rmsnorm_cuda", "rope_kv_cuda", "silu_mul_cuda", "decode_prepare_cuda",
           "sample_argmax_cuda", "sample_pick_cuda"]

NT = 256

DECODER_SOURCE = r"""
#define NT 256

extern "C" __global__ void __launch_bounds__(NT)
ts_add_rmsnorm(io_t* __restrict__ x, const io_t* __restrict__ delta, const io_t* __restrict__ w,
               io_t* __restrict__ out, int n, float eps) {
  __shared__ float scratch[32];
  const long long base = (long long)blockIdx.x * n;
  float ss[1] = {0.f};
  for (int c = threadIdx.x; c < n; c += NT) {
    float v = ts_f(x[base + c]);
    if (delta) {
      const io_t r = ts_to<io_t>(v + ts_f(delta[base + c]));
      x[base + c] = r;
      v = ts_f(r);
    }
    ss[0] += v * v;
  }
  ts_block_reduce<false, 1>(ss, scratch);
  const float rstd = 1.f / sqrtf(ss[0] / n + eps);
  for (int c = threadIdx.x; c < n; c += NT) {
    const float y = ts_f(ts_to<io_t>(ts_f(x[base + c]) * rstd));
    out[base + c] = ts_to<io_t>(y * ts_f(w[c]));
  }
}

// q and k heads: item = (t, head, i < D/2); v: item = (t, kv head, c < D), after them.
extern "C" __global__ void __launch_bounds__(NT)
ts_rope_kv(io_t* __restrict__ qkv, long long ld, const int* __restrict__ pos, const float* __restrict__ inv_freq,
           long long T, int nq, int nkv, int D, io_t* __restrict__ qout, io_t* __restrict__ kp,
           io_t* __restrict__ vp, const int* __restrict__ slots, int bs) {
  const int half = D / 2, heads = nq + nkv;
  const long long rope_items = T * heads * half;
  const long long v_items = kp ? T * nkv * D : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < rope_items + v_items; it += stride) {
    if (it < rope_items) {
      const int i = (int)(it % half);
      const int h = (int)((it / half) % heads);
      const long long t = it / ((long long)half * heads);
      float s, c;
      sincosf((float)pos[t] * inv_freq[i], &s, &c);
      c = ts_f(ts_to<io_t>(c));
      s = ts_f(ts_to<io_t>(s));
      io_t* row = qkv + t * ld + (long long)h * D;
      const float x1 = ts_f(row[i]), x2 = ts_f(row[i + half]);
      const io_t o1 = ts_to<io_t>(x1 * c - x2 * s), o2 = ts_to<io_t>(x2 * c + x1 * s);
      if (h < nq) {
        io_t* dst = qout ? qout + (t * nq + h) * D : row;
        dst[i] = o1;
        dst[i + half] = o2;
      } else {
        row[i] = o1;
        row[i + half] = o2;
        const int slot = kp ? slots[t] : -1;
        if (slot >= 0) {
          io_t* dst = kp + (((long long)(slot / bs) * nkv + (h - nq)) * bs + slot % bs) * D;
          dst[i] = o1;
          dst[i + half] = o2;
        }
      }
    } else {
      const long long j = it - rope_items;
      const int c = (int)(j % D);
      const int hk = (int)((j / D) % nkv);
      const long long t = j / ((long long)D * nkv);
      const int slot = slots[t];
      if (slot >= 0)
        vp[(((long long)(slot / bs) * nkv + hk) * bs + slot % bs) * D + c] = qkv[t * ld + (long long)(nq + nkv + hk) * D + c];
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT)
ts_silu_mul(const io_t* __restrict__ gu, io_t* __restrict__ out, long long T, int F) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < T * F; it += stride) {
    const long long t = it / F;
    const int j = (int)(it % F);
    const float g = ts_f(gu[t * 2 * F + j]), u = ts_f(gu[t * 2 * F + F + j]);
    out[it] = ts_to<io_t>(g / (1.f + expf(-g)) * u);
  }
}

extern "C" __global__ void __launch_bounds__(NT)
ts_decode_prepare(const int* __restrict__ pos, const int* __restrict__ tables, int W, int bs, int window,
                  int* __restrict__ lens, int* __restrict__ starts, int* __restrict__ slots, int B) {
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < B; b += gridDim.x * blockDim.x) {
    const int p = pos[b], col = p / bs;
    const int page = col < W ? tables[(long long)b * W + col] : -1;
    const bool live = page >= 0;
    lens[b] = live ? p + 1 : 0;
    starts[b] = (live && window > 0) ? max(0, p + 1 - window) : 0;
    slots[b] = live ? page * bs + p % bs : -1;
  }
}

__device__ __forceinline__ unsigned long long ts_mix64(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The better of two (value, id) candidates: larger value, then lower id.
__device__ __forceinline__ void ts_better(double& v, long long& i, double ov, long long oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

extern "C" __global__ void __launch_bounds__(NT)
ts_sample_argmax(const io_t* __restrict__ logits, int V, long long v0, double inv_t, long long seed,
                 const int* __restrict__ keys, double* __restrict__ out) {
  __shared__ double s_v[NT / 32];
  __shared__ long long s_i[NT / 32];
  const int b = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long h = 0;
  if (inv_t > 0.0) {
    h = ts_mix64((unsigned long long)seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
    h = ts_mix64(h ^ (unsigned long long)(long long)keys[2 * b]);
    h = ts_mix64(h ^ ((unsigned long long)(long long)keys[2 * b + 1] + 0x2545F4914F6CDD1Dull));
  }
  double best = -INFINITY;
  long long arg = 0x7fffffffffffffffll;
  for (int j = threadIdx.x; j < V; j += NT) {
    double z = (double)ts_f(logits[(long long)b * V + j]);
    if (inv_t > 0.0) {
      const unsigned long long r = ts_mix64(h ^ (unsigned long long)(v0 + j));
      const double u = ((double)(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);
      z = z * inv_t - log(-log(u));
    }
    ts_better(best, arg, z, v0 + j);
  }
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, best, w);
    const long long oi = __shfl_xor_sync(0xffffffffu, arg, w);
    ts_better(best, arg, ov, oi);
  }
  if (lane == 0) { s_v[warp] = best; s_i[warp] = arg; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < NT / 32; ++k) ts_better(best, arg, s_v[k], s_i[k]);
    out[2 * b] = best;
    out[2 * b + 1] = (double)(arg == 0x7fffffffffffffffll ? v0 : arg);
  }
}

extern "C" __global__ void __launch_bounds__(NT)
ts_sample_pick(const double* __restrict__ cand, int R, int B, int* __restrict__ tok, int* __restrict__ pos,
               int* __restrict__ keys, int* __restrict__ hist, int H, int* __restrict__ hist_n) {
  const int n = hist_n ? hist_n[0] : 0;
  for (int b = threadIdx.x; b < B; b += NT) {
    double v = cand[2 * b];
    long long i = (long long)cand[2 * b + 1];
    for (int r = 1; r < R; ++r) ts_better(v, i, cand[((long long)r * B + b) * 2], (long long)cand[((long long)r * B + b) * 2 + 1]);
    tok[b] = (int)i;
    if (pos) pos[b] += 1;
    if (keys) keys[2 * b + 1] += 1;
    if (hist && n < H) hist[(long long)b * H + n] = (int)i;
  }
  __syncthreads();
  if (hist_n && threadIdx.x == 0) hist_n[0] = n + 1;
}
"""


def render_decoder(io: str = "f32") -> str:
    return io_defines(io) + ELEM_IO + BLOCK_REDUCE + DECODER_SOURCE


_ENTRIES = ("ts_add_rmsnorm", "ts_rope_kv", "ts_silu_mul", "ts_decode_prepare", "ts_sample_argmax", "ts_sample_pick")
register_source(KernelSource("decoder", render_decoder, _ENTRIES, configs=[dict(io=d) for d in ("f32", "f16", "bf16")],
                             fast_math=False))
_GPU = {"f32", "f16", "bf16"}


def _fn(entry: str, dtype):
    return get_function("decoder", entry, dict(io=io_name(dtype) or "f32"), render_decoder, fast_math=False)


def _grid(items: int) -> tuple:
    return (max(1, min(1 << 16, -(-items // NT))),)


def _gpu_dtype(op: str, a) -> None:
    if io_name(a.dtype) not in _GPU:
        raise TypeError(f"{op}: the GPU kernel takes float32, float16 or bfloat16, got {a.dtype}")


def add_rmsnorm_cuda(x: Any, delta: Any, weight: Any, *, eps: float = 1e-6, out: Any, stream: Any = None) -> Any:
    """``x += delta``; ``out = rmsnorm(x) * weight``: one launch (a block per row)."""
    op = "add_rmsnorm"
    ref._check_rows(op, "x", x)
    _gpu_dtype(op, x)
    for name, a in (("delta", delta), ("out", out)):
        if a is not None and (tuple(a.shape) != tuple(x.shape) or a.dtype != x.dtype or not a.flags.c_contiguous):
            raise ValueError(f"{op}: {name} must be contiguous and match x {tuple(x.shape)}")
    if out is None or not x.flags.c_contiguous or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"{op}: needs contiguous x, out= and a ({x.shape[1]},) weight of x's dtype")
    if x.shape[0] > MAX_GRID_YZ * 32768:
        raise ValueError(f"{op}: {x.shape[0]} rows exceed one launch")
    with launch_stream(stream):
        if x.shape[0]:
            _fn("ts_add_rmsnorm", x.dtype)((x.shape[0],), (NT,), (x, null_ptr(delta), weight, out,
                                                                  np.int32(x.shape[1]), np.float32(eps)))
    return out


def rope_kv_cuda(qkv: Any, positions: Any, inv_freq: Any, n_q: int, n_kv: int, *, q_out: Any = None,
                 k_pages: Any = None, v_pages: Any = None, slots: Any = None, stream: Any = None) -> Any:
    """Roped q (into ``q_out``), roped k in place, k and v into the pages by ``slots``: one launch."""
    t, d = ref.check_rope_kv("rope_kv", qkv, positions, inv_freq, n_q, n_kv, q_out, k_pages, v_pages, slots)
    _gpu_dtype("rope_kv", qkv)
    if d % 2 or qkv.strides[0] % qkv.itemsize:
        raise ValueError(f"rope_kv: head_dim {d} must be even")
    items = t * (n_q + n_kv) * (d // 2) + (t * n_kv * d if k_pages is not None else 0)
    bs = k_pages.shape[2] if k_pages is not None else 1
    with launch_stream(stream):
        if items:
            _fn("ts_rope_kv", qkv.dtype)(_grid(items), (NT,), (
                qkv, np.int64(qkv.strides[0] // qkv.itemsize), positions, inv_freq, np.int64(t), np.int32(n_q),
                np.int32(n_kv), np.int32(d), null_ptr(q_out), null_ptr(k_pages), null_ptr(v_pages), null_ptr(slots),
                np.int32(bs)))
    return q_out if q_out is not None else qkv[:, :n_q * d].reshape(t, n_q, d)


def silu_mul_cuda(gu: Any, *, out: Any, stream: Any = None) -> Any:
    """``silu(gu[:, :F]) * gu[:, F:]`` into ``out (T, F)``: one launch."""
    ref._check_rows("silu_mul", "gu", gu)
    _gpu_dtype("silu_mul", gu)
    t, f = gu.shape[0], gu.shape[1] // 2
    if out is None or tuple(out.shape) != (t, f) or out.dtype != gu.dtype or not out.flags.c_contiguous \
            or not gu.flags.c_contiguous:
        raise ValueError(f"silu_mul: needs a contiguous gu and out= ({t}, {f}) of its dtype")
    with launch_stream(stream):
        if t * f:
            _fn("ts_silu_mul", gu.dtype)(_grid(t * f), (NT,), (gu, out, np.int64(t), np.int32(f)))
    return out


def decode_prepare_cuda(pos: Any, tables: Any, block_size: int, window: int | None, *, lens: Any, starts: Any,
                        slots: Any, stream: Any = None) -> None:
    """Key counts, window starts and slots of a decode step: one launch."""
    b = pos.shape[0]
    with launch_stream(stream):
        if b:
            _fn("ts_decode_prepare", np.float32)(_grid(b), (NT,), (
                pos, tables, np.int32(tables.shape[1]), np.int32(block_size), np.int32(window or 0), lens, starts,
                slots, np.int32(b)))


def sample_argmax_cuda(logits: Any, *, v0: int, temperature: float = 0.0, seed: int = 0, keys: Any = None,
                       out: Any, stream: Any = None) -> Any:
    """Each row's best (value, global id), greedy or Gumbel-max: one launch (a block per row)."""
    _gpu_dtype("sample_argmax", logits)
    b, v = logits.shape
    if out is None or tuple(out.shape) != (b, 2) or out.dtype != np.float64 or not logits.flags.c_contiguous:
        raise ValueError(f"sample_argmax: needs contiguous logits and out= float64 ({b}, 2)")
    if temperature > 0 and (keys is None or tuple(keys.shape) != (b, 2) or keys.dtype != np.int32):
        raise ValueError(f"sample_argmax: temperature needs keys int32 ({b}, 2)")
    with launch_stream(stream):
        if b:
            _fn("ts_sample_argmax", logits.dtype)((b,), (NT,), (
                logits, np.int32(v), np.int64(v0), np.float64(1.0 / temperature if temperature > 0 else 0.0),
                np.int64(seed), null_ptr(keys if temperature > 0 else None), out))
    return out


def sample_pick_cuda(cand: Any, *, tok: Any, pos: Any = None, keys: Any = None, hist: Any = None,
                     hist_n: Any = None, stream: Any = None) -> Any:
    """The best candidate over the ranks into ``tok``, and the step's bookkeeping: one launch."""
    b = tok.shape[0]
    r = cand.size // (2 * b) if b else 1
    with launch_stream(stream):
        if b:
            _fn("ts_sample_pick", np.float32)((1,), (NT,), (
                cand, np.int32(r), np.int32(b), tok, null_ptr(pos), null_ptr(keys), null_ptr(hist),
                np.int32(hist.shape[1] if hist is not None else 0), null_ptr(hist_n)))
    return tok


for _name, _impl in (("add_rmsnorm", add_rmsnorm_cuda), ("rope_kv", rope_kv_cuda), ("silu_mul", silu_mul_cuda),
                     ("decode_prepare", decode_prepare_cuda), ("sample_argmax", sample_argmax_cuda),
                     ("sample_pick", sample_pick_cuda)):
    register_kernel(_name, "cuda", _impl)
