"""``nn.KVCache``: a paged key/value cache (vLLM's block tables), sharded over tp by kv heads,
with a host tier (seed 000 §3.2: recent chunks on the device, old ones spilled to the host).

A sequence owns a list of pages (its block table); position ``j`` sits in page
``table[j // block_size]`` at row ``j % block_size``.  Pages come from a free list as a
sequence grows and go back when it finishes, so sequences of different lengths share one
pool and may join or leave between decode steps (continuous batching).  Each tp rank holds
only its own kv heads: the cache is chunked by time into pages and sharded by heads.

Tiers.  ``device_budget_tokens`` caps the pages kept on the device.  Beyond it the oldest
pages move to host memory (pinned on a GPU), every layer of them at once.  A decode step
reads a host page from a staging area on the device: once layer ``l``'s attention is issued,
the host pages of layer ``l + 1`` are copied into the other half of a double-buffered staging area on
the ``io`` stream (prefetch one layer ahead, §3.2.4, overlapping layer ``l``'s projections and MLP), and
layer ``l + 1`` waits on that copy's event.  The device holds ``layers x budget`` pages plus two layers' worth of staging,
instead of ``layers x all`` pages.  ``stats()`` counts page reads served from each tier.

The device pool is one flat array of pages so the paged kernel reads both tiers through one
table: layer ``l``'s device slot ``s`` is page ``l * n_dev + s``; staging buffer ``b``'s slot
``h`` is page ``layers * n_dev + b * n_host + h``.

``window=W`` limits look-back (§3.5.2): a decode query sees the last ``W`` positions, and a
page whose positions are all older than that is dropped (freed, its table entry set to -1).
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import runtime as rt
from .decode import DecodeBuffers, upload

__all__ = ["KVCache", "DecodeStep"]


@dataclass
class _Seq:
    blocks: list = field(default_factory=list)   # logical page ids; -1 where the window dropped one
    length: int = 0                               # positions written
    start: int = 0                                # first position a query may see


def _host_empty(xp, shape, dtype):
    """Host pages: pinned on a GPU (so the io stream's copies are asynchronous); plain memory on
    the CPU backend, or where the array module has no pinned allocator (the copies then block)."""
    n = int(np.prod(shape))
    alloc = getattr(getattr(xp, "cuda", None), "alloc_pinned_memory", None)
    if xp is np or n == 0 or alloc is None:
        return np.zeros(shape, dtype)
    mem = alloc(n * np.dtype(dtype).itemsize)
    return np.frombuffer(mem, dtype, n).reshape(shape)


class DecodeStep:
    """Block tables of one decode step, per layer, with the host pages staged one layer ahead.
    Tables, lengths and starts are written into ``buf``'s persistent arrays (no allocation)."""

    def __init__(self, cache: "KVCache", sids: Sequence[int], buf):
        self.cache, c = cache, cache
        seqs = [c._seqs[s] for s in sids]
        width = max(1, max(len(s.blocks) for s in seqs))
        logical = np.full((len(seqs), width), -1, np.int64)
        for i, s in enumerate(seqs):
            logical[i, :len(s.blocks)] = s.blocks
        live = logical >= 0
        page = np.where(live, logical, 0)
        on_host, slot = live & c._on_host[page], c._slot[page]
        self.host_slots = np.unique(slot[on_host])
        xp = c.model.xp
        # every layer's table at once, one copy to the device per step
        t = np.where(on_host, c.layers * c.n_dev + self._staging(np.arange(c.layers))[:, None, None] + slot,
                     np.arange(c.layers)[:, None, None] * c.n_dev + slot).astype(np.int32)
        t[:, ~live] = -1
        self.tables = buf.tables(width)
        upload(xp, self.tables, t)
        upload(xp, buf.lens, np.array([s.length for s in seqs], np.int32))
        upload(xp, buf.starts, np.array([s.start for s in seqs], np.int32))
        self.lens, self.starts = buf.lens, buf.starts
        self._events: dict[int, Any] = {}
        n_live, n_host = int(live.sum()), int(on_host.sum())
        c._reads["pages"] += n_live * c.layers
        c._reads["device"] += (n_live - n_host) * c.layers
        self.prefetch(0)

    def _staging(self, layer):
        """Offset of ``layer``'s staging half (double buffered: layer l+1 fills while l reads)."""
        return (layer % 2) * self.cache.n_host

    def prefetch(self, layer: int) -> None:
        """Copy ``layer``'s host pages into its staging half on the io stream (call it once the
        compute stream has issued the reads of layer - 1, which used the other half)."""
        c = self.cache
        if layer >= c.layers or not len(self.host_slots) or layer in self._events:
            return
        io, compute = rt.stream("io"), rt.stream("compute")
        io.wait_event(compute.record())            # after the reads of the other half's last user
        with io:
            base = c.layers * c.n_dev + self._staging(layer)
            for h in self.host_slots:              # page by page into the staging slots: no index arrays
                upload(c.model.xp, c.k[base + h], c.host_k[layer, h])
                upload(c.model.xp, c.v[base + h], c.host_v[layer, h])
        self._events[layer] = io.record()

    def layer(self, layer: int) -> tuple:
        """``(k_pages, v_pages, block_tables)`` for ``layer``, once its host pages are staged.
        Call ``prefetch(layer + 1)`` after issuing the attention that reads them: the next
        layer's copy then overlaps this layer's projections and MLP (§3.2.4)."""
        ev = self._events.pop(layer, None)
        if ev is not None:
            rt.stream("compute").wait_event(ev)
        return self.cache.k, self.cache.v, self.tables[layer]


class KVCache:
    """Paged KV cache for one ``Llama`` on this rank; ``max_tokens`` positions in all."""

    def __init__(self, model, max_tokens: int, block_size: int = 16, device_budget_tokens: int | None = None,
                 window: int | None = None, dtype=None):
        for name, val in (("max_tokens", max_tokens), ("block_size", block_size)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise ValueError(f"nn.KVCache: {name} must be a positive int, got {val!r}")
        if window is not None and (not isinstance(window, (int, np.integer)) or window <= 0):
            raise ValueError(f"nn.KVCache: window must be a positive int or None, got {window!r}")
        if device_budget_tokens is not None and (not isinstance(device_budget_tokens, (int, np.integer))
                                                 or device_budget_tokens < block_size):
            raise ValueError(f"nn.KVCache: device_budget_tokens must be an int >= block_size={block_size} or None, "
                             f"got {device_budget_tokens!r}")
        cfg = model.config
        self.model, self.block_size, self.window = model, int(block_size), window
        self.layers = cfg.num_hidden_layers
        self.num_blocks = math.ceil(max_tokens / block_size)
        self.max_tokens = self.num_blocks * self.block_size
        self.n_dev = self.num_blocks if device_budget_tokens is None else \
            min(self.num_blocks, device_budget_tokens // self.block_size)
        self.n_host = self.num_blocks - self.n_dev
        self.device_budget_tokens = self.n_dev * self.block_size
        self.dtype = np.dtype(model.dtype if dtype is None else dtype)
        xp = model.xp
        page = (model.n_kv, self.block_size, cfg.head_dim)
        flat = self.layers * self.n_dev + 2 * self.n_host           # device pages + two staging layers
        self.k, self.v = xp.zeros((flat,) + page, self.dtype), xp.zeros((flat,) + page, self.dtype)
        host = (self.layers, self.n_host) + page
        self.host_k, self.host_v = _host_empty(xp, host, self.dtype), _host_empty(xp, host, self.dtype)
        self._on_host = np.zeros(self.num_blocks, bool)
        self._slot = np.zeros(self.num_blocks, np.int64)
        self._free: deque = deque(range(self.num_blocks))            # logical pages
        self._dev_free: deque = deque(range(self.n_dev))
        self._host_free: deque = deque(range(self.n_host))
        self._dev_order: OrderedDict = OrderedDict()                 # device pages, oldest first
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._reads = {"pages": 0, "device": 0}
        self.moved_to_host = 0
        self._buffers: dict[int, DecodeBuffers] = {}

    # ---- sequences -------------------------------------------------------------------------
    def add(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq()
        return sid

    def free(self, sid: int) -> None:
        """Finish sequence ``sid``: its pages go back to the pool."""
        for b in self._seqs.pop(sid).blocks:
            if b >= 0:
                self._release(b)

    def length(self, sid: int) -> int:
        return self._seqs[sid].length

    def pages_of(self, sid: int) -> int:
        """Pages sequence ``sid`` holds now (dropped ones not counted)."""
        return sum(1 for b in self._seqs[sid].blocks if b >= 0)

    def blocks_needed(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, sid: int, n: int) -> np.ndarray:
        """Make room for ``n`` more positions of ``sid``; returns their positions."""
        s = self._seqs[sid]
        need = self.blocks_needed(s.length + n) - len(s.blocks)
        if need > len(self._free):
            raise ValueError(f"nn.KVCache: out of pages: sequence {sid} needs {need} more blocks of "
                             f"{self.block_size} and {len(self._free)} are free (max_tokens={self.max_tokens}); "
                             "give the cache more max_tokens or decode fewer sequences at once")
        s.blocks.extend(self._allocate() for _ in range(need))
        pos = np.arange(s.length, s.length + n)
        s.length += n
        if self.window is not None:
            s.start = max(0, s.length - self.window)
            for j in range(s.start // self.block_size):
                if s.blocks[j] >= 0:
                    self._release(s.blocks[j])
                    s.blocks[j] = -1
        return pos

    def _allocate(self) -> int:
        page = self._free.popleft()
        if not self._dev_free:
            self._evict_oldest()
        self._on_host[page], self._slot[page] = False, self._dev_free.popleft()
        self._dev_order[page] = None
        return page

    def _release(self, page: int) -> None:
        (self._host_free if self._on_host[page] else self._dev_free).append(int(self._slot[page]))
        self._dev_order.pop(page, None)
        self._free.append(page)

    def _evict_oldest(self) -> None:
        """Move the oldest full device page, every layer of it, to a host slot on the io stream.
        A sequence's last page (the one decode writes into) stays on the device."""
        tails = {s.blocks[-1] for s in self._seqs.values() if s.blocks}
        page = next((p for p in self._dev_order if p not in tails), None)
        if page is None:
            raise ValueError(f"nn.KVCache: device_budget_tokens={self.device_budget_tokens} holds only the last page "
                             f"of each of {len(tails)} running sequences; raise the budget to at least "
                             f"{(len(tails) + 1) * self.block_size} tokens or decode fewer sequences at once")
        del self._dev_order[page]
        slot, hslot = int(self._slot[page]), self._host_free.popleft()
        io = rt.stream("io")
        io.wait_event(rt.stream("compute").record())      # after the writes into the page
        with io:
            for layer in range(self.layers):              # page by page: no gathered copy on the device
                _download(self.k[layer * self.n_dev + slot], self.host_k[layer, hslot])
                _download(self.v[layer * self.n_dev + slot], self.host_v[layer, hslot])
        rt.stream("compute").wait_event(io.record())      # before the slot is overwritten
        self._on_host[page], self._slot[page] = True, hslot
        self._dev_free.append(slot)
        self.moved_to_host += 1

    # ---- data ------------------------------------------------------------------------------
    def write(self, layer: int, sids: Sequence[int], positions: np.ndarray, k: Any, v: Any) -> None:
        """Store ``k, v (B, Hkv_l, S, D)`` of sequences ``sids`` at ``positions (B, S)``."""
        bs, xp = self.block_size, self.model.xp
        pages = np.array([[self._seqs[sid].blocks[p // bs] for p in row] for sid, row in zip(sids, positions)])
        rows = (np.asarray(positions) % bs).ravel()
        b, hkv, n, d = k.shape
        kk = k.transpose(0, 2, 1, 3).reshape(b * n, hkv, d)               # (B*S, Hkv_l, D)
        vv = v.transpose(0, 2, 1, 3).reshape(b * n, hkv, d)
        pages = pages.ravel()
        keep = pages >= 0                        # a prefill longer than the window drops its oldest pages
        host, slot = self._on_host[pages] & keep, self._slot[np.maximum(pages, 0)]
        dev = keep & ~host
        # page-row (p, r) of head h: row (p * Hkv + h) * bs + r of the pool seen as (-1, D)
        for mask, pool, base in ((dev, (self.k, self.v), layer * self.n_dev), (host, None, None)):
            if not mask.any():
                continue
            sel = np.flatnonzero(mask)
            if pool is None:
                self.host_k[layer, slot[sel], :, rows[sel]] = _to_host(_take(xp, kk, sel))
                self.host_v[layer, slot[sel], :, rows[sel]] = _to_host(_take(xp, vv, sel))
                continue
            idx = ((base + slot[sel])[:, None] * hkv + np.arange(hkv)) * bs + rows[sel][:, None]
            for dst, src in zip(pool, (kk, vv)):
                _put(xp, dst.reshape(-1, d), idx, _take(xp, src, sel))

    def write_decode(self, layer: int, sids: Sequence[int], positions: np.ndarray, k: Any, v: Any) -> None:
        """Store one position per sequence, ``k, v (B, Hkv_l, D)``: row by row into the pages
        (basic slices, so nothing is allocated).  Decode writes into a sequence's last page,
        which eviction keeps on the device."""
        bs = self.block_size
        for i, (sid, p) in enumerate(zip(sids, positions)):
            page = self._seqs[sid].blocks[int(p) // bs]
            assert page >= 0 and not self._on_host[page], "decode writes into a device page"
            dst = layer * self.n_dev + int(self._slot[page])
            # through the row's view, so the copy touches only that row's bytes (a staging page
            # of the same pool may be in flight on the io stream)
            self.k[dst, :, int(p) % bs][...] = k[i]
            self.v[dst, :, int(p) % bs][...] = v[i]

    def decode_buffers(self, b: int) -> DecodeBuffers:
        """The persistent buffers of a decode step at batch ``b`` (made on first use)."""
        buf = self._buffers.get(b)
        if buf is None:
            buf = self._buffers[b] = DecodeBuffers(self.model, self, b)
        return buf

    def step(self, sids: Sequence[int], buf: DecodeBuffers | None = None) -> DecodeStep:
        """The tables of a decode step over ``sids`` (call after ``reserve``)."""
        return DecodeStep(self, sids, buf if buf is not None else self.decode_buffers(len(sids)))

    def stats(self) -> dict:
        """Pages per tier, bytes per tier and the hot-tier hit ratio of page reads (per layer)."""
        page_bytes = 2 * self.k[0].nbytes
        dev, host = self.n_dev - len(self._dev_free), self.n_host - len(self._host_free)
        reads = self._reads["pages"]
        return {"sequences": len(self._seqs), "blocks_device": dev, "blocks_host": host,
                "blocks_free": len(self._free), "bytes_device": dev * self.layers * page_bytes,
                "bytes_host": host * self.layers * page_bytes,
                "bytes_staging": 2 * self.n_host * page_bytes,
                "bytes_per_token": self.layers * page_bytes // self.block_size,
                "moved_to_host": self.moved_to_host,
                "hit_ratio": 1.0 if reads == 0 else self._reads["device"] / reads}


def _to_host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _download(src, out: np.ndarray) -> None:
    """``out[...] = src`` from the device into host memory ``out`` (no new host or device array)."""
    if isinstance(src, np.ndarray):
        np.copyto(out, src)
    else:
        src.get(out=out)


def _put(xp, dst, index: np.ndarray, values) -> None:
    """``dst[index] = values`` along dst's first axis, as a flat ``put`` (element indices made on
    the host): one scatter that CuPy and NumPy both run in place on a contiguous ``dst``."""
    inner = int(np.prod(dst.shape[1:]))
    flat = (np.asarray(index, np.int64).reshape(-1, 1) * inner + np.arange(inner)).ravel()
    dst.put(xp.asarray(flat), xp.ascontiguousarray(values).ravel())


def _take(xp, src, index: np.ndarray):
    return xp.take(src, xp.asarray(np.asarray(index, np.int64)), axis=0)
