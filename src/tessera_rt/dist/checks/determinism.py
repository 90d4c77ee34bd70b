"""Deterministic reductions (seed 000 §3.4, §8, §11): fixed order, bits independent of layout.

    with dist.deterministic(op.numeric(deterministic=True), compensated=False):
        logits = model(x)                     # the same bits on every rerun and mesh shape

While the mode is on:

* ``all_reduce`` / ``reduce_scatter`` with sum or avg gather every rank's contribution and add
  them in rank order with one fixed pairwise tree (``tree_sum``), so the result does not
  depend on arrival order or on the MPI/NCCL algorithm: bitwise identical across reruns with
  the same group size.  (Contributions are per rank, so a different group size sums
  different partial values: only the DTensor reductions below are layout-independent.)
* DTensor ``sum``/``mean`` over a sharded dim gather that dim and reduce in global index
  order with the same tree, and DTensor ``matmul`` keeps the contracted dim whole (it
  gathers it instead of leaving a pending sum) and runs ``matmul`` below, whose every output
  element is the same pairwise tree over k of exactly rounded products.  Each output element
  is then a function of the global inputs alone: bitwise identical across reruns and across
  tp/dp degrees and layouts.  The cost is the gathers and a slower local matmul.

``compensated=True`` carries a TwoSum (Neumaier-style) error term through the tree: the sum
is then nearly as accurate as one in twice the precision.  ``op.matmul(..., policy=op.numeric(
deterministic=True))`` asks for the deterministic matmul on that call alone.
"""
from __future__ import annotations

import numpy as np

from ...backend import get_backend
from ...kernels.numerics import register_mode_switch
from ..comm.hooks import SEAM
from ..comm.plans import backend

__all__ = ["deterministic", "set_deterministic", "is_deterministic", "tree_sum", "matmul", "reduce_sum",
           "active", "FIXED_ORDER"]


class _State:
    on = False
    compensated = False


_STATE = _State()
_ON_CHANGE: list = []          # called when the mode changes (dispatch registers clear_cache)


def on_change(fn) -> None:
    """Call ``fn()`` whenever the mode turns on or off (or changes ``compensated``)."""
    _ON_CHANGE.append(fn)


_MARK = type("_DeterministicMark", (), {"before": lambda self, call: None})()


def _apply(on: bool, compensated: bool) -> None:
    changed = (on, compensated) != (_STATE.on, _STATE.compensated)
    _STATE.on, _STATE.compensated = on, compensated
    SEAM.det[:] = [compensated] if on else []
    watchers = SEAM.watchers
    if on and _MARK not in watchers:
        watchers.append(_MARK)          # (a watcher: collectives take their hooked path, which reads det)
    elif not on and _MARK in watchers:
        watchers.remove(_MARK)
    if changed:
        for fn in _ON_CHANGE:
            fn()                      # dispatch: cached decisions were made for the other mode


def _flag(policy) -> bool:
    if policy is None or isinstance(policy, bool):
        return True if policy is None else policy
    return bool(getattr(policy, "deterministic", False))


def set_deterministic(policy: object = True, *, compensated: bool = False) -> None:
    """Turn the mode on or off for the process (see the module docstring).

    Parameters
    ----------
    policy : bool or NumericPolicy
        On or off; a NumericPolicy gives its ``deterministic`` field.
    compensated : bool
        Carry a TwoSum error term through the reduction tree.
    """
    _apply(_flag(policy), bool(compensated))


def is_deterministic() -> bool:
    """Whether the deterministic mode is on.

    Returns
    -------
    bool
        The process-wide mode.
    """
    return _STATE.on


class deterministic:
    """Context manager form of :func:`set_deterministic` (restores the previous mode).

    Parameters
    ----------
    policy : bool or NumericPolicy, optional
        On or off; a NumericPolicy gives its ``deterministic`` field; None: on.
    compensated : bool
        Carry a TwoSum error term through the reduction tree.
    """

    def __init__(self, policy: object = None, *, compensated: bool = False) -> None:
        self._want = (_flag(policy), bool(compensated))

    def __enter__(self) -> deterministic:
        self._prev = (_STATE.on, _STATE.compensated)
        _apply(*self._want)
        return self

    def __exit__(self, *exc) -> None:
        _apply(*self._prev)


register_mode_switch(deterministic)      # ``with op.numeric(deterministic=True):`` enters it


def active(policy=None) -> bool:
    """True if a reduction under ``policy`` must be fixed-order (the mode, or the policy asks)."""
    return _STATE.on or bool(getattr(policy, "deterministic", False))


# --------------------------------------------------------------------------- fixed-order kernels

def _xp(x):
    b = get_backend()
    return b.xp if b.is_array(x) else np


def tree_sum(x, axis=0, *, compensated: bool | None = None, dtype=None):
    """Sum ``x`` over ``axis`` (an int or a tuple, flattened in row-major order) with a fixed
    pairwise tree: level by level, element 2i plus element 2i+1 (a zero pads an odd level).
    Every add is an elementwise IEEE add, so each output element depends only on its own
    inputs and the reduced length, never on the other dims or how the array was split."""
    xp = _xp(x)
    compensated = _STATE.compensated if compensated is None else compensated
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    rest = [d for d in range(x.ndim) if d not in axes]
    x = xp.transpose(x, axes + tuple(rest))
    lead = int(np.prod([x.shape[i] for i in range(len(axes))], dtype=np.int64))
    x = x.reshape((lead,) + x.shape[len(axes):])
    if dtype is not None and x.dtype != dtype:
        x = x.astype(dtype)
    if lead == 0:
        return xp.zeros(x.shape[1:], x.dtype)
    c = None
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            pad = xp.zeros((1,) + x.shape[1:], x.dtype)
            x = xp.concatenate([x, pad])
            if c is not None:
                c = xp.concatenate([c, pad])
        a, b = x[0::2], x[1::2]
        s = a + b
        if compensated:
            bp = s - a
            e = (a - (s - bp)) + (b - bp)          # TwoSum: a + b == s + e exactly
            c = e if c is None else (c[0::2] + c[1::2]) + e
        x = s
    return x[0] + c[0] if c is not None else x[0].copy()


def reduce_sum(x, axes, keepdims: bool, *, mean_of: int = 0):
    """``x.sum(axes, keepdims)`` (divided by ``mean_of`` if given) in the fixed tree order."""
    axes = tuple(range(x.ndim)) if axes is None else ((axes,) if isinstance(axes, int) else tuple(axes))
    acc = np.float64 if x.dtype == np.float64 else (np.float32 if x.dtype.kind in "fV" else None)
    r = tree_sum(x, axes, dtype=acc)
    if mean_of:
        r = r / mean_of
    if keepdims:
        r = r.reshape(tuple(1 if d in axes else s for d, s in enumerate(x.shape)))
    if x.dtype.kind in "fV" and r.dtype != x.dtype:
        r = r.astype(x.dtype)
    return _xp(x).asarray(r)


_KB = 32               # products summed per block along k (fixed: part of the canonical order)
_TILE = 1 << 20        # elements of products held at once (tiling m and n does not change bits)


def matmul(a, b, policy=None):
    """``a @ b`` (2-D or batched with equal batch dims) where each output element is the fixed
    pairwise tree over k of exactly rounded products: blocks of 32 along k summed by
    ``tree_sum``, then the block sums by ``tree_sum``.  No FMA, no BLAS blocking: the bits do
    not depend on m, n, or which rows and columns a rank computes."""
    xp = _xp(a)
    dt = np.result_type(a.dtype, b.dtype)
    acc = np.float64 if dt == np.float64 else np.float32
    a, b = a.astype(acc, copy=False), b.astype(acc, copy=False)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = xp.broadcast_to(a, batch + a.shape[-2:])
    b = xp.broadcast_to(b, batch + b.shape[-2:])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    nb = max(1, -(-k // _KB))
    kp = nb * _KB
    if kp != k:
        a = xp.concatenate([a, xp.zeros(batch + (m, kp - k), acc)], axis=-1)
        b = xp.concatenate([b, xp.zeros(batch + (kp - k, n), acc)], axis=-2)
    out = xp.empty(batch + (m, n), acc)
    tm = max(1, min(m, _TILE // max(1, _KB * n)))
    tn = n if tm > 1 or _KB * n <= _TILE else max(1, _TILE // _KB)
    for i in range(0, m, tm):
        for j in range(0, n, tn):
            blocks = []
            for kb in range(nb):
                ks = slice(kb * _KB, (kb + 1) * _KB)
                prod = a[..., i:i + tm, ks, None] * b[..., None, ks, j:j + tn]      # (..., tm, KB, tn)
                blocks.append(tree_sum(prod, prod.ndim - 2))
            out[..., i:i + tm, j:j + tn] = tree_sum(xp.stack(blocks), 0) if nb > 1 else blocks[0]
    res = dt if dt.kind == "f" and dt.itemsize >= 4 else np.dtype(dt)
    return out.astype(res, copy=False)


# --------------------------------------------------------------------------- fixed-order collectives
# While the mode is on, collectives' sum/avg reductions come here: every rank's contribution
# is gathered and added in rank order with tree_sum, so the bits do not depend on which rank
# arrives first or on the MPI/NCCL algorithm.  ``issue`` is the collectives' own
# (work.issue: the role's stream order), passed by the caller.

def _all_reduce_fixed(g, x, out, op: str, role: str, issue):
    n = g.size
    buf = backend().empty((n * x.size,), x.dtype)
    issue(role, False, g.comm.all_gather, (x.reshape(-1), buf, None), buf)
    res = tree_sum(buf.reshape((n,) + tuple(x.shape)), 0, compensated=_STATE.compensated)
    out[...] = res / n if op == "avg" else res
    return out


def _reduce_scatter_fixed(g, send, flat, counts, op: str, result, role: str, issue):
    n, mine = g.size, flat.size
    buf = backend().empty((n * mine,), send.dtype)
    split = None if counts is None else list(counts)
    issue(role, False, g.comm.all_to_all, (send.reshape(-1), buf, split, None if split is None else [mine] * n),
             buf)
    res = tree_sum(buf.reshape(n, mine), 0, compensated=_STATE.compensated)
    flat[...] = res / n if op == "avg" else res
    return result


# the collectives find them in the seam (their hooked path, while ``SEAM.det`` is on)
FIXED_ORDER = SEAM.fixed_order
FIXED_ORDER.update(all_reduce=_all_reduce_fixed, reduce_scatter=_reduce_scatter_fixed)
