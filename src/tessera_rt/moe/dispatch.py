"""The fused MoE dispatch: pack -> all_to_all -> local experts (one batched GEMM per weight)
-> all_to_all back -> unpack and weighted combine, and its VJP (seed 000 §3.1, 002 §2.7).

``moe_ffn(x, probs, w1, w3, w2, layer=...)`` is one differentiable op: the gate (``x @ gate``,
softmax, router hooks) is ordinary ``op.*`` code in ``layer.py``, and this op takes its
probabilities.  The routing decision (top-k, capacity) is made on the detached
probabilities; the gradient flows into the probabilities through the combine weights and
into ``x`` and the expert weights through the experts.  The backward pass issues two
all_to_alls, each the reverse of a forward one.

Collectives on ``ep`` per forward: the two payload exchanges, plus one exchange of
per-expert counts when the sizes are not known in advance (dropless routing, or plain-array
tokens whose per-rank count the layout does not give).  Packing and unpacking run on the
``a2a`` stream, ordered against ``compute`` with events.  Every staging buffer comes from
``DispatchBuffers``: two persistent sets used alternately (seed 004's double buffers), so a
step allocates nothing once the sizes are seen; under ``ts.grad`` the activations the
backward pass needs are fresh arrays (a later call must not overwrite them).
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from .. import runtime as rt
from ..autodiff.tape import differentiable, vjp_rule
from ..backend import get_backend
from ..dist import collectives as C
from ..dist.dtensor import DTensor, meta_of
from ..dist.shard import dim_extent
from .routing import capacity, route

__all__ = ["DispatchBuffers", "Clock", "moe_ffn"]


class DispatchBuffers:
    """Two sets of grow-only staging buffers, used alternately (one set per call), so the
    buffers of call i are still intact while call i+1 packs.  ``allocations`` counts the
    times a buffer had to be (re)allocated: it stops growing once the sizes are seen."""

    def __init__(self, headroom: float = 1.25):
        self._sets: list[dict] = [{}, {}]
        self._cur = 0
        self.headroom = headroom          # dropless sizes vary a little per step
        self.allocations = 0

    def flip(self) -> None:
        self._cur ^= 1

    def get(self, name: str, shape: tuple, dtype, zero: bool = False):
        xp = get_backend().xp
        n = math.prod(shape)
        key = (name, np.dtype(dtype))
        buf = self._sets[self._cur].get(key)
        if buf is None or buf.size < n:
            buf = xp.empty(max(int(n * self.headroom), 1), dtype)
            self._sets[self._cur][key] = buf
            self.allocations += 1
        view = buf[:n].reshape(shape)
        if zero:
            view.fill(0)
        return view

    def ids(self) -> list[set]:
        """The identities of each set's buffers (tests check that the two sets alternate)."""
        return [{id(b) for b in s.values()} for s in self._sets]


class Clock:
    """Phase times (seconds, host clock) added into ``layer.timings`` when it is a dict
    (scripts/bench_moe.py); free when it is None.  On a GPU the host clock sees issue time
    unless the caller synchronizes."""

    __slots__ = ("t", "last")

    def __init__(self, layer):
        self.t = layer.timings
        self.last = time.perf_counter() if self.t is not None else 0.0

    def lap(self, name: str) -> None:
        if self.t is not None:
            now = time.perf_counter()
            self.t[name] = self.t.get(name, 0.0) + now - self.last
            self.last = now


class _A2A:
    """Run a block on the ``a2a`` stream: it waits for compute first, and compute waits for it
    after (the packing works on values compute made, and compute reads what it unpacks)."""

    def __enter__(self):
        self.s, self.c = rt.stream("a2a"), rt.stream("compute")
        self.s.wait_event(self.c.record())
        self.s.__enter__()
        return self

    def __exit__(self, *exc):
        self.s.__exit__(*exc)
        self.c.wait_event(self.s.record())


def _local(v, lo: int, hi: int):
    """A DTensor's local piece, or an array's experts [lo, hi) (plain arrays are global)."""
    if type(v) is DTensor:
        return v._local
    return v[lo:hi] if lo is not None else v


def _source_tokens(x, layer) -> list[int] | None:
    """Tokens each ep position holds (same coordinates elsewhere), from x's layout; None when
    x is a plain array (each rank's count is then exchanged)."""
    n = layer.ep_size
    if type(x) is not DTensor:
        return [x.shape[0]] if n == 1 else None
    axes = x.layout.dims[0]
    mesh = x.mesh
    sizes = tuple(mesh.size(a) for a in axes)
    out = []
    for s in range(n):
        coords = dict(mesh.coords)
        coords[layer.axis] = s
        out.append(dim_extent(x.shape[0], sizes, tuple(coords[a] for a in axes))[1])
    return out


def _a2a(buf, layer, split, recv, out):
    if layer.ep_size == 1:
        out[...] = buf
        return out
    return C.all_to_all(buf, layer.axis, mesh=layer.mesh, split_sizes=split, recv_sizes=recv, out=out, role="a2a")


def _rows_index(xp, cnt):
    """For recv rows (ordered sender-major, then local expert), their row in the expert-major
    batch flattened to (experts * M, d), and M (the largest local expert's load)."""
    n, nle = cnt.shape
    per_e = cnt.sum(axis=0)
    m = int(per_e.max()) if per_e.size else 0
    off = np.cumsum(cnt, axis=0) - cnt                   # rows of earlier senders, per expert
    sizes = cnt.reshape(-1)
    block = np.repeat(np.arange(n * nle), sizes)
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    flat = (block % nle) * m + off.reshape(-1)[block] + within
    return xp.asarray(flat), m


def _to_wire(rows, layer, name: str):
    """rows (N, d) -> uint8 (N, d + 4): e4m3 bit patterns then the row's f32 scale (the
    sideband travels in the same message, so FP8 costs no extra collective)."""
    b = get_backend()
    q, s = b.kernel("quantize_fp8", like=rows)(rows, "fp8_e4m3", scale="per_channel", axis=0)
    n, d = rows.shape
    wire = layer.buffers.get(name, (n, d + 4), np.uint8)
    wire[:, :d] = q.view(np.uint8)
    wire[:, d:] = b.xp.ascontiguousarray(s.reshape(n, 1).astype(np.float32)).view(np.uint8).reshape(n, 4)
    return wire


def _from_wire(wire, d: int, dtype):
    b = get_backend()
    n = wire.shape[0]
    bits = b.xp.ascontiguousarray(wire[:, :d])
    s = b.xp.ascontiguousarray(wire[:, d:]).view(np.float32).reshape(n, 1)
    return b.kernel("dequantize_fp8_bits", like=bits)(bits, s, "fp8_e4m3", axis=0).astype(dtype, copy=False)


def _exchange(rows, layer, split, recv, name: str, fp8: bool):
    """Send ``rows`` (N, d) over ep (split/recv: rows per position); returns the received rows."""
    d = rows.shape[1]
    total = int(sum(recv))
    if not fp8:
        out = layer.buffers.get(name, (total, d), rows.dtype)
        return _a2a(rows, layer, split, recv, out)
    wire = _to_wire(rows, layer, name + "_wire")
    out = layer.buffers.get(name, (total, d + 4), np.uint8)
    got = _a2a(wire, layer, split, recv, out)
    return _from_wire(got, d, rows.dtype)


def _forward(x, probs, w1, w3, w2, layer, save: bool):
    xp = get_backend().xp
    bufs = layer.buffers
    bufs.flip()
    n, me = layer.ep_size, layer.ep_index
    lo, hi = layer.ranges[me] if type(w1) is not DTensor else (None, None)
    xl, pl = _local(x, None, None), _local(probs, None, None)
    w1l, w3l, w2l = _local(w1, lo, hi), _local(w3, lo, hi), _local(w2, lo, hi)
    t, d = xl.shape
    k, nle = layer.top_k, w1l.shape[0]
    src = _source_tokens(x, layer)
    clock = Clock(layer)
    cf = layer.capacity_factor
    cap = capacity(cf, t, k, layer.num_experts)
    with _A2A():
        r = route(xp, pl, k, cap, layer.ranges)
        # rows each sender puts in each local expert's part: the counts (dropless), or the
        # sender's capacity (padded parts), known from x's layout or exchanged for arrays
        if cap is None:
            mine = r.counts
        elif src is None:
            mine = xp.full(layer.num_experts, cap, dtype=np.int64)
        else:
            mine = None
        if mine is None:
            cnt = np.array([[capacity(cf, ts_, k, layer.num_experts)] * nle for ts_ in src], dtype=np.int64)
        else:
            cnt = bufs.get("counts", (n * nle,), np.int64)
            if n == 1:
                cnt[...] = mine
            else:
                C.all_to_all(xp.ascontiguousarray(mine), layer.axis, mesh=layer.mesh,
                             split_sizes=[h - l_ for l_, h in layer.ranges], recv_sizes=[nle] * n, out=cnt)
            cnt = np.asarray(get_backend().to_host(cnt)).reshape(n, nle)
        clock.lap("route")
        kept = r.kept
        tok = xp.arange(t * k) // k
        send = bufs.get("send", (r.send_rows, d), xl.dtype, zero=cap is not None)
        send[r.slot[kept]] = xl[tok[kept]]
        clock.lap("pack")
    recv_rows = [int(c) for c in cnt.sum(axis=1)]
    got = _exchange(send, layer, r.split, recv_rows, "recv", layer.quantize_fp8)
    clock.lap("exchange")
    active = None
    if layer.prefetch is not None:             # tiers: only the experts that got rows, from the cache
        active = np.nonzero(cnt.sum(axis=0))[0]
        w1l, w3l, w2l = layer.prefetch.gather(active, w1, w3, w2)
        nle = len(active)
    with _A2A():
        rows_at, m = _rows_index(xp, cnt if active is None else cnt[:, active])
        xe = xp.zeros((nle, m, d), xl.dtype) if save else bufs.get("xe", (nle, m, d), xl.dtype, zero=True)
        xe.reshape(-1, d)[rows_at] = got
        clock.lap("pack")
    mm = get_backend().kernel("matmul", like=xe)
    h1, h3 = mm(xe, w1l), mm(xe, w3l)
    # in place: each temporary of this size is a fresh allocation and its page faults
    sig = xp.negative(h1)
    xp.exp(sig, out=sig)
    sig += 1
    xp.reciprocal(sig, out=sig)                            # sigmoid(h1)
    act = h1 * sig                                         # silu(h1)
    a = act * h3
    ye = mm(a, w2l)
    clock.lap("experts")
    with _A2A():
        back_send = bufs.get("back_send", (int(rows_at.size), d), xl.dtype)
        xp.take(ye.reshape(-1, d), rows_at, axis=0, out=back_send)
        clock.lap("pack")
    back = _exchange(back_send, layer, recv_rows, r.split, "back", layer.quantize_fp8)
    clock.lap("exchange")
    with _A2A():
        o = back[r.slot]                                   # (T*k, d): a fresh gather
        wk = (r.weight.reshape(-1) * kept).astype(xl.dtype)
        y = (o * wk[:, None]).reshape(t, k, d).sum(axis=1)
        clock.lap("combine")
    info = {"route": r, "counts": cnt, "tokens": t}
    saved = (r, rows_at, xe, h1, h3, sig, act, a, o, recv_rows, active, (w1l, w3l, w2l)) if save else None
    return (_wrap_like(x, y), info), saved


def _wrap_like(x, y):
    if type(x) is DTensor:
        m = x._meta
        return DTensor._wrap(y, meta_of(m.layout, m.shape, y.dtype, m.mesh))
    return y


@differentiable("moe_ffn")
def moe_ffn(x, probs, w1, w3, w2, *, layer):
    """The routed experts' output ``y`` (x's shape and layout) and the routing info."""
    return _forward(x, probs, w1, w3, w2, layer, save=False)[0]


def _moe_forward(fn, args, kw):
    return _forward(*args, kw["layer"], save=True)


def _grad_like(ref, g, partial_axes=()):
    """Wrap a local gradient in ``ref``'s layout (pending sums over ``partial_axes``)."""
    if type(ref) is not DTensor:
        return g
    m = ref._meta
    lay = m.layout.with_partial(tuple((a, "sum") for a in partial_axes)) if partial_axes else m.layout
    return DTensor._wrap(g, meta_of(lay, m.shape, g.dtype, m.mesh))


@vjp_rule("moe_ffn", forward=_moe_forward)
def _moe_vjp(g, out, args, kw, needs):
    x, probs, w1, w3, w2 = args
    layer = kw["layer"]
    r, rows_at, xe, h1, h3, sig, act, a, o, recv_rows, active, (w1l, w3l, w2l) = kw["_saved"]
    xp = get_backend().xp
    clock = Clock(layer)
    if type(g) is DTensor and g.layout != x.layout:
        g = g.redistribute(x.layout)          # e.g. a pending sum over tp from a row-parallel layer
    gy = g._local if type(g) is DTensor else g
    t, d = gy.shape
    k = layer.top_k
    kept = r.kept
    gdt = layer.grad_dtype(gy.dtype)
    # combine: y_t = sum_j w_tj o_tj, w = top / sum(top)
    gw = xp.matmul(o.reshape(t, k, d), gy[:, :, None])[..., 0] * kept.reshape(t, k)
    gtop = (gw - (gw * r.weight).sum(axis=1, keepdims=True)) / r.denom
    pl = probs._local if type(probs) is DTensor else probs
    gp = xp.zeros(pl.shape, pl.dtype)
    e_all = pl.shape[1]                   # put_along_axis, spelled with a flat index (CuPy has no put_along_axis)
    gp.reshape(-1)[(xp.arange(t)[:, None] * e_all + r.idx).reshape(-1)] = gtop.astype(pl.dtype).reshape(-1)
    # the cotangent of each kept pair's expert output goes back where the pair came from
    tok = xp.arange(t * k) // k
    wk = r.weight.reshape(-1)[kept].astype(gy.dtype)
    gsend = layer.buffers.get("gsend", (r.send_rows, d), gdt, zero=True)
    gsend[r.slot[kept]] = (gy[tok[kept]] * wk[:, None]).astype(gdt)
    clock.lap("bwd_combine")
    grecv = _exchange(gsend, layer, r.split, recv_rows, "grecv", False)
    clock.lap("bwd_exchange")
    nle, m = xe.shape[0], xe.shape[1]
    gye = layer.buffers.get("gye", (nle, m, d), gy.dtype, zero=True)
    gye.reshape(-1, d)[rows_at] = grecv
    lo, hi = layer.ranges[layer.ep_index]
    mm = get_backend().kernel("matmul", like=xe)
    tr = (0, 2, 1)                       # transposed views: BLAS reads them with its trans flags
    gw2 = mm(a.transpose(tr), gye)
    da = mm(gye, w2l.transpose(tr))
    dh3 = da * act
    da *= h3
    dsilu = layer.buffers.get("dsilu", sig.shape, sig.dtype)
    xp.subtract(1, sig, out=dsilu)       # d silu / d h1 = sig * (1 + h1 * (1 - sig)), in place
    dsilu *= h1
    dsilu += 1
    dsilu *= sig
    da *= dsilu
    dh1 = da
    xet = xe.transpose(tr)
    gw1, gw3 = mm(xet, dh1), mm(xet, dh3)
    dxe = mm(dh1, w1l.transpose(tr))
    dxe += mm(dh3, w3l.transpose(tr))
    dsend = layer.buffers.get("dsend", (int(rows_at.size), d), gdt)
    dsend[...] = xp.take(dxe.reshape(-1, d), rows_at, axis=0)
    clock.lap("bwd_experts")
    dback = _exchange(dsend, layer, recv_rows, r.split, "dback", False)
    clock.lap("bwd_exchange")
    dx = (dback[r.slot].astype(gy.dtype, copy=False) * kept[:, None]).reshape(t, k, d).sum(axis=1)
    clock.lap("bwd_combine")
    part = layer.token_axes_besides_ep(x)
    grads = []
    for ref, gl in ((w1, gw1), (w3, gw3), (w2, gw2)):
        if active is not None:                           # tiers: rows of the active experts only
            full = xp.zeros((hi - lo,) + gl.shape[1:], gl.dtype)
            full[xp.asarray(active)] = gl
            gl = full
        if type(ref) is not DTensor:                     # a global array: zeros off this rank's experts
            full = xp.zeros(ref.shape, gl.dtype)
            full[lo:hi] = gl
            gl = full
        grads.append(_grad_like(ref, gl.astype(ref.dtype, copy=False), part))
    return (_grad_like(x, dx.astype(gy.dtype, copy=False)), _grad_like(probs, gp), *grads)
