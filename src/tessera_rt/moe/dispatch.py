"""The fused MoE dispatch as one differentiable op, ``moe_ffn``, in three steps (seed 000
§3.1, 002 §2.7; compare Megatron-core's ``MoETokenDispatcher``):

* ``TokenDispatcher.preprocess``: route (top-k, capacity), learn how many rows each ep
  position sends each local expert, pack this rank's rows in send order;
* ``dispatch``: send them over ``layer.transport`` and ``unpack`` what arrives into the
  experts' rows (expert-major, no padding: grouped GEMMs over ragged groups in ``experts.py``);
* ``combine``: pack the experts' rows back, send them home, weighted sum per token.

The backward runs ``combine_backward``, the experts' backward, then ``dispatch_backward``:
two exchanges, each the reverse of a forward one.  The dispatcher does all the local work;
the transport (``transport.py``) only moves rows, so another transport is a new
``Transport`` subclass set on ``layer.transport``.  What the backward reads travels from the
forward as named records: ``Dispatch`` (the plan of one call) inside ``MoESaved``.

``moe_ffn(x, probs, w1, w3, w2, layer=...)``: the gate (``x @ gate``, softmax, router hooks)
is ordinary ``op.*`` code in ``layer.py``, and this op takes its probabilities.  The routing
decision is made on the detached probabilities; the gradient flows into the probabilities
through the combine weights and into ``x`` and the expert weights through the experts.

Exchanges on ``ep`` per forward: the two payload exchanges, plus one of per-expert counts
when the sizes are not known in advance (dropless routing, or plain-array tokens whose
per-rank count the layout does not give); the host waits once for those counts (the payload
exchanges need their sizes).  With one ep position nothing is exchanged and the host never
waits: the rows stay in send order, which is already expert-major, and the grouped GEMMs read
the experts' offsets on the device.  Packing and unpacking run on the ``a2a`` stream,
ordered against ``compute`` with events.  Every staging buffer comes from
``DispatchBuffers``: two persistent sets used alternately (seed 004's double buffers), so a
step allocates nothing once the sizes are seen; under ``ts.grad`` the activations the
backward pass needs are fresh arrays (a later call must not overwrite them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..autodiff.tape import differentiable, vjp_rule
from ..backend import get_backend
from ..dist.tensor.dtensor import DTensor, meta_of
from ..dist.tensor.shard import dim_extent
from .experts import ExpertActs, swiglu_experts, swiglu_experts_backward
from .routing import Route, capacity, route
from .staging import A2AStream, Clock
from .transport import from_wire, to_wire

__all__ = ["Dispatch", "MoESaved", "TokenDispatcher", "moe_ffn"]


@dataclass
class Dispatch:
    """One call's dispatch: made by ``preprocess``, completed by ``unpack``, read by ``combine``
    and the backward."""
    route: Route            # this rank's routing decision (its ``split``: rows sent to each position)
    counts: np.ndarray | None   # (positions, local experts) rows each position sends each local expert
    #                         (None: one position, dropless: only on the device, as route.counts)
    recv_rows: list         # rows received from each position
    tokens: int             # this rank's tokens
    send: Any               # (route.send_rows, d) the packed rows
    rows_at: Any = None     # each received row's row in the experts' rows (None: the same row)
    offsets: Any = None     # (experts + 1,) each expert's first row in the experts' rows (host or device)
    active: Any = None      # expert tiers: the local experts that received rows (None: all)

    def split(self) -> list:
        """``route.split``, rows sent to each position (``preprocess`` has read it)."""
        assert self.route.split is not None
        return self.route.split

    def host_counts(self) -> np.ndarray:
        """``counts`` on the host (with one position and dropless routing, a wait for the device)."""
        if self.counts is None:
            self.counts = np.asarray(get_backend().to_host(self.route.counts)).reshape(1, -1)
        return self.counts


class MoESaved(NamedTuple):
    """What ``moe_ffn``'s forward hands its VJP."""
    plan: Dispatch
    acts: ExpertActs        # the experts' rows, offsets and SwiGLU activations
    out_rows: Any           # (T*k, d) each pair's expert output, before the combine weights
    weights: tuple          # (w1, w3, w2) the local experts' arrays the forward used


def _expert_rows(cnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows received sender-major (then by local expert) with ``cnt (senders, experts)``:
    each row's row among the experts' rows (expert-major, senders in order within an expert)
    and the experts' offsets ``(experts + 1,)``."""
    n, nle = cnt.shape
    per_e = cnt.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(per_e)]).astype(np.int64)
    before = np.cumsum(cnt, axis=0) - cnt                # rows of earlier senders, per expert
    sizes = cnt.reshape(-1)
    block = np.repeat(np.arange(n * nle), sizes)
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return offsets[block % nle] + before.reshape(-1)[block] + within, offsets


class TokenDispatcher:
    """The steps of ``layer``'s dispatch; the exchanges go through ``layer.transport``.

    Parameters
    ----------
    layer : MoE
        The layer whose transport, buffers and ranges it uses.
    """

    def __init__(self, layer: Any):
        self.layer = layer

    def source_tokens(self, x: Any) -> list[int] | None:
        """Tokens each ep position holds (same coordinates elsewhere), from x's layout; None when
        x is a plain array (each rank's count is then exchanged).

        Parameters
        ----------
        x : DTensor or array
            The layer's input.

        Returns
        -------
        list of int or None
            Per ep position.
        """
        layer = self.layer
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

    def preprocess(self, x: Any, xl: Any, pl: Any, clock: Clock) -> Dispatch:
        """Route this rank's tokens ``xl`` by their probabilities ``pl``, get the counts every
        position sends here, and pack the rows in send order.

        Parameters
        ----------
        x : DTensor or array
            The layer's input.
        xl : array
            This rank's tokens ``(T, d)``.
        pl : array
            Their probabilities ``(T, E)``.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        Dispatch
            The route, counts and packed rows.
        """
        lay = self.layer
        xp, bufs = get_backend().xp, lay.buffers
        n, (lo, hi) = lay.ep_size, lay.ranges[lay.ep_index]
        t, d = xl.shape
        k, nle, cf = lay.top_k, hi - lo, lay.capacity_factor
        src = self.source_tokens(x)
        cap = capacity(cf, t, k, lay.num_experts)
        with A2AStream():
            r = route(xp, pl, k, cap, lay.ranges)
            # rows each sender puts in each local expert's part: the counts (dropless), or the
            # sender's capacity (padded parts), known from x's layout or exchanged for arrays
            if cap is None and n == 1:
                cnt = None                      # stays on the device: nothing to exchange
            elif cap is None or src is None:
                mine = r.counts if cap is None else xp.full(lay.num_experts, cap, dtype=np.int64)
                cnt, mine_h = lay.transport.counts(mine, lay.ranges, bufs.get("counts", (n * nle,), np.int64))
                if r.split is None:
                    r.split = [int(mine_h[a:b].sum()) for a, b in lay.ranges]
            else:
                cnt = np.array([[capacity(cf, ts_, k, lay.num_experts)] * nle for ts_ in src], dtype=np.int64)
            clock.lap("route")
            tok = xp.arange(t * k) // k
            # a dropped pair writes the spare row past the buffer's rows (no mask: no host sync)
            full = bufs.get("send", (r.send_rows + (cap is not None), d), xl.dtype, zero=cap is not None)
            full[r.dest] = xl[tok]
            send = full[:r.send_rows]
            clock.lap("pack")
        recv = [r.send_rows] if cnt is None else [int(c) for c in cnt.sum(axis=1)]
        return Dispatch(r, cnt, recv, t, send)

    def dispatch(self, plan: Dispatch, clock: Clock) -> Any:
        """The packed rows to their experts' positions; returns the rows this rank received.

        Parameters
        ----------
        plan : Dispatch
            ``preprocess``'s result.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        array
            The received rows.
        """
        got = self.send(plan.send, plan.split(), plan.recv_rows, "recv", self.layer.quantize_fp8)
        clock.lap("exchange")
        return got

    def unpack(self, plan: Dispatch, got: Any, fresh: bool, clock: Clock) -> Any:
        """The received rows as the experts' rows ``(R, d)``, expert-major with no padding (the
        active experts only under tiers), and ``plan.offsets``; ``fresh``: a new array the
        backward may keep, not a staging buffer.

        Parameters
        ----------
        plan : Dispatch
            ``preprocess``'s result.
        got : array
            ``dispatch``'s rows.
        fresh : bool
            Return a new array.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        array
            ``(R, d)``.
        """
        xp, lay = get_backend().xp, self.layer
        with A2AStream():
            if lay.ep_size == 1:
                # one sender: the rows arrive in send order, expert-major already
                plan.rows_at = None
                if plan.counts is None:
                    plan.offsets = plan.route.bounds            # on the device: the host never reads it
                else:
                    cnt = plan.counts if plan.active is None else plan.counts[:, plan.active]
                    plan.offsets = np.concatenate([[0], np.cumsum(cnt.sum(axis=0))]).astype(np.int64)
                xr = got.copy() if fresh else got
            else:
                counts = plan.host_counts()                     # (exchanged: on the host already)
                cnt = counts if plan.active is None else counts[:, plan.active]
                rows_at, plan.offsets = _expert_rows(cnt)
                plan.rows_at = xp.asarray(rows_at)
                shape = (int(rows_at.size), got.shape[1])
                xr = xp.empty(shape, got.dtype) if fresh else lay.buffers.get("xr", shape, got.dtype)
                xr[plan.rows_at] = got                          # a permutation: every row written once
            clock.lap("pack")
        return xr

    def combine(self, plan: Dispatch, ye: Any, clock: Clock) -> tuple:
        """The experts' rows back home, summed per token with the combine weights: ``y (T, d)``
        and each pair's expert output ``(T*k, d)`` (the weights' gradient reads it).

        Parameters
        ----------
        plan : Dispatch
            ``preprocess``'s result.
        ye : array
            The experts' output rows ``(R, d)``.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        tuple of array
            ``(y, o)``.
        """
        xp, lay, r = get_backend().xp, self.layer, plan.route
        d = ye.shape[-1]
        with A2AStream():
            back_send = ye
            if plan.rows_at is not None:
                back_send = lay.buffers.get("back_send", (int(plan.rows_at.size), d), plan.send.dtype)
                xp.take(ye, plan.rows_at, axis=0, out=back_send)
            clock.lap("pack")
        back = self.send(back_send, plan.recv_rows, plan.split(), "back", lay.quantize_fp8)
        clock.lap("exchange")
        with A2AStream():
            o = back[r.slot]                                   # (T*k, d): a fresh gather
            wk = (r.weight.reshape(-1) * r.kept).astype(plan.send.dtype)
            y = (o * wk[:, None]).reshape(plan.tokens, lay.top_k, d).sum(axis=1)
            clock.lap("combine")
        return y, o

    def combine_backward(self, plan: Dispatch, gy: Any, o: Any, pl: Any, clock: Clock) -> tuple:
        """From the cotangent ``gy (T, d)`` of ``y``: the probabilities' (through the combine
        weights; ``pl``'s shape) and the experts' output rows' ``gye (R, d)``, sent back to the
        experts' positions.

        Parameters
        ----------
        plan : Dispatch
            ``preprocess``'s result.
        gy : array
            ``(T, d)``.
        o : array
            ``combine``'s per-pair outputs.
        pl : array
            The probabilities.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        tuple of array
            ``(gp, gye)``.
        """
        xp, lay, r = get_backend().xp, self.layer, plan.route
        t, d = gy.shape
        k, kept = lay.top_k, r.kept
        gdt = lay.grad_dtype(gy.dtype)
        # combine: y_t = sum_j w_tj o_tj, w = top / sum(top)
        # a product and a sum, not a batched matmul (CuPy 14.2's refuses bf16)
        gw = (o.reshape(t, k, d) * gy[:, None, :]).sum(axis=-1) * kept.reshape(t, k)
        gtop = (gw - (gw * r.weight).sum(axis=1, keepdims=True)) / r.denom
        gp = xp.zeros(pl.shape, pl.dtype)
        e_all = pl.shape[1]                   # put_along_axis, spelled with a flat index (CuPy has no put_along_axis)
        gp.reshape(-1)[(xp.arange(t)[:, None] * e_all + r.idx).reshape(-1)] = gtop.astype(pl.dtype).reshape(-1)
        # the cotangent of each kept pair's expert output goes back where the pair came from (a
        # dropped pair's goes to the spare row past the buffer's rows: no mask, no host sync)
        tok = xp.arange(t * k) // k
        wk = (r.weight.reshape(-1) * kept).astype(gy.dtype)
        capped = lay.capacity_factor is not None
        full = lay.buffers.get("gsend", (r.send_rows + capped, d), gdt, zero=capped)
        full[r.dest] = (gy[tok] * wk[:, None]).astype(gdt)
        clock.lap("bwd_combine")
        grecv = self.send(full[:r.send_rows], plan.split(), plan.recv_rows, "grecv", False)
        clock.lap("bwd_exchange")
        if plan.rows_at is None:
            return gp, grecv
        gye = lay.buffers.get("gye", grecv.shape, gy.dtype)
        gye[plan.rows_at] = grecv
        return gp, gye

    def dispatch_backward(self, plan: Dispatch, dxe: Any, dtype: Any, clock: Clock) -> Any:
        """The cotangent of the experts' rows ``dxe (R, d)`` back to their tokens: ``dx (T, d)``.

        Parameters
        ----------
        plan : Dispatch
            ``preprocess``'s result.
        dxe : array
            ``(R, d)``.
        dtype : dtype
            The cotangent's dtype.
        clock : Clock
            Times the phases (``MoEAux``'s timings).

        Returns
        -------
        array
            ``dx (T, d)``.
        """
        xp, lay, r = get_backend().xp, self.layer, plan.route
        d, gdt = dxe.shape[-1], lay.grad_dtype(dtype)
        if plan.rows_at is None:
            dsend = dxe if dxe.dtype == gdt else dxe.astype(gdt)
        else:
            dsend = lay.buffers.get("dsend", dxe.shape, gdt)
            dsend[...] = xp.take(dxe, plan.rows_at, axis=0)
        clock.lap("bwd_experts")
        dback = self.send(dsend, plan.recv_rows, plan.split(), "dback", False)
        clock.lap("bwd_exchange")
        dx = (dback[r.slot].astype(dtype, copy=False) * r.kept[:, None]).reshape(plan.tokens, lay.top_k, d).sum(axis=1)
        clock.lap("bwd_combine")
        return dx

    def send(self, rows: Any, split: list, recv: list, name: str, fp8: bool) -> Any:
        """``rows (N, d)`` over the transport (split/recv: rows per position) into staging buffer
        ``name``; returns the received rows (FP8 on the wire when ``fp8``).

        Parameters
        ----------
        rows : array
            ``(N, d)``.
        split : list of int
            Rows to each position.
        recv : list of int
            Rows from each position.
        name : str
            The staging buffer.
        fp8 : bool
            FP8 on the wire (per-row scales).

        Returns
        -------
        array
            The received rows.
        """
        bufs, d = self.layer.buffers, rows.shape[1]
        total = int(sum(recv))
        if not fp8:
            return self.layer.transport.exchange(rows, split, recv, bufs.get(name, (total, d), rows.dtype))
        wire = to_wire(rows, bufs.get(name + "_wire", (rows.shape[0], d + 4), np.uint8))
        got = self.layer.transport.exchange(wire, split, recv, bufs.get(name, (total, d + 4), np.uint8))
        return from_wire(got, d, rows.dtype)


def _local(v, lo: int | None, hi: int | None):
    """A DTensor's local piece, or an array's experts [lo, hi) (plain arrays are global)."""
    if type(v) is DTensor:
        return v._local
    return v[lo:hi] if lo is not None else v


def _forward(x, probs, w1, w3, w2, layer, save: bool):
    dsp = layer.dispatcher
    layer.buffers.flip()
    lo, hi = layer.ranges[layer.ep_index] if type(w1) is not DTensor else (None, None)
    ws = (_local(w1, lo, hi), _local(w3, lo, hi), _local(w2, lo, hi))
    clock = Clock(layer)
    plan = dsp.preprocess(x, _local(x, None, None), _local(probs, None, None), clock)
    got = dsp.dispatch(plan, clock)
    if layer.prefetch is not None:             # tiers: only the experts that got rows, from the cache
        plan.active = np.nonzero(plan.host_counts().sum(axis=0))[0]
        ws = layer.prefetch.gather(plan.active, w1, w3, w2)
    xr = dsp.unpack(plan, got, save, clock)
    ye, acts = swiglu_experts(xr, plan.offsets, *ws, save=save)
    clock.lap("experts")
    y, o = dsp.combine(plan, ye, clock)
    info = {"route": plan.route, "counts": plan.counts, "tokens": plan.tokens}
    return (_wrap_like(x, y), info), (MoESaved(plan, acts, o, ws) if save else None)


def _wrap_like(x, y):
    if type(x) is DTensor:
        m = x._meta
        return DTensor._wrap(y, meta_of(m.layout, m.shape, y.dtype, m.mesh))
    return y


@differentiable("moe_ffn")
def moe_ffn(x: Any, probs: Any, w1: Any, w3: Any, w2: Any, *, layer: Any) -> tuple[Any, dict]:
    """The routed experts' output and the routing info (differentiable: ``ts.grad`` runs its VJP).

    Parameters
    ----------
    x : DTensor or array
        Tokens ``(T, d_model)``.
    probs : DTensor or array
        Gate probabilities ``(T, E)``.
    w1, w3 : DTensor or array
        Experts' gate and up projections ``(E, d_model, d_ff)``.
    w2 : DTensor or array
        Experts' down projections ``(E, d_ff, d_model)``.
    layer : MoE
        The layer (routing, transport, buffers).

    Returns
    -------
    tuple
        ``(y, info)``: y of x's shape and layout, and the routing info.
    """
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
    s: MoESaved = kw["_saved"]
    dsp, plan = layer.dispatcher, s.plan
    xp = get_backend().xp
    clock = Clock(layer)
    if type(g) is DTensor and g.layout != x.layout:
        g = g.redistribute(x.layout)          # e.g. a pending sum over tp from a row-parallel layer
    gy = g._local if type(g) is DTensor else g
    gp, gye = dsp.combine_backward(plan, gy, s.out_rows, _local(probs, None, None), clock)
    dxr, *gws = swiglu_experts_backward(gye, s.acts, *s.weights)
    dx = dsp.dispatch_backward(plan, dxr, gy.dtype, clock)
    lo, hi = layer.ranges[layer.ep_index]
    part = layer.token_axes_besides_ep(x)
    grads = []
    for ref, gl in zip((w1, w3, w2), gws):
        if plan.active is not None:                      # tiers: rows of the active experts only
            full = xp.zeros((hi - lo,) + gl.shape[1:], gl.dtype)
            full[xp.asarray(plan.active)] = gl
            gl = full
        if type(ref) is not DTensor:                     # a global array: zeros off this rank's experts
            full = xp.zeros(ref.shape, gl.dtype)
            full[lo:hi] = gl
            gl = full
        grads.append(_grad_like(ref, gl.astype(ref.dtype, copy=False), part))
    return (_grad_like(x, dx.astype(gy.dtype, copy=False)), _grad_like(probs, gp), *grads)
