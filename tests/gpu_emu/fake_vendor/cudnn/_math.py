"""What the fake cuDNN computes: SDPA forward and backward in float64 from device memory."""
from __future__ import annotations

import numpy as np

import _fake_device as _device
from . import _np_type, data_type, diagonal_alignment


def _dt(graph, t) -> np.dtype:
    return _np_type(t.data_type if t.data_type is not data_type.NOT_SET else graph.io)


def _mask_of(args) -> tuple:
    """(alignment, right bound or None) from the preferred or the deprecated arguments."""
    if args.get("use_causal_mask"):
        return diagonal_alignment.TOP_LEFT, 0
    if args.get("use_causal_mask_bottom_right"):
        return diagonal_alignment.BOTTOM_RIGHT, 0
    return args.get("diagonal_alignment", diagonal_alignment.TOP_LEFT), args.get("diagonal_band_right_bound")


class _Reader:
    """Reads a graph tensor's batch ``b`` rows as float64 ``(heads, L, D)`` (ragged or dense)."""

    def __init__(self, graph, ptrs, stream):
        self.graph, self.ptrs, self.stream = graph, ptrs, stream
        self._offsets: dict = {}
        self.seen: dict = {}            # name -> the small tensors' values (offsets, lengths, tables)

    def ptr(self, t) -> int:
        return self.ptrs[t.uid]

    def offsets(self, t) -> np.ndarray:
        off = t.ragged
        if off.uid not in self._offsets:
            n = off.dim[0]
            self._offsets[off.uid] = _device.read(self.ptr(off), (n,), (off.stride[0],), _np_type(off.data_type),
                                                  self.stream, f"{off.name} (ragged offsets)")
            self.seen[off.name] = self._offsets[off.uid]
        return self._offsets[off.uid]

    def small(self, t, what: str) -> np.ndarray:
        v = _device.read(self.ptr(t), t.dim, t.stride, _np_type(t.data_type), self.stream, what)
        if v.dtype.kind in "iu":
            self.seen[t.name] = v
        return v

    def _base(self, t, b: int) -> int:
        dt = _dt(self.graph, t)
        elem = int(self.offsets(t)[b]) if t.ragged is not None else b * t.stride[0]
        return self.ptr(t) + elem * dt.itemsize

    def rows(self, t, b: int, length: int) -> np.ndarray:
        dims = (t.dim[1], length, t.dim[3])
        return _device.read(self._base(t, b), dims, t.stride[1:], _dt(self.graph, t), self.stream,
                            f"{t.name}[{b}]").astype(np.float64)

    def store(self, t, b: int, values: np.ndarray) -> None:
        dims = (t.dim[1], values.shape[1], t.dim[3])
        _device.write(self._base(t, b), dims, t.stride[1:], _dt(self.graph, t), values, self.stream, f"{t.name}[{b}]")


def _lengths(r: _Reader, args, name: str, b: int, full: int) -> np.ndarray:
    if not args.get("use_padding_mask"):
        return np.full(b, full, np.int64)
    t = args.get(name)
    if t is None:
        raise ValueError(f"use_padding_mask without {name}")
    return r.small(t, name).reshape(-1).astype(np.int64)


def _keys(r: _Reader, args, which: str, b: int, lk: int) -> np.ndarray:
    t = args[which]
    table = args.get(f"paged_attention_{which}_table")
    if table is None:
        return r.rows(t, b, lk)
    pages = r.small(t, f"{which} container").astype(np.float64)          # (blocks, Hkv, bs, D)
    tab = r.small(table, f"{which} page table")                           # (B, 1, MB, 1)
    bs = t.dim[2]
    idx = tab[b, 0, :, 0]
    out = np.empty((t.dim[1], lk, t.dim[3]))
    for j in range(lk):
        page = int(idx[j // bs])
        if not 0 <= page < t.dim[0]:
            raise IndexError(f"page table entry {page} of batch {b} (position {j}) is not a page of the container")
        out[:, j] = pages[page, :, j % bs]
    return out


def _probs(q, k, scale, align, right, lq, lk):
    """P (H, Lq, Lk) and the natural-log logsumexp (H, Lq) of the masked, scaled scores."""
    h, hkv = q.shape[0], k.shape[0]
    kk = np.repeat(k, h // hkv, axis=0)
    s = np.einsum("hid,hjd->hij", q, kk) * scale
    if right is not None:
        i = np.arange(lq)[:, None] + (lk - lq if align == diagonal_alignment.BOTTOM_RIGHT else 0)
        s = np.where(np.arange(lk)[None, :] <= i + right, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if lk else np.full(s.shape[:-1] + (1,), -np.inf)
    ms = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - ms)
    tot = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (ms + np.log(tot))[..., 0]
    return e / np.where(tot > 0, tot, 1), lse


def run_forward(graph, args, ptrs, stream) -> dict:
    r = _Reader(graph, ptrs, stream)
    q, k, o, stats = args["q"], args["k"], args["o"], args["stats"]
    b, h, sq, d = q.dim
    scale = 1.0 if args.get("attn_scale") is None else float(args["attn_scale"])
    align, right = _mask_of(args)
    paged = args.get("paged_attention_k_table") is not None
    sk = int(args["paged_attention_max_seq_len_kv"]) if paged else k.dim[2]
    lens_q = _lengths(r, args, "seq_len_q", b, sq)
    lens_k = _lengths(r, args, "seq_len_kv", b, sk)
    want_stats = args.get("generate_stats", not args.get("is_inference", True))
    for i in range(b):
        lq, lk = int(lens_q[i]), int(lens_k[i])
        if lq > sq or lk > sk:
            raise ValueError(f"batch {i}: lengths {lq}/{lk} exceed the graph's {sq}/{sk}")
        qi = r.rows(q, i, lq)
        p, lse = _probs(qi, _keys(r, args, "k", i, lk), scale, align, right, lq, lk)
        vi = _keys(r, args, "v", i, lk)
        out = np.einsum("hij,hjd->hid", p, np.repeat(vi, h // vi.shape[0], axis=0))
        r.store(o, i, out)
        if want_stats:
            _device.write(r.ptr(stats) + i * stats.stride[0] * 4, (h, lq, 1), stats.stride[1:], np.float32,
                          lse[..., None], stream, "stats")
    return r.seen


def run_backward(graph, args, ptrs, stream) -> dict:
    r = _Reader(graph, ptrs, stream)
    q, k = args["q"], args["k"]
    b, h, sq, d = q.dim
    hkv, sk = k.dim[1], k.dim[2]
    g = h // hkv
    scale = 1.0 if args.get("attn_scale") is None else float(args["attn_scale"])
    align, right = _mask_of(args)
    st = args["stats"]
    for i in range(b):
        qi, ki, vi = r.rows(q, i, sq), r.rows(k, i, sk), r.rows(args["v"], i, sk)
        oi, doi = r.rows(args["o"], i, sq), r.rows(args["dO"], i, sq)
        lse = _device.read(r.ptr(st) + i * st.stride[0] * 4, (h, sq), (st.stride[1], st.stride[2]), np.float32,
                           stream, "stats").astype(np.float64)
        kk, vv = np.repeat(ki, g, axis=0), np.repeat(vi, g, axis=0)
        s = np.einsum("hid,hjd->hij", qi, kk) * scale
        if right is not None:
            row = np.arange(sq)[:, None] + (sk - sq if align == diagonal_alignment.BOTTOM_RIGHT else 0)
            s = np.where(np.arange(sk)[None, :] <= row + right, s, -np.inf)
        p = np.exp(s - lse[..., None])                     # FlashAttention-2: P from the saved stats
        dv = np.einsum("hij,hid->hjd", p, doi)
        dp = np.einsum("hid,hjd->hij", doi, vv)
        ds = p * (dp - (doi * oi).sum(-1, keepdims=True))
        dq = np.einsum("hij,hjd->hid", ds, kk) * scale
        dk = np.einsum("hij,hid->hjd", ds, qi) * scale
        r.store(args["dQ"], i, dq)
        r.store(args["dK"], i, dk.reshape(hkv, g, sk, d).sum(1))
        r.store(args["dV"], i, dv.reshape(hkv, g, sk, d).sum(1))
    return r.seen
