"""A dense NumPy mixture of experts: the oracle the tests compare ``op.moe`` with.

Written independently of the dispatch: every expert runs on every token, and the output
keeps the (token, expert) pairs the routing rule keeps.  ``sources`` splits the tokens
into that many sending ranks (array_split), the unit GShard's capacity counts in.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["dense_reference"]


def _silu(v):
    return v / (1.0 + np.exp(-v))


def dense_reference(params: dict, x: np.ndarray, top_k: int, capacity_factor: float | None = None,
                    sources: int = 1, logits_add: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """A dense NumPy oracle of the layer, computed in f64.

    Parameters
    ----------
    params : dict
        ``gate``, ``w1``, ``w3``, ``w2`` as global arrays.
    x : numpy.ndarray
        Global tokens ``(tokens, d_model)``.
    top_k : int
        Experts per token.
    capacity_factor : float, optional
        None: dropless.
    sources : int
        Token groups with their own capacity (the ranks holding tokens).
    logits_add : numpy.ndarray, optional
        Added to the logits (a regularizer's penalty).

    Returns
    -------
    tuple
        ``(y, load, dropped)``: the output, pairs routed per expert, pairs over capacity.
    """
    x = np.asarray(x, np.float64)
    gate = np.asarray(params["gate"], np.float64)
    w1, w3, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "w3", "w2"))
    e = gate.shape[1]
    logits = x @ gate + (0 if logits_add is None else logits_add)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    outs = np.stack([(_silu(x @ w1[i]) * (x @ w3[i])) @ w2[i] for i in range(e)], axis=1)  # (T, E, d)
    y = np.zeros_like(x)
    load = np.zeros(e, np.int64)
    dropped = 0
    for part in np.array_split(np.arange(x.shape[0]), sources):
        cap = None if capacity_factor is None else math.ceil(capacity_factor * len(part) * top_k / e)
        used = np.zeros(e, np.int64)
        for t in part:
            order = sorted(range(e), key=lambda j: (-p[t, j], j))[:top_k]
            norm = sum(p[t, j] for j in order)
            for j in order:
                load[j] += 1
                if cap is not None and used[j] >= cap:
                    dropped += 1
                    continue
                used[j] += 1
                y[t] += p[t, j] / norm * outs[t, j]
    return y, load, dropped
