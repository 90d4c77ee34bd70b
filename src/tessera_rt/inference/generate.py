"""The decode loop: prefill each prompt into the paged cache, then one token per step for every
running sequence together (continuous batching: a finished sequence frees its pages and a
waiting prompt is prefilled in its place between steps).

Every input is checked before the first collective, on every rank (all ranks hold the same
prompts and settings), so a bad prompt is one clear ValueError rather than a hang.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import op
from ..backend import get_backend
from .decode import decode_hidden
from .sampling import check_sampling, sample

__all__ = ["generate", "check_prompts"]


def check_prompts(model, cache, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[np.ndarray]:
    """Prompts as int arrays, or a ValueError naming the problem and the fix."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("generate: prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]]")
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or not len(a) or a.dtype.kind not in "iu":
            raise ValueError(f"generate: prompt {i} must be a non-empty list of ints, got {p!r:.80}")
        model.check_ids(a, f"generate: prompt {i}")
        need = len(a) + max_new_tokens
        if cache.window is None and need > cache.max_tokens:
            raise ValueError(f"generate: prompt {i} has {len(a)} tokens + max_new_tokens={max_new_tokens} = {need} "
                             f"positions, more than the cache holds (max_tokens={cache.max_tokens}); give "
                             "nn.KVCache more max_tokens or shorten the prompt")
        out.append(a.astype(np.int64))
    return out


def _prefill_attend(cache, sid, pos):
    def attend(layer, q, k, v):
        cache.write(layer, [sid], pos, k, v)
        return op.flash_attention(q, k, v, causal=True)
    return attend


def generate(model: object, cache: object, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_token_id: int | None = None, max_batch: int | None = None) -> list[list[int]]:
    """Generated ids (prompt excluded) for each prompt; collective over the model's mesh.

    Parameters
    ----------
    model : Llama
        The model.
    cache : KVCache
        Its cache (sequences are added and freed here).
    prompts : sequence of sequence of int
        Token ids.
    max_new_tokens : int
        Per sequence.
    temperature : float
        0: greedy.
    top_k : int, optional
        Sample among the k likeliest.
    top_p : float, optional
        Sample within the nucleus of mass p.
    seed : int
        The sampling noise's seed.
    eos_token_id : int, optional
        Ends a sequence early.
    max_batch : int, optional
        Caps the sequences decoding at once (the rest wait and join as others finish).

    Returns
    -------
    list of list of int
        One list per prompt.
    """
    ps = check_prompts(model, cache, prompts, max_new_tokens)
    check_sampling(temperature, top_k, top_p, model.config.vocab_size)
    if max_batch is not None and max_batch <= 0:
        raise ValueError(f"generate: max_batch must be positive or None, got {max_batch}")
    outs: list[list[int]] = [[] for _ in ps]
    if max_new_tokens == 0:
        return outs
    skw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    dp, dp_index = _dp_of(model)
    waiting = list(range(dp_index, len(ps), dp))     # prompt i decodes on dp replica i % dp
    running: dict[int, int] = {}                 # prompt index -> cache sequence id

    def finished(i: int) -> bool:
        return len(outs[i]) >= max_new_tokens or (eos_token_id is not None and outs[i][-1] == eos_token_id)

    def pages_for(i: int) -> int:
        # the pages prompt i holds at its longest (a window caps what a sequence keeps)
        n = len(ps[i]) + max_new_tokens
        return cache.blocks_needed(n if cache.window is None else min(n, cache.window + cache.block_size))

    def fits(i: int) -> bool:
        # admit only what can run to the end: no sequence is ever preempted for pages
        growth = sum(pages_for(j) - cache.pages_of(running[j]) for j in running)
        return cache.free_blocks - growth >= pages_for(i)

    # checked here, for every prompt on every rank, so no dp replica fails alone mid-run
    for i in range(len(ps)):
        if pages_for(i) > cache.num_blocks:
            raise ValueError(f"generate: prompt {i} needs {pages_for(i)} pages of {cache.block_size} and the cache "
                             f"has {cache.num_blocks}; raise max_tokens")
    if cache.n_host and cache.n_dev < 2:
        raise ValueError(f"generate: device_budget_tokens={cache.device_budget_tokens} holds only the last page of a "
                         f"running sequence; give the cache at least {2 * cache.block_size} device tokens")
    # with a host tier, one device page more than the running sequences' last pages: eviction
    # always finds a full page to move
    cap = min(max_batch or len(ps), cache.n_dev - 1 if cache.n_host else len(ps))

    def admit() -> None:
        while waiting and len(running) < cap and fits(waiting[0]):
            i = waiting.pop(0)
            sid = cache.add()
            pos = cache.reserve(sid, len(ps[i]))
            h = model.hidden(ps[i][None], pos[None], _prefill_attend(cache, sid, pos[None]))
            tok = sample(model, model.local_logits(h[:, -1]), keys=[(i, 0)], **skw)
            outs[i].append(int(tok[0]))
            if finished(i):
                cache.free(sid)
            else:
                running[i] = sid
        if waiting and not running:
            raise ValueError(f"generate: prompt {waiting[0]} ({len(ps[waiting[0]])} tokens) needs {pages_for(waiting[0])} "
                             f"pages of {cache.block_size} and the cache has {cache.free_blocks}; raise max_tokens")

    admit()
    while running:
        idx = sorted(running)
        sids = [running[i] for i in idx]
        pos = np.stack([cache.reserve(s, 1) for s in sids])                # (B, 1)
        ids = np.array([[outs[i][-1]] for i in idx])
        # persistent buffers from the second step at this batch size on: nothing is allocated
        h = decode_hidden(model, cache, sids, ids[:, 0], pos)
        logits = op.matmul(h, model.params["head"], out=cache.decode_buffers(len(sids)).logits)
        toks = sample(model, logits, keys=[(i, len(outs[i])) for i in idx], **skw)
        for i, t in zip(idx, toks):
            outs[i].append(int(t))
            if finished(i):
                cache.free(running.pop(i))
        admit()
    return outs if dp == 1 else _gather_dp(model, outs, max_new_tokens)


def _dp_of(model) -> tuple[int, int]:
    mesh = model.mesh
    if mesh is None or "dp" not in mesh.axes:
        return 1, 0
    return mesh.size("dp"), mesh.coordinate("dp")


def _gather_dp(model, outs: list, max_new_tokens: int) -> list[list[int]]:
    """Every replica's generated ids on every rank: one all_reduce(max) of a -1-padded table
    (each prompt's row is filled by exactly one dp replica)."""
    from ..dist.comm import collectives as C
    table = np.full((len(outs), max_new_tokens), -1, np.int64)
    for i, o in enumerate(outs):
        table[i, :len(o)] = o
    be = get_backend()
    table = be.to_host(C.all_reduce(be.asarray(table), axis="dp", op="max", mesh=model.mesh))
    return [[int(t) for t in row if t >= 0] for row in table]
