"""Batched variable-length prefill: the prompts admitted in a step run as one packed
``(tokens, hidden)`` batch through ``Llama.forward`` (each GEMM once for all of them), and
chunked prefill splits a long prompt over steps so decoding sequences keep getting a token
every step.

A step's ``PrefillBatch`` is built on the host and uploaded in one copy: the token ids, their
positions, the slot mapping (where each token's K and V go in the paged cache, shared by every
layer), the cumulative sequence lengths, and for chunks that continue a prompt the context
lengths and slot tables (their attention reads the earlier positions from the cache).  Then
every layer writes K/V with one kernel and attends with one (block-diagonal causal), the
last rows of the prompts completed in the step are gathered and sampled on the device; the
host reads back those first tokens (one sync a step).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layers import PrefillAttention, Workspace, host_int32

__all__ = ["Chunk", "PrefillBatch", "run_prefill", "plan_chunks"]


@dataclass
class Chunk:
    """Part of a prompt to prefill in a step: ``tokens`` at positions ``start ...`` of cache
    sequence ``sid``; ``last``: it completes prompt ``index`` (its last row is sampled)."""

    index: int
    sid: int
    tokens: np.ndarray
    start: int
    last: bool


class PrefillBatch:
    """The device arrays of one packed prefill step (one host->device copy).

    Parameters
    ----------
    model : Llama
        The model.
    cache : KVCache
        Its cache; every chunk's positions must be reserved already.
    chunks : sequence of Chunk
        The step's chunks, in order.
    """

    # views of the step's one upload (set in __init__, by name); context and tables: None when
    # no chunk continues its prompt
    ids: Any
    pos: Any
    slots: Any
    cu: Any
    last: Any
    keys: Any
    context: Any
    tables: Any

    def __init__(self, model, cache, chunks: Sequence[Chunk]):
        lens = np.array([len(c.tokens) for c in chunks], np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        self.t, self.max_len = int(cu[-1]), int(lens.max())
        pos = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        slots, host = [], []
        for c, off in zip(chunks, cu[:-1]):
            s, h = cache.slot_mapping(c.sid, np.arange(c.start, c.start + len(c.tokens)))
            slots.append(s)
            if h is not None:
                host.append((h[0] + off, h[1], h[2]))
        self.host_rows = None if not host else tuple(np.concatenate(p) for p in zip(*host))
        last = [i for i, c in enumerate(chunks) if c.last]
        self.last_index = [chunks[i].index for i in last]
        keys = np.array([[chunks[i].index, 0] for i in last], np.int32).reshape(-1, 2)
        ctx = np.array([c.start for c in chunks], np.int32)
        parts = [np.concatenate([c.tokens for c in chunks]), pos, np.concatenate(slots), cu, cu[1:][last] - 1, keys]
        names = ["ids", "pos", "slots", "cu", "last", "keys"]
        if ctx.any():                 # a chunk continues its prompt: attention reads the cache
            width = max(cache.blocks_needed(c.start + len(c.tokens)) for c in chunks)
            parts += [ctx, cache.slot_table([c.sid for c in chunks], width)]
            names += ["context", "tables"]
        flat, cuts = host_int32(*parts)
        dev = model.xp.asarray(flat)                       # the step's one upload
        for name, sl, p in zip(names, cuts, parts):
            setattr(self, name, dev[sl].reshape(np.shape(p)))
        if "context" not in names:
            self.context = self.tables = None


def run_prefill(model, cache, chunks: Sequence[Chunk], sampler, host_sample=None) -> dict[int, int]:
    """Prefill ``chunks`` as one packed batch; returns ``{prompt index: first token}`` for the
    prompts it completes (sampled on the device by ``sampler``, or by ``host_sample(logits,
    keys)`` for top-k / top-p)."""
    batch = PrefillBatch(model, cache, chunks)
    work = Workspace.of(cache, model, "prefill", batch.t).view(batch.t)
    h = model.forward(batch.ids, PrefillAttention(model, cache, batch), work)
    if not batch.last_index:
        return {}
    xp = model.xp
    rows = xp.take(h, batch.last, axis=0)                 # the completed prompts' last rows
    logits = model.local_logits(rows)
    if host_sample is not None:
        toks = host_sample(logits, [(i, 0) for i in batch.last_index])
    else:
        b = len(batch.last_index)
        pairs, cand = sampler.buffers(b)
        tok = xp.empty(b, np.int32)
        sampler(logits, batch.keys, pairs, cand, tok)
        toks = tok.get() if hasattr(tok, "get") else tok                 # the step's one sync
    return {i: int(t) for i, t in zip(batch.last_index, toks)}


def plan_chunks(cache, prompts: Sequence[np.ndarray], prefilling: dict, admit: list, budget: int | None,
                split: bool) -> list[Chunk]:
    """The chunks of a step: prompts being prefilled continue first, then newly admitted ones,
    until ``budget`` tokens (None: no cap).  ``prefilling`` maps prompt index -> (sid, next
    position) and is updated; ``admit`` lists ``(index, sid)`` of prompts admitted this step.
    Without ``split`` (a windowed or tiered cache) a prompt is never cut: one longer than what
    is left waits for the next step, unless the step would otherwise be empty."""
    chunks: list[Chunk] = []
    left = budget
    for i, sid in [(i, v[0]) for i, v in prefilling.items()] + list(admit):
        if i not in prefilling:
            prefilling[i] = (sid, 0)
        start = prefilling[i][1]
        rest = len(prompts[i]) - start
        n = rest if left is None else min(rest, left)
        if n <= 0 or (not split and n < rest and chunks):
            continue
        if not split:
            n = rest
        cache.reserve(sid, n)
        chunks.append(Chunk(i, sid, prompts[i][start:start + n].astype(np.int32), start, start + n == len(prompts[i])))
        prefilling[i] = (sid, start + n)
        if left is not None:
            left -= n
    for c in chunks:
        if c.last:
            del prefilling[c.index]
    return chunks
