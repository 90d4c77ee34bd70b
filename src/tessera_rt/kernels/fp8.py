"""FP8 (e4m3, e5m2) quantize/dequantize with per-tensor or per-channel scales.

``q = cast_fp8(x / scale)`` with ``scale = amax / fp8_max`` so the largest magnitude lands
on the format's largest finite value (Transformer Engine's delayed-scaling recipe without
the history).  On CPU the FP8 types are ml-dtypes arrays.  Stochastic rounding picks
between the two neighbouring FP8 values with probability proportional to the distance,
so the expectation of ``dequantize(quantize(x))`` is ``x``: sums of many small updates
keep their mean, which round-to-nearest loses.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from ._common import array_module, check_float, check_out, check_stream
from .numerics import FP8_DTYPES, NumericPolicy

__all__ = ["quantize_fp8", "dequantize_fp8", "dequantize_fp8_bits", "fake_quantize_fp8", "fp8_max", "compute_scale"]

_E4M3 = resolve_dtype("fp8_e4m3")
_E5M2 = resolve_dtype("fp8_e5m2")
_HIGH = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), resolve_dtype("bf16"))


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    dt = resolve_dtype(dtype)
    if dt not in FP8_DTYPES:
        raise TypeError(f"fp8_max: {dtype_name(dt)} is not an FP8 dtype; use 'fp8_e4m3' or 'fp8_e5m2'")
    import ml_dtypes
    return float(ml_dtypes.finfo(dt).max)


def _fp8(op: str, dtype) -> np.dtype:
    dt = resolve_dtype(dtype)
    if dt not in FP8_DTYPES:
        raise TypeError(f"{op}: dtype {dtype_name(dt)} is not FP8; use 'fp8_e4m3' or 'fp8_e5m2'")
    return dt


def compute_scale(x: Any, dtype="fp8_e4m3", scale: str = "per_tensor", axis: int = -1):
    """f32 scale(s) mapping ``amax`` onto the FP8 max: a 0-d array, or one per slice along ``axis``.

    Per-channel keeps ``axis`` (the channel axis) and reduces over all others, so the scale
    broadcasts against ``x`` with ``keepdims`` shape.
    """
    xp = array_module(x)
    dt = _fp8("compute_scale", dtype)
    xf = xp.abs(x.astype(np.float32))
    if scale == "per_tensor":
        amax = xf.max()
    elif scale == "per_channel":
        ax = axis % x.ndim
        amax = xf.max(axis=tuple(i for i in range(x.ndim) if i != ax), keepdims=True)
    else:
        raise ValueError(f"compute_scale: scale={scale!r}; use 'per_tensor' or 'per_channel'")
    # an all-zero channel gets scale 1 so that dequantize is exact (0 * 1)
    s = amax / np.float32(fp8_max(dt))
    return xp.where(s > 0, s, np.float32(1.0)).astype(np.float32)


def _stochastic_cast(y, dt: np.dtype, seed: int):
    """Round f32 ``y`` to ``dt`` up or down with probability given by the distance (CPU only)."""
    down = y.astype(dt)                      # nearest; fix it below to the lower neighbour
    d32 = down.astype(np.float32)
    # the neighbour on the other side of y: step the FP8 bit pattern by one ulp
    bits = down.view(np.uint8).astype(np.int16)
    toward = np.where((y > d32) == (d32 >= 0), 1, -1)        # +1 ulp in magnitude or -1
    zero = d32 == 0
    other_bits = np.where(zero, np.where(y >= 0, 0x01, 0x81), bits + toward).astype(np.uint8)
    other = other_bits.view(dt).astype(np.float32)
    gap = np.abs(other - d32)
    with np.errstate(invalid="ignore", divide="ignore"):
        p_other = np.where((gap > 0) & np.isfinite(other), np.abs(y - d32) / gap, 0.0)
    rng = np.random.default_rng(seed)
    pick = rng.random(y.shape, dtype=np.float32) < p_other
    return np.where(pick & (y != d32), other_bits, down.view(np.uint8)).view(dt)


def quantize_fp8(x: Any, dtype: DTypeLike = "fp8_e4m3", *, scale: str | Any = "per_tensor", axis: int = -1,
                 stochastic_round: bool = False, seed: int = 0, out: Any | None = None,
                 stream: Any | None = None, policy: NumericPolicy | None = None) -> tuple[Any, Any]:
    """Quantize ``x`` to FP8.  Values beyond the format saturate to its max (no inf/NaN from an outlier).

    Parameters
    ----------
    x : array
        The input (float).
    dtype : str or numpy.dtype
        "fp8_e4m3" or "fp8_e5m2".
    scale : str or array
        "per_tensor", "per_channel" (one per index of ``axis``) or a given f32 scale array.
    axis : int
        The channel dim for per-channel scales.
    stochastic_round : bool
        Round stochastically (seeded) instead of to nearest.
    seed : int
        The stochastic rounding's seed.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Overrides ``dtype``, ``scale`` and ``stochastic_round``.

    Returns
    -------
    tuple of array
        ``(q, scale)`` with ``x ≈ q.astype(f32) * scale``.
    """
    op = "quantize_fp8"
    check_stream(op, stream)
    if policy is not None:
        dtype = policy.dtype if policy.dtype is not None and policy.quantizes else dtype
        scale = policy.scale or scale
        stochastic_round = policy.stochastic_round
    dt = _fp8(op, dtype)
    check_float(op, "x", x, _HIGH, min_ndim=0)
    xp = array_module(x)
    s = compute_scale(x, dt, scale, axis) if isinstance(scale, str) else xp.asarray(scale, np.float32)
    fmax = np.float32(fp8_max(dt))
    y = xp.clip(x.astype(np.float32) / s, -fmax, fmax)
    if stochastic_round:
        if xp is not np:
            raise NotImplementedError(f"{op}: stochastic rounding of CuPy arrays goes through the "
                                      "GPU quantize kernel (fp8_cuda.quantize_fp8_cuda)")
        q = _stochastic_cast(y, dt, seed)
    else:
        q = y.astype(dt)
    check_out(op, out, q.shape, dt)
    if out is not None:
        out[...] = q
        q = out
    return q, s


def dequantize_fp8(q: Any, scale: Any, *, dtype: str = "f32", out: Any | None = None,
                   stream: Any | None = None) -> Any:
    """``q.astype(dtype) * scale`` computed in f32.

    Parameters
    ----------
    q : array
        FP8 values.
    scale : array
        The scale ``quantize_fp8`` returned.
    dtype : str
        The result's dtype.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        ``q * scale`` in ``dtype``.
    """
    op = "dequantize_fp8"
    check_stream(op, stream)
    check_float(op, "q", q, FP8_DTYPES, min_ndim=0)
    dt = resolve_dtype(dtype)
    r = (q.astype(np.float32) * scale).astype(dt)
    check_out(op, out, r.shape, dt)
    if out is not None:
        out[...] = r
        return out
    return r


def dequantize_fp8_bits(bits: Any, scale: Any, dtype="fp8_e4m3", *, axis: int = -1, out: Any | None = None,
                        stream: Any | None = None):
    """f32 values of FP8 bit patterns (uint8, as they travel on a wire or come from the GPU
    quantize kernel): ``bits`` read as ``dtype`` times ``scale`` (one value, or one per index
    of ``axis`` in ``quantize_fp8``'s keepdims shape)."""
    op = "dequantize_fp8_bits"
    check_stream(op, stream)
    dt = _fp8(op, dtype)
    if bits.dtype != np.uint8:
        raise TypeError(f"{op}: bits must be uint8 FP8 bit patterns, got {dtype_name(bits.dtype)}")
    r = bits.view(dt).astype(np.float32) * scale
    check_out(op, out, r.shape, np.float32)
    if out is not None:
        out[...] = r
        return out
    return r


def fake_quantize_fp8(x: Any, policy: NumericPolicy, axis: int = -1, seed: int = 0) -> Any:
    """Round-trip ``x`` through the policy's FP8 format, returning f32 (how GEMMs see FP8 operands).

    Parameters
    ----------
    x : array
        The input.
    policy : NumericPolicy
        An FP8 policy (its dtype, scale, rounding).
    axis : int
        The channel dim for per-channel scales.
    seed : int
        The stochastic rounding's seed.

    Returns
    -------
    array
        f32 values on the FP8 grid.
    """
    if policy.dtype is None:
        raise TypeError("fake_quantize_fp8: the policy has no dtype; make it with op.numeric(dtype='fp8_e4m3')")
    q, s = quantize_fp8(x, policy.dtype, scale=policy.scale or "per_tensor", axis=axis,
                        stochastic_round=policy.stochastic_round, seed=seed)
    return q.astype(np.float32) * s


register_kernel("quantize_fp8", "cpu", quantize_fp8)
register_kernel("dequantize_fp8", "cpu", dequantize_fp8)
register_kernel("dequantize_fp8_bits", "cpu", dequantize_fp8_bits)
