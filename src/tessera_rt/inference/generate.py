"""The serving loop: each iteration prefills a packed batch of prompt chunks into the paged
cache (``inference.prefill``: chunked, so a long prompt does not stall the decoding ones), then
runs one decode step for every running sequence together (``inference.decode``: static
buffers, a CUDA graph on a GPU, sampling on the device).  Continuous batching: a finished
sequence frees its pages and a waiting prompt is admitted in its place.  The host reads the
new token ids back only when it needs them: an eos to check, a sequence finishing, the batch
changing.

Every input is checked before the first collective, on every rank (all ranks hold the same
prompts and settings), so a bad prompt is one clear ValueError rather than a hang.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import runtime as rt
from ..backend import get_backend
from .decode import HISTORY, runner_for
from .kv_cache import KVCache
from .prefill import plan_chunks, run_prefill
from .sampling import DeviceSampler, check_sampling, sample

if TYPE_CHECKING:                   # llama.py imports this module (Llama.generate)
    from .llama import Llama

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


DEFAULT_PREFILL_TOKENS = 2048


class _Decoding:
    """The running sequences' decode batch: its rows (prompt indexes), the runner, what the
    host knows of the device state, and the history columns not yet read."""

    def __init__(self, rows: list, runner):
        self.rows, self.runner = rows, runner
        self.col = 0               # the device history's next column (steps since the state upload)
        self.unread = 0            # columns [col - unread, col) not read yet
        self.pages: list = []      # per row, what the uploaded table reflects
        self.dirty = True


def generate(model: Llama, cache: KVCache, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_token_id: int | None = None, max_batch: int | None = None,
             max_prefill_tokens: int | None = DEFAULT_PREFILL_TOKENS) -> list[list[int]]:
    """Generated ids (prompt excluded) for each prompt; collective over the model's mesh.

    Each iteration prefills a packed batch of prompt chunks (at most ``max_prefill_tokens``
    tokens, so the running sequences are not starved) and then runs one decode step for every
    running sequence (continuous batching: a finished sequence frees its pages and a waiting
    prompt is admitted in its place).

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
        Ends a sequence early (the host then reads the new tokens every step).
    max_batch : int, optional
        Caps the sequences decoding at once (the rest wait and join as others finish).
    max_prefill_tokens : int, optional
        Prompt tokens prefilled per step (a longer prompt is prefilled in chunks); None: no cap.
        A cache with a window or a host tier prefills each prompt whole.

    Returns
    -------
    list of list of int
        One list per prompt.
    """
    ps = check_prompts(model, cache, prompts, max_new_tokens)
    check_sampling(temperature, top_k, top_p, model.config.vocab_size)
    if max_batch is not None and max_batch <= 0:
        raise ValueError(f"generate: max_batch must be positive or None, got {max_batch}")
    if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, (int, np.integer))
                                           or max_prefill_tokens <= 0):
        raise ValueError(f"generate: max_prefill_tokens must be a positive int or None, got {max_prefill_tokens!r}")
    outs: list[list[int]] = [[] for _ in ps]
    if max_new_tokens == 0:
        return outs
    skw: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    rt.stream("compute")          # CuPy's current stream: every upload and kernel of the loop goes there
    dp, dp_index = _dp_of(model)
    waiting = list(range(dp_index, len(ps), dp))     # prompt i decodes on dp replica i % dp
    prefilling: dict[int, tuple] = {}             # prompt index -> (sequence id, next position)
    running: dict[int, int] = {}                 # prompt index -> cache sequence id (decoding)
    on_device = DeviceSampler.serves(temperature, top_k, top_p)
    sampler = DeviceSampler(model, 0.0 if (temperature == 0 or top_k == 1) else temperature, seed) \
        if on_device else None
    host_sample = None if on_device else (lambda logits, keys: sample(model, logits, keys=keys, **skw))

    def finished(i: int) -> bool:
        return len(outs[i]) >= max_new_tokens or (eos_token_id is not None and outs[i][-1] == eos_token_id)

    def pages_for(i: int) -> int:
        # the pages prompt i holds at its longest (a window caps what a sequence keeps)
        n = len(ps[i]) + max_new_tokens
        return cache.blocks_needed(n if cache.window is None else min(n, cache.window + cache.block_size))

    def fits(i: int, admitted: list) -> bool:
        # admit only what can run to the end: no sequence is ever preempted for pages
        held = list(running.values()) + [v[0] for v in prefilling.values()]
        growth = sum(pages_for(j) - cache.pages_of(sid) for j, sid in zip(list(running) + list(prefilling), held))
        growth += sum(pages_for(j) for j, _ in admitted)
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
    split = cache.window is None and cache.n_host == 0
    dec: _Decoding | None = None

    def read(d: _Decoding) -> None:
        """Append the history columns not yet read to the rows' outputs (one sync)."""
        if d.unread:
            toks = d.runner.tokens(len(d.rows), slice(d.col - d.unread, d.col))
            for r, i in enumerate(d.rows):
                outs[i].extend(int(t) for t in toks[r])
            d.unread = 0

    def decode_step() -> None:
        nonlocal dec
        rows = sorted(running)
        if dec is None or dec.rows != rows or dec.col >= HISTORY:
            if dec is not None:
                read(dec)
                if any(finished(i) for i in rows):
                    return                 # (the caller frees them first)
            dec = _Decoding(rows, runner_for(model, cache, len(rows), sampler))
        sids = [running[i] for i in rows]
        pos = [int(cache.reserve(s, 1)[0]) for s in sids]
        pages = [(len(cache._seqs[s].blocks), cache.pages_of(s)) for s in sids]
        width = max(p[0] for p in pages)
        if width > dec.runner.batch.width:       # a windowed sequence outgrew the tables: new buffers
            read(dec)
            dec.runner.fit(width)
            dec.dirty = True
        b = dec.runner.batch
        if dec.dirty or sampler is None:
            b.upload_state([outs[i][-1] for i in rows], pos, [(i, len(outs[i])) for i in rows],
                           cache.slot_table(sids, b.width))
            dec.col, dec.dirty = 0, False
        elif pages != dec.pages:                 # a sequence got a page (or, windowed, dropped one)
            b.upload_tables(cache.slot_table(sids, b.width))
        dec.pages = pages
        dec.runner.sids = sids
        dec.runner.run()
        if host_sample is not None:          # top-k / top-p: on the host, from the step's logits
            toks = host_sample(b.logits[:len(rows)], [(i, len(outs[i])) for i in rows])
            for i, t in zip(rows, toks):
                outs[i].append(int(t))
            return
        dec.col += 1
        dec.unread += 1
        if eos_token_id is not None or any(len(outs[i]) + dec.unread >= max_new_tokens for i in rows):
            read(dec)

    while waiting or prefilling or running:
        admitted: list = []
        while waiting and len(running) + len(prefilling) + len(admitted) < cap and fits(waiting[0], admitted):
            i = waiting.pop(0)
            admitted.append((i, cache.add()))
        if waiting and not (running or prefilling or admitted):
            raise ValueError(f"generate: prompt {waiting[0]} ({len(ps[waiting[0]])} tokens) needs {pages_for(waiting[0])} "
                             f"pages of {cache.block_size} and the cache has {cache.free_blocks}; raise max_tokens")
        chunks = plan_chunks(cache, ps, prefilling, admitted, max_prefill_tokens, split)
        if chunks:
            sids = {c.index: c.sid for c in chunks}
            for i, t in run_prefill(model, cache, chunks, sampler, host_sample).items():
                outs[i].append(t)
                if finished(i):
                    cache.free(sids[i])
                else:
                    running[i] = sids[i]
        if running:
            decode_step()
            for i in [i for i in running if finished(i)]:
                cache.free(running.pop(i))
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
