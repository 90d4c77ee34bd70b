"""Fused bias + activation and the SwiGLU double matmul (seed 004's fused matmul).

``bias_act`` is the epilogue a GEMM would fuse: add a per-column bias, apply gelu/silu,
cast once.  ``swiglu`` computes ``silu(x @ w1) * (x @ w3)``: both products read ``x``
once (here by multiplying against ``[w1 | w3]`` in one GEMM, on the GPU by a kernel that
keeps the x tile in shared memory for both), then the gate multiplies in f32.
"""
from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ..backend import register_kernel
from ._common import array_module, check_float, check_policy, check_stream, finish, widen
from .gemm import matmul_shapes
from .norms import NORM_DTYPES
from .numerics import NumericPolicy, accum_dtype, result_dtype

__all__ = ["ACTIVATIONS", "erf", "gelu", "silu", "bias_act", "bias_gelu", "bias_silu", "swiglu", "check_pair"]

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "identity")


def erf(x: Any):
    """erf to |err| < 1.5e-7 (Abramowitz & Stegun 7.1.26); NumPy has no erf and f32 needs no more."""
    xp = array_module(x)
    t = 1.0 / (1.0 + 0.3275911 * xp.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return xp.sign(x) * (1.0 - poly * xp.exp(-x * x))


def gelu(x: Any, approximate: bool = False) -> Any:
    """x·Φ(x); ``approximate`` uses the tanh form GPT-2 trained with (cheaper on GPUs).

    Parameters
    ----------
    x : array
        The input.
    approximate : bool
        Use the tanh form.

    Returns
    -------
    array
        x's dtype.
    """
    xp = array_module(x)
    if approximate:
        return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))


def silu(x: Any) -> Any:
    """x·sigmoid(x), written so exp never overflows for large |x|.

    Parameters
    ----------
    x : array
        The input.

    Returns
    -------
    array
        x's dtype.
    """
    xp = array_module(x)
    z = xp.exp(-xp.abs(x))
    return x * xp.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def _activate(op: str, y: Any, act: str):
    if act == "gelu":
        return gelu(y)
    if act == "gelu_tanh":
        return gelu(y, approximate=True)
    if act == "silu":
        return silu(y)
    if act == "relu":
        return array_module(y).maximum(y, 0)
    if act == "identity":
        return y
    raise ValueError(f"{op}: act={act!r} is not supported; use one of {ACTIVATIONS}")


def bias_act(x: Any, bias: Any | None = None, *, act: str = "gelu", out: Any | None = None,
             stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``act(x + bias)`` with ``bias`` over the last dim, computed in f32 and cast once.

    Parameters
    ----------
    x : array
        The input ``(..., N)``.
    bias : array, optional
        ``(N,)``; None: no bias.
    act : str
        The activation: "gelu", "gelu_tanh", "silu", "relu", ... (``ACTIVATIONS``).
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        x's dtype.
    """
    op = "bias_act"
    check_float(op, "x", x, NORM_DTYPES)
    check_policy(op, policy)
    check_stream(op, stream)
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act={act!r} is not supported; use one of {ACTIVATIONS}")
    acc = accum_dtype(x.dtype, policy)
    y = widen(x, acc)
    if bias is not None:
        check_float(op, "bias", bias, NORM_DTYPES)
        if tuple(bias.shape) != (x.shape[-1],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({x.shape[-1]},) "
                             f"to match the last dim of x {tuple(x.shape)}")
        y = y + widen(bias, acc)
    return finish(op, _activate(op, y, act), out, result_dtype(x.dtype, policy))


def bias_gelu(x: Any, bias: Any | None = None, *, approximate: bool = False, out: Any | None = None,
              stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """``gelu(x + bias)`` (``bias_act`` with act "gelu", or "gelu_tanh" when ``approximate``).

    Parameters
    ----------
    x : array
        The input ``(..., N)``.
    bias : array, optional
        ``(N,)``.
    approximate : bool
        The tanh form.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        x's dtype.
    """
    return bias_act(x, bias, act="gelu_tanh" if approximate else "gelu", out=out, stream=stream,
                    policy=policy)


def bias_silu(x: Any, bias: Any | None = None, *, out: Any | None = None, stream: Any | None = None,
              policy: NumericPolicy | None = None) -> Any:
    """``silu(x + bias)`` (``bias_act`` with act "silu").

    Parameters
    ----------
    x : array
        The input ``(..., N)``.
    bias : array, optional
        ``(N,)``.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        x's dtype.
    """
    return bias_act(x, bias, act="silu", out=out, stream=stream, policy=policy)


def check_pair(op: str, x: Any, w1: Any, w3: Any, stream: Any, policy: Any) -> None:
    """x (..., D) times two (D, F) weights of x's dtype (swiglu, dual_matmul)."""
    for name, t in (("x", x), ("w1", w1), ("w3", w3)):
        check_float(op, name, t, NORM_DTYPES)
    check_policy(op, policy)
    check_stream(op, stream)
    if w1.ndim != 2 or tuple(w1.shape) != tuple(w3.shape):
        raise ValueError(f"{op}: w1 {tuple(w1.shape)} and w3 {tuple(w3.shape)} must be the same "
                         "2-D (D, F) shape")
    matmul_shapes(op, x, w1)
    if not (x.dtype == w1.dtype == w3.dtype):
        raise TypeError(f"{op}: x, w1, w3 must share a dtype, got {x.dtype}, {w1.dtype}, {w3.dtype}")


def swiglu(x: Any, w1: Any, w3: Any, *, out: Any | None = None, stream: Any | None = None,
           policy: NumericPolicy | None = None) -> Any:
    """``silu(x @ w1) * (x @ w3)`` for ``x (..., D)``, ``w1, w3 (D, F)``; one pass over ``x``.

    Parameters
    ----------
    x : array
        ``(..., D)``.
    w1, w3 : array
        The gate and up projections ``(D, F)``.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        ``(..., F)``, x's dtype.
    """
    op = "swiglu"
    check_pair(op, x, w1, w3, stream, policy)
    xp = array_module(x, w1, w3)
    acc = accum_dtype(x.dtype, policy)
    f = w1.shape[1]
    both = xp.matmul(widen(x, acc), xp.concatenate([widen(w1, acc), widen(w3, acc)], axis=1))
    return finish(op, silu(both[..., :f]) * both[..., f:], out, result_dtype(x.dtype, policy))


_TILE_IO = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))     # the tile kernels' operand types


def dual_reads_x_once(x: Any, w1: Any, w3: Any, policy: Any = None, *, on_gpu: bool = False) -> bool:
    """Whether ``dual_matmul`` computes both products in one pass over x: on the GPU the
    DUAL_OUT tile kernel takes fp16 and bf16 (2-D or more, no policy); on the CPU ``x @ [w1 | w3]``
    pays for copying both weights only when x has more rows than 2F."""
    if on_gpu:
        return (x.ndim >= 2 and x.dtype == w1.dtype == w3.dtype and np.dtype(x.dtype) in _TILE_IO
                and policy is None)
    return x.ndim >= 1 and x.size // max(x.shape[-1], 1) > 2 * w1.shape[-1]


def dual_matmul(x: Any, w1: Any, w3: Any, *, stream: Any | None = None, policy: NumericPolicy | None = None) -> tuple[Any, Any]:
    """``(x @ w1, x @ w3)`` for ``x (..., D)``, ``w1, w3 (D, F)`` (seed 004's double matmul).
    One product ``x @ [w1 | w3]``, split after, when x has more than 2F rows: it reads x once
    but copies both weights into the concatenation, which only pays when x is the larger
    operand; two products otherwise (decode-sized x).

    Parameters
    ----------
    x : array
        ``(..., D)``.
    w1, w3 : array
        ``(D, F)`` each.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    tuple of array
        ``(x @ w1, x @ w3)``.
    """
    op = "dual_matmul"
    check_pair(op, x, w1, w3, stream, policy)
    xp = array_module(x, w1, w3)
    acc, res = accum_dtype(x.dtype, policy), result_dtype(x.dtype, policy)
    f = w1.shape[1]
    xa = widen(x, acc)
    if dual_reads_x_once(x, w1, w3):
        both = xp.matmul(xa, xp.concatenate([widen(w1, acc), widen(w3, acc)], axis=1))
        return finish(op, both[..., :f], None, res), finish(op, both[..., f:], None, res)
    return (finish(op, xp.matmul(xa, widen(w1, acc)), None, res),
            finish(op, xp.matmul(xa, widen(w3, acc)), None, res))


for _name, _fn in (("bias_act", bias_act), ("bias_gelu", bias_gelu), ("bias_silu", bias_silu),
                   ("swiglu", swiglu), ("dual_matmul", dual_matmul)):
    register_kernel(_name, "cpu", _fn)
