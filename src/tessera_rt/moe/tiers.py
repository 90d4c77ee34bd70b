"""Expert tiers and prefetch (seed 000 §3.5.3, §6.4, §10.2).

    rt.register_prefetch(moe, window=2, tier_order=["HBM", "Grace"], policy="lru_hotness",
                         stream="io", budget=2)
    rt.register_prefetch([moe_0, moe_1, moe_2], window=1, budget=4)   # layers share one budget

Every local expert's weights live in the host tier (pinned host memory on a GPU; plain host
arrays on the CPU path); at most ``budget`` experts per rank -- over all the layers
registered together -- stay in the device tier between calls.  A forward needs the experts
that received tokens: a resident one is a hit, another is copied in on the ``io`` stream (a
miss; compute waits for the copy with an event).  Each call's counts update its experts'
hotness (an exponential average over about ``window`` + 1 calls).  While layer i runs, the
hottest experts of layers i+1 .. i+window (wrapping to the next step's first layers) are
prefetched on ``io`` -- the router's look-ahead -- evicting what was used least recently,
least hot first among equals, and never an expert of the running layer or of the layers
being prefetched.  The weights are the same values either way, so outputs and gradients do
not depend on the budget; ``stats()`` reports hits, misses, prefetches and the hit ratio.

Limits: a layer's host tier is filled from the parameters passed in and refreshed when those
arrays change (an optimizer step replaces them), which copies that layer's experts to the
host once per change -- the mode is meant for inference or frozen experts.  A call whose
routed experts outnumber the budget holds them all while it runs.
"""
from __future__ import annotations

import numpy as np

from .. import runtime as rt
from ..backend import get_backend
from ..dist.tensor.dtensor import DTensor

__all__ = ["ExpertTiers", "LayerTiers", "register_prefetch", "TIERS", "POLICIES"]

TIERS = ("HBM", "Grace", "host", "NVMe")
POLICIES = ("lru_hotness",)
_NAMES = ("w1", "w3", "w2")


class LayerTiers:
    """One layer's view of the shared tiers (``layer.prefetch``): its host copies and hotness."""

    def __init__(self, tiers: ExpertTiers, index: int, layer):
        self.tiers, self.index = tiers, index
        lo, hi = layer.ranges[layer.ep_index]
        self.lo, self.nle = lo, hi - lo
        self.hot = np.zeros(self.nle)
        self.host: dict = {}
        self._src: tuple = ()

    def fill_host(self, w1, w3, w2) -> None:
        """Copy the local experts to the host tier when the parameters are new arrays."""
        # the arrays themselves are kept, so "the same object" cannot be a recycled id
        srcs = tuple(w._local if type(w) is DTensor else w for w in (w1, w3, w2))
        if len(self._src) == 3 and all(a is b for a, b in zip(srcs, self._src)):
            return
        b = get_backend()
        for name, w, a in zip(_NAMES, (w1, w3, w2), srcs):
            a = a if type(w) is DTensor else a[self.lo:self.lo + self.nle]
            if b.is_gpu:                       # pinned host memory: the io stream copies asynchronously
                import cupyx
                h = cupyx.empty_pinned(a.shape, a.dtype)
                a.get(out=h)
            else:
                h = np.array(a, copy=True)
            self.host[name] = h
        self._src = srcs
        self.tiers.drop_layer(self.index)      # device copies of old values are stale

    def gather(self, active, w1, w3, w2) -> tuple:
        return self.tiers.gather(self, active, w1, w3, w2)

    def observe(self, rows_per_expert) -> None:
        """After the call: update hotness and evict beyond the budget (least recently used, least
        hot first among equals; the look-ahead prefetches are as recent as this call)."""
        self.hot = self.tiers.decay * self.hot + np.asarray(rows_per_expert, dtype=np.float64)
        self.tiers._busy = set()
        self.tiers.trim()

    def stats(self) -> dict:
        return self.tiers.stats()


class ExpertTiers:
    """A device cache of at most ``budget`` experts (keyed by (layer, expert)) over the layers'
    host tiers, with look-ahead prefetch ``window`` layers ahead."""

    def __init__(self, budget: int, window: int, tier_order: list, policy: str, stream: str):
        self.budget, self.window = int(budget), int(window)
        self.tier_order, self.policy, self.stream = list(tier_order), policy, stream
        self.decay = (self.window + 1) / (self.window + 2.0)
        self.layers: list[LayerTiers] = []
        self.cache: dict[tuple, tuple] = {}          # (layer, expert) -> (w1, w3, w2) device arrays
        self.last_use: dict[tuple, int] = {}
        self.clock = 0
        self.hits = self.misses = self.prefetched = 0
        self._busy: set = set()                      # layers whose experts may not be evicted now

    def _fetch(self, lt: LayerTiers, e: int) -> tuple:
        """Copy expert ``e`` of ``lt`` from the host tier on the io stream; compute waits for it."""
        b = get_backend()
        io, compute = rt.stream(self.stream), rt.stream("compute")
        # An evicted expert's blocks went back to io's pool arena (they were allocated there)
        # while compute's reads of them may still run: io allocates only after those reads.
        io.wait_event(compute.record())
        with io:
            ws = tuple(b.xp.asarray(lt.host[n][e]) for n in _NAMES)
        compute.wait_event(io.record())
        return ws

    def drop_layer(self, li: int) -> None:
        for key in [k for k in self.cache if k[0] == li]:
            del self.cache[key]

    def _victim(self):
        keys = [k for k in self.cache if k[0] not in self._busy]
        if not keys:
            return None
        return min(keys, key=lambda k: (self.last_use.get(k, -1), self.layers[k[0]].hot[k[1]], k))

    def trim(self) -> None:
        """Evict beyond the budget (sparing the layers in ``_busy``)."""
        while len(self.cache) > self.budget:
            k = self._victim()
            if k is None:
                return
            del self.cache[k]

    def gather(self, lt: LayerTiers, active, w1, w3, w2) -> tuple:
        """Stacked (w1, w3, w2) of ``lt``'s local experts ``active`` (sorted), through the cache,
        then the look-ahead prefetch for the next ``window`` layers."""
        lt.fill_host(w1, w3, w2)
        self.clock += 1
        li = lt.index
        parts = []
        for e in active:
            key = (li, int(e))
            if key in self.cache:
                self.hits += 1
            else:
                self.misses += 1
                self.cache[key] = self._fetch(lt, key[1])
            self.last_use[key] = self.clock
            parts.append(self.cache[key])
        ahead = [(li + j) % len(self.layers) for j in range(1, self.window + 1)] if self.layers else []
        self._busy = {li}
        for lj in ahead:                               # nearest first; farther layers stay evictable
            self._busy.add(lj)
            nxt = self.layers[lj]
            if not nxt.host:
                continue                               # never called: nothing to predict from
            for e in np.argsort(-nxt.hot, kind="stable"):
                key = (lj, int(e))
                if nxt.hot[e] <= 0:
                    break
                if key in self.cache:
                    continue
                if len(self.cache) >= self.budget:
                    victim = self._victim()
                    if victim is None:
                        break
                    del self.cache[victim]
                self.cache[key] = self._fetch(nxt, key[1])
                self.last_use[key] = self.clock
                self.prefetched += 1
        self._busy = {li}
        xp = get_backend().xp
        if not parts:
            return tuple(xp.asarray(lt.host[n][:0]) for n in _NAMES)
        return tuple(xp.stack([p[i] for p in parts]) for i in range(3))

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "prefetched": self.prefetched,
                "hit_ratio": self.hits / n if n else 1.0, "resident": sorted(self.cache),
                "budget": self.budget, "layers": len(self.layers)}


def register_prefetch(layers, window: int = 2, tier_order=("HBM", "Grace"), policy: str = "lru_hotness",
                      stream: str = "io", budget: int | None = None) -> ExpertTiers:
    """Attach expert tiers to one ``op.moe`` layer or a list of them run in that order (one
    shared budget; ``rt.register_prefetch``); returns the tiers."""
    chain = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    where = f"rt.register_prefetch({chain[0]!r}{', ...' if len(chain) > 1 else ''})"
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy={policy!r}; use one of {list(POLICIES)}")
    bad = [t for t in tier_order if t not in TIERS]
    if len(tier_order) < 2 or bad:
        raise ValueError(f"{where}: tier_order={list(tier_order)} needs a device tier then a host tier from "
                         f"{list(TIERS)}")
    if stream not in rt.ROLES:
        raise ValueError(f"{where}: stream={stream!r}; use a stream role from {list(rt.ROLES)}")
    if int(window) < 0:
        raise ValueError(f"{where}: window={window} must be >= 0 layers of look-ahead")
    total = sum(m.ranges[m.ep_index][1] - m.ranges[m.ep_index][0] for m in chain)
    budget = total if budget is None else int(budget)
    if budget < 0:
        raise ValueError(f"{where}: budget={budget} must be >= 0 resident experts")
    tiers = ExpertTiers(budget, window, tier_order, policy, stream)
    for i, m in enumerate(chain):
        m.prefetch = LayerTiers(tiers, i, m)
        tiers.layers.append(m.prefetch)
    return tiers


rt.set_prefetch_impl(register_prefetch)
