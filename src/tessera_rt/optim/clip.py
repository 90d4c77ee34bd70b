"""The global gradient norm (replicas counted once, one all-reduce per mesh) and clipping by it."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import op
from ..autodiff.engine import tree_flatten, tree_unflatten
from ..dist.tensor.dtensor import DTensor
from ..kernels._common import array_module
from .finite import _agree, check_finite
from .optimizers import _local


def _mesh_weight(g: DTensor) -> float:
    """1 / (number of ranks holding each element): replicas count once in the global sum."""
    sharded = set(g.layout.sharded_axes)
    n = 1
    for a, s in zip(g.mesh.axes, g.mesh.sizes):
        if a not in sharded:
            n *= s
    return 1.0 / n


_CHUNK = 1 << 20
_SQUARES: dict = {}          # array module -> an f64 buffer of up to _CHUNK elements


def _sum_squares(x):
    """``sum(float64(x) ** 2)`` as a 0-d array on x's device, squared chunk by chunk into
    one f64 buffer kept per array module (no per-call copies of x in f64)."""
    xp = array_module(x)
    flat = x.reshape(-1)
    buf = _SQUARES.get(xp)
    if buf is None or buf.size < min(flat.size, _CHUNK):
        buf = _SQUARES[xp] = xp.empty(min(flat.size, _CHUNK), np.float64)
    total = None
    for i in range(0, max(flat.size, 1), _CHUNK):
        part = flat[i:i + _CHUNK]
        sq = buf[:part.size]
        sq[...] = part                            # widen, then square in place (no cast buffers)
        xp.multiply(sq, sq, out=sq)
        total = xp.sum(sq) if total is None else total + xp.sum(sq)
    return total


def global_norm(grads: Any) -> float:
    """The L2 norm of all gradients together, the same on every rank.  Each rank sums the
    squares of its local pieces (weighted so replicated elements count once) and one
    all-reduce of a single float64 over each mesh adds them up.

    Parameters
    ----------
    grads : pytree
        DTensors and arrays.

    Returns
    -------
    float
        The norm.
    """
    # The squares are summed where the gradients live (on the GPU: no copy to the host).
    leaves, _, _ = tree_flatten(grads)
    local_total = 0.0
    meshes: dict = {}
    for g in leaves:
        if type(g) is DTensor:
            if g.layout.partial:
                g = g.redistribute(g.layout.with_partial(()))
            meshes.setdefault(g.mesh, []).append(_sum_squares(g.to_local()) * _mesh_weight(g))
        else:
            local_total += float(_sum_squares(g))
    for mesh, squares in meshes.items():
        local_total += _agree(squares, mesh, "sum")
    return math.sqrt(local_total)


def clip_grad_norm(grads: Any, max_norm: float, norm: float | None = None, error_if_nonfinite: bool = False,
                   in_place: bool = False) -> tuple[Any, float]:
    """``(grads * min(1, max_norm / norm), norm)`` with the global norm across all shards.

    Parameters
    ----------
    grads : pytree
        DTensors and arrays.
    max_norm : float
        The largest norm kept.
    norm : float, optional
        The global norm if already known (default: ``global_norm(grads)``).
    error_if_nonfinite : bool
        Raise ``NonFiniteError`` when the norm is inf or nan.
    in_place : bool
        Scale the gradients themselves where that changes nothing else (the others are
        scaled into new arrays), allocating nothing: for a training loop that drops the
        unclipped gradients anyway.

    Returns
    -------
    tuple
        The clipped gradients (``grads`` itself when the norm is within ``max_norm`` or not
        finite) and the norm before clipping.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    norm = global_norm(grads) if norm is None else norm
    if error_if_nonfinite:
        check_finite(norm=norm, grads=grads)
    if not math.isfinite(norm) or norm <= max_norm:
        return grads, norm
    leaves, _, struct = tree_flatten(grads)
    scale = max_norm / (norm + 1e-6)
    owned = _owned([_local(g) for g in leaves]) if in_place else [False] * len(leaves)
    out = []
    for g, own in zip(leaves, owned):
        if own:
            x = _local(g)
            array_module(x).multiply(x, scale, out=x)
            out.append(g)
        else:
            out.append(op.mul(g, scale))
    return tree_unflatten(struct, out), norm


def _owned(arrays: list) -> list[bool]:
    """Which arrays can be scaled in place: writeable (not a broadcast view) and sharing no
    memory with another leaf (the add rule hands both operands the same cotangent), so
    scaling one scales nothing else.  NumPy views of one buffer whose bytes do not overlap
    (the gradients of one all-reduce bucket) are each their own."""
    def root(x):
        while getattr(x, "base", None) is not None:
            x = x.base
        return id(x)
    roots = [root(x) for x in arrays]
    groups: dict = {}
    for i, r in enumerate(roots):
        groups.setdefault(r, []).append(i)
    ok = [getattr(getattr(x, "flags", None), "writeable", True) for x in arrays]
    for idx in groups.values():
        if len(idx) == 1:
            continue
        if not all(type(arrays[i]) is np.ndarray and arrays[i].flags.c_contiguous for i in idx):
            for i in idx:                # (other arrays: the buffer is shared, leave it alone)
                ok[i] = False
            continue
        spans = sorted((arrays[i].ctypes.data, arrays[i].ctypes.data + arrays[i].nbytes, i) for i in idx)
        for (s0, e0, i), (s1, e1, j) in zip(spans, spans[1:]):
            if s1 < e0:                  # overlapping bytes: scaling one would scale the other
                ok[i] = ok[j] = False
    return ok
