"""Routing: top-k selection, GShard capacity, slot assignment, gate noise and locality
(seed 000 §3.1.1, §3.1.2, §3.4.3, §10.1).

Everything here is local to a rank and issues no collective: it turns the gate
probabilities of this rank's tokens into a ``Route`` -- which expert each (token, choice)
pair goes to, its slot in the packed send buffer, its combine weight, and whether it was
kept -- that the dispatch (``dispatch.py``) moves over ``ep``.

Pair order is token-major (token 0's choices, then token 1's, ...); an expert over its
capacity keeps its first pairs in that order and drops the rest (GShard's rule, applied
per sending rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dist.tensor.shard import split_offsets, split_sizes

__all__ = ["Route", "capacity", "expert_ranges", "route", "topk", "gate_noise", "remote_mask"]


def capacity(capacity_factor: float | None, tokens: int, top_k: int, num_experts: int) -> int | None:
    """Slots per expert per sending rank: ``ceil(cf * tokens * top_k / E)`` (None: dropless)."""
    if capacity_factor is None:
        return None
    return int(math.ceil(capacity_factor * tokens * top_k / num_experts))


def expert_ranges(num_experts: int, n: int) -> list[tuple[int, int]]:
    """[lo, hi) experts of each ep position: the array_split rule DTensors use."""
    return [(o, o + s) for o, s in zip(split_offsets(num_experts, n), split_sizes(num_experts, n))]


def topk(xp, probs, k: int):
    """Indices (T, k) of each row's k largest probabilities, largest first; ties go to the
    lower expert index (a stable sort, so every backend and rerun picks the same experts)."""
    order = xp.argsort(-probs, axis=1, kind="stable") if xp is np else xp.argsort(-probs, axis=1)
    return xp.ascontiguousarray(order[:, :k])


@dataclass
class Route:
    """One rank's routing decision.  ``slot[p]`` is pair p's row in the send buffer (rows are
    expert-major: experts in order, each expert's pairs in token order), ``kept[p]`` whether
    it fits the capacity, ``weight`` (T, k) the renormalized probabilities.  Nothing here is
    read on the host: ``split`` (rows to each ep position) is known without the device under a
    capacity, and filled in by the dispatcher, from its one wait for the counts, when dropless."""
    idx: Any            # (T, k) experts
    weight: Any         # (T, k) combine weights (sum to 1 per token)
    denom: Any          # (T, 1) sum of the top-k probabilities (for the gradient)
    kept: Any           # (T*k,) bool
    slot: Any           # (T*k,) row in the send buffer (0 for dropped pairs: weight 0)
    dest: Any           # (T*k,) the row a pair's scatter writes: slot, or send_rows (a spare row) if dropped
    counts: Any         # (E,) pairs sent per expert after capacity (int64)
    routed: Any         # (E,) pairs routed per expert before capacity
    bounds: Any         # (E+1,) dropless: each expert's first row in the send buffer, then send_rows
    send_rows: int      # rows of the send buffer
    split: list | None  # rows sent to each ep position (None: dropless, not yet read)

    @property
    def dropped(self) -> int:
        return int(self.kept.size - int(self.kept.sum()))


def route(xp, probs, k: int, cap: int | None, ranges: list[tuple[int, int]]) -> Route:
    """Route this rank's tokens: top-k, renormalize, assign slots under capacity ``cap``
    (None: every pair is kept; rows are then packed with no padding).  No host sync: the
    per-expert counts come from a sort and a binary search on the device."""
    t, e = probs.shape
    idx = topk(xp, probs, k)
    top = xp.take_along_axis(probs, idx, axis=1)
    denom = top.sum(axis=1, keepdims=True)
    weight = top / denom
    flat = idx.reshape(-1).astype(np.int64)
    # expert-major, token order within an expert: unique keys make any sort give this order
    order = xp.argsort(flat * flat.size + xp.arange(flat.size))
    sorted_e = flat[order]
    bounds = xp.searchsorted(sorted_e, xp.arange(e + 1, dtype=np.int64))     # pairs before each expert
    routed = (bounds[1:] - bounds[:-1]).astype(np.int64)
    starts = bounds[:-1]
    pos = xp.empty_like(flat)
    pos[order] = xp.arange(flat.size) - starts[sorted_e]
    if cap is None:
        kept = xp.ones(flat.size, dtype=bool)
        counts = routed
        slot = starts[flat] + pos
        rows = int(flat.size)
        dest = slot
        split = [rows] if len(ranges) == 1 else None
    else:
        kept = pos < cap
        counts = xp.minimum(routed, cap)
        slot = xp.where(kept, flat * cap + pos, 0)
        rows = e * cap
        dest = xp.where(kept, slot, rows)
        split = [(hi - lo) * cap for lo, hi in ranges]
    return Route(idx, weight, denom, kept, slot, dest, counts, routed, bounds, rows, split)


def gate_noise(seed: int, step: int, shape: tuple, rows: slice, std: float) -> np.ndarray:
    """Gaussian gate noise for global rows ``rows`` of a (tokens, experts) logit matrix.
    One stream per (seed, step) over the global matrix, sliced: every mesh draws the same
    noise for the same token, so noisy routing is independent of the layout."""
    rng = np.random.Generator(np.random.Philox(key=[seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF]))
    return (rng.standard_normal(shape, dtype=np.float64)[rows] * std)


def remote_mask(groups: list[int], ranges: list[tuple[int, int]], me: int, num_experts: int) -> np.ndarray:
    """(E,) 1.0 for experts held by an ep position outside ``me``'s group, else 0.0."""
    out = np.zeros(num_experts)
    for pos, (lo, hi) in enumerate(ranges):
        if groups[pos] != groups[me]:
            out[lo:hi] = 1.0
    return out
