"""Ring attention (seed 000 §3.2.2): the sequence is split over a mesh axis; K/V blocks travel
around the ring while each rank folds them into its queries' online softmax.

    o = ccl.ring_attention(q, k, v, axis="tp", mesh=mesh, causal=True)   # q, k, v: this rank's tokens

``layout="striped"`` (the default) gives rank r the tokens r, r+n, r+2n, ...: under a causal
mask every rank then has the same work each step (striped attention's load balance);
``"contiguous"`` gives rank r one block (``split_sizes``).  Each step posts the next block's
exchange before attending to the current one, so the transfer overlaps the block's
compute.  A block is attended with the flash-attention kernel (its causal mask is aligned
bottom-right, so cutting the block's keys gives the striped mask: keys of lower ranks with
j <= i, of higher ranks with j < i) and merged by logsumexp.  The backward walks the ring
again with FlashAttention-2's backward kernel on the final (o, lse): dq stays, and each
block's dk/dv travel with it until they are back at their owner.  Memory per rank: the
local q/k/v, two K/V blocks, and (backward) two dk/dv blocks: O(S/n).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ... import runtime as rt
from ...backend import get_backend
from ..comm.hooks import SEAM, differentiable, vjp_rule
from ..comm.mesh import Mesh
from ..tensor.shard import split_offsets, split_sizes
from ._common import check_array, resolve, where

__all__ = ["ring_attention", "sequence_positions", "shard_sequence"]

LAYOUTS = ("striped", "contiguous")


def _lengths(seq_len: int, n: int, layout: str) -> list[int]:
    if layout == "striped":
        return [len(range(r, seq_len, n)) for r in range(n)]
    return list(split_sizes(seq_len, n))


def sequence_positions(seq_len: int, n: int, index: int, layout: str = "striped") -> np.ndarray:
    """The global token positions rank ``index`` of ``n`` holds.

    Parameters
    ----------
    seq_len : int
        The full sequence length.
    n : int
        Ranks on the axis.
    index : int
        The rank's position on the axis.
    layout : {"striped", "contiguous"}
        Striped: tokens ``index, index + n, ...``; contiguous: one block (``split_sizes``).

    Returns
    -------
    numpy.ndarray
        The positions, ascending.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    if layout == "striped":
        return np.arange(index, seq_len, n)
    return np.arange(split_offsets(seq_len, n)[index], split_offsets(seq_len, n)[index]
                     + split_sizes(seq_len, n)[index])


def shard_sequence(x: Any, axis: str | None, *, mesh: Mesh | None = None, layout: str = "striped",
                   dim: int = 2) -> Any:
    """This rank's tokens of the full ``x`` (same on every rank) along ``dim``, for ring_attention.

    Parameters
    ----------
    x : array
        The full tensor, e.g. ``(B, H, S, D)``.
    axis : str
        The mesh axis the sequence is split over.
    mesh : Mesh, optional
        Default: the current mesh.
    layout : {"striped", "contiguous"}
        Which tokens each rank holds (``sequence_positions``).
    dim : int
        The sequence dim.

    Returns
    -------
    array
        This rank's tokens.
    """
    mesh, name, g = resolve("shard_sequence", mesh, axis)
    pos = sequence_positions(x.shape[dim], g.size, g.index, layout)
    xp = get_backend().xp
    return xp.ascontiguousarray(xp.take(x, xp.asarray(pos), axis=dim))


def _visible(me: int, s: int, lens: list[int], layout: str, causal: bool) -> tuple[int, bool]:
    """(how many of block s's keys rank me's queries may see, apply the kernel's causal mask)."""
    if not causal:
        return lens[s], False
    if layout == "contiguous":
        return (lens[s], False) if s < me else (lens[s], True) if s == me else (0, False)
    return (min(lens[s], lens[me]) if s <= me else max(min(lens[s], lens[me] - 1), 0)), True


class _Ring:
    """The checked call: group, sizes, the K/V message buffers and the exchange."""

    def __init__(self, op: str, q, k, v, axis, mesh, causal: bool, layout: str, seq_len):
        self.mesh, self.axis, g = resolve(op, mesh, axis)
        q, k, v = (check_array(op, g, t) for t in (q, k, v))
        from ...kernels.attention import check_attention
        b, h, hkv, sq, sk, d = check_attention(f"ccl.{op}", q, k, v)
        if layout not in LAYOUTS:
            raise ValueError(f"{where(op, g, q)}: layout={layout!r}; use one of {LAYOUTS}")
        n = g.size
        seq_len = n * sq if seq_len is None else int(seq_len)
        self.lens = _lengths(seq_len, n, layout)
        if sq != self.lens[g.index] or sk != sq:
            raise ValueError(f"{where(op, g, q)}: q holds {sq} tokens and k/v {sk}, but a {layout} split of "
                             f"seq_len={seq_len} over the {n} ranks of {self.axis!r} gives this rank "
                             f"{self.lens[g.index]}; pass seq_len= (uneven splits) or this rank's tokens")
        check = SEAM.check
        if check is not None:
            check(f"ccl.{op}", g, q.dtype, (b, h, hkv, d, seq_len), (causal, layout))
        self.g, self.q, self.k, self.v, self.causal, self.layout = g, q, k, v, causal, layout
        self.block = (b, hkv, d)
        self.xp = get_backend().xp
        self.gpu = get_backend().is_gpu

    def view(self, buf, s: int, parts: int):
        """Block s (its length) in the flat message buffer ``buf`` of ``parts`` K/V-shaped pieces."""
        b, hkv, d = self.block
        return buf[:parts * b * hkv * self.lens[s] * d].reshape(parts, b, hkv, self.lens[s], d)

    def buffers(self, parts: int, dtype):
        b, hkv, d = self.block
        size = parts * b * hkv * max(self.lens) * d
        return [self.xp.empty((size,), dtype) for _ in range(2)]

    def exchange(self, send, recv) -> list:
        """Post: send ``send`` to the next rank, receive ``recv`` from the previous one, on the
        ``tp_collective`` stream after the compute work issued so far (which last read ``recv``)."""
        g = self.g
        if g.size == 1:
            return []
        tp, compute = rt.stream("tp_collective"), rt.stream("compute")
        if self.gpu and tp is not compute:
            tp.wait_event(compute.record())
        reqs = [g.comm.recv(recv, (g.index - 1) % g.size, 0, blocking=False, stream=tp),
                g.comm.send(send, (g.index + 1) % g.size, 0, blocking=False, stream=tp)]
        flush = getattr(g.comm, "flush", None)
        if flush is not None:
            flush()                  # NCCL holds grouped p2p until a wait: launch it now, before compute
        return reqs

    def wait(self, reqs) -> None:
        """The posted exchange is done (CPU) or launched (GPU); compute's next work runs after it."""
        for r in reqs:
            if r is not None:
                r.wait_done()
        if reqs and self.gpu:
            rt.stream("compute").wait_event(rt.stream("tp_collective").record())


def _forward(q, k, v, axis, mesh, causal, scale, layout, seq_len):
    ring = _Ring("ring_attention", q, k, v, axis, mesh, causal, layout, seq_len)
    xp, n, me = ring.xp, ring.g.size, ring.g.index
    kern = get_backend().kernel("flash_attention", like=ring.q)
    b, h, sq, d = ring.q.shape
    acc_dt = np.promote_types(ring.q.dtype, np.float32)       # f64 stays f64; bf16/f16 accumulate in f32
    o_acc = xp.zeros((b, h, sq, d), acc_dt)
    lse_acc = xp.full((b, h, sq), -np.inf, np.float32)        # the kernel's lse is f32
    bufs = ring.buffers(2, ring.k.dtype)
    cur = ring.view(bufs[0], me, 2)
    cur[0], cur[1] = ring.k, ring.v
    for t in range(n):
        s, nxt = (me - t) % n, (me - t - 1) % n
        blk = ring.view(bufs[t % 2], s, 2)
        reqs = ring.exchange(blk.reshape(-1), ring.view(bufs[(t + 1) % 2], nxt, 2).reshape(-1)) \
            if t < n - 1 else []
        seen, masked = _visible(me, s, ring.lens, layout, causal)
        if seen:
            o_b, lse_b = kern(ring.q, xp.ascontiguousarray(blk[0][:, :, :seen]),
                              xp.ascontiguousarray(blk[1][:, :, :seen]), causal=masked, scale=scale,
                              return_lse=True)
            new = xp.logaddexp(lse_acc, lse_b)
            fin = xp.isfinite(new)
            safe = xp.where(fin, new, 0)
            w_acc = xp.where(fin, xp.exp(lse_acc - safe), 0)[..., None]
            w_b = xp.where(fin, xp.exp(lse_b - safe), 0)[..., None]
            o_acc = o_acc * w_acc + o_b.astype(acc_dt) * w_b
            lse_acc = new
        ring.wait(reqs)
    return o_acc.astype(ring.q.dtype), lse_acc


@differentiable("ring_attention", ("q", "k", "v"))
def ring_attention(q: Any, k: Any, v: Any, axis: str | None = None, *, mesh: Mesh | None = None,
                   causal: bool = False, scale: float | None = None, layout: str = "striped",
                   seq_len: int | None = None, return_lse: bool = False) -> Any:
    """Attention of this rank's queries over the whole sequence split along ``axis``.  Equals
    ``op.flash_attention`` on the gathered sequence, at this rank's positions
    (``sequence_positions``).

    Parameters
    ----------
    q : array
        This rank's queries ``(B, H, S_local, D)``.
    k, v : array
        This rank's keys and values ``(B, Hkv, S_local, D)``.
    axis : str
        The mesh axis the sequence is split over.
    mesh : Mesh, optional
        Default: the current mesh.
    causal : bool
        Mask later positions (by global position).
    scale : float, optional
        The logit scale; default ``1 / sqrt(D)``.
    layout : {"striped", "contiguous"}
        Which tokens each rank holds.
    seq_len : int, optional
        The full length when the split is uneven (default: every rank holds the same number).
    return_lse : bool
        Also return the log-sum-exp per query.

    Returns
    -------
    array, or (array, array)
        The output ``(B, H, S_local, D)``; with ``return_lse`` also ``(B, H, S_local)`` lse.
    """
    o, lse = _forward(q, k, v, axis, mesh, bool(causal), scale, layout, seq_len)
    return (o, lse) if return_lse else o


def _ring_forward(fn, vals, kw):
    q, k, v = vals[:3]
    o, lse = _forward(q, k, v, vals[3] if len(vals) > 3 else kw.get("axis"), kw.get("mesh"),
                      bool(kw.get("causal", False)), kw.get("scale"), kw.get("layout", "striped"), kw.get("seq_len"))
    return ((o, lse) if kw.get("return_lse") else o), lse


@vjp_rule("ring_attention", forward=_ring_forward, effect=True)
def _ring_attention_vjp(g, out, args, kw, needs):
    """dq stays; each block's dk/dv ride along the ring with it and arrive home after n hops."""
    q, k, v = args[:3]
    axis = args[3] if len(args) > 3 else kw.get("axis")
    causal, layout = bool(kw.get("causal", False)), kw.get("layout", "striped")
    lse = kw["_saved"]
    ring = _Ring("ring_attention", q, k, v, axis, kw.get("mesh"), causal, layout, kw.get("seq_len"))
    xp, n, me = ring.xp, ring.g.size, ring.g.index
    do = xp.zeros_like(out) if g is None else xp.ascontiguousarray(g, dtype=out.dtype)
    bwd = get_backend().kernel("flash_attention_backward", like=ring.q)
    acc_dt = np.promote_types(ring.q.dtype, np.float32)
    dq = xp.zeros(ring.q.shape, acc_dt)
    kv, dkv = ring.buffers(2, ring.k.dtype), ring.buffers(2, acc_dt)
    first = ring.view(kv[0], me, 2)
    first[0], first[1] = ring.k, ring.v
    ring.view(dkv[0], me, 2)[...] = 0
    for t in range(n):
        s, nxt = (me - t) % n, (me - t - 1) % n
        blk, acc = ring.view(kv[t % 2], s, 2), ring.view(dkv[t % 2], s, 2)
        reqs = ring.exchange(blk.reshape(-1), ring.view(kv[(t + 1) % 2], nxt, 2).reshape(-1)) \
            if t < n - 1 else []
        seen, masked = _visible(me, s, ring.lens, layout, causal)
        if seen:
            dq_b, dk_b, dv_b = bwd(ring.q, xp.ascontiguousarray(blk[0][:, :, :seen]),
                                   xp.ascontiguousarray(blk[1][:, :, :seen]), out, do, lse, causal=masked,
                                   scale=kw.get("scale"))
            dq += dq_b
            acc[0][:, :, :seen] += dk_b
            acc[1][:, :, :seen] += dv_b
        ring.wait(reqs)
        # this block's dk/dv go on with it; the previous rank's (the next block's) arrive
        ring.wait(ring.exchange(acc.reshape(-1), ring.view(dkv[(t + 1) % 2], nxt, 2).reshape(-1)))
    home = ring.view(dkv[n % 2 if n > 1 else 0], me, 2)
    grads = (dq.astype(ring.q.dtype), home[0].astype(ring.k.dtype), home[1].astype(ring.v.dtype))
    return tuple(gr if nd else None for gr, nd in zip(grads, needs[:3])) + (None,) * (len(args) - 3)
