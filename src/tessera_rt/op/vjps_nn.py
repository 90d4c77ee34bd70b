"""VJP rules for the network ops: matmul, softmax, layernorm and RMSNorm, the fused kernels
(swiglu, bias_act, gelu), the embedding and the fused softmax cross-entropy; written with ``op.*`` and
``vjps``'s helpers, so they too differentiate plain arrays and DTensors alike."""
from __future__ import annotations

import math

import numpy as np

from ..autodiff.tape import vjp_rule
from ..backend import get_backend
from ..dist.tensor import dispatch
from ..dist.tensor.dtensor import DTensor, meta_of
from ..dtypes import resolve_dtype
from ..kernels import cpu_fused
from ..kernels.mlp import check_pair
from ..kernels.numerics import result_dtype
from . import ops as op
from .nn_ops import embedding_backward
from .vjps import _as, _host, _plain, _shape, _wide, fused, sum_to

# --------------------------------------------------------------------------- matmul, shapes

def _swap(x):
    n = len(_shape(x))
    return op.transpose(x, tuple(range(n - 2)) + (n - 1, n - 2))


@vjp_rule("matmul", "gemm")
def _matmul(g, out, args, kw, needs):
    a, b = args[0], args[1]
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 1 or len(sb) == 1:             # vectors: promote, differentiate, demote
        a2 = op.reshape(a, (1,) + sa) if len(sa) == 1 else a
        b2 = op.reshape(b, sb + (1,)) if len(sb) == 1 else b
        g2 = op.reshape(g, _promoted_shape(sa, sb, _shape(g)))
        ga, gb = _matmul(g2, None, (a2, b2), kw, needs)
        return (op.reshape(ga, sa) if ga is not None else None,
                op.reshape(gb, sb) if gb is not None else None) + (None,) * (len(args) - 2)
    ga = gb = None
    if needs[0]:
        ga = _as(sum_to(op.matmul(g, _swap(b)), sa), a)
    if needs[1]:
        if len(sb) == 2 and len(sa) > 2:
            # fold the batch dims into the contraction: one GEMM instead of a batch and a sum
            k, n = sa[-1], _shape(g)[-1]
            gb = op.matmul(op.transpose(op.reshape(a, (-1, k)), None), op.reshape(g, (-1, n)))
        else:
            gb = sum_to(op.matmul(_swap(a), g), sb)
        gb = _as(gb, b)
    return (ga, gb) + (None,) * (len(args) - 2)


def _promoted_shape(sa, sb, sg):
    shape = list(sg)
    if len(sa) == 1:
        shape.insert(len(shape) - (0 if len(sb) == 1 else 1), 1)
    if len(sb) == 1:
        shape.append(1)
    return tuple(shape)


# --------------------------------------------------------------------------- softmax, norms

def _row_param(args, i):
    return args[i] if len(args) > i else None


@vjp_rule("softmax")
def _softmax(g, out, args, kw, needs):
    x = args[0]
    axis = args[1] if len(args) > 1 else kw.get("axis", -1)
    if _host(out, g) and axis in (-1, len(_shape(out)) - 1):
        return (cpu_fused.softmax_backward(g, out).astype(x.dtype, copy=False),) + (None,) * (len(args) - 1)
    y, gw = _wide(out), _wide(g)
    gx = op.mul(y, op.sub(gw, op.sum(op.mul(gw, y), axis=axis, keepdims=True)))
    return (_as(gx, x),) + (None,) * (len(args) - 1)


def _lead_sum(t, width):
    """Sum every dim but the last (a row parameter's gradient)."""
    n = len(_shape(t))
    return op.sum(t, axis=tuple(range(n - 1)), keepdims=False) if n > 1 else t


@vjp_rule("layernorm", "layernorm_safe")
def _layernorm(g, out, args, kw, needs):
    x, w, b = args[0], _row_param(args, 1), _row_param(args, 2)
    eps = kw.get("eps", 1e-5)
    if _plain(x, w, b, g):
        grads = fused("layernorm_backward", x)(g, x, w, b, eps=eps)
        return tuple(t if i < len(needs) and needs[i] else None for i, t in enumerate(grads))[:len(args)]
    xf, gf = _wide(x), _wide(g)
    mean = op.mean(xf, axis=-1, keepdims=True)
    xc = op.sub(xf, mean)
    rstd = op.rsqrt(op.add(op.mean(op.mul(xc, xc), axis=-1, keepdims=True), eps))
    xhat = op.mul(xc, rstd)
    gw = op.mul(gf, _wide(w)) if w is not None else gf
    gx = gwx = gb = None
    if needs[0]:
        m1 = op.mean(gw, axis=-1, keepdims=True)
        m2 = op.mean(op.mul(gw, xhat), axis=-1, keepdims=True)
        gx = _as(op.mul(rstd, op.sub(op.sub(gw, m1), op.mul(xhat, m2))), x)
    if len(needs) > 1 and needs[1]:
        gwx = _as(_lead_sum(op.mul(gf, xhat), None), w)
    if len(needs) > 2 and needs[2]:
        gb = _as(_lead_sum(gf, None), b)
    return (gx, gwx, gb)[:len(args)]


def _rmsnorm_pieces(g, x, w, eps):
    """The fused backward on each rank's rows of DTensors (x and g alike, the normalized dim
    whole, a replicated weight): the weight's gradient is this rank's rows' sum, pending
    over the axes that split the rows.  None where that does not hold."""
    if type(g) is DTensor and type(x) is DTensor and g.layout.partial and g.layout.with_partial(()) == x.layout:
        g = g.redistribute(x.layout)             # (the rows need their sums: the op chain reduces as well)
    pieces = _same_pieces(g, x)
    if pieces is None or x.layout.dims[-1]:     # (global facts only: every rank takes the same path)
        return None
    if w is not None:
        if type(w) is not DTensor or not w.layout.is_replicate or w.mesh is not x.mesh \
                or not _plain(w._local) or w.dtype != x.dtype:
            return None
        pieces.append(w._local)
    with dispatch.compute_region("rmsnorm_backward"):
        gx, gw = fused("rmsnorm_backward", pieces[0])(*pieces, eps=eps)
    gx = DTensor._wrap(gx, x._meta)
    if gw is not None:
        lay = w.layout.with_partial({a: "sum" for a in x.layout.sharded_axes})
        gw = DTensor._wrap(gw, meta_of(lay, w.shape, gw.dtype, x.mesh))
    return gx, gw


@vjp_rule("rmsnorm", "rmsnorm_safe")
def _rmsnorm(g, out, args, kw, needs):
    x, w = args[0], _row_param(args, 1)
    eps = kw.get("eps", 1e-6)
    grads = fused("rmsnorm_backward", x)(g, x, w, eps=eps) if _plain(x, w, g) else _rmsnorm_pieces(g, x, w, eps)
    if grads is not None:
        return tuple(t if i < len(needs) and needs[i] else None for i, t in enumerate(grads))[:len(args)]
    xf, gf = _wide(x), _wide(g)
    r = op.rsqrt(op.add(op.mean(op.mul(xf, xf), axis=-1, keepdims=True), eps))
    gw = op.mul(gf, _wide(w)) if w is not None else gf
    gx = gwx = None
    if needs[0]:
        m = op.mean(op.mul(gw, xf), axis=-1, keepdims=True)
        gx = _as(op.sub(op.mul(gw, r), op.mul(xf, op.mul(m, op.mul(r, op.mul(r, r))))), x)
    if len(needs) > 1 and needs[1]:
        gwx = _as(_lead_sum(op.mul(gf, op.mul(xf, r)), None), w)
    return (gx, gwx)[:len(args)]


# --------------------------------------------------------------------------- fused kernels

def _same_pieces(*ts):
    """The local pieces of DTensors that share one layout (no pending sum), mesh and float
    dtype: an elementwise fused kernel then runs on the pieces as they are, with no
    redistribution and no chain of dispatched ops.  None where that does not hold."""
    meta = ts[0]._meta if type(ts[0]) is DTensor else None
    if meta is None or meta.layout.partial or meta.dtype not in _FUSED_DTYPES:
        return None
    out = []
    for t in ts:
        m = t._meta if type(t) is DTensor else None
        if m is None or not _plain(t._local) or (m is not meta and (
                m.layout != meta.layout or m.mesh is not meta.mesh or m.dtype != meta.dtype or m.shape != meta.shape)):
            return None
        out.append(t._local)
    return out


_FUSED_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.float16)) + (np.dtype(resolve_dtype("bf16")),)


def _swiglu_forward(fn, vals, kw):
    """Run swiglu keeping its pre-activations ``h1 = x @ w1``, ``h3 = x @ w3`` for the backward,
    which then recomputes neither GEMM: two GEMMs in the operands' dtype and the fused gate.
    Under ``ts.remat`` the forward records nothing (no_grad), so a rematerialized block
    holds them only while its own backward runs."""
    x, w1, w3 = vals
    policy = kw.get("policy")
    if type(x) is DTensor or type(w1) is DTensor or type(w3) is DTensor:
        h1, h3 = dispatch.matmul(x, w1, None, policy), dispatch.matmul(x, w3, None, policy)
        pieces = _same_pieces(h1, h3)
        if pieces is None:
            return dispatch.binary("mul", dispatch.unary("silu", h1), h3), (h1, h3)
        with dispatch.compute_region("swiglu"):
            return DTensor._wrap(fused("swiglu_gate", pieces[0])(*pieces), h1._meta), (h1, h3)
    check_pair("swiglu", x, w1, w3, kw.get("stream"), policy)
    if _host(x, w1, w3):           # one pass on the CPU (16-bit inputs widened once, as the reference)
        y, h1, h3 = cpu_fused.swiglu_forward(x, w1, w3, policy)
        return y.astype(result_dtype(x.dtype, policy), copy=False), (h1, h3)
    if policy is None and _plain(x, w1, w3):
        h1, h3 = op.matmul(x, w1), op.matmul(x, w3)
        return fused("swiglu_gate", h1)(h1, h3), (h1, h3)
    return fn(*vals, **kw), None                                  # (the rule recomputes h1, h3)


@vjp_rule("swiglu", forward=_swiglu_forward)
def _swiglu(g, out, args, kw, needs):
    """The gate's backward fused (``swiglu_backward``), then the four GEMMs in the compute
    dtype: a bf16 weight is never widened (its gradient GEMMs stay on the tensor cores)."""
    x, w1, w3 = args
    saved = kw.get("_saved")
    h1, h3 = saved if saved is not None else (op.matmul(x, w1), op.matmul(x, w3))
    pieces = None if _plain(h1, h3, g) else _same_pieces(g, h1, h3)
    if _plain(h1, h3, g):
        dh1, dh3 = fused("swiglu_backward", h1)(g, h1, h3)      # one fused pass
    elif pieces is not None:                                    # the same pass on each rank's pieces
        with dispatch.compute_region("swiglu_backward"):
            dh1, dh3 = (DTensor._wrap(t, h1._meta) for t in fused("swiglu_backward", pieces[0])(*pieces))
    else:
        h1f, gf = _wide(h1), _wide(g)
        s = op.sigmoid(h1f)
        dh3 = _as(op.mul(gf, op.mul(h1f, s)), h1)
        dh1 = _as(op.mul(op.mul(gf, _wide(h3)), op.mul(s, op.add(1, op.mul(h1f, op.sub(1, s))))), h1)
    gx = gw1 = gw3 = None
    if needs[0]:
        gx = _as(op.add(op.matmul(dh1, op.transpose(w1, None)), op.matmul(dh3, op.transpose(w3, None))), x)
    d = _shape(x)[-1]
    xt = op.transpose(op.reshape(x, (-1, d)), None)
    f = _shape(w1)[-1]
    if needs[1]:
        gw1 = _as(op.matmul(xt, op.reshape(dh1, (-1, f))), w1)
    if needs[2]:
        gw3 = _as(op.matmul(xt, op.reshape(dh3, (-1, f))), w3)
    return gx, gw1, gw3


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _act_grad(y, act: str):
    """d act(y) / dy for the bias_act activations (y in f32, or f64 for f64 inputs)."""
    xp = get_backend().xp
    if act == "identity":
        return None
    if act == "relu":
        return (y > 0).astype(y.dtype)
    if act == "silu":
        s = 1.0 / (1.0 + xp.exp(-y))
        return s * (1.0 + y * (1.0 - s))
    if act == "gelu":
        from ..kernels.mlp import erf
        cdf = 0.5 * (1.0 + erf(y * (1.0 / math.sqrt(2.0))))
        return cdf + y * xp.exp(-0.5 * y * y) * (1.0 / math.sqrt(2.0 * math.pi))
    if act == "gelu_tanh":
        u = _SQRT_2_PI * (y + 0.044715 * y ** 3)
        t = xp.tanh(u)
        return 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3 * 0.044715 * y * y)
    raise ValueError(f"bias_act: no derivative for act={act!r}")


def _bias_act_grad(g, x, bias, act):
    if type(x) is DTensor or type(g) is DTensor:
        raise NotImplementedError("bias_act/gelu on DTensors has no rule; use op.silu / op.relu or the "
                                  "array kernel on local pieces")
    # f32 for 16-bit and f32 inputs, as the forward computes; f64 stays f64 (an f32 derivative
    # put a 1e-7 error into f64 gradients)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = x.astype(acc) + (bias.astype(acc) if bias is not None else 0)
    d = _act_grad(y, act)
    gx = g.astype(acc) if d is None else g.astype(acc) * d
    return gx


def _bias_act_rule(pick_act):
    def rule(g, out, args, kw, needs):
        x, bias = args[0], _row_param(args, 1)
        gx = _bias_act_grad(g, x, bias, pick_act(kw))
        gb = sum_to(gx, _shape(bias)).astype(bias.dtype) if bias is not None and needs[1] else None
        return (gx.astype(x.dtype), gb)[:len(args)]
    return rule


vjp_rule("bias_act")(_bias_act_rule(lambda kw: kw.get("act", "gelu")))
vjp_rule("bias_gelu")(_bias_act_rule(lambda kw: "gelu_tanh" if kw.get("approximate") else "gelu"))
vjp_rule("bias_silu")(_bias_act_rule(lambda kw: "silu"))


@vjp_rule("gelu")
def _gelu(g, out, args, kw, needs):
    x = args[0]
    approx = args[1] if len(args) > 1 else kw.get("approximate", False)
    return (_bias_act_grad(g, x, None, "gelu_tanh" if approx else "gelu").astype(x.dtype),) + \
        (None,) * (len(args) - 1)


@vjp_rule("embedding")
def _embedding(g, out, args, kw, needs):
    """A scatter-add of the rows' cotangents into the table (nothing for the integer ids)."""
    ids, table = args
    return None, (_as(embedding_backward(g, ids, table), table) if needs[1] else None)


def _xent_forward(fn, vals, kw):
    loss, lse = fn(*vals, **dict(kw, return_lse=True))
    return ((loss, lse) if kw.get("return_lse") else loss), lse


@vjp_rule("softmax_cross_entropy", forward=_xent_forward)
def _softmax_cross_entropy(g, out, args, kw, needs):
    """(softmax - onehot) * g / rows from the logsumexp the forward kept (on a GPU ``g`` stays
    a device scalar: no host sync)."""
    logits, targets = args
    return fused("cross_entropy_backward", logits)(g, logits, targets, kw["_saved"]), None
