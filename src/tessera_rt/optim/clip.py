"""The global gradient norm (replicas counted once, one all-reduce per mesh) and clipping by
it, in multi-tensor passes (``sum_squares_multi``, ``clip_scale_multi`` of the kernel table)
that on a GPU keep the norm and the scale on the device."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import op
from ..autodiff.engine import tree_flatten, tree_unflatten
from ..backend import get_backend
from ..dist.tensor.dtensor import DTensor
from .finite import _agree_on_device, check_finite
from .optimizers import _local


def _mesh_weight(g: DTensor) -> float:
    """1 / (number of ranks holding each element): replicas count once in the global sum."""
    sharded = set(g.layout.sharded_axes)
    n = 1
    for a, s in zip(g.mesh.axes, g.mesh.sizes):
        if a not in sharded:
            n *= s
    return 1.0 / n


def _total_squares(grads: Any):
    """The sum of squares of all gradients as a 0-d float64 array on their device: each rank
    sums its local pieces with one multi-tensor pass per group (``sum_squares_multi``),
    weighted so replicated elements count once, and one all-reduce of a single float64 over
    each mesh adds the ranks' sums.  Nothing waits for the device."""
    leaves, _, _ = tree_flatten(grads)
    groups: dict = {}                   # (mesh, weight) -> local pieces; (None, 1.0) for arrays
    for g in leaves:
        if type(g) is DTensor:
            if g.layout.partial:
                g = g.redistribute(g.layout.with_partial(()))
            groups.setdefault((g.mesh, _mesh_weight(g)), []).append(g.to_local())
        else:
            groups.setdefault((None, 1.0), []).append(g)
    total = None
    meshes: dict = {}
    for (mesh, weight), arrays in groups.items():
        part = get_backend().kernel("sum_squares_multi", like=arrays[0])(arrays)
        part = part * weight if weight != 1.0 else part
        if mesh is None:
            total = part if total is None else total + part
        else:
            meshes.setdefault(mesh, []).append(part)
    for mesh, parts in meshes.items():
        part = _agree_on_device(parts, mesh, "sum")
        total = part if total is None else total + part
    return get_backend().xp.zeros((), np.float64) if total is None else total


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
        The norm (on a GPU, reading it waits for the device: ``clip_grad_norm`` does not).
    """
    return math.sqrt(float(_total_squares(grads)))


def clip_grad_norm(grads: Any, max_norm: float, norm: float | None = None, error_if_nonfinite: bool = False,
                   in_place: bool = False) -> tuple[Any, Any]:
    """``(grads * min(1, max_norm / norm), norm)`` with the global norm across all shards.

    Parameters
    ----------
    grads : pytree
        DTensors and arrays.
    max_norm : float
        The largest norm kept.
    norm : float, optional
        The global norm if already known (default: computed here).
    error_if_nonfinite : bool
        Raise ``NonFiniteError`` when the norm is inf or nan (on a GPU this reads the norm:
        a host sync).
    in_place : bool
        Scale the gradients themselves where that changes nothing else (the others are
        scaled into new arrays), allocating nothing: for a training loop that drops the
        unclipped gradients anyway.

    Returns
    -------
    tuple
        The clipped gradients and the norm before clipping.  On the CPU the norm is a float
        and ``grads`` itself comes back when the norm is within ``max_norm`` or not finite.
        On a GPU nothing waits for the device: the norm is a 0-d float64 device array
        (``float(norm)`` reads it), and the scale ``min(1, max_norm / (norm + 1e-6))`` (1 for
        a non-finite norm) is applied on the device whatever its value.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    total = None
    if norm is None:
        total = _total_squares(grads)
        on_host = type(total) is not get_backend().xp.ndarray or not get_backend().is_gpu
        norm = math.sqrt(float(total)) if on_host else get_backend().xp.sqrt(total)
    on_host = isinstance(norm, (float, int, np.floating))
    if error_if_nonfinite:
        check_finite(norm=float(norm), grads=grads)
    if on_host:
        if not math.isfinite(norm) or norm <= max_norm:
            return grads, norm
        total = np.float64(norm) ** 2
    leaves, _, struct = tree_flatten(grads)
    locals_ = [_local(g) for g in leaves]
    owned = _owned(locals_) if in_place else [False] * len(leaves)
    mine = [x for x, own in zip(locals_, owned) if own]
    be = get_backend()
    like = mine[0] if mine else locals_[0] if locals_ else None
    if be.is_gpu and type(like) is be.xp.ndarray and type(total) is not be.xp.ndarray:
        total = be.xp.asarray(np.float64(total))         # a norm given on the host, for the device kernel
    clip = be.kernel("clip_scale_multi", like=like)
    scale = clip(mine, total, float(max_norm))
    if on_host:
        scale = max_norm / (norm + 1e-6)     # (the others as the in-place ones: by a Python float)
    out = [g if own else op.mul(g, scale) for g, own in zip(leaves, owned)]
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
