"""GPU matmul: cuBLAS by default, the tensor-core tile GEMM on request, and the SwiGLU dual GEMM.

The tile kernel's source and configs live in ``gemm_tile_cuda`` (mma.sync fed by ldmatrix from a
multi-stage cp.async pipeline); this module launches it: ``tile_gemm`` (batched, f16/bf16
operands, f16/bf16/f32 output, the dual forms), ``swiglu_cuda`` (``silu(x@w1) * (x@w3)`` in one
kernel) and ``dual_matmul_cuda`` (both products from one pass over x).  cuBLAS
(``cupy.matmul``) stays the default for plain GEMM; the tile kernel runs when ``tile_shape`` is
given or autotune picks it.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import check_float, check_out, check_policy, check_stream
from .cuda_common import MAX_GRID_YZ, get_function, is_aligned, launch_stream
from .gemm import autocast_pair, check_tile_shape, matmul as matmul_reference, matmul_shapes
from .gemm_tile_cuda import DUAL_CONFIGS, GEMM_CONFIGS, gemm_grid, gemm_smem_bytes, gemm_threads, render_gemm
from .precision import f32_compute, note

__all__ = ["GEMM_CONFIGS", "DUAL_CONFIGS", "render_gemm", "gemm_smem_bytes", "tile_gemm", "gemm_vec", "matmul_cuda",
           "swiglu_cuda", "dual_matmul_cuda", "tuned_matmul", "cublas_f32_compute"]

_BF16 = resolve_dtype("bf16")
_F32 = np.dtype(np.float32)
# cuBLAS through cupy.matmul (CuPy >= 14 for bf16): 16-bit operands on the tensor cores with
# f32 accumulation; f32 in f32 (or TF32, see cublas_f32_compute); f64 in f64
_CUBLAS_DTYPES = (np.dtype(np.float16), _BF16, _F32, np.dtype(np.float64))
_TILE_DTYPES = {np.dtype(np.float16): "f16", _BF16: "bf16"}
_SHORT = {np.dtype(np.float16): "f16", _BF16: "bf16", _F32: "f32", np.dtype(np.float64): "f64"}


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


def gemm_vec(k: int, n: int, *arrays) -> int:
    """Elements per global->shared copy: 8 (16-byte cp.async) where K and N are multiples of 8 and
    every operand starts 16-byte aligned, else the widest of 4, 2 and 1 that divides both (a
    view starting mid-word is read in place, with narrower copies, not copied)."""
    for vec in (8, 4, 2):
        if k % vec == 0 and n % vec == 0 and all(a.data.ptr % (2 * vec) == 0 for a in arrays):
            return vec
    return 1


def dual_tile(m: int) -> tuple[int, int, int]:
    """The dual GEMM's tile for ``m`` rows: 128-row tiles once they fill, else 64."""
    return (128, 128, 32) if m >= 1024 else (128, 64, 32) if m > 64 else (64, 64, 32)


def tile_gemm(a: Any, b: Any, tile_shape: tuple = (128, 128, 32), *, out: Any | None = None,
              stream: Any | None = None, out_dtype: Any = None, b2: Any | None = None,
              dual_out: bool = False):
    """Launch the tensor-core tile GEMM on CuPy float16 or bf16 arrays (``b2`` selects the SwiGLU
    form; ``b2`` with ``dual_out=True`` returns ``(a @ b, a @ b2)`` from one pass over ``a``).
    ``out_dtype``: the operands' dtype (default) or float32."""
    import cupy
    if dual_out and (b2 is None or out is not None):
        raise ValueError("tile_gemm: dual_out=True needs b2= and makes its own two outputs (no out=)")
    op = ("dual_matmul" if dual_out else "swiglu") if b2 is not None else "tile_gemm"
    tile = check_tile_shape(op, tile_shape)
    allowed = DUAL_CONFIGS if b2 is not None else GEMM_CONFIGS
    if tile not in allowed:
        raise ValueError(f"{op}: tile_shape {tile} has no compiled variant; use one of {sorted(allowed)}")
    ops = (a, b) if b2 is None else (a, b, b2)
    _check_gpu_operands(op, *ops)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"{op}: the tile kernel needs 2-D or batched operands, got {a.shape} @ {b.shape}")
    shape = matmul_shapes(op, a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = tuple(shape[:-2])
    out_dt = np.dtype(a.dtype if out_dtype is None else out_dtype)
    if out_dt not in (np.dtype(a.dtype), _F32):
        raise TypeError(f"{op}: out_dtype {dtype_name(out_dt)} for {dtype_name(a.dtype)} operands; the kernel writes "
                        f"{dtype_name(a.dtype)} or float32")
    check_out(op, out, shape, out_dt, xp=cupy)
    nb = int(np.prod(batch)) if batch else 1
    a_stride, b_stride = _batch_stride(a, batch, m, k), _batch_stride(b, batch, k, n)
    b2_ = b2 if b2 is not None else b
    cfg = dict(BM=tile[0], BN=tile[1], BK=tile[2], dtype=_TILE_DTYPES[np.dtype(a.dtype)], out_f32=out_dt == _F32,
               dual=b2 is not None, dual_out=dual_out, vec=gemm_vec(k, n, a, b, b2_))
    smem = gemm_smem_bytes(*tile, dual=b2 is not None)
    fn = get_function("tile_gemm", "ts_gemm", cfg, render_gemm, dynamic_smem=smem)
    with launch_stream(stream):     # allocations and copies on the launch's stream
        # the epilogue stores (col, col+1) pairs: 4 (f16/bf16) or 8 (f32) bytes, aligned
        c = out if out is not None and is_aligned(out, 2 * out_dt.itemsize) else cupy.empty(shape, out_dt)
        c2 = cupy.empty(shape, out_dt) if dual_out else c
        a3, b3, b23 = (x.reshape((-1,) + x.shape[-2:]) for x in (a, b, b2_))
        c3, c23 = c.reshape((nb, m, n)), c2.reshape((nb, m, n))
        # the batch rides on grid.z, which CUDA caps at 65535: launch in slices of that many
        for z0 in range(0, nb, MAX_GRID_YZ):
            z1 = min(nb, z0 + MAX_GRID_YZ)
            pick = (lambda x, stride: x[z0:z1] if stride else x)
            fn(gemm_grid(m, n, tile, z1 - z0), (gemm_threads(tile, b2 is not None),),
               (pick(a3, a_stride), pick(b3, b_stride), pick(b23, b_stride), c3[z0:z1], c23[z0:z1], np.int32(m),
                np.int32(n), np.int32(k), np.int64(a_stride), np.int64(b_stride), np.int64(m * n)), shared_mem=smem)
        c = _into(out, c)
    return (c, c2) if dual_out else c


def _into(out: Any, c: Any):
    """``c``, copied into ``out`` when the caller gave one that ``c`` is not."""
    if out is None or c is out:
        return c
    out[...] = c
    return out


@contextlib.contextmanager
def cublas_f32_compute(kind: str):
    """cupy.matmul on f32 operands computes in ``kind`` ("f32" or "tf32") inside the block.

    CuPy keeps one compute type per dtype for the process (``cupy._core.set_compute_type``,
    which ``CUPY_TF32=1`` also sets); the float32 matmul precision is tessera_rt's, so it is
    set here around each call and put back, whatever CuPy held before."""
    from cupy._core import _routines_linalg as linalg, set_compute_type
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
    """SwiGLU on the GPU: the DUAL tile kernel for f16/bf16 (one pass over x, silu(x@w1) * (x@w3)
    in its epilogue), else the xp reference."""
    from .mlp import check_pair, swiglu as swiglu_reference
    # before any launch: the kernel indexes w3 with w1's shape and would read past a smaller w3
    check_pair("swiglu", x, w1, w3, stream, policy)
    if np.dtype(x.dtype) in _TILE_DTYPES and policy is None and x.ndim >= 2:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        with launch_stream(stream):
            y = tile_gemm(x2, w1, dual_tile(x2.shape[0]), b2=w3, stream=stream, out_dtype=x.dtype)
            return _into(out, y.reshape(lead + (w1.shape[1],)))
    with launch_stream(stream):
        return swiglu_reference(x, w1, w3, out=out, policy=policy)


def dual_matmul_cuda(x: Any, w1: Any, w3: Any, *, stream: Any | None = None, policy: Any = None):
    """``(x @ w1, x @ w3)`` on the GPU: the DUAL_OUT tile kernel (one pass over x, two weight
    tiles per block) where ``mlp.dual_reads_x_once`` says so, else the xp reference (cuBLAS products)."""
    from .mlp import check_pair, dual_matmul as dual_reference, dual_reads_x_once
    check_pair("dual_matmul", x, w1, w3, stream, policy)     # as swiglu_cuda: before any launch
    if dual_reads_x_once(x, w1, w3, policy, on_gpu=True):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        with launch_stream(stream):
            y1, y3 = tile_gemm(x2, w1, dual_tile(x2.shape[0]), b2=w3, stream=stream, out_dtype=x.dtype,
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
