"""VJP rules for the math ops: elementwise, reductions, shape ops, fake-quantize and saxpy,
and the helpers every rule uses (``vjps_nn`` has matmul, softmax, the norms and the fused
kernels).

Every rule is written with ``op.*``, so the same rule differentiates plain arrays and
DTensors: on DTensors the dispatcher picks each cotangent's layout and the collectives it
needs (a column-parallel weight's gradient comes out column-sharded; a replicated input's
gradient comes out as a pending sum, reduced only when something needs it).  Statistics
of low-precision values are recomputed in f32, as the forward kernels do.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..autodiff.tape import float_kind, vjp_rule
from ..backend import get_backend
from ..dist.tensor.dtensor import DTensor
from . import ops as op

__all__ = ["sum_to", "broadcast_like"]


def _shape(x):
    return tuple(getattr(x, "shape", ()))


def _is_tensor(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _wide(x):
    """f32 view of a low-precision value (the statistics dtype)."""
    return op.astype(x, "float32") if float_kind(x.dtype) in ("b", "h") else x     # (bf16, fp16)


def _as(x, like):
    """Cast a cotangent back to its primal's dtype."""
    dt = getattr(like, "dtype", None)
    if dt is None or getattr(x, "dtype", None) == dt:
        return x
    return op.astype(x, dt)


def sum_to(g: Any, shape: tuple) -> Any:
    """Undo NumPy broadcasting: sum the cotangent ``g`` down to its operand's ``shape``."""
    gs = _shape(g)
    shape = tuple(shape)
    if gs == shape:
        return g
    lead = len(gs) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and gs[lead + i] != 1)
    if axes:
        g = op.sum(g, axis=axes, keepdims=True)
    if _shape(g) != shape:
        g = op.reshape(g, shape)
    return g


def broadcast_like(g: Any, x: Any) -> Any:
    """The cotangent ``g`` of a reduction broadcast to its operand ``x``'s shape (a DTensor takes
    ``x``'s sharding, without its pending reductions)."""
    if _shape(g) == _shape(x):
        return g
    if type(x) is DTensor:
        from ..dist.tensor.dtensor import zeros
        return op.add(zeros(x.shape, layout=x.layout.with_partial(()), mesh=x.mesh, dtype=g.dtype), g)
    xp = get_backend().xp
    return xp.broadcast_to(g, _shape(x))


def _cot(g, x):
    """The cotangent of operand ``x`` of a broadcasting op (None for Python scalars)."""
    if not _is_tensor(x):
        return None
    return _as(sum_to(g, _shape(x)), x)


def _plain(*xs) -> bool:
    """All given values are plain arrays of the backend (NumPy, or CuPy on the GPU backend),
    None skipped: the fused kernels of the kernel table apply to them as they are."""
    kinds = (np.ndarray, get_backend().xp.ndarray)
    for x in xs:
        if x is not None and type(x) not in kinds:
            return False
    return True


def _host(*xs) -> bool:
    """All given values are NumPy arrays (None skipped)."""
    for x in xs:
        if x is not None and type(x) is not np.ndarray:
            return False
    return True


def fused(op: str, like):
    """The kernel table's ``op`` for arrays like ``like`` (the fused backward kernels)."""
    return get_backend().kernel(op, like=like)


def _mask(cond, like):
    return op.astype(cond, like.dtype)


# --------------------------------------------------------------------------- elementwise

@vjp_rule("add")
def _add(g, out, args, kw, needs):
    a, b = args
    return (_cot(g, a) if needs[0] else None, _cot(g, b) if needs[1] else None)


@vjp_rule("sub")
def _sub(g, out, args, kw, needs):
    a, b = args
    return (_cot(g, a) if needs[0] else None, _cot(op.neg(g), b) if needs[1] else None)


@vjp_rule("mul")
def _mul(g, out, args, kw, needs):
    a, b = args
    return (_cot(op.mul(g, b), a) if needs[0] else None, _cot(op.mul(g, a), b) if needs[1] else None)


@vjp_rule("div")
def _div(g, out, args, kw, needs):
    a, b = args
    ga = op.div(g, b)
    return (_cot(ga, a) if needs[0] else None,
            _cot(op.neg(op.mul(ga, out)), b) if needs[1] else None)


@vjp_rule("pow")
def _pow(g, out, args, kw, needs):
    a, b = args
    ga = gb = None
    if needs[0]:
        ga = _cot(op.mul(g, op.mul(b, op.pow(a, op.sub(b, 1)))), a)
    if needs[1]:
        gb = _cot(op.mul(g, op.mul(out, op.log(a))), b)
    return ga, gb


def _minmax(pick_a):
    def rule(g, out, args, kw, needs):
        a, b = args
        # ties go to a, as NumPy's maximum/minimum return a
        ma = pick_a(a, b)
        ga = _cot(op.mul(g, _mask(ma, g)), a) if needs[0] else None
        gb = _cot(op.mul(g, op.sub(1, _mask(ma, g))), b) if needs[1] else None
        return ga, gb
    return rule


vjp_rule("maximum")(_minmax(lambda a, b: op.greater_equal(a, b)))
vjp_rule("minimum")(_minmax(lambda a, b: op.less_equal(a, b)))


def _sign(x, like):
    return op.sub(_mask(op.greater(x, 0), like), _mask(op.less(x, 0), like))


_UNARY = {
    "neg": lambda g, x, y: op.neg(g),
    "abs": lambda g, x, y: op.mul(g, _sign(x, g)),
    "exp": lambda g, x, y: op.mul(g, y),
    "log": lambda g, x, y: op.div(g, x),
    "sqrt": lambda g, x, y: op.div(op.mul(g, 0.5), y),
    "rsqrt": lambda g, x, y: op.mul(op.mul(g, -0.5), op.mul(y, op.mul(y, y))),
    "tanh": lambda g, x, y: op.mul(g, op.sub(1, op.mul(y, y))),
    "sin": lambda g, x, y: op.mul(g, op.cos(x)),
    "cos": lambda g, x, y: op.neg(op.mul(g, op.sin(x))),
    "square": lambda g, x, y: op.mul(g, op.mul(x, 2)),
    "relu": lambda g, x, y: op.mul(g, _mask(op.greater(x, 0), g)),
    "sigmoid": lambda g, x, y: op.mul(g, op.mul(y, op.sub(1, y))),
    "silu": lambda g, x, y: _silu_grad(g, x),
}


def _silu_grad(g, x):
    s = op.sigmoid(x)
    return op.mul(g, op.mul(s, op.add(1, op.mul(x, op.sub(1, s)))))


def _unary_rule(name):
    f = _UNARY[name]

    def rule(g, out, args, kw, needs):
        return (_as(f(g, args[0], out), args[0]),)
    return rule


for _n in _UNARY:
    vjp_rule(_n)(_unary_rule(_n))


@vjp_rule("astype")
def _astype(g, out, args, kw, needs):
    return (op.astype(g, args[0].dtype), None)


@vjp_rule("getitem")
def _getitem(g, out, args, kw, needs):
    x, index = args
    xp = get_backend().xp
    z = xp.zeros(_shape(x), dtype=g.dtype)
    xp.add.at(z, index, g)
    return (z, None)


# --------------------------------------------------------------------------- reductions

def _norm_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    return tuple(sorted(int(a) % ndim for a in axes))


def _keep(g, x, axis, keepdims):
    """``g`` reshaped to the reduced shape with keepdims, ready to broadcast against x."""
    if keepdims:
        return g
    axes = _norm_axes(axis, len(_shape(x)))
    shape = tuple(1 if d in axes else s for d, s in enumerate(_shape(x)))
    return op.reshape(g, shape) if _is_tensor(g) else g


def _red_args(args, kw):
    x = args[0]
    axis = args[1] if len(args) > 1 else kw.get("axis")
    keepdims = args[2] if len(args) > 2 else kw.get("keepdims", False)
    return x, axis, keepdims


@vjp_rule("sum")
def _sum(g, out, args, kw, needs):
    x, axis, keepdims = _red_args(args, kw)
    return (_as(broadcast_like(_keep(g, x, axis, keepdims), x), x),) + (None,) * (len(args) - 1)


@vjp_rule("mean")
def _mean(g, out, args, kw, needs):
    x, axis, keepdims = _red_args(args, kw)
    n = int(np.prod([_shape(x)[d] for d in _norm_axes(axis, len(_shape(x)))]))
    gx = broadcast_like(op.div(_keep(g, x, axis, keepdims), n), x)
    return (_as(gx, x),) + (None,) * (len(args) - 1)


def _extreme(g, out, args, kw, needs):
    x, axis, keepdims = _red_args(args, kw)
    y = _keep(out, x, axis, keepdims)
    hit = _mask(op.equal(x, y), x)
    count = op.sum(hit, axis=axis, keepdims=True)   # ties share the gradient
    gx = op.mul(hit, op.div(_keep(g, x, axis, keepdims), count))
    return (_as(gx, x),) + (None,) * (len(args) - 1)


vjp_rule("max", "min")(_extreme)


# --------------------------------------------------------------------------- shapes

@vjp_rule("transpose")
def _transpose(g, out, args, kw, needs):
    x = args[0]
    perm = args[1] if len(args) > 1 else kw.get("axes")
    n = len(_shape(x))
    perm = tuple(range(n - 1, -1, -1)) if perm is None else tuple(int(p) % n for p in perm)
    inv = tuple(int(i) for i in np.argsort(perm))
    return (op.transpose(g, inv), None)


@vjp_rule("reshape")
def _reshape(g, out, args, kw, needs):
    return (op.reshape(g, _shape(args[0])), None)


@vjp_rule("fake_quantize_fp8")
def _fake_quant(g, out, args, kw, needs):
    # straight-through estimator: quantization is treated as the identity in the backward
    return (_as(g, args[0]),) + (None,) * (len(args) - 1)


@vjp_rule("saxpy")
def _saxpy(g, out, args, kw, needs):
    alpha = args[2] if len(args) > 2 else kw["alpha"]
    return (op.mul(g, float(alpha)) if needs[0] else None, g if needs[1] else None, None)[:len(args)]
