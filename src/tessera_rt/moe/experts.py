"""The local experts: a SwiGLU FFN over the expert-major batch ``xe (experts, M, d)``, one
batched GEMM per weight, and its backward (seed 002 §2.7).  Nothing here communicates: the
dispatcher fills ``xe`` and takes the output rows back."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..backend import get_backend

__all__ = ["ExpertActs", "swiglu_experts", "swiglu_experts_backward"]

_T = (0, 2, 1)                   # transposed views: BLAS reads them with its trans flags


class ExpertActs(NamedTuple):
    """The activations the experts' backward reads: ``silu(h1) * h3 @ w2`` with
    ``h1 = xe @ w1``, ``h3 = xe @ w3``, ``sig = sigmoid(h1)``, ``act = silu(h1)``, ``a = act * h3``."""
    xe: Any
    h1: Any
    h3: Any
    sig: Any
    act: Any
    a: Any


def swiglu_experts(xe, w1, w3, w2) -> tuple[Any, ExpertActs]:
    """``ye (experts, M, d)`` and the activations its backward needs."""
    xp = get_backend().xp
    mm = get_backend().kernel("matmul", like=xe)
    h1, h3 = mm(xe, w1), mm(xe, w3)
    # in place: each temporary of this size is a fresh allocation and its page faults
    sig = xp.negative(h1)
    xp.exp(sig, out=sig)
    sig += 1
    xp.reciprocal(sig, out=sig)                            # sigmoid(h1)
    act = h1 * sig                                         # silu(h1)
    a = act * h3
    return mm(a, w2), ExpertActs(xe, h1, h3, sig, act, a)


def swiglu_experts_backward(gye, acts: ExpertActs, w1, w3, w2, buffers) -> tuple:
    """``(dxe, gw1, gw3, gw2)`` from the output cotangent ``gye`` (experts, M, d)."""
    xp = get_backend().xp
    mm = get_backend().kernel("matmul", like=acts.xe)
    gw2 = mm(acts.a.transpose(_T), gye)
    da = mm(gye, w2.transpose(_T))
    dh3 = da * acts.act
    da *= acts.h3
    sig = acts.sig
    dsilu = buffers.get("dsilu", sig.shape, sig.dtype)
    xp.subtract(1, sig, out=dsilu)       # d silu / d h1 = sig * (1 + h1 * (1 - sig)), in place
    dsilu *= acts.h1
    dsilu += 1
    dsilu *= sig
    da *= dsilu
    dh1 = da
    xet = acts.xe.transpose(_T)
    gw1, gw3 = mm(xet, dh1), mm(xet, dh3)
    dxe = mm(dh1, w1.transpose(_T))
    dxe += mm(dh3, w3.transpose(_T))
    return dxe, gw1, gw3, gw2
