"""VJP rules for data movement: DTensor redistribution and access, the collectives (on
DTensors and on arrays), send/recv, and flash attention on DTensors.

Two conventions, one per kind of value:

* **DTensors** hold one global value.  A redistribution (and every DTensor collective that
  completes a pending reduction or moves shards) is the identity on that value, so its VJP
  moves the cotangent back to the input's layout without the pending reductions:
  ``all_gather``'s cotangent returns by a local slice if it is replicated and by
  ``reduce_scatter`` if it is a pending sum; ``all_to_all``'s by the inverse all_to_all; a
  partial -> replicated ``all_reduce``'s cotangent stays replicated.  ``all_reduce`` over an
  axis the tensor is *replicated* on (per-replica values, e.g. gradients) reads each rank's
  piece as its own variable: each gets the cotangent (``avg``: divided by the group size).
* **Arrays** are per-rank values; the objective is the sum over ranks of each rank's scalar
  (what data-parallel training with a per-rank loss means).  Then all_reduce(sum) is its own
  dual, all_gather and reduce_scatter are each other's, all_to_all's dual is the inverse
  all_to_all, a broadcast's is a sum to the root, and send/recv swap roles.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..backend import get_backend
from ..dist.comm import collectives as C, p2p
from ..dist.comm.hooks import vjp_rule
from ..dist.comm.work import resolve_group
from ..dist.tensor.dispatch import compute_region
from ..dist.tensor.dtensor import DTensor, distribute, from_local, meta_of
from ..dist.tensor.layout import Layout

__all__: list[str] = []          # rules only: they register on import (autodiff imports this module)


def _strip(lay: Layout) -> Layout:
    return lay.with_partial(()) if lay.partial else lay


def _arg(args, kw, i: int, name: str, default=None):
    return args[i] if len(args) > i else kw.get(name, default)


def _none(args, first):
    return (first,) + (None,) * (len(args) - 1)


# --------------------------------------------------------------------------- DTensor access

@vjp_rule("redistribute")
def _redistribute(g, out, args, kw, needs):
    return (g.redistribute(_strip(args[0].layout)), None)


@vjp_rule("full_tensor")
def _full_tensor(g, out, args, kw, needs):
    x = args[0]
    return (distribute(g, layout=_strip(x.layout), mesh=x.mesh),)


@vjp_rule("to_local")
def _to_local(g, out, args, kw, needs):
    x = args[0]
    g = get_backend().xp.ascontiguousarray(g)
    return (from_local(g, layout=_strip(x.layout), mesh=x.mesh, shape=x.shape, validate=False),)


@vjp_rule("from_local")
def _from_local(g, out, args, kw, needs):
    return _none(args, g.redistribute(_strip(out.layout)).to_local())


@vjp_rule("distribute")
def _distribute(g, out, args, kw, needs):
    return _none(args, g.full_tensor())


# --------------------------------------------------------------------------- collectives

def _group_size(x: DTensor, axes) -> int:
    n = 1
    for a in axes:
        n *= x.mesh.size(a)
    return n


def _axes(x, axis):
    return x.mesh.axes if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


@vjp_rule("all_reduce")
def _all_reduce(g, out, args, kw, needs):
    x, axis, rop = args[0], _arg(args, kw, 1, "axis"), _arg(args, kw, 2, "op", "sum")
    if rop not in ("sum", "avg"):
        raise NotImplementedError(f"all_reduce(op={rop!r}) has no gradient here (only sum and avg); "
                                  "detach the value or reduce with sum")
    if type(x) is DTensor:
        gx = g.redistribute(_strip(x.layout))
        if rop == "avg":
            replicated = [a for a in _axes(x, axis) if x.layout.partial_op(a) is None]
            if replicated:
                gx = gx * (1.0 / _group_size(x, replicated))
        return _none(args, gx)
    return _none(args, C.all_reduce(g, axis, rop, mesh=kw.get("mesh"), role=kw.get("role", "tp_collective")))


@vjp_rule("reduce_scatter")
def _reduce_scatter(g, out, args, kw, needs):
    x, axis, rop = args[0], _arg(args, kw, 1, "axis"), _arg(args, kw, 2, "op", "sum")
    if rop not in ("sum", "avg"):
        raise NotImplementedError(f"reduce_scatter(op={rop!r}) has no gradient here (only sum and avg)")
    if type(x) is DTensor:
        gx = g.redistribute(_strip(x.layout))
        if rop == "avg" and x.layout.partial_op(_axes(x, axis)[0]) is None:
            gx = gx * (1.0 / _group_size(x, _axes(x, axis)))
        return _none(args, gx)
    gx = C.all_gather(g, axis, dim=kw.get("dim", 0), sizes=kw.get("sizes"), mesh=kw.get("mesh"))
    if rop == "avg":
        gx = gx * (1.0 / resolve_group(kw.get("mesh"), axis, "reduce_scatter").size)
    return _none(args, gx)


@vjp_rule("all_gather")
def _all_gather(g, out, args, kw, needs):
    x, axis = args[0], _arg(args, kw, 1, "axis")
    if type(x) is DTensor:
        return _none(args, g.redistribute(_strip(x.layout)))
    dim = kw.get("dim")
    return _none(args, C.reduce_scatter(get_backend().xp.ascontiguousarray(g), axis, "sum",
                                        dim=0 if dim is None else dim, sizes=kw.get("sizes"), mesh=kw.get("mesh")))


@vjp_rule("all_to_all")
def _all_to_all(g, out, args, kw, needs):
    x, axis = args[0], _arg(args, kw, 1, "axis")
    if type(x) is DTensor:
        return _none(args, g.redistribute(_strip(x.layout)))
    split = kw.get("split_dim", 0)
    concat = kw.get("concat_dim")
    concat = split if concat is None else concat
    return _none(args, C.all_to_all(get_backend().xp.ascontiguousarray(g), axis, split_dim=concat,
                                    concat_dim=split, split_sizes=kw.get("recv_sizes"),
                                    recv_sizes=kw.get("split_sizes"), mesh=kw.get("mesh")))


@vjp_rule("broadcast")
def _broadcast(g, out, args, kw, needs):
    x, axis, root = args[0], _arg(args, kw, 1, "axis"), kw.get("root", 0)
    xp = get_backend().xp
    if type(x) is DTensor:
        axes = _axes(x, axis)
        gl = g.redistribute(_strip(x.layout)).to_local()
        at_root = x.mesh.group(axes[0] if len(axes) == 1 else axes).index == root
        # the cotangent lives on the root: as a pending sum over the axes, the others hold 0
        lay = x.layout.with_partial({**dict(x.layout.partial), **{a: "sum" for a in axes}})
        local = gl if at_root else xp.zeros_like(gl)
        return _none(args, DTensor._wrap(local, meta_of(lay, x.shape, local.dtype, x.mesh)))
    grp = resolve_group(kw.get("mesh"), axis, "broadcast")
    total = C.all_reduce(xp.ascontiguousarray(g), axis, "sum", mesh=kw.get("mesh"))
    return _none(args, total if grp.index == root else xp.zeros_like(total))


def _peer_kw(kw):
    return dict(axis=kw.get("axis"), mesh=kw.get("mesh"), tag=kw.get("tag", 0))


@vjp_rule("send", effect=True, source=True)
def _send(g, out, args, kw, needs):
    x, dst = args[0], args[1]
    xp = get_backend().xp
    local = x.to_local() if type(x) is DTensor else x
    buf = xp.zeros(local.shape, local.dtype)
    mesh = kw.get("mesh") if kw.get("mesh") is not None or type(x) is not DTensor else x.mesh
    p2p.recv(buf, dst, **dict(_peer_kw(kw), mesh=mesh))
    gx = DTensor._wrap(buf, x._meta) if type(x) is DTensor else buf
    return _none(args, gx if needs and needs[0] else None)


@vjp_rule("recv", effect=True, source=True)
def _recv(g, out, args, kw, needs):
    x, src = args[0], args[1]
    xp = get_backend().xp
    if g is None:
        local = xp.zeros(out.to_local().shape if type(out) is DTensor else out.shape, out.dtype)
    elif type(g) is DTensor:
        local = g.redistribute(_strip(out.layout)).to_local()
    else:
        local = g
    local = xp.ascontiguousarray(local, dtype=out.dtype)
    mesh = kw.get("mesh") if kw.get("mesh") is not None or type(x) is not DTensor else x.mesh
    p2p.send(local, src, **dict(_peer_kw(kw), mesh=mesh))
    return (None,) * len(args)


# --------------------------------------------------------------------------- flash attention

def _fa_params(kw):
    return bool(kw.get("causal", False)), kw.get("scale"), kw.get("policy")


class _FlashSaved(NamedTuple):
    """What flash attention's forward hands its VJP."""
    lse: Any                # logsumexp of each query row's scores (the backward recomputes P)
    locs: list | None       # DTensors: the local q, k, v pieces the kernel saw (None: arrays)
    decision: Any           # DTensors: the dispatch decision (layouts, mesh) it ran under


def _fa_forward(fn, vals, kw):
    q, k, v = vals[:3]
    causal, scale, policy = _fa_params(kw)
    kern = get_backend().kernel("flash_attention")
    if type(q) is DTensor:
        from ..dist.tensor import dispatch
        dec = dispatch.explain("flash_attention", (causal, scale, policy), (q, k, v))
        locs = [a.to_local() if p is None else p.run(a.to_local()) for a, p in zip((q, k, v), dec.plans)]
        with compute_region("flash_attention"):         # (outside the dispatcher: tell the profiler)
            o_loc, lse = kern(*locs, causal=causal, scale=scale, return_lse=True, policy=policy)
        o = DTensor._wrap(o_loc, meta_of(dec.layout, dec.shape, o_loc.dtype, dec.mesh))
        return o, _FlashSaved(lse, locs, dec)
    o, lse = fn(q, k, v, **dict(kw, return_lse=True))
    return ((o, lse) if kw.get("return_lse") else o), _FlashSaved(lse, None, None)


@vjp_rule("flash_attention", forward=_fa_forward)
def _flash_attention(g, out, args, kw, needs):
    """FlashAttention-2's backward kernel (P recomputed from the saved logsumexp); on
    DTensors it runs on the pieces the forward saw, in the forward rule's layouts."""
    causal, scale, policy = _fa_params(kw)
    s: _FlashSaved = kw["_saved"]
    lse, dec = s.lse, s.decision
    bwd = get_backend().kernel("flash_attention_backward")
    if dec is None:
        q, k, v = args[:3]
        with compute_region("flash_attention_backward"):
            dq, dk, dv = bwd(q, k, v, out, g, lse, causal=causal, scale=scale, policy=policy)
        return (dq, dk, dv) + (None,) * (len(args) - 3)
    g_loc = g.redistribute(dec.layout).to_local()
    with compute_region("flash_attention_backward"):
        dq, dk, dv = bwd(*s.locs, out.to_local(), get_backend().xp.ascontiguousarray(g_loc), lse, causal=causal,
                         scale=scale, policy=policy)
    outs = []
    for a, t, lay in zip(args[:3], (dq, dk, dv), dec.strategy.inputs):
        outs.append(DTensor._wrap(t, meta_of(lay, a.shape, t.dtype, dec.mesh)))
    return tuple(outs) + (None,) * (len(args) - 3)
