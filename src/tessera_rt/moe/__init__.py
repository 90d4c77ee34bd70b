"""tessera_rt.moe: mixture of experts over the ``ep`` mesh axis (seed 000 §3.1, §10).

``layer`` holds the ``op.moe`` layer and its statistics, ``routing`` the per-rank routing
decision (top-k, capacity, noise, locality), ``dispatch`` the fused op and its VJP as a
``TokenDispatcher``'s preprocess -> dispatch -> experts -> combine steps, ``transport`` how
rows cross the ep axis (``AllToAll`` today; a new transport is a new ``Transport`` subclass
set on ``layer.transport``), ``experts`` the local SwiGLU experts, ``staging`` the persistent
dispatch buffers, ``reference`` a dense NumPy oracle, and ``tiers`` expert residency and
prefetch.  ``op.moe``, ``op.set_router``,
``op.set_router_regularizer`` and ``rt.register_prefetch`` are the public names.
"""
from collections.abc import Callable
from typing import Any

from .. import op as _op
from . import (
    model as _model,  # noqa: F401  (registers nn.Transformer's MoE block)
    tiers as _tiers,  # noqa: F401  (registers rt.register_prefetch)
)
from .dispatch import TokenDispatcher, moe_ffn
from .layer import GATES, MoE, MoEAux
from .reference import dense_reference
from .staging import DispatchBuffers
from .transport import AllToAll, Transport

__all__ = ["MoE", "MoEAux", "GATES", "DispatchBuffers", "TokenDispatcher", "Transport", "AllToAll", "moe_ffn",
           "dense_reference", "set_router", "set_router_regularizer"]


def set_router(layer: MoE, fn: "Callable[..., Any]") -> MoE:
    """Route with ``fn(logits, meta) -> logits`` (traced op.* code; seed 000 §10.1).

    Parameters
    ----------
    layer : MoE
        The layer.
    fn : callable
        ``fn(logits, meta) -> logits``.

    Returns
    -------
    MoE
        ``layer``.
    """
    if not callable(fn):
        raise TypeError(f"op.set_router: fn must be callable (logits, meta) -> logits, got {type(fn).__name__}")
    layer.router = fn
    return layer


def set_router_regularizer(layer: MoE, kind: str = "topology_distance", weight: float = 0.05, *,
                           groups: list | None = None, scale: float = 10.0) -> MoE:
    """Penalize experts outside the token's locality group: ``weight * scale`` is subtracted
    from their logits, and ``aux["router_reg"]`` (``weight`` times the expected remote share)
    joins the gating loss.  ``groups``: a group id per ep position (default: by host).

    Parameters
    ----------
    layer : MoE
        The layer.
    kind : str
        The one kind is "topology_distance".
    weight : float
        ``aux["router_reg"]`` is ``weight`` times the expected remote share (>= 0).
    groups : list of int, optional
        A group id per ep position (default: by host).
    scale : float
        ``weight * scale`` is subtracted from remote experts' logits.

    Returns
    -------
    MoE
        ``layer``.
    """
    if kind != "topology_distance":
        raise ValueError(f"op.set_router_regularizer: kind={kind!r}; the one kind is 'topology_distance'")
    if not float(weight) >= 0:
        raise ValueError(f"op.set_router_regularizer: weight={weight} must be >= 0")
    if groups is not None:
        if len(groups) != layer.ep_size:
            raise ValueError(f"op.set_router_regularizer: groups={groups} needs one id per "
                             f"{layer.axis} position ({layer.ep_size})")
        layer.groups = list(groups)
    layer.regularizer = {"kind": kind, "weight": float(weight), "scale": float(scale)}
    return layer


_op.register_moe(MoE=MoE, set_router=set_router, set_router_regularizer=set_router_regularizer)
