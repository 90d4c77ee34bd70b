"""The local experts: a SwiGLU FFN over the experts' rows, grouped GEMMs over ragged groups
(seed 002 §2.7).  Nothing here communicates: the dispatcher fills the rows and takes the
output rows back.

The batch is ``xr (R, d)``: expert 0's rows, then expert 1's, ... with ``offsets (E+1,)``
(``offsets[e]`` the first row of expert ``e``; NumPy on the host, or a device array that the
host never reads).  No expert is padded: each grouped GEMM (``kernels.grouped_gemm``, one
launch on the GPU, one BLAS call per expert on the CPU) multiplies every expert's own rows.
Forward: ``h1, h3 = x @ w1, x @ w3`` (one pass over x), ``a = silu(h1) * h3``, ``y = a @ w2``;
without a backward to feed, the fused ``grouped_swiglu`` skips ``h1``/``h3``.  Backward: the
fused SwiGLU gradient and four grouped products, ``dx = dh1 @ w1.T + dh3 @ w3.T`` in one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..backend import get_backend

__all__ = ["ExpertActs", "swiglu_experts", "swiglu_experts_backward"]


class ExpertActs(NamedTuple):
    """What the experts' backward reads: the rows ``xr``, their ``offsets``, ``h1 = xr @ w1``,
    ``h3 = xr @ w3`` and ``a = silu(h1) * h3`` (all ``(R, .)``, None when not saved)."""
    xr: Any
    offsets: Any
    h1: Any
    h3: Any
    a: Any


def swiglu_experts(xr, offsets, w1, w3, w2, save: bool = True) -> tuple[Any, ExpertActs]:
    """``ye (R, d)``: each expert's rows through its SwiGLU FFN; and the activations its
    backward needs (``save``).

    Parameters
    ----------
    xr : array
        ``(R, d)`` the experts' rows, expert-major.
    offsets : array
        ``(E + 1,)`` each expert's first row (host or device).
    w1, w3 : array
        ``(E, d, f)``.
    w2 : array
        ``(E, f, d)``.
    save : bool
        Keep ``h1``, ``h3``, ``a`` for the backward.

    Returns
    -------
    tuple
        ``(ye, ExpertActs)``.
    """
    kern = get_backend().kernel
    w1, w3, w2 = (w if w.dtype == xr.dtype else w.astype(xr.dtype) for w in (w1, w3, w2))
    if not save and not isinstance(offsets, np.ndarray):
        # device offsets (the grouped kernels): one pass for silu(x@w1) * (x@w3), no h1/h3
        a = kern("grouped_swiglu", like=xr)(xr, w1, w3, offsets)
        return kern("grouped_matmul", like=a)(a, w2, offsets), ExpertActs(xr, offsets, None, None, None)
    h1, h3 = kern("grouped_dual_matmul", like=xr)(xr, w1, w3, offsets)
    a = kern("swiglu_gate", like=h1)(h1, h3)
    ye = kern("grouped_matmul", like=a)(a, w2, offsets)
    return ye, ExpertActs(xr, offsets, h1, h3, a) if save else ExpertActs(xr, offsets, None, None, None)


def swiglu_experts_backward(gye, acts: ExpertActs, w1, w3, w2) -> tuple:
    """``(dxr, gw1, gw3, gw2)`` from the output rows' cotangent ``gye (R, d)``.

    Parameters
    ----------
    gye : array
        ``(R, d)``.
    acts : ExpertActs
        The forward's saved activations.
    w1, w3, w2 : array
        The forward's weights.

    Returns
    -------
    tuple of array
        ``dxr (R, d)`` and the weights' gradients in their shapes.
    """
    kern = get_backend().kernel
    like, off = acts.xr, acts.offsets
    w1, w3, w2 = (w if w.dtype == like.dtype else w.astype(like.dtype) for w in (w1, w3, w2))
    gye = gye if gye.dtype == like.dtype else gye.astype(like.dtype)
    gw2 = kern("grouped_matmul_wgrad", like=like)(acts.a, gye, off)                     # a.T @ gy per expert
    da = kern("grouped_matmul", like=like)(gye, w2, off, trans_w=True)                # gy @ w2.T
    dh1, dh3 = kern("swiglu_backward", like=da)(da, acts.h1, acts.h3)
    gw1, gw3 = kern("grouped_matmul_wgrad_dual", like=like)(acts.xr, dh1, dh3, off)    # one pass over x
    dxr = kern("grouped_matmul", like=like)(dh1, w1, off, trans_w=True, x2=dh3, w2=w3)
    return dxr, gw1, gw3, gw2
