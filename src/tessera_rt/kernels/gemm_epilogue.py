"""GEMMs with fused epilogues: ``matmul_bias_act`` and the FP8 GEMM ``matmul_fp8``.

``matmul_bias_act(x, w, bias, act)`` is ``act(x @ w + bias)``: the GEMM that a ``bias_act``
follows in an MLP, in one op so that a library with fused epilogues (cuBLASLt, the
``cublaslt_gemm`` provider) writes the activated result once.  The project's own GPU path is
the unfused pair: the matmul kernel (cuBLAS), then the ``bias_act`` row kernel.

``matmul_fp8(a, b, a_scale, b_scale)`` multiplies FP8 operands: ``(a * a_scale) @ (b * b_scale)``
with f32 accumulation, in ``out_dtype``.  On the GPU FP8 arrays are uint8 bit patterns (CuPy
has no FP8 dtype; ``quantize_fp8`` returns them with their scales); on the CPU ml-dtypes FP8
arrays work too.  Scales: None (1), one per tensor, or one per row of ``a`` (``(M, 1)``) and
per column of ``b`` (``(1, N)``), as ``quantize_fp8(..., scale="per_channel", axis=...)`` makes
them.  cuBLASLt takes per-tensor scales; other cases run the own path (dequantize, f32 GEMM).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import get_backend, register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import array_module, check_float, check_policy, check_stream, finish, is_cupy, widen
from .fp8 import _fp8
from .gemm import matmul_shapes
from .mlp import ACTIVATIONS, _activate
from .norms import NORM_DTYPES
from .numerics import NumericPolicy, accum_dtype, result_dtype
from .precision import f32_compute, note
from .providers import dispatching

__all__ = ["matmul_bias_act", "matmul_fp8", "check_bias_act", "check_fp8_matmul", "FP8_OUT_DTYPES"]

FP8_OUT_DTYPES = ("f16", "bf16", "f32")


def check_bias_act(op: str, x: Any, w: Any, bias: Any, act: str) -> tuple[int, int, int]:
    """Validate ``x (..., K) @ w (K, N) + bias (N,)``; returns ``(M, K, N)``."""
    check_float(op, "x", x, NORM_DTYPES)
    check_float(op, "w", w, NORM_DTYPES)
    if w.ndim != 2 or x.ndim < 1:
        raise ValueError(f"{op}: w must be 2-D (K, N) and x (..., K), got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: x and w must share a dtype, got {dtype_name(x.dtype)} and {dtype_name(w.dtype)}")
    matmul_shapes(op, x, w)
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act={act!r} is not supported; use one of {ACTIVATIONS}")
    k, n = w.shape
    if bias is not None:
        check_float(op, "bias", bias, NORM_DTYPES)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({n},) (w's columns)")
    return x.size // max(k, 1), k, n


def matmul_bias_act(x: Any, w: Any, bias: Any | None = None, *, act: str = "identity", out: Any | None = None,
                    stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``act(x @ w + bias)`` with f32 accumulation, rounded once to x's dtype.

    Parameters
    ----------
    x : array
        ``(..., K)``.
    w : array
        ``(K, N)``, x's dtype.
    bias : array, optional
        ``(N,)``; None: no bias.
    act : str
        "identity", "relu", "gelu" (erf), "gelu_tanh", "silu" (``mlp.ACTIVATIONS``).
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        ``(..., N)``, x's dtype.
    """
    op = "matmul_bias_act"
    check_bias_act(op, x, w, bias, act)
    check_policy(op, policy)
    check_stream(op, stream)
    xp = array_module(x, w)
    acc = accum_dtype(x.dtype, policy)
    y = xp.matmul(widen(x, acc), widen(w, acc))
    if bias is not None:
        y = y + widen(bias, acc)
    return finish(op, _activate(op, y, act), out, result_dtype(x.dtype, policy))


def matmul_bias_act_cuda(x: Any, w: Any, bias: Any | None = None, *, act: str = "identity", out: Any | None = None,
                         stream: Any | None = None, policy: Any = None) -> Any:
    """The project's own GPU path: the matmul kernel (cuBLAS), then the ``bias_act`` row kernel."""
    op = "matmul_bias_act"
    check_bias_act(op, x, w, bias, act)
    be = get_backend()
    dt = np.dtype(x.dtype)
    note(op, f32_compute() if dt == np.float32 else "f16" if dt == np.float16 else dtype_name(dt))
    y = be.kernel("matmul", like=x)(x, w, stream=stream, policy=policy)
    if bias is None and act == "identity":
        if out is not None:
            out[...] = y
            return out
        return y
    return be.kernel("bias_act", like=x)(y, bias, act=act, out=out, stream=stream, policy=policy)


# --------------------------------------------------------------------------- FP8

def _scale_kind(op: str, name: str, s: Any, rows: int, axis_len: int, per: tuple) -> str:
    """"none", "tensor" or "channel" for scale ``s`` (``per``: the per-channel shapes allowed)."""
    if s is None:
        return "none"
    if np.isscalar(s) or getattr(s, "size", None) == 1:
        return "tensor"
    if tuple(s.shape) in per:
        return "channel"
    raise ValueError(f"{op}: {name} has shape {tuple(s.shape)}; pass one value, or one per "
                     f"{'row of a' if rows else 'column of b'} shaped {per[0]} (quantize_fp8's per_channel scales)")


def check_fp8_matmul(op: str, a: Any, b: Any, a_scale: Any, b_scale: Any, a_format: str, b_format: str,
                     out_dtype: Any) -> tuple:
    """Validate; returns ``(M, K, N, a FP8 dtype, b FP8 dtype, out dtype, a scale kind, b scale kind)``."""
    fa, fb = _fp8(op, a_format), _fp8(op, b_format)
    for name, t, f in (("a", a, fa), ("b", b, fb)):
        if not hasattr(t, "dtype") or t.ndim != 2:
            raise ValueError(f"{op}: {name} must be a 2-D array of FP8 values, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.dtype != np.uint8 and np.dtype(t.dtype) != f:
            raise TypeError(f"{op}: {name} must hold {dtype_name(f)} values as uint8 bit patterns (or, on the CPU, "
                            f"as {dtype_name(f)}), got {dtype_name(t.dtype)}; quantize with quantize_fp8")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"{op}: a {tuple(a.shape)} @ b {tuple(b.shape)}: inner dims differ")
    od = resolve_dtype(out_dtype)
    if od not in {resolve_dtype(t) for t in FP8_OUT_DTYPES}:
        raise TypeError(f"{op}: out_dtype {dtype_name(od)}; use one of {FP8_OUT_DTYPES}")
    sa = _scale_kind(op, "a_scale", a_scale, 1, m, ((m, 1), (m,)))
    sb = _scale_kind(op, "b_scale", b_scale, 0, n, ((1, n), (n,)))
    return m, k, n, fa, fb, od, sa, sb


def _dequant(xp, t: Any, fmt: np.dtype, s: Any, column: bool):
    """f32 values of FP8 ``t`` times scale ``s`` (None: 1; a row vector for ``b``'s columns)."""
    v = (t.view(fmt) if t.dtype == np.uint8 else t).astype(np.float32)
    if s is None:
        return v
    s = xp.asarray(s, np.float32)
    return v * (s.reshape(1, -1) if column and s.size > 1 else s.reshape(-1, 1) if s.size > 1 else s.reshape(()))


def matmul_fp8(a: Any, b: Any, a_scale: Any | None = None, b_scale: Any | None = None, *,
               a_format: str = "fp8_e4m3", b_format: str = "fp8_e4m3", out_dtype: Any = "f32",
               out: Any | None = None, stream: Any | None = None) -> Any:
    """``(a * a_scale) @ (b * b_scale)`` of FP8 operands with f32 accumulation.

    Parameters
    ----------
    a : array
        ``(M, K)`` FP8 values: uint8 bit patterns (GPU) or ml-dtypes FP8 (CPU).
    b : array
        ``(K, N)`` FP8 values.
    a_scale, b_scale : array or float, optional
        Dequantization scales (what ``quantize_fp8`` returned): one value, or ``(M, 1)`` per row
        of a / ``(1, N)`` per column of b.  None: 1.
    a_format, b_format : str
        "fp8_e4m3" or "fp8_e5m2".
    out_dtype : str or dtype
        "f16", "bf16" or "f32".
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        ``(M, N)`` of ``out_dtype``.
    """
    op = "matmul_fp8"
    m, k, n, fa, fb, od, _, _ = check_fp8_matmul(op, a, b, a_scale, b_scale, a_format, b_format, out_dtype)
    check_stream(op, stream)
    xp = array_module(a, b)
    y = xp.matmul(_dequant(xp, a, fa, a_scale, False), _dequant(xp, b, fb, b_scale, True))
    return finish(op, y, out, od)


def matmul_fp8_cuda(a: Any, b: Any, a_scale: Any | None = None, b_scale: Any | None = None, *,
                    a_format: str = "fp8_e4m3", b_format: str = "fp8_e4m3", out_dtype: Any = "f32",
                    out: Any | None = None, stream: Any | None = None) -> Any:
    """The project's own GPU path: dequantize both operands to f32 (``ts_dequantize_fp8``),
    one f32 GEMM (at the float32 matmul precision), cast to ``out_dtype``."""
    import cupy

    from .cuda_common import launch_stream
    op = "matmul_fp8"
    m, k, n, fa, fb, od, sa, sb = check_fp8_matmul(op, a, b, a_scale, b_scale, a_format, b_format, out_dtype)
    check_stream(op, stream)
    if not (is_cupy(a) and is_cupy(b) and a.dtype == np.uint8 and b.dtype == np.uint8):
        raise TypeError(f"{op}: on the GPU a and b are uint8 FP8 bit patterns on the device "
                        "(quantize_fp8's output); got host or non-uint8 arrays")
    be = get_backend()
    deq = be.kernel("dequantize_fp8_bits", like=a)
    note(op, f32_compute())
    with launch_stream(stream):
        one = cupy.ones((1,), np.float32)
        af = deq(a, one if a_scale is None else a_scale, fa, axis=0, stream=stream)
        bf = deq(b, one if b_scale is None else b_scale, fb, axis=-1, stream=stream)
        y = be.kernel("matmul", like=af)(af, bf, stream=stream)
        y = y if y.dtype == od else y.astype(od)
        if out is not None:
            out[...] = y
            return out
    return y


register_kernel("matmul_bias_act", "cpu", matmul_bias_act)
register_kernel("matmul_bias_act", "cuda", dispatching("matmul_bias_act", matmul_bias_act_cuda))
register_kernel("matmul_fp8", "cpu", matmul_fp8)
register_kernel("matmul_fp8", "cuda", dispatching("matmul_fp8", matmul_fp8_cuda))
