"""Tensor-core tile GEMM (CuPy RawKernel) beside cuBLAS, and the SwiGLU double GEMM.

``C[b] = A[b] @ B[b]`` for f16/bf16 operands with f32 accumulators (seed 003 §4.7): a block
computes a BM×BN tile of C, its WM×WN warps each own a (BM/WM)×(BN/WN) sub-tile made of
m16n8k16 MMAs.  A and B tiles of depth BK are staged in shared memory, two buffers deep:
while the warps multiply buffer ``s``, each thread already holds the next K slab in
registers and stores it into buffer ``s^1`` afterwards (seed 003 §4.4's double buffering,
without cp.async so that it also runs on sm_80 unchanged).  B is stored n-major in shared
memory so each B fragment is one 32-bit load.  ``DUAL=1`` multiplies the same A tile by
two B matrices and writes ``silu(A@B1) * (A@B2)``: the SwiGLU MLP's x@w1 and x@w3 share
the x loads.  cuBLAS (``cupy.matmul``) stays the default for plain GEMM; the tile kernel
runs when ``tile_shape`` is given or autotune picks it.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import check_float, check_out, check_policy, check_stream
from .compile import KernelSource, register_source
from .cuda_common import MAX_GRID_YZ, MMA_HEADER, aligned, get_function, is_aligned, launch_stream
from .gemm import autocast_pair, check_tile_shape, matmul as matmul_reference, matmul_shapes
from .precision import f32_compute, note

__all__ = ["GEMM_CONFIGS", "DUAL_CONFIGS", "render_gemm", "gemm_smem_bytes", "tile_gemm", "matmul_cuda", "swiglu_cuda",
           "dual_matmul_cuda", "tuned_matmul", "cublas_f32_compute"]

# (BM, BN, BK) -> warps (WM, WN).  Warp tiles are multiples of 16x8.
GEMM_CONFIGS = {(128, 128, 32): (2, 4), (128, 64, 32): (2, 2), (64, 128, 32): (2, 2),
                (64, 64, 32): (2, 2), (64, 64, 64): (2, 2)}
# The SwiGLU form stages two B tiles; these fit the 48 KiB of static shared memory.
DUAL_CONFIGS = ((64, 64, 32),)   # (128, 64, 32) needs 255 registers and spills
STATIC_SMEM_LIMIT = 48 * 1024
_BF16 = resolve_dtype("bf16")
_F32 = np.dtype(np.float32)
# cuBLAS through cupy.matmul (CuPy >= 14 for bf16): 16-bit operands on the tensor cores with
# f32 accumulation; f32 in f32 (or TF32, see cublas_f32_compute); f64 in f64
_CUBLAS_DTYPES = (np.dtype(np.float16), _BF16, _F32, np.dtype(np.float64))
_TILE_DTYPES = {np.dtype(np.float16): "f16", _BF16: "bf16"}
_SHORT = {np.dtype(np.float16): "f16", _BF16: "bf16", _F32: "f32", np.dtype(np.float64): "f64"}
_PAD = 8  # halves of padding per smem row: keeps rows 16-byte aligned and spreads banks

GEMM_SOURCE = r"""
#define NTHREADS (WM * WN * 32)
#define LDS (BK + PAD)
#define WTM (BM / WM)
#define WTN (BN / WN)
#define MT (WTM / 16)
#define NT (WTN / 8)
#define A_PAIRS (BM * BK / 2 / NTHREADS)
#define B_PAIRS (BN * BK / 2 / NTHREADS)
#define NB (DUAL ? 2 : 1)

__device__ __forceinline__ unsigned ld_pair(const elem_t* p, int row, int col, int rows, int cols, int ld) {
  // two consecutive elements (row, col), (row, col+1); zeros outside the matrix
  if (row >= rows || col >= cols) return 0u;
  const unsigned short* q = reinterpret_cast<const unsigned short*>(p) + (long long)row * ld + col;
  if (((ld & 1) == 0) && col + 1 < cols) return *reinterpret_cast<const unsigned*>(q);
  unsigned lo = q[0], hi = (col + 1 < cols) ? q[1] : 0u;
  return lo | (hi << 16);
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
ts_gemm(const elem_t* __restrict__ A, const elem_t* __restrict__ B0, const elem_t* __restrict__ B1,
        void* __restrict__ C, void* __restrict__ C2, int M, int N, int K,
        long long a_batch, long long b_batch, long long c_batch) {
  __shared__ __align__(16) elem_t sA[2][BM * LDS];
  __shared__ __align__(16) elem_t sB[2][NB][BN * LDS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / WN) * WTM, wn0 = (warp % WN) * WTN;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  A += blockIdx.z * a_batch;
  const elem_t* Bs[2] = {B0 + blockIdx.z * b_batch, (DUAL ? B1 : B0) + blockIdx.z * b_batch};

  float acc[NB][MT][NT][4];
  #pragma unroll
  for (int b = 0; b < NB; ++b)
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        acc[b][i][j][0] = acc[b][i][j][1] = acc[b][i][j][2] = acc[b][i][j][3] = 0.f;

  unsigned ra[A_PAIRS], rb[NB][B_PAIRS];
  auto fetch = [&](int k0) {
    #pragma unroll
    for (int p = 0; p < A_PAIRS; ++p) {
      int idx = tid + p * NTHREADS, r = idx / (BK / 2), c = (idx % (BK / 2)) * 2;
      ra[p] = ld_pair(A, m0 + r, k0 + c, M, K, K);
    }
    #pragma unroll
    for (int b = 0; b < NB; ++b)
      #pragma unroll
      for (int p = 0; p < B_PAIRS; ++p) {       // pairs along N: coalesced reads of B's rows
        int idx = tid + p * NTHREADS, r = idx / (BN / 2), c = (idx % (BN / 2)) * 2;
        rb[b][p] = ld_pair(Bs[b], k0 + r, n0 + c, K, N, N);
      }
  };
  auto stash = [&](int s) {
    #pragma unroll
    for (int p = 0; p < A_PAIRS; ++p) {
      int idx = tid + p * NTHREADS, r = idx / (BK / 2), c = (idx % (BK / 2)) * 2;
      *reinterpret_cast<unsigned*>(&sA[s][r * LDS + c]) = ra[p];
    }
    #pragma unroll
    for (int b = 0; b < NB; ++b)
      #pragma unroll
      for (int p = 0; p < B_PAIRS; ++p) {       // transpose into n-major rows
        int idx = tid + p * NTHREADS, k = idx / (BN / 2), n = (idx % (BN / 2)) * 2;
        unsigned short* dst = reinterpret_cast<unsigned short*>(sB[s][b]);
        dst[n * LDS + k] = (unsigned short)(rb[b][p] & 0xffffu);
        dst[(n + 1) * LDS + k] = (unsigned short)(rb[b][p] >> 16);
      }
  };

  const int ktiles = (K + BK - 1) / BK;
  fetch(0);
  stash(0);
  __syncthreads();
  for (int kt = 0; kt < ktiles; ++kt) {
    const int s = kt & 1;
    if (kt + 1 < ktiles) fetch((kt + 1) * BK);     // global loads in flight during the MMAs
    #pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MT][4];
      #pragma unroll
      for (int i = 0; i < MT; ++i) ts_load_a(af[i], &sA[s][(wm0 + i * 16) * LDS + kk], LDS, lane);
      #pragma unroll
      for (int b = 0; b < NB; ++b)
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
          unsigned bf[2];
          ts_load_b(bf, &sB[s][b][(wn0 + j * 8) * LDS + kk], LDS, lane);
          #pragma unroll
          for (int i = 0; i < MT; ++i) ts_mma(acc[b][i][j], af[i], bf);
        }
    }
    if (kt + 1 < ktiles) stash(s ^ 1);
    __syncthreads();
  }

  const int g = lane >> 2, t = lane & 3;
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int row = m0 + wm0 + i * 16 + g + (h >= 2 ? 8 : 0);
        const int col = n0 + wn0 + j * 8 + 2 * t + (h & 1);
        if (row < M && col < N) {
          float v = acc[0][i][j][h];
#if DUAL && !DUAL_OUT
          v = v / (1.f + __expf(-v)) * acc[NB - 1][i][j][h];
#endif
          const long long off = blockIdx.z * c_batch + (long long)row * N + col;
#if OUT_F32
          reinterpret_cast<float*>(C)[off] = v;
#if DUAL_OUT
          reinterpret_cast<float*>(C2)[off] = acc[NB - 1][i][j][h];
#endif
#else
          reinterpret_cast<elem_t*>(C)[off] = ts_elem(v);
#if DUAL_OUT
          reinterpret_cast<elem_t*>(C2)[off] = ts_elem(acc[NB - 1][i][j][h]);
#endif
#endif
        }
      }
}
"""


def render_gemm(BM: int = 128, BN: int = 128, BK: int = 32, dtype: str = "f16", out_f32: bool = False,
                dual: bool = False, dual_out: bool = False) -> str:
    """CUDA C for one GEMM config; the macros are the compile-time tile.  ``dual_out`` (with
    ``dual``) writes both products, ``A@B1`` to C and ``A@B2`` to C2, instead of SwiGLU."""
    wm, wn = GEMM_CONFIGS[(BM, BN, BK)]
    defs = (f"#define BM {BM}\n#define BN {BN}\n#define BK {BK}\n#define WM {wm}\n#define WN {wn}\n"
            f"#define PAD {_PAD}\n#define OUT_F32 {int(out_f32)}\n#define DUAL {int(dual)}\n"
            f"#define DUAL_OUT {int(dual and dual_out)}\n"
            f"#define TS_BF16 {int(dtype == 'bf16')}\n")
    return defs + MMA_HEADER + GEMM_SOURCE


def gemm_smem_bytes(BM: int, BN: int, BK: int, dual: bool = False) -> int:
    return 2 * (BM + (2 if dual else 1) * BN) * (BK + _PAD) * 2


register_source(KernelSource(
    "tile_gemm", render_gemm, ("ts_gemm",),
    configs=[dict(BM=bm, BN=bn, BK=bk) for (bm, bn, bk) in GEMM_CONFIGS]
    + [dict(BM=128, BN=128, BK=32, dtype="bf16"), dict(BM=128, BN=128, BK=32, out_f32=True)]
    + [dict(BM=bm, BN=bn, BK=bk, dual=True) for (bm, bn, bk) in DUAL_CONFIGS]
    + [dict(BM=bm, BN=bn, BK=bk, dual=True, dual_out=True) for (bm, bn, bk) in DUAL_CONFIGS],
    smem_dynamic=lambda **cfg: 0))


def _check_gpu_operands(op: str, *arrays) -> None:
    for i, a in enumerate(arrays):
        if np.dtype(a.dtype) not in _TILE_DTYPES or a.dtype != arrays[0].dtype:
            raise TypeError(f"{op}: the tensor-core kernel takes float16 or bf16 operands of one dtype, got "
                            f"{', '.join(dtype_name(x.dtype) for x in arrays)}; cast with .astype(...) or "
                            "call without tile_shape to use cuBLAS")
        if not a.flags.c_contiguous:
            raise ValueError(f"{op}: operand {i} of shape {tuple(a.shape)} is not C-contiguous; "
                             "pass cupy.ascontiguousarray(x)")


def _batch_stride(a: Any, batch: tuple, rows: int, cols: int) -> int:
    """0 when ``a`` broadcasts over the batch, else its per-matrix stride (one batch dim folded)."""
    if a.ndim <= 2 or int(np.prod(a.shape[:-2])) == 1:
        return 0
    if tuple(a.shape[:-2]) != batch:
        raise ValueError(f"tile_gemm: operand batch dims {tuple(a.shape[:-2])} must equal the result's "
                         f"{batch} or be absent; broadcast explicitly first")
    return rows * cols


def tile_gemm(a: Any, b: Any, tile_shape: tuple = (128, 128, 32), *, out: Any | None = None,
              stream: Any | None = None, out_dtype: Any = np.float16, b2: Any | None = None,
              dual_out: bool = False):
    """Launch the tensor-core tile GEMM on CuPy float16 arrays (``b2`` selects the SwiGLU form;
    ``b2`` with ``dual_out=True`` returns ``(a @ b, a @ b2)`` from one pass over ``a``)."""
    import cupy
    if dual_out and (b2 is None or out is not None):
        raise ValueError("tile_gemm: dual_out=True needs b2= and makes its own two outputs (no out=)")
    op = ("dual_matmul" if dual_out else "swiglu") if b2 is not None else "tile_gemm"
    tile = check_tile_shape(op, tile_shape)
    allowed = DUAL_CONFIGS if b2 is not None else tuple(GEMM_CONFIGS)
    if tile not in allowed:
        smem = gemm_smem_bytes(*tile, dual=b2 is not None)
        raise ValueError(f"{op}: tile_shape {tile} has no compiled variant (it would stage {smem} bytes "
                         f"of shared memory, limit {STATIC_SMEM_LIMIT}); use one of {sorted(allowed)}")
    ops = (a, b) if b2 is None else (a, b, b2)
    _check_gpu_operands(op, *ops)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"{op}: the tile kernel needs 2-D or batched operands, got {a.shape} @ {b.shape}")
    shape = matmul_shapes(op, a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = tuple(shape[:-2])
    out_dt = np.dtype(out_dtype)
    check_out(op, out, shape, out_dt, xp=cupy)
    nb = int(np.prod(batch)) if batch else 1
    a_stride, b_stride = _batch_stride(a, batch, m, k), _batch_stride(b, batch, k, n)
    cfg = dict(BM=tile[0], BN=tile[1], BK=tile[2], dtype=_TILE_DTYPES[np.dtype(a.dtype)], out_f32=out_dt == np.float32,
               dual=b2 is not None, dual_out=dual_out)
    fn = get_function("tile_gemm", "ts_gemm", cfg, render_gemm)
    wm, wn = GEMM_CONFIGS[tile]
    with launch_stream(stream):     # allocations and copies on the launch's stream
        # ld_pair reads two halves as one 32-bit word: operands must start 4-byte aligned
        a, b = aligned(a, 4), aligned(b, 4)
        b2 = aligned(b2, 4) if b2 is not None else b
        c = out if out is not None and is_aligned(out, 4) else cupy.empty(shape, out_dt)
        c2 = cupy.empty(shape, out_dt) if dual_out else c
        a3, b3, b23 = (x.reshape((-1,) + x.shape[-2:]) for x in (a, b, b2))
        c3, c23 = c.reshape((nb, m, n)), c2.reshape((nb, m, n))
        # the batch rides on grid.z, which CUDA caps at 65535: launch in slices of that many
        for z0 in range(0, nb, MAX_GRID_YZ):
            z1 = min(nb, z0 + MAX_GRID_YZ)
            pick = (lambda x, stride: x[z0:z1] if stride else x)
            grid = ((n + tile[1] - 1) // tile[1], (m + tile[0] - 1) // tile[0], z1 - z0)
            fn(grid, (wm * wn * 32,), (pick(a3, a_stride), pick(b3, b_stride), pick(b23, b_stride), c3[z0:z1],
                                        c23[z0:z1], np.int32(m), np.int32(n), np.int32(k), np.int64(a_stride),
                                        np.int64(b_stride), np.int64(m * n)))
        if out is not None and c is not out:
            out[...] = c
            c = out
    return (c, c2) if dual_out else c


@contextlib.contextmanager
def cublas_f32_compute(kind: str):
    """cupy.matmul on f32 operands computes in ``kind`` ("f32" or "tf32") inside the block.

    CuPy keeps one compute type per dtype for the process (``cupy._core.set_compute_type``,
    which ``CUPY_TF32=1`` also sets); the float32 matmul precision is tessera_rt's, so it is
    set here around each call and put back, whatever CuPy held before."""
    from cupy._core import _routines_linalg as linalg
    from cupy._core import set_compute_type
    want = linalg.COMPUTE_TYPE_TF32 if kind == "tf32" else linalg.COMPUTE_TYPE_DEFAULT
    before = linalg.get_compute_type(_F32)
    if before == want:
        yield
        return
    set_compute_type(_F32, want)
    try:
        yield
    finally:
        set_compute_type(_F32, before)


def _rows_fold(a: Any) -> bool:
    """Whether ``a``'s leading dims merge with its rows without a copy (a reshape view)."""
    dims = [(n, st) for n, st in zip(a.shape[:-1], a.strides[:-1]) if n != 1]
    return a.strides[-1] == a.itemsize and all(st == s_in * n_in for (_, st), (n_in, s_in) in zip(dims, dims[1:]))


def _bf16_matmul(a: Any, b: Any, out: Any = None):
    """cupy.matmul of bf16 operands.  CuPy 14.2 sends a batched (ndim > 2) bf16 product to
    its integer GEMM, which refuses the dtype (fixed after 14.2), so batches are 2-D GEMMs:
    one over all rows when ``b`` is a matrix, else one per matrix of the batch."""
    import cupy
    if a.ndim <= 2 and b.ndim <= 2:
        return cupy.matmul(a, b, out=out)
    shape = matmul_shapes("matmul", a, b)
    if b.ndim == 2:
        c = cupy.matmul(a.reshape(-1, a.shape[-1]), b).reshape(shape)
    else:
        a3 = cupy.broadcast_to(a, shape[:-2] + a.shape[-2:]).reshape((-1,) + a.shape[-2:])
        b3 = cupy.broadcast_to(b, shape[:-2] + b.shape[-2:]).reshape((-1,) + b.shape[-2:])
        c = cupy.empty((a3.shape[0], shape[-2], shape[-1]), a.dtype)
        for i in range(a3.shape[0]):
            cupy.matmul(a3[i], b3[i], out=c[i])
        c = c.reshape(shape)
    if out is None:
        return c
    out[...] = c
    return out


def _cublas(a: Any, b: Any, out: Any):
    """cupy.matmul at the dtype's precision; f32 follows the float32 matmul precision."""
    import cupy
    if a.dtype != _F32:
        note("matmul", _SHORT[np.dtype(a.dtype)], "cublas")
        return _bf16_matmul(a, b, out) if a.dtype == _BF16 else cupy.matmul(a, b, out=out)
    kind = f32_compute()
    note("matmul", kind, "cublas")
    if kind == "bf16":          # "medium": bf16 tensor cores, f32 accumulation, f32 back
        c = _bf16_matmul(a.astype(_BF16), b.astype(_BF16))
        if out is None:
            return c.astype(_F32)
        out[...] = c
        return out
    with cublas_f32_compute(kind):
        return cupy.matmul(a, b, out=out)


def matmul_cuda(a: Any, b: Any, *, tile_shape: Any = None, out: Any | None = None,
                stream: Any | None = None, policy: Any = None):
    """GPU matmul: cuBLAS by default (16-bit on the tensor cores, f32 per the float32 matmul
    precision); the tile kernel when ``tile_shape`` is given for f16/bf16.  A 16-bit operand
    with an f32 one computes in the 16-bit dtype (``gemm.autocast_pair``)."""
    check_float("matmul", "a", a)
    check_float("matmul", "b", b)
    check_policy("matmul", policy)
    check_stream("matmul", stream)
    with launch_stream(stream):   # casts, cuBLAS and outputs on the caller's stream
        a, b = autocast_pair(a, b)
        if tile_shape is not None and a.dtype == b.dtype and a.dtype in _TILE_DTYPES and policy is None:
            note("matmul", _TILE_DTYPES[np.dtype(a.dtype)], "own")
            return tile_gemm(a, b, tuple(tile_shape), out=out, stream=stream, out_dtype=a.dtype)
        if policy is None and a.dtype == b.dtype and a.dtype in _CUBLAS_DTYPES:
            # Straight to cuBLAS: widening 16-bit operands first (the reference's way) would
            # only add two copies and turn a tensor-core GEMM into an f32 SIMT one.
            shape = matmul_shapes("matmul", a, b)
            if a.ndim > 2 and b.ndim == 2 and _rows_fold(a) and (out is None or out.flags.c_contiguous):
                # (..., m, k) @ (k, n) as one 2-D GEMM: CuPy's batched path would broadcast the
                # weight through pointer arrays (three more kernels) and copy a transposed one
                c = _cublas(a.reshape(-1, a.shape[-1]), b, None if out is None else out.reshape(-1, shape[-1]))
                return c.reshape(shape) if out is None else out
            return _cublas(a, b, out)
        return matmul_reference(a, b, out=out, policy=policy)


def swiglu_cuda(x: Any, w1: Any, w3: Any, *, out: Any | None = None, stream: Any | None = None,
                policy: Any = None):
    """SwiGLU on the GPU: the DUAL tile kernel for fp16, else the xp reference."""
    from .mlp import _check_pair, swiglu as swiglu_reference
    # before any launch: the kernel indexes w3 with w1's shape and would read past a smaller w3
    _check_pair("swiglu", x, w1, w3, stream, policy)
    if x.dtype == np.float16 and policy is None and x.ndim >= 2:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        with launch_stream(stream):
            y = tile_gemm(x2, w1, (64, 64, 32), b2=w3, stream=stream, out_dtype=np.float16)
            y = y.reshape(lead + (w1.shape[1],))
            if out is not None:
                out[...] = y
                return out
        return y
    with launch_stream(stream):
        return swiglu_reference(x, w1, w3, out=out, policy=policy)


def dual_matmul_cuda(x: Any, w1: Any, w3: Any, *, stream: Any | None = None, policy: Any = None):
    """``(x @ w1, x @ w3)`` on the GPU: the DUAL_OUT tile kernel (one pass over x, two weight
    tiles per block) for fp16, else the xp reference (cuBLAS products)."""
    from .mlp import _check_pair, dual_matmul as dual_reference, dual_reads_x_once
    _check_pair("dual_matmul", x, w1, w3, stream, policy)     # as swiglu_cuda: before any launch
    if dual_reads_x_once(x, w1, w3, policy, on_gpu=True):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        with launch_stream(stream):
            y1, y3 = tile_gemm(x2, w1, DUAL_CONFIGS[0], b2=w3, stream=stream, out_dtype=np.float16,
                               dual_out=True)
        return y1.reshape(lead + (w1.shape[1],)), y3.reshape(lead + (w1.shape[1],))
    with launch_stream(stream):
        return dual_reference(x, w1, w3, policy=policy)


def _tuned_matmul():
    from .autotuner import autotune
    # cuBLAS (None) competes with every tile config; the tile kernel is used only where it wins.
    return autotune(space={"tile_shape": [None] + sorted(GEMM_CONFIGS)}, name="matmul_cuda")(matmul_cuda)


tuned_matmul = _tuned_matmul()

register_kernel("matmul", "cuda", matmul_cuda)
register_kernel("gemm", "cuda", matmul_cuda)
register_kernel("swiglu", "cuda", swiglu_cuda)
register_kernel("dual_matmul", "cuda", dual_matmul_cuda)
