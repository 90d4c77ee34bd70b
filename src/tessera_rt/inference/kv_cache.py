"""``nn.KVCache``: a paged key/value cache (vLLM's block tables), sharded over tp by kv heads.

Keys and values of every layer live in pages of ``block_size`` positions:
``k[layer] (num_blocks, kv_heads_local, block_size, head_dim)``.  A sequence owns a list of
pages (its block table); position ``j`` sits in page ``table[j // block_size]`` at row
``j % block_size``.  Pages are taken from a free list as a sequence grows and returned when it
finishes, so sequences of different lengths share one pool and may join or leave between
decode steps (continuous batching).  Each tp rank holds only its own kv heads (the cache is
chunked by time into pages and sharded by heads, seed 000 §3.2).

``window=W`` limits look-back (§3.5.2): a decode query sees the last ``W`` positions, and a
page whose positions are all older than that is dropped (returned to the pool, its table
entry set to -1).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["KVCache"]


@dataclass
class _Seq:
    blocks: list = field(default_factory=list)   # page ids; -1 where the window dropped a page
    length: int = 0                               # positions written
    start: int = 0                                # first position a query may see


class KVCache:
    """Paged KV cache for one ``Llama`` on this rank; ``max_tokens`` positions in all."""

    def __init__(self, model, max_tokens: int, block_size: int = 16, device_budget_tokens: int | None = None,
                 window: int | None = None, dtype=None):
        for name, val in (("max_tokens", max_tokens), ("block_size", block_size)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise ValueError(f"nn.KVCache: {name} must be a positive int, got {val!r}")
        if window is not None and (not isinstance(window, (int, np.integer)) or window <= 0):
            raise ValueError(f"nn.KVCache: window must be a positive int or None, got {window!r}")
        if device_budget_tokens is not None and device_budget_tokens <= 0:
            raise ValueError(f"nn.KVCache: device_budget_tokens must be positive or None, got {device_budget_tokens}")
        cfg = model.config
        self.model, self.block_size, self.window = model, int(block_size), window
        self.num_blocks = math.ceil(max_tokens / block_size)
        self.max_tokens = self.num_blocks * self.block_size
        self.device_budget_tokens = device_budget_tokens
        self.dtype = np.dtype(model.dtype if dtype is None else dtype)
        xp = model.xp
        shape = (cfg.num_hidden_layers, self.num_blocks, model.n_kv, self.block_size, cfg.head_dim)
        self.k, self.v = xp.zeros(shape, self.dtype), xp.zeros(shape, self.dtype)
        self._free: deque = deque(range(self.num_blocks))
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._reads = {"blocks": 0, "hits": 0}

    # ---- sequences -------------------------------------------------------------------------
    def add(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq()
        return sid

    def free(self, sid: int) -> None:
        """Finish sequence ``sid``: its pages go back to the pool."""
        s = self._seqs.pop(sid)
        self._free.extend(b for b in s.blocks if b >= 0)

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
        s.blocks.extend(self._free.popleft() for _ in range(need))
        pos = np.arange(s.length, s.length + n)
        s.length += n
        if self.window is not None:
            self._drop_stale(s)
        return pos

    def _drop_stale(self, s: _Seq) -> None:
        s.start = max(0, s.length - self.window)
        for j in range(s.start // self.block_size):
            if s.blocks[j] >= 0:
                self._free.append(s.blocks[j])
                s.blocks[j] = -1

    # ---- data ------------------------------------------------------------------------------
    def write(self, layer: int, sids: Sequence[int], positions: np.ndarray, k: Any, v: Any) -> None:
        """Store ``k, v (B, Hkv_l, S, D)`` of sequences ``sids`` at ``positions (B, S)``."""
        bs = self.block_size
        pages = np.array([[self._seqs[sid].blocks[p // bs] for p in row] for sid, row in zip(sids, positions)])
        rows = np.asarray(positions) % bs
        kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)         # (B, S, Hkv_l, D)
        keep = pages >= 0                        # a prefill longer than the window drops its oldest pages
        self.k[layer, pages[keep], :, rows[keep]] = kk[keep]
        self.v[layer, pages[keep], :, rows[keep]] = vv[keep]

    def tables(self, sids: Sequence[int]) -> tuple:
        """``(block_tables (B, max_blocks) int32, seq_lens (B,) int32, seq_starts (B,) int32)``."""
        seqs = [self._seqs[s] for s in sids]
        mb = max(1, max(len(s.blocks) for s in seqs))
        t = np.full((len(seqs), mb), -1, np.int32)
        for i, s in enumerate(seqs):
            t[i, :len(s.blocks)] = s.blocks
            n_read = sum(1 for b in s.blocks if b >= 0)
            self._reads["blocks"] += n_read
            self._reads["hits"] += n_read
        lens = np.array([s.length for s in seqs], np.int32)
        starts = np.array([s.start for s in seqs], np.int32)
        xp = self.model.xp
        return xp.asarray(t), xp.asarray(lens), xp.asarray(starts)

    def stats(self) -> dict:
        """Blocks in use, free blocks, bytes per tier and the hot-tier hit ratio of block reads."""
        used = self.num_blocks - len(self._free)
        per_block = 2 * self.k[0, 0].nbytes * self.k.shape[0]
        reads = self._reads["blocks"]
        return {"sequences": len(self._seqs), "blocks_device": used, "blocks_host": 0,
                "blocks_free": len(self._free), "bytes_device": used * per_block, "bytes_host": 0,
                "bytes_per_token": per_block // self.block_size,
                "hit_ratio": 1.0 if reads == 0 else self._reads["hits"] / reads}
