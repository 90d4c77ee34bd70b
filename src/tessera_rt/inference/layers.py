"""What the one Llama layer stack (``Llama.forward``) runs over: the activation buffers of a
step (``Workspace``) and the attention of each use, as a callable ``attention(layer, qkv, q,
out)`` that ropes the fused q/k/v rows, writes K/V where the use keeps them and attends:

* ``CausalAttention``: packed sequences with no cache (``Llama.logits``): block-diagonal causal
  attention over the packed rows (``flash_attention_varlen``);
* ``PrefillAttention``: a packed prefill step: K/V into the paged cache by one slot mapping
  (shared by every layer), then varlen attention over the packed rows, or, when a chunk
  continues a prompt whose earlier positions are cached, paged prefill attention reading
  them through block tables (``paged_prefill_attention``);
* ``DecodeAttention``: one new token per sequence: K/V into the cache, then paged decode
  attention through the batch's tables (per-layer tables with host pages staged one layer
  ahead when the cache has a host tier).

Every op writes into the workspace (``out=``), so a step allocates nothing once its buffers
exist; the kernels are the kernel table's (``decoder_ops`` on the CPU, ``decoder_cuda`` and
the attention kernels on a GPU).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from ..backend import get_backend

__all__ = ["Workspace", "CausalAttention", "PrefillAttention", "DecodeAttention", "kernel"]


def kernel(name: str, own: bool = False):
    """The backend's kernel for ``name``; ``own``: the project's own GPU kernel, past the vendor
    providers (what a captured decode step runs: a provider may allocate per call)."""
    fn = get_backend().kernel(name)
    return getattr(fn, "__wrapped__", fn) if own else fn


class Workspace:
    """The activations of ``rows`` token rows of ``model`` (this rank's shard): the residual
    stream, normed rows, the fused q/k/v and gate/up products, roped q, attention output,
    row-parallel partial sums, the SwiGLU activation."""

    def __init__(self, model, rows: int):
        xp, cfg, dt = model.xp, model.config, model.dtype
        hd, hl, kvl = cfg.head_dim, model.n_heads, model.n_kv
        f = model.params["layers"][0]["gate_up"].shape[1] // 2 if model.params["layers"] else 0
        self.rows = rows
        e = (lambda *s: xp.empty(s, dt))
        self._all = dict(x=e(rows, cfg.hidden_size), h=e(rows, cfg.hidden_size), part=e(rows, cfg.hidden_size),
                         qkv=e(rows, (hl + 2 * kvl) * hd), q=e(rows, hl, hd), attn=e(rows, hl, hd),
                         gu=e(rows, 2 * f), act=e(rows, f))

    def view(self, t: int) -> SimpleNamespace:
        """The first ``t`` rows of every buffer (contiguous views)."""
        if t > self.rows:
            raise ValueError(f"Workspace: {t} rows asked of {self.rows}")
        return SimpleNamespace(**{k: v[:t] for k, v in self._all.items()})

    @classmethod
    def of(cls, cache, model, key: str, rows: int) -> Workspace:
        """The cache's workspace for ``key`` with room for ``rows`` (made or grown on demand)."""
        ws = cache.workspaces.get(key) if cache is not None else None
        if ws is None or ws.rows < rows:
            ws = cls(model, rows)
            if cache is not None:
                cache.workspaces[key] = ws
        return ws


def _kv_views(model, qkv):
    hd, hl, kvl = model.config.head_dim, model.n_heads, model.n_kv
    t = qkv.shape[0]
    k = qkv[:, hl * hd:(hl + kvl) * hd].reshape(t, kvl, hd)
    v = qkv[:, (hl + kvl) * hd:(hl + 2 * kvl) * hd].reshape(t, kvl, hd)
    return k, v


class CausalAttention:
    """Packed sequences, no cache: rope, then block-diagonal causal attention.

    Parameters
    ----------
    model : Llama
        The model.
    positions, cu : array
        ``(T,)`` int32 positions and ``(B + 1,)`` int32 offsets, on the model's device.
    max_len : int
        The longest sequence.
    """

    def __init__(self, model, positions: Any, cu: Any, max_len: int):
        self.model, self.pos, self.cu, self.max_len = model, positions, cu, int(max_len)
        self.rope, self.attend = kernel("rope_kv"), kernel("flash_attention_varlen")

    def __call__(self, layer: int, qkv: Any, q: Any, out: Any) -> None:
        m = self.model
        self.rope(qkv, self.pos, m.inv_freq, m.n_heads, m.n_kv, q_out=q)
        k, v = _kv_views(m, qkv)
        self.attend(q, k, v, self.cu, self.cu, max_seqlen_q=self.max_len, max_seqlen_k=self.max_len, causal=True,
                    out=out)


class PrefillAttention:
    """A packed prefill step over a paged cache (``inference.prefill.PrefillBatch`` holds the
    step's device arrays: positions, slots, offsets, and for chunks with cached context the
    context lengths and slot tables)."""

    def __init__(self, model, cache, batch):
        self.model, self.cache, self.b = model, cache, batch
        self.rope = kernel("rope_kv")
        self.attend = kernel("paged_prefill_attention") if batch.context is not None else \
            kernel("flash_attention_varlen")

    def __call__(self, layer: int, qkv: Any, q: Any, out: Any) -> None:
        m, c, b = self.model, self.cache, self.b
        kp, vp = c.layer_pages(layer)
        self.rope(qkv, b.pos, m.inv_freq, m.n_heads, m.n_kv, q_out=q, k_pages=kp, v_pages=vp, slots=b.slots)
        k, v = _kv_views(m, qkv)
        if b.host_rows is not None:               # pages moved to the host tier before the prefill wrote them
            c.write_host_rows(layer, b.host_rows, k, v)
        if b.context is None:
            self.attend(q, k, v, b.cu, b.cu, max_seqlen_q=b.max_len, max_seqlen_k=b.max_len, causal=True, out=out)
        else:
            self.attend(q, kp, vp, b.tables, b.cu, b.context, max_seqlen_q=b.max_len, out=out)


class DecodeAttention:
    """One token per sequence (``inference.decode.DecodeBatch`` holds the positions, slots,
    keys, starts and slot tables on the device; ``step`` the per-layer tables of the host
    tier's staged path, or None)."""

    def __init__(self, model, cache, batch, step=None):
        self.model, self.cache, self.b, self.step = model, cache, batch, step
        self.rope, self.attend = kernel("rope_kv"), kernel("paged_decode_attention", own=True)
        self.starts = batch.starts if cache.window is not None else None

    def __call__(self, layer: int, qkv: Any, q: Any, out: Any) -> None:
        m, c, b = self.model, self.cache, self.b
        kp, vp = c.layer_pages(layer)
        self.rope(qkv, b.pos, m.inv_freq, m.n_heads, m.n_kv, q_out=q, k_pages=kp, v_pages=vp, slots=b.slots)
        if self.step is None:
            self.attend(q, kp, vp, b.tables, b.lens, seq_starts=self.starts, out=out)
            return
        ka, va, tables = self.step.layer(layer)
        self.attend(q, ka, va, tables, b.lens, seq_starts=self.starts, out=out)
        self.step.prefetch(layer + 1)


def host_int32(*parts: np.ndarray) -> tuple[np.ndarray, list[slice]]:
    """Int32 host arrays packed into one (a step's one upload) and the slice of each."""
    flat = [np.ascontiguousarray(p, np.int32).reshape(-1) for p in parts]
    cuts = np.cumsum([0] + [f.size for f in flat])
    return np.concatenate(flat) if flat else np.zeros(0, np.int32), \
        [slice(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
