"""Vocab-parallel sampling: each tp rank holds its slice of the logits; no rank gathers them all.

Every rule reduces to an argmax over candidates, decided by one small all_gather of
``(value, id)`` pairs (seed 004's SAMPLING buffers).  Greedy and plain temperature sampling
also run on the device (``DeviceSampler``: the ``sample_argmax`` / ``sample_pick`` kernels,
nothing read back but the token ids), which is what a captured decode step uses; ``sample``
below is the host path, which top-k and top-p take:

* greedy: each rank's (max, argmax); the lowest id wins a tie, as ``torch.argmax`` does.
* temperature: the Gumbel-max trick, ``argmax(logits / T + g)`` with ``g`` Gumbel noise drawn
  per *global* vocabulary id by a counter hash of (seed, sequence, step, id)
  (``kernels.decoder_ops.gumbel_hash``) — an exact sample of ``softmax(logits / T)`` that is
  the same token on any mesh, and the same noise the device sampler draws.
* top-k: each rank's local top-k, gathered (``k * tp`` pairs), the global top-k kept, then
  Gumbel-max among them.
* top-p: candidates as top-k (``top_k`` or 256 at first, doubled until their mass reaches
  ``top_p``), normalized by the global logsumexp (one more tiny gather of (max, sum)), the
  smallest prefix of mass ``>= top_p`` kept (after top-k when both are given, as transformers
  applies them), then Gumbel-max.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import get_backend
from ..dist.ccl.buffers import take
from ..dist.comm import collectives as C
from ..kernels.decoder_ops import gumbel_hash
from .kv_storage import upload

__all__ = ["sample", "check_sampling", "gumbel_noise", "DeviceSampler"]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, vocab: int) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"generate: temperature must be a float >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or not 0 < top_k <= vocab):
        raise ValueError(f"generate: top_k must be an int in [1, {vocab}] or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")


def gumbel_noise(seed: int, seq: int, step: int, vocab: int) -> np.ndarray:
    """Gumbel(0, 1) noise for every global vocab id: the same on every rank and mesh, and what
    the device sampler draws."""
    return gumbel_hash(seed, seq, step, np.arange(vocab))


class DeviceSampler:
    """Greedy or temperature sampling on the device: each rank's best ``(z, id)`` of its vocab
    slice (``sample_argmax``), gathered over tp into ``cand``, the winner picked into ``tok``
    (``sample_pick``, which also advances a decode batch's positions, step keys and token
    history when given them).  Launches only: nothing is read back.

    Parameters
    ----------
    model : Llama
        The model (its mesh and vocab slice).
    temperature : float
        0: greedy.
    seed : int
        The noise's seed.
    """

    def __init__(self, model, temperature: float, seed: int):
        self.model, self.temperature, self.seed = model, float(temperature), int(seed)
        be = get_backend()
        self.argmax, self.pick = be.kernel("sample_argmax"), be.kernel("sample_pick")

    @staticmethod
    def serves(temperature: float, top_k: int | None, top_p: float | None) -> bool:
        """Whether these settings sample on the device (greedy, or temperature alone)."""
        return temperature == 0 or top_k == 1 or (top_k is None and top_p is None)

    def buffers(self, b: int) -> tuple:
        """``(pairs (1, b, 2), cand (tp, b, 2))`` float64 for ``b`` rows (cand is pairs at tp=1)."""
        xp, tp = self.model.xp, self.model.shard.tp
        pairs = xp.empty((1, b, 2), np.float64)
        return pairs, (pairs if tp == 1 else xp.empty((tp, b, 2), np.float64))

    def __call__(self, logits, keys, pairs, cand, tok, advance: bool = False, **history) -> None:
        """Sample ``logits (b, V_local)`` with ``keys (b, 2)`` int32 (sequence, step) into ``tok``;
        ``advance``: a decode batch's step (keys' step +1, and ``pos``, ``hist``, ``hist_n`` as given)."""
        m = self.model
        self.argmax(logits, v0=m.shard.vocab.start, temperature=self.temperature, seed=self.seed, keys=keys,
                    out=pairs[0])
        if m.shard.tp > 1:
            C.all_gather(pairs, axis=m.tp_axis, mesh=m.mesh, out=cand)
        self.pick(cand, tok=tok, keys=keys if advance else None, **history)


def _gather(model, pairs: np.ndarray) -> np.ndarray:
    """All ranks' ``(B, n, 2)`` (value, id) pairs as ``(B, tp * n, 2)``, in rank order.  The
    send and receive arrays are ccl's persistent double buffers, one key per shape (seed 004's
    SAMPLING buffers): after a shape's first step the gather allocates nothing on the device."""
    tp = model.shard.tp
    if tp == 1:
        return pairs
    send, recv = (1,) + pairs.shape, (tp,) + pairs.shape
    key = f"inference.sample{list(pairs.shape)}@{model.tp_axis}x{tp}"
    bufs = take(key, ("inference.sample", model.tp_axis, send, np.dtype(np.float64), (("tp", tp),)),
                lambda: {"send": send, "recv": recv}, np.float64)
    upload(model.xp, bufs["send"], pairs.reshape(send))
    g = C.all_gather(bufs["send"], axis=model.tp_axis, mesh=model.mesh, out=bufs["recv"])
    return np.concatenate(list(get_backend().to_host(g)), axis=1)


def _best(vals: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per row, the id of the largest value, the lowest id among equals."""
    order = np.lexsort((ids, -vals), axis=-1)[..., 0]
    return np.take_along_axis(ids, order[..., None], -1)[..., 0]


def _local_topk(lg: np.ndarray, k: int, v0: int) -> np.ndarray:
    """``(B, k, 2)`` (value, id) of this rank's k largest; a slice shorter than k pads with
    (-inf, id 0) so every rank sends the same shape."""
    n = lg.shape[-1]
    idx = np.argpartition(-lg, k - 1, axis=-1)[..., :k] if k < n else np.broadcast_to(np.arange(n), lg.shape)
    pairs = np.stack([np.take_along_axis(lg, idx, -1), idx + v0], axis=-1)
    if k > n:
        pad = np.zeros((lg.shape[0], k - n, 2))
        pad[..., 0] = -np.inf
        pairs = np.concatenate([pairs, pad], axis=1)
    return pairs


def _global_topk(model, lg: np.ndarray, k: int) -> tuple:
    """The k largest (values, ids) per row over the whole vocabulary, sorted descending."""
    k_local = min(k, max(model.shard.vocab_sizes))
    cand = _gather(model, _local_topk(lg, k_local, model.shard.vocab.start))
    vals, ids = cand[..., 0], cand[..., 1]
    order = np.lexsort((ids, -vals), axis=-1)[..., :k]
    return np.take_along_axis(vals, order, -1), np.take_along_axis(ids, order, -1).astype(np.int64)


def _global_lse(model, lg: np.ndarray) -> np.ndarray:
    m = lg.max(axis=-1)
    s = np.exp(lg - m[:, None]).sum(axis=-1)
    ms = _gather(model, np.stack([m, s], axis=-1)[:, None])          # (B, tp, 2)
    mg = ms[..., 0].max(axis=-1)
    return mg + np.log((ms[..., 1] * np.exp(ms[..., 0] - mg[:, None])).sum(axis=-1))


def sample(model: Any, local_logits: Any, *, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, seed: int = 0, keys: Sequence[tuple] = ()) -> np.ndarray:
    """Next token ids from this rank's logits slice; every rank returns the same ids.

    Parameters
    ----------
    model : Llama
        The model (its mesh and vocab split).
    local_logits : array
        This rank's f32 logits ``(B, V_local)``.
    temperature : float
        0: greedy.
    top_k : int, optional
        Sample among the k likeliest.
    top_p : float, optional
        Within the nucleus of mass p.
    seed : int
        The noise's seed.
    keys : sequence of tuple
        Each row's (sequence, step) for the noise.

    Returns
    -------
    numpy.ndarray
        ``(B,)`` token ids.
    """
    lg = get_backend().to_host(local_logits).astype(np.float64)      # (B, V_local): small next to the weights
    b, v0, vocab = lg.shape[0], model.shard.vocab.start, model.config.vocab_size
    if temperature == 0 or top_k == 1:
        loc = lg.argmax(axis=-1)
        pairs = np.stack([lg[np.arange(b), loc], loc + v0], axis=-1)[:, None]
        cand = _gather(model, pairs)
        return _best(cand[..., 0], cand[..., 1]).astype(np.int64)
    lg = lg / temperature
    noise = [gumbel_noise(seed, s, t, vocab) for s, t in keys]
    if top_k is None and top_p is None:
        z = lg + np.stack([n[v0:v0 + lg.shape[1]] for n in noise])
        loc = z.argmax(axis=-1)
        cand = _gather(model, np.stack([z[np.arange(b), loc], loc + v0], axis=-1)[:, None])
        return _best(cand[..., 0], cand[..., 1]).astype(np.int64)
    lse = None if top_k is not None else _global_lse(model, lg)
    k = top_k if top_k is not None else min(256, vocab)
    while True:
        vals, ids = _global_topk(model, lg, k)
        if top_p is None:
            keep = np.ones(vals.shape, bool)
            break
        norm = lse if lse is not None else np.log(np.exp(vals - vals[:, :1]).sum(-1)) + vals[:, 0]
        cum = np.cumsum(np.exp(vals - norm[:, None]), axis=-1)
        if top_k is not None or k >= vocab or (cum[:, -1] >= top_p - 1e-12).all():
            keep = np.concatenate([np.ones((b, 1), bool), cum[:, :-1] < top_p], axis=-1)
            break
        k = min(vocab, 2 * k)                      # the candidates' mass is short of top_p: widen
    z = np.where(keep, vals + np.stack([n[i] for n, i in zip(noise, ids)]), -np.inf)
    return ids[np.arange(b), z.argmax(axis=-1)]
