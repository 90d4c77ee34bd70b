"""matmul / gemm: the NumPy reference (CPU path and test oracle) and its checks.

``np.matmul`` semantics, batch dims broadcast.  Low-precision inputs (bf16, fp16) are
widened to the policy's accumulation dtype (f32 by default) before the product, so the
reference sums exactly as the GPU tile kernel's f32 accumulators do, and the result is
cast back to the input dtype.  With ``tile_shape=(BM, BN, BK)`` the reference also sums
K in BK-wide slabs, the order the tile kernel uses, which matters for low precision.
The GPU launcher lives in ``gemm_cuda.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .numerics import FP8_DTYPES, NumericPolicy, accum_dtype, result_dtype

__all__ = ["matmul", "gemm", "matmul_shapes", "check_tile_shape", "autocast_pair", "SMEM_LIMIT_BYTES"]

# Opt-in shared memory per block on H100 (227 KiB); A100 allows 163 KiB.  Tile shapes are
# checked against the largest so a CPU run rejects what no GPU could launch.
SMEM_LIMIT_BYTES = 227 * 1024


def check_tile_shape(op: str, tile_shape: Any, itemsize: int = 2, stages: int = 2,
                     smem_limit: int = SMEM_LIMIT_BYTES) -> tuple[int, int, int] | None:
    """Validate ``(BM, BN, BK)``: three positive ints whose staged A/B tiles fit in shared memory."""
    if tile_shape is None:
        return None
    try:
        bm, bn, bk = (int(t) for t in tile_shape)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: tile_shape must be three ints (BM, BN, BK), got {tile_shape!r}") from None
    if min(bm, bn, bk) <= 0:
        raise ValueError(f"{op}: tile_shape entries must be positive, got {(bm, bn, bk)}")
    smem = stages * (bm * bk + bk * bn) * itemsize
    if smem > smem_limit:
        raise ValueError(
            f"{op}: tile_shape {(bm, bn, bk)} needs {smem} bytes of shared memory for {stages} "
            f"stages of {itemsize}-byte A and B tiles, over the {smem_limit}-byte limit; "
            f"shrink BK or BM/BN (e.g. (128, 128, 64))")
    return bm, bn, bk


def matmul_shapes(op: str, a: Any, b: Any) -> tuple[int, ...]:
    """The result shape of ``a @ b`` under np.matmul rules, or a ValueError naming both shapes."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"{op}: operands must have at least 1 dim, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}; use multiply for scalars")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ValueError(f"{op}: inner dims differ: a {tuple(a.shape)} has K={ka}, b {tuple(b.shape)} "
                         f"has K={kb}; transpose or reshape so a.shape[-1] == b.shape[-2]")
    try:
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        raise ValueError(f"{op}: batch dims {tuple(a.shape[:-2])} and {tuple(b.shape[:-2])} "
                         f"(of a {tuple(a.shape)}, b {tuple(b.shape)}) do not broadcast") from None
    m = (a.shape[-2],) if a.ndim >= 2 else ()
    n = (b.shape[-1],) if b.ndim >= 2 else ()
    return tuple(batch) + m + n


def _input_dtype(op: str, a: Any, b: Any) -> np.dtype:
    if a.dtype == b.dtype:
        return np.dtype(a.dtype)
    try:
        return np.result_type(a.dtype, b.dtype)
    except Exception:
        raise TypeError(f"{op}: cannot mix {dtype_name(a.dtype)} and {dtype_name(b.dtype)}; "
                        "cast one operand to the other's dtype") from None


_PLAIN = (np.dtype(np.float32), np.dtype(np.float64))
_HALF = frozenset((np.dtype(np.float16), np.dtype(resolve_dtype("bf16"))))


def autocast_pair(a: Any, b: Any) -> tuple[Any, Any]:
    """A GEMM of a 16-bit operand (f16/bf16) with an f32/f64 one computes in the 16-bit dtype:
    the wide operand is cast down, as autocast does, and the 16-bit one (typically a weight)
    is never widened (that would double its bytes and take the GEMM off the tensor cores).
    Other mixes are left to NumPy's promotion."""
    da, db = a.dtype, b.dtype
    if da == db:
        return a, b
    if da in _HALF and db in _PLAIN:
        return a, b.astype(da)
    if db in _HALF and da in _PLAIN:
        return a.astype(db), b
    return a, b


def matmul(a: Any, b: Any, *, tile_shape: Any = None, out: Any | None = None,
           stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``a @ b`` with f32 accumulation for low-precision inputs (NumPy reference).

    A 16-bit operand with an f32/f64 one computes in the 16-bit dtype (``autocast_pair``).
    FP8 inputs (or an FP8 ``policy``) compute on the dequantized values and return f32
    (or the input dtype), since an FP8 result would discard the f32 accumulation.

    Parameters
    ----------
    a, b : array
        The operands (batched, broadcasting).
    tile_shape : tuple of int, optional
        ``(BM, BN, BK)`` for the GPU kernel (checked against shared memory).
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        The product, f32 for FP8 inputs, else the inputs' dtype.
    """
    if (tile_shape is None and out is None and stream is None and policy is None and type(a) is np.ndarray
            and type(b) is np.ndarray and a.dtype == b.dtype and a.dtype in _PLAIN and a.ndim >= 2 and b.ndim >= 2
            and a.shape[-1] == b.shape[-2]):
        # f32/f64 without options: exactly np.matmul (no widening, no cast), without the ~8 us
        # of checks below (51 calls in a toy transformer step); batch dims that do not
        # broadcast fall through to them for the readable error
        try:
            return np.matmul(a, b)
        except ValueError:
            pass
    op = "matmul"
    check_float(op, "a", a)
    check_float(op, "b", b)
    check_policy(op, policy)
    check_stream(op, stream)
    a, b = autocast_pair(a, b)
    matmul_shapes(op, a, b)
    in_dt = _input_dtype(op, a, b)
    check_tile_shape(op, tile_shape, itemsize=max(in_dt.itemsize, 1))
    acc = accum_dtype(in_dt, policy)
    res_dt = result_dtype(np.dtype(np.float32) if in_dt in FP8_DTYPES else in_dt, policy)
    xp = array_module(a, b)
    if policy is not None and policy.quantizes:
        from .fp8 import fake_quantize_fp8
        # per-channel: one scale per row of A (axis -2) and per column of B (axis -1)
        a_c = fake_quantize_fp8(a, policy, axis=-2 if a.ndim >= 2 else -1)
        b_c = fake_quantize_fp8(b, policy, axis=-1, seed=1)
        a_c, b_c = widen(a_c, acc), widen(b_c, acc)
    else:
        a_c, b_c = widen(a, acc), widen(b, acc)
    if tile_shape is None or a.ndim < 2 or b.ndim < 2:
        result = xp.matmul(a_c, b_c)
    else:
        bk = int(tile_shape[2])
        k = a.shape[-1]
        result = xp.matmul(a_c[..., :, 0:bk], b_c[..., 0:bk, :])
        for k0 in range(bk, k, bk):
            result += xp.matmul(a_c[..., :, k0:k0 + bk], b_c[..., k0:k0 + bk, :])
    return finish(op, result, out, res_dt)


gemm = matmul

register_kernel("matmul", "cpu", matmul)
register_kernel("gemm", "cpu", matmul)
