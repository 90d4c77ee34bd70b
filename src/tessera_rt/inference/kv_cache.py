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

Three parts, vLLM's split: ``KVCache`` (this module) is the manager -- sequences and their
block tables, reserve / free, the decode step's tables; ``kv_blocks`` allocates ids
(``BlockPool``: free queue and reference counts, no arrays) and places pages in tiers
(``PageTiers``: device or host slot, which page to spill: the cache policy);
``kv_storage.PageStorage`` holds the pages' arrays and does every copy.

``window=W`` limits look-back (§3.5.2): a decode query sees the last ``W`` positions, and a
page whose positions are all older than that is dropped (freed, its table entry set to -1).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import runtime as rt
from .kv_blocks import BlockPool, PageTiers
from .kv_storage import PageStorage, upload

__all__ = ["KVCache", "DecodeStep", "StepTables"]


@dataclass
class _Seq:
    blocks: list = field(default_factory=list)   # logical page ids; -1 where the window dropped one
    length: int = 0                               # positions written
    start: int = 0                                # first position a query may see


class StepTables:
    """The persistent arrays a staged decode step fills: per-layer block tables as wide as the
    pool (their shape never changes as sequences grow: without a window the width is made
    once; a windowed sequence may outgrow it, and then the room doubles), keys and starts."""

    def __init__(self, xp, layers: int, b: int, width: int):
        self.xp, self.layers, self.b = xp, layers, b
        self.lens, self.starts = xp.empty(b, np.int32), xp.empty(b, np.int32)
        self.fit(width)

    def fit(self, width: int) -> None:
        cap = getattr(self, "_cap", 0)
        if cap >= width:
            return
        self._cap = width if not cap else max(width, 2 * cap)
        self._flat = self.xp.empty(self.layers * self.b * self._cap, np.int32)

    def tables(self, width: int):
        """``(layers, b, width)``: a contiguous view of the persistent array."""
        self.fit(width)
        return self._flat[:self.layers * self.b * width].reshape(self.layers, self.b, width)


class DecodeStep:
    """Block tables of one decode step, per layer, with the host pages staged one layer ahead
    (the host tier's path: a layer's table points into the whole pool, staging included).
    Tables, lengths and starts are written into ``buf``'s persistent arrays (no allocation)."""

    def __init__(self, cache: KVCache, sids: Sequence[int], buf: StepTables):
        self.cache, c = cache, cache
        seqs = [c._seqs[s] for s in sids]
        width = max(1, max(len(s.blocks) for s in seqs))
        logical = np.full((len(seqs), width), -1, np.int64)
        for i, s in enumerate(seqs):
            logical[i, :len(s.blocks)] = s.blocks
        live = logical >= 0
        page = np.where(live, logical, 0)
        on_host, slot = live & c.tiers.on_host[page], c.tiers.slot[page]
        self.host_slots = np.unique(slot[on_host])
        xp = c.model.xp
        layers = np.arange(c.layers)[:, None, None]
        # every layer's table at once, one copy to the device per step
        t = np.where(on_host, c.storage.staging_base(layers) + slot, layers * c.n_dev + slot).astype(np.int32)
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

    def prefetch(self, layer: int) -> None:
        """Copy ``layer``'s host pages into its staging half on the io stream (call it once the
        compute stream has issued the reads of layer - 1, which used the other half)."""
        c = self.cache
        if layer >= c.layers or not len(self.host_slots) or layer in self._events:
            return
        self._events[layer] = c.storage.stage(layer, self.host_slots)

    def layer(self, layer: int) -> tuple:
        """``(k_pages, v_pages, block_tables)`` for ``layer``, once its host pages are staged.
        Call ``prefetch(layer + 1)`` after issuing the attention that reads them: the next
        layer's copy then overlaps this layer's projections and MLP (§3.2.4)."""
        ev = self._events.pop(layer, None)
        if ev is not None:
            rt.stream("compute").wait_event(ev)
        return self.cache.k, self.cache.v, self.tables[layer]


class KVCache:
    """Paged KV cache for one ``Llama`` on this rank (see the module docstring).

    Parameters
    ----------
    model : Llama
        The model (its layers, kv heads and dtype).
    max_tokens : int
        Positions in all, over every sequence (rounded up to whole pages).
    block_size : int
        Positions per page.
    device_budget_tokens : int, optional
        Pages kept on the device; older ones move to the host tier (None: all on the device).
    window : int, optional
        Sliding-window attention: a decode query sees the last ``window`` positions; pages wholly
        before them are dropped.
    dtype : dtype, optional
        Default: the model's.
    """

    def __init__(self, model: Any, max_tokens: int, block_size: int = 16, device_budget_tokens: int | None = None,
                 window: int | None = None, dtype: Any = None):
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
        self.pages = BlockPool(self.num_blocks, "page")             # logical pages
        self.tiers = PageTiers(self.num_blocks, self.n_dev, self.n_host)
        self.storage = PageStorage(model.xp, self.layers, self.n_dev, self.n_host,
                                   (model.n_kv, self.block_size, cfg.head_dim), self.dtype)
        # the page arrays, as the paged kernel and the tests read them
        self.k, self.v = self.storage.k, self.storage.v
        self.host_k, self.host_v = self.storage.host_k, self.storage.host_v
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._reads = {"pages": 0, "device": 0}
        self.moved_to_host = 0
        self._step_tables: dict[int, StepTables] = {}
        self.runners: dict = {}            # inference.decode's per-batch-size step runners (and graphs)
        self.workspaces: dict = {}         # inference.layers' activation buffers, by use

    # ---- sequences -------------------------------------------------------------------------
    def add(self) -> int:
        """A new empty sequence.

        Returns
        -------
        int
            Its id.
        """
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq()
        return sid

    def free(self, sid: int) -> None:
        """Finish sequence ``sid``: its pages go back to the pool.

        Parameters
        ----------
        sid : int
            The sequence id.
        """
        for b in self._seqs.pop(sid).blocks:
            if b >= 0:
                self._release(b)

    def length(self, sid: int) -> int:
        """Positions sequence ``sid`` holds.

        Parameters
        ----------
        sid : int
            The sequence id.

        Returns
        -------
        int
            Its length.
        """
        return self._seqs[sid].length

    def pages_of(self, sid: int) -> int:
        """Pages sequence ``sid`` holds now (dropped ones not counted).

        Parameters
        ----------
        sid : int
            The sequence id.

        Returns
        -------
        int
            The count.
        """
        return sum(1 for b in self._seqs[sid].blocks if b >= 0)

    def blocks_needed(self, n_tokens: int) -> int:
        """Pages ``n_tokens`` positions take.

        Parameters
        ----------
        n_tokens : int
            Positions.

        Returns
        -------
        int
            ``ceil(n_tokens / block_size)``.
        """
        return math.ceil(n_tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return self.pages.num_free

    def reserve(self, sid: int, n: int) -> np.ndarray:
        """Make room for ``n`` more positions of ``sid``; returns their positions.

        Parameters
        ----------
        sid : int
            The sequence id.
        n : int
            Positions to add.

        Returns
        -------
        numpy.ndarray
            The new positions.
        """
        s = self._seqs[sid]
        need = self.blocks_needed(s.length + n) - len(s.blocks)
        if need > self.pages.num_free:
            raise ValueError(f"nn.KVCache: out of pages: sequence {sid} needs {need} more blocks of "
                             f"{self.block_size} and {self.pages.num_free} are free (max_tokens={self.max_tokens}); "
                             "give the cache more max_tokens or decode fewer sequences at once")
        # (extend takes the pages one by one: a page allocated here is its sequence's last
        # page, which eviction keeps, while the next is allocated)
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
        page = self.pages.allocate()
        if self.tiers.device_full():
            self._evict_oldest()
        self.tiers.place(page)
        return page

    def _release(self, page: int) -> None:
        self.tiers.release(page)
        self.pages.free(page)

    def _evict_oldest(self) -> None:
        """Move the page the tiers' policy picks (the oldest full device page), every layer of it,
        to a host slot on the io stream.  A sequence's last page (the one decode writes into)
        stays on the device."""
        tails = {s.blocks[-1] for s in self._seqs.values() if s.blocks}
        page = self.tiers.victim(tails)
        if page is None:
            raise ValueError(f"nn.KVCache: device_budget_tokens={self.device_budget_tokens} holds only the last page "
                             f"of each of {len(tails)} running sequences; raise the budget to at least "
                             f"{(len(tails) + 1) * self.block_size} tokens or decode fewer sequences at once")
        self.storage.spill(*self.tiers.spill(page))
        self.moved_to_host += 1

    # ---- data ------------------------------------------------------------------------------
    def write(self, layer: int, sids: Sequence[int], positions: np.ndarray, k: Any, v: Any) -> None:
        """Store ``k, v (B, Hkv_l, S, D)`` of sequences ``sids`` at ``positions (B, S)``.

        Parameters
        ----------
        layer : int
            The layer.
        sids : sequence of int
            The sequences.
        positions : numpy.ndarray
            ``(B, S)``.
        k, v : array
            ``(B, Hkv_l, S, D)``.
        """
        bs = self.block_size
        pages = np.array([[self._seqs[sid].blocks[p // bs] for p in row] for sid, row in zip(sids, positions)])
        rows = (np.asarray(positions) % bs).ravel()
        b, hkv, n, d = k.shape
        kk = k.transpose(0, 2, 1, 3).reshape(b * n, hkv, d)               # (B*S, Hkv_l, D)
        vv = v.transpose(0, 2, 1, 3).reshape(b * n, hkv, d)
        pages = pages.ravel()
        keep = pages >= 0                        # a prefill longer than the window drops its oldest pages
        host, slot = self.tiers.on_host[pages] & keep, self.tiers.slot[np.maximum(pages, 0)]
        self.storage.write(layer, keep & ~host, host, slot, rows, kk, vv)

    def layer_pages(self, layer: int) -> tuple:
        """``layer``'s device pages, indexed by device slot (views of the pool).

        Parameters
        ----------
        layer : int
            The layer.

        Returns
        -------
        tuple
            ``(k, v)``, each ``(device slots, Hkv_l, block_size, D)``.
        """
        return self.storage.layer_k[layer], self.storage.layer_v[layer]

    def slot_mapping(self, sid: int, positions: np.ndarray) -> tuple[np.ndarray, tuple | None]:
        """Where positions of ``sid`` go (any layer: a page has the same slot in every layer).

        Parameters
        ----------
        sid : int
            The sequence (its positions reserved).
        positions : numpy.ndarray
            The positions.

        Returns
        -------
        tuple
            int32 ``device slot * block_size + row`` per position (-1 for a dropped page or one
            on the host tier), and for the host ones ``(index, host slot, row)`` arrays (None
            when there are none).
        """
        bs = self.block_size
        pos = np.asarray(positions, np.int64)
        blocks = np.asarray(self._seqs[sid].blocks, np.int64)[pos // bs]
        live = blocks >= 0
        page = np.maximum(blocks, 0)
        host = live & self.tiers.on_host[page]
        slot = self.tiers.slot[page]
        out = np.where(live & ~host, slot * bs + pos % bs, -1).astype(np.int32)
        idx = np.flatnonzero(host)
        return out, ((idx, slot[idx], (pos % bs)[idx]) if idx.size else None)

    def slot_table(self, sids: Sequence[int], width: int) -> np.ndarray:
        """Block tables of device slots (layer-independent: index a layer's ``layer_pages``).

        Parameters
        ----------
        sids : sequence of int
            The sequences.
        width : int
            Pages per row.

        Returns
        -------
        numpy.ndarray
            ``(len(sids), width)`` int32, -1 where a page was dropped, sits on the host tier,
            or the sequence has ended.
        """
        t = np.full((len(sids), width), -1, np.int32)
        for i, sid in enumerate(sids):
            b = np.asarray(self._seqs[sid].blocks, np.int64)[:width]
            ok = b >= 0
            page = np.maximum(b, 0)
            ok &= ~self.tiers.on_host[page]
            t[i, :len(b)] = np.where(ok, self.tiers.slot[page], -1)
        return t

    def write_host_rows(self, layer: int, host: tuple, k: Any, v: Any) -> None:
        """Store a prefill's rows whose pages sit on the host tier.

        Parameters
        ----------
        layer : int
            The layer.
        host : tuple
            ``(index, host slot, row)`` as ``slot_mapping`` returns them (indexes into k, v).
        k, v : array
            ``(T, Hkv_l, D)`` the prefill's roped keys and values.
        """
        idx, hslot, rows = host
        xp = self.model.xp
        take = xp.asarray(idx) if xp is not np else idx
        self.storage.write_host(layer, hslot, rows, k[take], v[take])

    def step_tables(self, b: int) -> StepTables:
        """The persistent tables of a staged decode step (made on first use).

        Parameters
        ----------
        b : int
            The batch.

        Returns
        -------
        StepTables
            Its arrays.
        """
        buf = self._step_tables.get(b)
        if buf is None:
            buf = self._step_tables[b] = StepTables(self.model.xp, self.layers, b, self.num_blocks)
        return buf

    def step(self, sids: Sequence[int], buf: StepTables | None = None) -> DecodeStep:
        """The per-layer tables of a staged decode step over ``sids`` (call after ``reserve``).

        Parameters
        ----------
        sids : sequence of int
            The sequences decoding.
        buf : StepTables, optional
            Persistent buffers (``step_tables``).

        Returns
        -------
        DecodeStep
            Block tables, lengths and staging for the step.
        """
        return DecodeStep(self, sids, buf if buf is not None else self.step_tables(len(sids)))

    def stats(self) -> dict:
        """Pages per tier, bytes per tier and the hot-tier hit ratio of page reads (per layer).

        Returns
        -------
        dict
            The figures.
        """
        page_bytes = self.storage.page_bytes
        dev, host = self.n_dev - self.tiers.dev.num_free, self.n_host - self.tiers.host.num_free
        reads = self._reads["pages"]
        return {"sequences": len(self._seqs), "blocks_device": dev, "blocks_host": host,
                "blocks_free": self.pages.num_free, "bytes_device": dev * self.layers * page_bytes,
                "bytes_host": host * self.layers * page_bytes,
                "bytes_staging": 2 * self.n_host * page_bytes,
                "bytes_per_token": self.layers * page_bytes // self.block_size,
                "moved_to_host": self.moved_to_host,
                "hit_ratio": 1.0 if reads == 0 else self._reads["device"] / reads}

