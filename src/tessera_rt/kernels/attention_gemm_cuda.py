"""f32 attention on the GPU: cuBLAS GEMMs around f32 softmax kernels, exact to f32.

The tensor-core flash kernel (``attention_cuda``) multiplies 16-bit operands; f32 inputs
must not be rounded to them behind the caller's back (fp16 lost 1-9% of small gradients).
Here the scores of a group of (batch, kv head) slices are one batched f32 GEMM
``S = Q Kᵀ`` (the query heads of a kv head stacked as rows: grouped-query attention needs
no copies of K or V), a row kernel turns S into P in place (scale, causal mask, max, sum,
natural-log ``lse``), and ``O = P V`` is a second GEMM.  The backward recomputes S from
``lse`` (as FlashAttention-2 does), forms ``dP = dO Vᵀ``, one elementwise kernel writes
``P`` over S and ``dS = P (dP - delta) * scale`` over dP, and three GEMMs give dVᵀ = dOᵀ P,
dQ = dS K and dKᵀ = Qᵀ dS.  Every batched GEMM reads C-contiguous operands (CuPy copies
any other): the small (S x D) inputs are transposed where a product needs them so, never
the (Sq x Sk) score matrices.

The GEMMs are f32 (CuPy's batched GEMM has no TF32 mode; at "medium" attention_cuda runs the
bf16 flash kernel instead).  S and dP are materialized for ``slices`` (batch x kv head) at a time,
sized so that they stay under ``SCRATCH_BYTES``; every slice of a call uses the same two
buffers.  The kernels are compiled without fast math: ``expf``/``logf`` within 2 ulp.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .compile import KernelSource, register_source
from .cuda_common import get_function, launch_stream

__all__ = ["attention_f32", "attention_f32_backward", "render_attn_f32", "SCRATCH_BYTES"]

SCRATCH_BYTES = 256 << 20          # S (and dP in the backward) per group of slices
NT = 256

ATTN_F32_SOURCE = r"""
#define NT 256
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Key c of score row r is visible when c <= (r % sq) + offset (causal; offset = sk - sq).
__device__ __forceinline__ bool visible(long long r, int c, int sq, int offset, int causal) {
  return !causal || c <= (int)(r % sq) + offset;
}

// One block per row of S (rows x sk): P = softmax(S * scale) in place, masked keys 0;
// LSE[row] = logsumexp of the visible scaled scores (-inf for a row with none).
extern "C" __global__ void __launch_bounds__(NT)
ts_attn_probs(float* __restrict__ S, float* __restrict__ LSE, int sk, int sq, int offset, float scale,
              int causal) {
  __shared__ float sm[NT / 32], sl[NT / 32];
  const long long r = blockIdx.x;
  float* s = S + r * sk;
  const int end = causal ? min(sk, (int)(r % sq) + offset + 1) : sk;
  float m = -INFINITY, l = 0.f;                       // this thread's running max and sum
  for (int c = threadIdx.x; c < end; c += NT) {
    const float x = s[c] * scale;
    if (x > m) { l = l * expf(m - x) + 1.f; m = x; } else { l += expf(x - m); }
  }
  // combine the (m, l) pairs: a warp, then the warps
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, w), lo = __shfl_xor_sync(0xffffffffu, l, w);
    const float mx = fmaxf(m, mo);
    l = (mx == -INFINITY) ? 0.f : l * expf(m - mx) + lo * expf(mo - mx);
    m = mx;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
  __syncthreads();
  float M = -INFINITY;
  #pragma unroll
  for (int w = 0; w < NT / 32; ++w) M = fmaxf(M, sm[w]);
  float L = 0.f;
  if (M != -INFINITY) {
    #pragma unroll
    for (int w = 0; w < NT / 32; ++w) L += sl[w] * expf(sm[w] - M);
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int c = threadIdx.x; c < sk; c += NT) s[c] = c < end ? expf(s[c] * scale - M) * inv : 0.f;
  if (threadIdx.x == 0) LSE[r] = L > 0.f ? M + logf(L) : -INFINITY;
}

// Over S and DP (rows x sk): S := P = exp(S * scale - lse) (masked 0), DP := P (DP - delta) * scale.
extern "C" __global__ void ts_attn_dscores(float* __restrict__ S, float* __restrict__ DP,
                                           const float* __restrict__ LSE, const float* __restrict__ DELTA,
                                           long long total, int sk, int sq, int offset, float scale, int causal) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / sk;
    const int c = (int)(i - r * sk);
    const float lse = LSE[r];
    const float p = (lse == -INFINITY || !visible(r, c, sq, offset, causal)) ? 0.f : expf(S[i] * scale - lse);
    S[i] = p;
    DP[i] = p * (DP[i] - DELTA[r]) * scale;
  }
}

// delta[row] = sum_d dO[row, d] * O[row, d]; one warp per row.
extern "C" __global__ void ts_attn_delta(const float* __restrict__ O, const float* __restrict__ dO,
                                         float* __restrict__ delta, long long rows, int d) {
  const long long row = (long long)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float sum = 0.f;
  for (int c = lane; c < d; c += 32) sum += O[row * d + c] * dO[row * d + c];
  #pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane == 0) delta[row] = sum;
}
"""

def render_attn_f32() -> str:
    return ATTN_F32_SOURCE


register_source(KernelSource("attention_f32", render_attn_f32, ("ts_attn_probs", "ts_attn_dscores", "ts_attn_delta"),
                             configs=[{}], fast_math=False))      # expf/logf to 2 ulp: f32 means f32


def _fn(entry: str):
    return get_function("attention_f32", entry, {}, render_attn_f32, fast_math=False)


def _grid(total: int) -> tuple:
    return (max(1, min(-(-total // NT), 65535 * 8)),)


def _slices(bh: int, rows: int, sk: int, buffers: int) -> int:
    """How many (batch, kv head) slices go into one GEMM: ``buffers`` f32 (rows x sk) score
    matrices per slice within SCRATCH_BYTES (at least one)."""
    return max(1, min(bh, SCRATCH_BYTES // max(1, buffers * rows * sk * 4)))


def _stacked(xp, t, bh: int, rows: int, d: int):
    """A (B, H, S, D) tensor as (B*Hkv, groups*S, D): a kv head's query heads stacked as rows."""
    return xp.ascontiguousarray(t).reshape(bh, rows, d)


def _transposed(xp, t3):
    """A stacked (B*Hkv, rows, D) array's matrices transposed, contiguous (B*Hkv, D, rows).
    CuPy's batched GEMM copies any operand that is not C-contiguous: transposing the small
    (rows x D) inputs here keeps every product's operands contiguous, so the (rows x Sk)
    score matrices are never copied."""
    return xp.ascontiguousarray(t3.transpose(0, 2, 1))


def _f32_gemms():
    from .gemm_cuda import cublas_f32_compute
    return cublas_f32_compute("f32")


def attention_f32(q: Any, k: Any, v: Any, shape: tuple, *, causal: bool, scale: float, out: Any = None,
                  stream: Any = None):
    """``(o, lse)`` for f32 CuPy ``q`` (B, H, Sq, D), ``k``/``v`` (B, Hkv, Sk, D); ``shape``
    is check_attention's ``(B, H, Hkv, Sq, Sk, D)``."""
    import cupy
    b, h, hkv, sq, sk, d = shape
    g, bh = h // hkv, b * hkv
    rows = g * sq
    probs = _fn("ts_attn_probs")
    with launch_stream(stream), _f32_gemms():
        q3, v3 = _stacked(cupy, q, bh, rows, d), _stacked(cupy, v, bh, sk, d)
        kt3 = _transposed(cupy, _stacked(cupy, k, bh, sk, d))
        o3 = out.reshape(bh, rows, d) if out is not None and out.flags.c_contiguous else cupy.empty((bh, rows, d), np.float32)
        lse = cupy.empty((bh, rows), np.float32)
        n = _slices(bh, rows, sk, 1)
        s_buf = cupy.empty((n, rows, sk), np.float32)
        for z0 in range(0, bh, n):
            z1 = min(bh, z0 + n)
            s = s_buf[:z1 - z0]
            cupy.matmul(q3[z0:z1], kt3[z0:z1], out=s)
            probs(((z1 - z0) * rows,), (NT,), (s, lse[z0:z1], np.int32(sk), np.int32(sq), np.int32(sk - sq),
                                              np.float32(scale), np.int32(bool(causal))))
            cupy.matmul(s, v3[z0:z1], out=o3[z0:z1])
        o = o3.reshape(b, h, sq, d)
        if out is not None and o.data.ptr != out.data.ptr:
            out[...] = o
            o = out
    return o, lse.reshape(b, h, sq)


def attention_f32_backward(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, shape: tuple, *,
                           causal: bool, scale: float, stream: Any = None):
    """``(dq, dk, dv)`` in f32 for the f32 CuPy forward above (``lse`` from it)."""
    import cupy
    b, h, hkv, sq, sk, d = shape
    g, bh = h // hkv, b * hkv
    rows = g * sq
    delta_fn, dscores = _fn("ts_attn_delta"), _fn("ts_attn_dscores")
    with launch_stream(stream), _f32_gemms():
        q3, k3, v3 = _stacked(cupy, q, bh, rows, d), _stacked(cupy, k, bh, sk, d), _stacked(cupy, v, bh, sk, d)
        o3, do3 = _stacked(cupy, o, bh, rows, d), _stacked(cupy, do, bh, rows, d)
        qt3, kt3, vt3, dot3 = (_transposed(cupy, t) for t in (q3, k3, v3, do3))
        lse2 = cupy.ascontiguousarray(lse, dtype=np.float32).reshape(bh, rows)
        delta = cupy.empty((bh, rows), np.float32)
        delta_fn((-(-bh * rows // (NT // 32)),), (NT,), (o3, do3, delta, np.int64(bh * rows), np.int32(d)))
        dq3 = cupy.empty((bh, rows, d), np.float32)
        dkt3, dvt3 = cupy.empty((bh, d, sk), np.float32), cupy.empty((bh, d, sk), np.float32)
        n = _slices(bh, rows, sk, 2)
        s_buf, dp_buf = cupy.empty((n, rows, sk), np.float32), cupy.empty((n, rows, sk), np.float32)
        for z0 in range(0, bh, n):
            z1 = min(bh, z0 + n)
            s, dp = s_buf[:z1 - z0], dp_buf[:z1 - z0]
            cupy.matmul(q3[z0:z1], kt3[z0:z1], out=s)
            cupy.matmul(do3[z0:z1], vt3[z0:z1], out=dp)
            total = (z1 - z0) * rows * sk
            dscores(_grid(total), (NT,), (s, dp, lse2[z0:z1], delta[z0:z1], np.int64(total), np.int32(sk),
                                          np.int32(sq), np.int32(sk - sq), np.float32(scale), np.int32(bool(causal))))
            cupy.matmul(dot3[z0:z1], s, out=dvt3[z0:z1])          # dVᵀ = dOᵀ P
            cupy.matmul(dp, k3[z0:z1], out=dq3[z0:z1])            # dQ = dS K
            cupy.matmul(qt3[z0:z1], dp, out=dkt3[z0:z1])          # dKᵀ = Qᵀ dS
        dk3, dv3 = (cupy.ascontiguousarray(t.transpose(0, 2, 1)) for t in (dkt3, dvt3))
    return dq3.reshape(b, h, sq, d), dk3.reshape(b, hkv, sk, d), dv3.reshape(b, hkv, sk, d)
