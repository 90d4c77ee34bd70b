"""The fused ops of a decoder step (``inference.Llama``): the references and CPU kernel-table
entries; the GPU kernels are ``decoder_cuda``.

* ``add_rmsnorm(x, delta, weight)``: the residual add folded into the next norm: ``x += delta``
  (in place, x's dtype), then ``out = rmsnorm(x) * weight`` (statistics in f32);
* ``rope_kv(qkv, positions, inv_freq, n_q, n_kv, ...)``: rotary embedding of the q and k heads
  of a fused q/k/v projection ``(T, (n_q + 2 n_kv) * D)`` (rotate-half convention, angles
  ``position * inv_freq`` in f32, cos/sin rounded to the dtype as transformers does): roped q
  into ``q_out (T, n_q, D)``, roped k back in place, and, given pages and a slot mapping,
  k and v of token t into page row ``slots[t]`` (``page * block_size + row``; -1: skipped);
* ``silu_mul(gu)``: ``silu(gu[:, :F]) * gu[:, F:]`` of a fused gate/up product;
* ``decode_prepare(pos, tables, ...)``: a decode step's per-sequence key counts, first
  visible positions (a window) and cache slots, from the positions and block tables on the
  device (a row whose page is -1 is padding: 0 keys, slot -1);
* ``sample_argmax(logits, ...)``: per row the best (value, global id) of this rank's vocab
  slice, greedy or Gumbel-max (``z = logits / T + g``, g from ``gumbel_hash``: the same noise
  for a (seed, sequence, step, id) on any mesh and either backend);
* ``sample_pick(cand, tok, ...)``: the winner over the tp ranks' candidates (the lowest id
  among equals, as ``torch.argmax``) into ``tok``, and a decode step's bookkeeping: positions
  and step counters +1, the token appended to a history.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from ._common import check_float, widen
from .norms import NORM_DTYPES

__all__ = ["add_rmsnorm", "rope_kv", "silu_mul", "decode_prepare", "sample_argmax", "sample_pick", "gumbel_hash",
           "check_rope_kv"]

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def gumbel_hash(seed: int, seq: Any, step: Any, ids: Any) -> np.ndarray:
    """Gumbel(0, 1) noise, float64, for token ``ids`` of sequence ``seq`` at ``step`` (broadcast):
    a hash of the four, so every rank and backend draws the same noise for a global id."""
    u64 = lambda a: np.asarray(a).astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(u64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019))
        h = _mix(h ^ u64(seq))
        h = _mix(h ^ (u64(step) + np.uint64(0x2545F4914F6CDD1D)))
        h = _mix(h ^ u64(ids))
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return -np.log(-np.log(u))


# ------------------------------------------------------------------------ checks

def _check_rows(op: str, name: str, a: Any, width: int | None = None) -> None:
    check_float(op, name, a, NORM_DTYPES)
    if a.ndim != 2 or (width is not None and a.shape[1] != width) or a.strides[1] != a.itemsize:
        raise ValueError(f"{op}: {name} must be 2-D rows{'' if width is None else f' of {width}'} with unit column "
                         f"stride, got shape {tuple(a.shape)}")


def _check_i32(op: str, name: str, a: Any, shape: tuple) -> None:
    if a is None or tuple(a.shape) != shape or a.dtype != np.int32:
        raise ValueError(f"{op}: {name} must be int32 of shape {shape}, got "
                         f"{None if a is None else (tuple(a.shape), dtype_name(a.dtype))}")


def check_rope_kv(op, qkv, positions, inv_freq, n_q, n_kv, q_out, k_pages, v_pages, slots) -> tuple:
    """Validate; returns ``(T, D)``."""
    _check_rows(op, "qkv", qkv)
    t = qkv.shape[0]
    d = 2 * inv_freq.shape[0]
    if inv_freq.ndim != 1 or inv_freq.dtype != np.float32 or qkv.shape[1] < (n_q + 2 * n_kv) * d:
        raise ValueError(f"{op}: qkv {tuple(qkv.shape)} must hold {n_q} + 2 x {n_kv} heads of {d} (inv_freq "
                         f"{tuple(inv_freq.shape)} f32 is half a head)")
    _check_i32(op, "positions", positions, (t,))
    if q_out is not None and (tuple(q_out.shape) != (t, n_q, d) or q_out.dtype != qkv.dtype
                              or not q_out.flags.c_contiguous):
        raise ValueError(f"{op}: q_out must be contiguous {(t, n_q, d)} {dtype_name(qkv.dtype)}, got "
                         f"{tuple(q_out.shape)} {dtype_name(q_out.dtype)}")
    if k_pages is not None:
        _check_i32(op, "slots", slots, (t,))
        for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
            if p is None or p.ndim != 4 or p.shape[1] != n_kv or p.shape[3] != d or p.dtype != qkv.dtype \
                    or not p.flags.c_contiguous:
                raise ValueError(f"{op}: {name} must be contiguous (pages, {n_kv}, block_size, {d}) "
                                 f"{dtype_name(qkv.dtype)}, got {None if p is None else tuple(p.shape)}")
    return t, d


# ------------------------------------------------------------------------ references

def add_rmsnorm(x: Any, delta: Any, weight: Any, *, eps: float = 1e-6, out: Any, stream: Any = None) -> Any:
    """``x += delta`` (skipped for None), then ``out = rmsnorm(x) * weight``; returns ``out``.

    Parameters
    ----------
    x : array
        ``(T, N)`` residual rows, updated in place.
    delta : array or None
        ``(T, N)`` what the previous sublayer adds.
    weight : array
        ``(N,)``.
    eps : float
        Added to the mean square.
    out : array
        ``(T, N)`` receives the normed rows.
    stream : stream, optional
        Unused on the CPU.

    Returns
    -------
    array
        ``out``.
    """
    op = "add_rmsnorm"
    _check_rows(op, "x", x)
    for name, a in (("delta", delta), ("out", out)):
        if a is not None and (tuple(a.shape) != tuple(x.shape) or a.dtype != x.dtype):
            raise ValueError(f"{op}: {name} {tuple(a.shape)} {dtype_name(a.dtype)} must match x "
                             f"{tuple(x.shape)} {dtype_name(x.dtype)}")
    if out is None:
        raise ValueError(f"{op}: out= is required (the normed rows' buffer)")
    if delta is not None:
        np.add(x, delta, out=x)
    from .cpu_fused import rmsnorm
    rmsnorm(x, weight, eps=eps, out=out)
    return out


def rope_kv(qkv: Any, positions: Any, inv_freq: Any, n_q: int, n_kv: int, *, q_out: Any = None,
            k_pages: Any = None, v_pages: Any = None, slots: Any = None, stream: Any = None) -> Any:
    """Rotary embedding of a fused q/k/v projection, and its k and v into the cache pages.

    Parameters
    ----------
    qkv : array
        ``(T, (n_q + 2 n_kv) * D)``: k is roped in place.
    positions : array
        ``(T,)`` int32.
    inv_freq : array
        ``(D / 2,)`` float32.
    n_q, n_kv : int
        Query and kv heads.
    q_out : array, optional
        ``(T, n_q, D)`` receives roped q (else q is roped in place).
    k_pages, v_pages : array, optional
        ``(pages, n_kv, block_size, D)``.
    slots : array, optional
        ``(T,)`` int32 ``page * block_size + row``; -1 skips the token.
    stream : stream, optional
        Unused on the CPU.

    Returns
    -------
    array
        The roped q (``q_out``, or a view of qkv).
    """
    t, d = check_rope_kv("rope_kv", qkv, positions, inv_freq, n_q, n_kv, q_out, k_pages, v_pages, slots)
    dt, h = qkv.dtype, d // 2
    ang = np.asarray(positions).astype(np.float32)[:, None] * inv_freq          # (T, D/2), f32 as transformers
    cos, sin = np.cos(ang).astype(dt)[:, None], np.sin(ang).astype(dt)[:, None]
    q = qkv[:, :n_q * d].reshape(t, n_q, d)
    k = qkv[:, n_q * d:(n_q + n_kv) * d].reshape(t, n_kv, d)
    for src, dst in ((q, q if q_out is None else q_out), (k, k)):
        x1, x2 = src[..., :h].copy(), src[..., h:].copy()
        dst[..., :h] = x1 * cos - x2 * sin
        dst[..., h:] = x2 * cos + x1 * sin
    if k_pages is not None:
        sl = np.asarray(slots)
        keep = np.flatnonzero(sl >= 0)
        if keep.size:
            bs = k_pages.shape[2]
            page, row = sl[keep] // bs, sl[keep] % bs
            v = qkv[:, (n_q + n_kv) * d:(n_q + 2 * n_kv) * d].reshape(t, n_kv, d)
            k_pages[page, :, row] = k[keep]
            v_pages[page, :, row] = v[keep]
    return q if q_out is None else q_out


def silu_mul(gu: Any, *, out: Any, stream: Any = None) -> Any:
    """``out = silu(gu[:, :F]) * gu[:, F:]`` for ``gu (T, 2F)``, ``out (T, F)``."""
    from .mlp import silu
    _check_rows("silu_mul", "gu", gu)
    f = gu.shape[1] // 2
    if out is None or tuple(out.shape) != (gu.shape[0], f) or out.dtype != gu.dtype:
        raise ValueError(f"silu_mul: out must be {(gu.shape[0], f)} {dtype_name(gu.dtype)}")
    np.multiply(silu(gu[:, :f]), gu[:, f:], out=out)
    return out


def decode_prepare(pos: Any, tables: Any, block_size: int, window: int | None, *, lens: Any, starts: Any,
                   slots: Any, stream: Any = None) -> None:
    """Per decode row: keys ``pos + 1`` (0 for padding), first visible position (window), slot
    of the new token (-1 for padding)."""
    b = pos.shape[0]
    for name, a in (("pos", pos), ("lens", lens), ("starts", starts), ("slots", slots)):
        _check_i32("decode_prepare", name, a, (b,))
    if tables.ndim != 2 or tables.shape[0] != b or tables.dtype != np.int32:
        raise ValueError(f"decode_prepare: tables must be int32 ({b}, width), got {tuple(tables.shape)}")
    p = np.asarray(pos).astype(np.int64)
    col = p // block_size
    inside = col < tables.shape[1]
    page = np.where(inside, tables[np.arange(b), np.minimum(col, tables.shape[1] - 1)], -1)
    live = page >= 0
    lens[...] = np.where(live, p + 1, 0)
    starts[...] = np.where(live & (window is not None), np.maximum(0, p + 1 - (window or 0)), 0)
    slots[...] = np.where(live, page * block_size + p % block_size, -1)


def sample_argmax(logits: Any, *, v0: int, temperature: float = 0.0, seed: int = 0, keys: Any = None,
                  out: Any, stream: Any = None) -> Any:
    """Per row of this rank's ``logits (B, V_local)``: ``out[b] = (best z, its global id)`` with
    ``z = logits`` (greedy) or ``logits / T + gumbel_hash(seed, keys[b, 0], keys[b, 1], id)``."""
    check_float("sample_argmax", "logits", logits, NORM_DTYPES)
    b, n = logits.shape
    if out is None or tuple(out.shape) != (b, 2) or out.dtype != np.float64:
        raise ValueError(f"sample_argmax: out must be float64 ({b}, 2)")
    z = widen(logits, np.float32).astype(np.float64)
    if temperature > 0:
        _check_i32("sample_argmax", "keys", keys, (b, 2))
        k = np.asarray(keys)
        z = z / float(temperature) + gumbel_hash(seed, k[:, :1], k[:, 1:], v0 + np.arange(n)[None])
    best = z.argmax(axis=1) if n else np.zeros(b, np.int64)      # argmax: the first (lowest id) of equals
    out[:, 0] = z[np.arange(b), best] if n else -np.inf
    out[:, 1] = v0 + best
    return out


def sample_pick(cand: Any, *, tok: Any, pos: Any = None, keys: Any = None, hist: Any = None, hist_n: Any = None,
                stream: Any = None) -> Any:
    """``tok[b]`` = the id of the best of ``cand (R, B, 2)`` over R ranks (lowest id among equal
    values); then ``pos += 1``, ``keys[:, 1] += 1``, ``hist[:, hist_n] = tok``, ``hist_n += 1``
    for whichever are given."""
    c = np.asarray(cand).reshape(-1, tok.shape[0], 2)
    vals, ids = c[..., 0], c[..., 1]
    r = np.lexsort((ids, -vals), axis=0)[0]
    tok[...] = ids[r, np.arange(tok.shape[0])].astype(np.int32)
    if pos is not None:
        pos += 1
    if keys is not None:
        keys[:, 1] += 1
    if hist is not None:
        n = int(hist_n[0])
        hist[:, n] = tok
        hist_n[0] = n + 1
    return tok


for _name, _fn in (("add_rmsnorm", add_rmsnorm), ("rope_kv", rope_kv), ("silu_mul", silu_mul),
                   ("decode_prepare", decode_prepare), ("sample_argmax", sample_argmax), ("sample_pick", sample_pick)):
    register_kernel(_name, "cpu", _fn)
