"""Block allocation for the paged KV cache, apart from the arrays that hold the pages (compare
vLLM's v1 ``BlockPool`` behind its ``KVCacheManager``).

``BlockPool`` hands out block ids from a free queue and counts who holds each one: it knows
nothing of pages, tiers or devices, so the cache uses it for logical pages and again for the
device and host slots.  ``PageTiers`` says where each logical page lives (a device slot or a
host slot) and which device page to spill when the device is full: the cache policy.  A new
policy (another spill order, pinning a shared prefix) is a change to ``PageTiers.victim`` or
a subclass of it; the storage (``kv_storage.py``) only moves the pages it is told to.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

__all__ = ["BlockPool", "PageTiers"]


class BlockPool:
    """``num_blocks`` block ids with a reference count each.  ``allocate`` takes the block free
    the longest (FIFO, so a freed block is reused last); ``share`` adds a holder; ``free``
    drops one and returns the block to the queue when none is left."""

    def __init__(self, num_blocks: int, what: str = "block"):
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise ValueError(f"BlockPool: num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks, self.what = int(num_blocks), what
        self._free: deque = deque(range(self.num_blocks))
        self._refs = [0] * self.num_blocks

    def __repr__(self) -> str:
        return f"BlockPool({self.what}: {self.num_free} of {self.num_blocks} free)"

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, block: int) -> int:
        """How many holders ``block`` has (0: free)."""
        return self._refs[self._index(block, "refs")]

    def allocate(self) -> int:
        """A free block, now held once."""
        if not self._free:
            raise ValueError(f"BlockPool: no free {self.what} (all {self.num_blocks} held); free one first "
                             "or make the pool larger")
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def share(self, block: int) -> None:
        """One more holder of the held ``block`` (e.g. a sequence sharing another's prefix)."""
        b = self._index(block, "share")
        if not self._refs[b]:
            raise ValueError(f"BlockPool.share({block}): {self.what} {block} is free; allocate it first")
        self._refs[b] += 1

    def free(self, block: int) -> bool:
        """Drop one holder of ``block``; True when that was the last and the block is free again."""
        b = self._index(block, "free")
        if not self._refs[b]:
            raise ValueError(f"BlockPool.free({block}): {self.what} {block} is already free (freed twice?)")
        self._refs[b] -= 1
        if self._refs[b]:
            return False
        self._free.append(b)
        return True

    def _index(self, block, op: str) -> int:
        b = int(block)
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"BlockPool.{op}({block}): no such {self.what}; ids are 0..{self.num_blocks - 1}")
        return b


class PageTiers:
    """Where each of ``num_pages`` logical pages lives: ``on_host[p]`` and ``slot[p]`` (its slot
    in that tier), the ``n_dev`` device and ``n_host`` host slots as pools, and the device
    pages in the order they arrived (the spill order)."""

    def __init__(self, num_pages: int, n_dev: int, n_host: int):
        self.on_host = np.zeros(num_pages, bool)
        self.slot = np.zeros(num_pages, np.int64)
        self.dev, self.host = BlockPool(n_dev, "device slot"), BlockPool(n_host, "host slot")
        self._dev_order: OrderedDict = OrderedDict()                 # device pages, oldest first

    def device_full(self) -> bool:
        return not self.dev.num_free

    def place(self, page: int) -> None:
        """Put a new ``page`` in a free device slot (``device_full()`` must be False)."""
        self.on_host[page], self.slot[page] = False, self.dev.allocate()
        self._dev_order[page] = None

    def victim(self, keep: set) -> int | None:
        """The device page to spill: the oldest not in ``keep`` (None: every one is kept)."""
        return next((p for p in self._dev_order if p not in keep), None)

    def spill(self, page: int) -> tuple[int, int]:
        """Move ``page`` to a host slot; returns (its device slot, now free, and its host slot)
        for the storage to copy between."""
        del self._dev_order[page]
        slot, hslot = int(self.slot[page]), self.host.allocate()
        self.on_host[page], self.slot[page] = True, hslot
        self.dev.free(slot)
        return slot, hslot

    def release(self, page: int) -> None:
        """``page`` is done with: its slot goes back to its tier."""
        (self.host if self.on_host[page] else self.dev).free(int(self.slot[page]))
        self._dev_order.pop(page, None)
