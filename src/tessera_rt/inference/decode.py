"""One decode step with persistent buffers (seed 004 "Persistent Buffers"): after a batch size's
first step, a step allocates no device memory.

Every activation of a decode step at batch ``B`` lives in a ``DecodeBuffers`` made once per
``(cache, B)``: the residual stream, the normed rows, the fused q/k/v and gate/up products, the
roped q and k, the attention output, the row-parallel partial sums (reduced in place over tp,
``all_reduce(out=x)``), the logits slice, and the block tables, lengths and rope rows of the
step (copied in from the host with ``ndarray.set``, never uploaded as fresh arrays).  Kernels
take ``out=``; elementwise work uses the array module's ufuncs with ``out=``; K/V rows go into
their pages through basic-slice assignment (one small copy per sequence and layer, no index
arrays).  Continuous batching changes ``B`` between steps: each batch size seen gets its own
buffers, once.

Not covered: prefill (one prompt at a time, sized by the prompt) allocates as before; the CPU
reference kernels called with ``out=`` still make NumPy temporaries inside (their results are
copied into ``out``), so the zero-allocation property is a device-memory one (the CUDA path).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import op
from ..backend import get_backend

__all__ = ["DecodeBuffers", "decode_hidden", "upload"]


def upload(xp, dst, host: np.ndarray) -> None:
    """``dst[...] = host`` with no device allocation (CuPy: one host->device copy into ``dst``)."""
    if xp is np:
        np.copyto(dst, host)
    else:
        dst.set(np.ascontiguousarray(host, dtype=dst.dtype))


class DecodeBuffers:
    """The persistent arrays of a decode step at batch ``b`` for ``model`` and ``cache``."""

    def __init__(self, model, cache, b: int):
        xp, cfg, dt = model.xp, model.config, model.dtype
        hd, hl, kvl = cfg.head_dim, model.n_heads, model.n_kv
        f = model.params["layers"][0]["gate_up"].shape[1] // 2
        e = (lambda *s, d=dt: xp.empty(s, d))
        self.b = b
        self.x, self.h, self.part = e(b, cfg.hidden_size), e(b, cfg.hidden_size), e(b, cfg.hidden_size)
        self.qkv, self.gu, self.act = e(b, (hl + 2 * kvl) * hd), e(b, 2 * f), e(b, f)
        self.q, self.rq = e(b, hl, hd), e(b, hl, hd)
        self.k, self.rk = e(b, kvl, hd), e(b, kvl, hd)
        self.attn = e(b, hl, hd)
        self.cos, self.sin = e(b, 1, hd), e(b, 1, hd)
        self.logits = e(b, model.params["head"].shape[1])
        # tables as wide as the whole pool, so their shape never changes as sequences grow
        self.xp, self.layers = xp, cache.layers
        self.fit_tables(cache.num_blocks)
        self.lens, self.starts = e(b, d=np.int32), e(b, d=np.int32)
        # rope angles in f32, as transformers computes them (Llama.rope), then cast into cos/sin
        self.pos, self.angle, self.trig = e(b, 1, d=np.float32), e(b, hd, d=np.float32), e(b, hd, d=np.float32)


    def fit_tables(self, width: int) -> None:
        """Room for tables ``width`` pages wide.  Without a window the pool's width is made once;
        a windowed sequence may outgrow it (its dropped pages keep their table entries), and
        then the room doubles: one allocation per doubling."""
        cap = getattr(self, "_cap", 0)
        if cap >= width:
            return
        self._cap = width if not cap else max(width, 2 * cap)
        self._flat = self.xp.empty(self.layers * self.b * self._cap, np.int32)

    def tables(self, width: int):
        """``(layers, b, width)`` block tables: a contiguous view of the persistent array, as wide
        as this step's longest sequence (a reference kernel's work grows with the width)."""
        self.fit_tables(width)
        return self._flat[:self.layers * self.b * width].reshape(self.layers, self.b, width)


def _rotate(xp, x, cos, sin, rot, out) -> None:
    """``out = x * cos + rotate_half(x) * sin`` written into ``rot`` and ``out``."""
    h = x.shape[-1] // 2
    xp.negative(x[..., h:], out=rot[..., :h])
    rot[..., h:] = x[..., :h]
    xp.multiply(rot, sin, out=rot)
    xp.multiply(x, cos, out=out)
    xp.add(out, rot, out=out)


def _silu_mul(xp, g, u, out) -> None:
    """``out = silu(g) * u`` in place: ``g / (1 + exp(-g)) * u``."""
    xp.negative(g, out=out)
    xp.exp(out, out=out)
    xp.add(out, 1, out=out)
    xp.divide(g, out, out=out)
    xp.multiply(out, u, out=out)


def decode_hidden(model, cache, sids: Sequence[int], ids: np.ndarray, positions: np.ndarray) -> Any:
    """Final-normed hidden rows ``(B, hidden)`` (a persistent buffer: read it before the next step)
    for one new token per sequence; K/V go into the cache's pages."""
    xp, cfg, b = model.xp, model.config, len(sids)
    buf = cache.decode_buffers(b)
    step = cache.step(sids, buf)
    kernel = get_backend().kernel("paged_decode_attention")
    hd, hl, kvl = cfg.head_dim, model.n_heads, model.n_kv
    pos = np.asarray(positions).reshape(b)
    v = model.shard.vocab
    for i in range(b):                         # vocab-parallel embedding rows
        t, p = int(ids[i]) - v.start, int(pos[i])
        if 0 <= t < v.stop - v.start:
            buf.x[i] = model.params["embed"][t]
        else:
            buf.x[i] = 0
    model.sum_tp(buf.x)
    upload(xp, buf.pos, pos.astype(np.float32).reshape(b, 1))
    half = hd // 2
    xp.multiply(buf.pos, model.inv_freq, out=buf.angle[:, :half])
    buf.angle[:, half:] = buf.angle[:, :half]
    for fn, dst in ((xp.cos, buf.cos), (xp.sin, buf.sin)):
        fn(buf.angle, out=buf.trig)
        dst[:, 0] = buf.trig                   # cast to the model's dtype
    x, h = buf.x, buf.h
    for layer, p in enumerate(model.params["layers"]):
        op.rmsnorm(x, p["ln1"], eps=cfg.rms_norm_eps, out=h)
        op.matmul(h, p["qkv"], out=buf.qkv)
        q = buf.qkv[:, :hl * hd].reshape(b, hl, hd)
        k = buf.qkv[:, hl * hd:(hl + kvl) * hd].reshape(b, kvl, hd)
        vv = buf.qkv[:, (hl + kvl) * hd:].reshape(b, kvl, hd)
        _rotate(xp, q, buf.cos, buf.sin, buf.rq, buf.q)
        _rotate(xp, k, buf.cos, buf.sin, buf.rk, buf.k)
        cache.write_decode(layer, sids, pos, buf.k, vv)
        kp, vp, tables = step.layer(layer)
        kernel(buf.q, kp, vp, tables, step.lens, seq_starts=step.starts, out=buf.attn)
        step.prefetch(layer + 1)
        op.matmul(buf.attn.reshape(b, hl * hd), p["o"], out=buf.part)
        xp.add(x, model.sum_tp(buf.part), out=x)
        op.rmsnorm(x, p["ln2"], eps=cfg.rms_norm_eps, out=h)
        op.matmul(h, p["gate_up"], out=buf.gu)
        f = buf.act.shape[1]
        _silu_mul(xp, buf.gu[:, :f], buf.gu[:, f:], buf.act)
        op.matmul(buf.act, p["down"], out=buf.part)
        xp.add(x, model.sum_tp(buf.part), out=x)
    op.rmsnorm(x, model.params["norm"], eps=cfg.rms_norm_eps, out=h)
    return h
