"""Expert tiers and prefetch (seed 000 §3.5.3, §6.4, §10.2).

    rt.register_prefetch(moe, window=2, tier_order=["HBM", "Grace"], policy="lru_hotness",
                         stream="io", budget=2)

With a budget of N resident experts per rank, every local expert's weights live in the host
tier (pinned host memory on a GPU; plain host arrays on the CPU path), and at most N of them
stay in the device tier between calls.  A forward needs the experts that received tokens:
a resident one is a hit, another is copied in on the ``io`` stream (a miss; compute waits
for the copy with an event).  After each call the router's counts update each expert's
hotness (an exponential average over about ``window`` calls: the look-ahead for the next
calls), the coldest experts beyond the budget are evicted (least hot first, least recently
used on ties, so the hot experts stay), and the hottest non-resident ones are prefetched on
``io`` for the next call.  The weights are the same values either way, so outputs and
gradients do not depend on the budget; ``stats()`` reports hits, misses, prefetches and the
hit ratio.

Limits: the host tier is filled from the parameters passed in and refreshed when those
arrays change (an optimizer step replaces them), which copies every local expert to the
host once per change -- the mode is meant for inference or frozen experts.  A call whose
routed experts outnumber the budget holds them all while it runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import runtime as rt
from ..backend import get_backend
from ..dist.dtensor import DTensor

__all__ = ["ExpertTiers", "register_prefetch", "TIERS", "POLICIES"]

TIERS = ("HBM", "Grace", "host", "NVMe")
POLICIES = ("lru_hotness",)
_NAMES = ("w1", "w3", "w2")


def _local(v, lo: int, hi: int):
    return v._local if type(v) is DTensor else v[lo:hi]


class ExpertTiers:
    """A device cache of at most ``budget`` local experts over a host tier holding them all."""

    def __init__(self, layer, budget: int, window: int, tier_order: list, policy: str, stream: str):
        self.layer, self.budget, self.window = layer, int(budget), int(window)
        self.tier_order, self.policy, self.stream = list(tier_order), policy, stream
        self.decay = self.window / (self.window + 1.0)
        lo, hi = layer.ranges[layer.ep_index]
        self.lo, self.nle = lo, hi - lo
        self.hot = np.zeros(self.nle)
        self.last_use = np.zeros(self.nle, np.int64)
        self.calls = 0
        self.host: dict[str, Any] = {}
        self._src: tuple = ()
        self.cache: dict[int, tuple] = {}        # local expert -> (w1, w3, w2) device arrays
        self.hits = self.misses = self.prefetched = 0

    # the host tier --------------------------------------------------------------------
    def _fill_host(self, w1, w3, w2) -> None:
        """Copy the local experts to the host tier when the parameters are new arrays."""
        # the arrays themselves are kept, so "the same object" cannot be a recycled id
        srcs = tuple(w._local if type(w) is DTensor else w for w in (w1, w3, w2))
        if len(self._src) == 3 and all(a is b_ for a, b_ in zip(srcs, self._src)):
            return
        locs = tuple(_local(w, self.lo, self.lo + self.nle) for w in (w1, w3, w2))
        b = get_backend()
        for name, a in zip(_NAMES, locs):
            if b.is_gpu:                       # pinned host memory: the io stream copies asynchronously
                import cupyx
                h = cupyx.empty_pinned(a.shape, a.dtype)
                a.get(out=h)
            else:
                h = np.array(a, copy=True)
            self.host[name] = h
        self._src = srcs
        self.cache.clear()                     # device copies of old values are stale

    def _fetch(self, e: int) -> tuple:
        """Copy expert ``e`` from the host tier on the io stream; compute waits for it."""
        b = get_backend()
        io, compute = rt.stream(self.stream), rt.stream("compute")
        with io:
            ws = tuple(b.xp.asarray(self.host[n][e]) for n in _NAMES)
        compute.wait_event(io.record())
        return ws

    # the forward's view ----------------------------------------------------------------------
    def gather(self, active, w1, w3, w2) -> tuple:
        """Stacked (w1, w3, w2) of the local experts ``active`` (sorted), through the cache."""
        self._fill_host(w1, w3, w2)
        self.calls += 1
        parts = []
        for e in active:
            e = int(e)
            if e in self.cache:
                self.hits += 1
            else:
                self.misses += 1
                self.cache[e] = self._fetch(e)
            self.last_use[e] = self.calls
            parts.append(self.cache[e])
        xp = get_backend().xp
        if not parts:
            return tuple(xp.asarray(self.host[n][:0]) for n in _NAMES)
        return tuple(xp.stack([p[i] for p in parts]) for i in range(3))

    def observe(self, routed_local) -> None:
        """Update hotness from this call's routing, evict beyond the budget, prefetch the hottest."""
        self.hot = self.decay * self.hot + np.asarray(routed_local, dtype=np.float64)
        rank = sorted(range(self.nle), key=lambda e: (-self.hot[e], -self.last_use[e], e))
        keep = set(rank[:self.budget])
        for e in [e for e in self.cache if e not in keep]:
            del self.cache[e]
        for e in rank[:self.budget]:
            if e not in self.cache and self.hot[e] > 0 and self.host:
                self.cache[e] = self._fetch(e)
                self.prefetched += 1

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "prefetched": self.prefetched,
                "hit_ratio": self.hits / n if n else 1.0, "resident": sorted(self.cache),
                "budget": self.budget, "local_experts": self.nle}


def register_prefetch(layer, window: int = 2, tier_order=("HBM", "Grace"), policy: str = "lru_hotness",
                      stream: str = "io", budget: int | None = None) -> ExpertTiers:
    """Attach expert tiers to an ``op.moe`` layer (``rt.register_prefetch``); returns them."""
    where = f"rt.register_prefetch({layer!r})"
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy={policy!r}; use one of {list(POLICIES)}")
    bad = [t for t in tier_order if t not in TIERS]
    if len(tier_order) < 2 or bad:
        raise ValueError(f"{where}: tier_order={list(tier_order)} needs a device tier then a host tier from "
                         f"{list(TIERS)}")
    if stream not in rt.ROLES:
        raise ValueError(f"{where}: stream={stream!r}; use a stream role from {list(rt.ROLES)}")
    if int(window) < 1:
        raise ValueError(f"{where}: window={window} must be >= 1")
    nle = layer.ranges[layer.ep_index][1] - layer.ranges[layer.ep_index][0]
    budget = nle if budget is None else int(budget)
    if not 0 <= budget:
        raise ValueError(f"{where}: budget={budget} must be >= 0 resident experts")
    layer.prefetch = ExpertTiers(layer, budget, window, tier_order, policy, stream)
    return layer.prefetch
