"""Sharding rules: one registry, one rule per op family (seed 000 §4.2, PyTorch's strategies).

A rule sees only global metadata (TensorMeta for DTensor arguments, a kind marker for
scalars and constants) and static parameters, and returns a ``Strategy``: the layout each
DTensor input must have, the output layout and shape, and the local function to run on
the local pieces.  Rules never look at data and never communicate, so the same inputs give
the same decision on every rank, a bad input raises the same error on every rank before
any collective, and the dispatcher caches the decision.

This module owns the registry and the rules of the ops that keep every dim: elementwise ops
and unary math, transpose and reshape.  The rules of the ops that reduce over a dim (matmul,
reductions, softmax and norms, attention) are in ``reduction_rules``, which ``dispatch``
imports so they are registered whenever DTensor ops run.

Elementwise ops, unary math and matmul share one solver (``dist.tensor.solve``): every tensor dim
carries a label (an output dim, or matmul's contracted ``k``); per mesh axis one operand's
use wins (the cheapest by the cost model, the largest operand's on ties), the others follow
it by a free local slice or give theirs up, and a pending reduction survives where the op
is linear in it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...backend import get_backend
from ..comm.process_group import world
from .layout import Layout
from .shard import dim_extents_all, local_shape
from .solve import solve

__all__ = ["Strategy", "RuleError", "RULES", "register_rule", "solve", "ScalarKind", "ConstKind", "fail",
           "array_module", "LINEAR", "unary_table"]


class RuleError(ValueError):
    """A user mistake found by a sharding rule (same on every rank, before any collective)."""


@dataclass(frozen=True)
class Strategy:
    inputs: tuple            # target Layout per argument (None for scalars and constants)
    out_layout: Layout
    out_shape: tuple
    local: Callable          # local(*local_args) -> local result


@dataclass(frozen=True)
class ScalarKind:
    """A Python/NumPy scalar (or 0-dim array) argument; its value is not part of the decision."""
    type: Any

    def __repr__(self) -> str:
        return f"scalar {getattr(self.type, '__name__', self.type)}"


@dataclass(frozen=True)
class ConstKind:
    """A plain array (or None) passed through to the kernel unchanged, e.g. a norm weight."""
    shape: tuple | None

    def __repr__(self) -> str:
        return "None" if self.shape is None else f"array{list(self.shape)}"


# the sharding-rule registry: op name -> rule (filled by register_rule, read by the dispatcher)
RULES: dict[str, Callable[..., Strategy]] = {}


def register_rule(*ops: str) -> Callable[[Callable[..., Strategy]], Callable[..., Strategy]]:
    """Decorator registering the sharding rule of ``ops`` for DTensor dispatch.

    The rule is called as ``rule(op, kinds, params) -> Strategy``: ``kinds`` holds each
    argument's ``TensorMeta`` (or ``ScalarKind``/``ConstKind``), ``params`` the op's static
    parameters; it returns the input layouts to move to, the output layout and shape, and the
    local function.  It raises ``RuleError`` (the same on every rank) for what it cannot shard.

    Parameters
    ----------
    *ops : str
        The op names the rule serves; each may be registered once.

    Returns
    -------
    callable
        The decorator (it returns the rule unchanged).
    """
    def put(fn):
        for op in ops:
            if op in RULES:
                raise ValueError(f"sharding rule for {op!r} registered twice")
            RULES[op] = fn
        return fn
    return put


def fail(op: str, metas, msg: str, cls: type = RuleError) -> Exception:
    """The error a rule raises for ``op`` on arguments ``metas``: this rank, the call, ``msg``."""
    args = ", ".join(repr(m) for m in metas)
    return cls(f"rank {world().rank}: {op}({args}): {msg}")


def array_module():
    """The backend's array module (NumPy or CuPy), looked up per call: the backend may change."""
    return get_backend().xp


# --------------------------------------------------------------------------- elementwise

_BINARY = {      # op -> array-module function name
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
    "maximum": "maximum", "minimum": "minimum",
    "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
    "eq": "equal", "ne": "not_equal",
}
LINEAR = ("sum", "avg")          # the pending reductions a linear op keeps


def _binary_partial(op: str, dt_pos: tuple[int, ...]) -> Callable:
    """Which pending reductions survive ``op``.  ``dt_pos``: argument positions that are
    DTensors (the other argument, if any, is a scalar)."""
    def rule(ops):
        full = [None, None]
        for p, o in zip(dt_pos, ops):
            full[p] = o
        a, b = full
        both = len(dt_pos) == 2
        if op in ("add", "sub"):
            return a if both and a == b and a in LINEAR else None
        if op == "mul":
            nz = [o for o in full if o]
            return nz[0] if len(nz) == 1 and nz[0] in LINEAR else None
        if op == "div":
            return a if a in LINEAR and b is None else None
        if op in ("maximum", "minimum"):
            want = "max" if op == "maximum" else "min"
            return want if all(o in (None, want) for o in full) and want in full else None
        return None
    return rule


def _broadcast_labels(meta, out_shape) -> tuple:
    off = len(out_shape) - meta.ndim
    return tuple(d + off if s == out_shape[d + off] else None for d, s in enumerate(meta.shape))


@register_rule(*_BINARY)
def binary_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    metas = [k for k in kinds if not isinstance(k, (ScalarKind, ConstKind))]
    if any(isinstance(k, ConstKind) for k in kinds):
        raise fail(op, kinds, "one operand is a plain array; make it a DTensor first "
                   "(dist.distribute(array, layout=..., mesh=X.mesh)) or pass a scalar", TypeError)
    try:
        out_shape = tuple(np.broadcast_shapes(*(m.shape for m in metas)))
    except ValueError:
        raise fail(op, kinds, f"shapes {' and '.join(str(m.shape) for m in metas)} do not broadcast "
                   "(NumPy rules: trailing dims must be equal or 1)") from None
    dt_pos = tuple(i for i, k in enumerate(kinds) if not isinstance(k, ScalarKind))
    operands = [(m, _broadcast_labels(m, out_shape)) for m in metas]
    targets, out = solve(operands, frozenset(), _binary_partial(op, dt_pos), tuple(range(len(out_shape))))
    it = iter(targets)
    inputs = tuple(next(it) if i in dt_pos else None for i in range(len(kinds)))
    return Strategy(inputs, out, out_shape, getattr(array_module(), _BINARY[op]))


def _one(x):
    """1 as a scalar of ``x``'s dtype: a Python float beside a bf16 array promotes it to f32
    in CuPy (its scalars are weak only for NumPy's own kinds), so a bf16 model would leave
    bf16 at its first sigmoid."""
    dt = getattr(x, "dtype", None)
    return 1.0 if dt is None else dt.type(1)


def unary_table(xp) -> dict[str, Callable]:
    """Unary op name -> its elementwise function over ``xp`` (NumPy or CuPy): what the unary
    rule runs on each shard, and ``op``'s unary ops on plain arrays."""
    return {
        "neg": xp.negative, "abs": xp.abs, "exp": xp.exp, "log": xp.log, "sqrt": xp.sqrt,
        "rsqrt": lambda x: _one(x) / xp.sqrt(x), "tanh": xp.tanh, "sin": xp.sin, "cos": xp.cos,
        "square": xp.square, "relu": lambda x: xp.maximum(x, 0 * _one(x)),
        "sigmoid": lambda x: _one(x) / (_one(x) + xp.exp(-x)),
        "silu": lambda x: x / (_one(x) + xp.exp(-x)),
    }


UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "square", "relu",
             "sigmoid", "silu", "astype")
_NEG = {"sum": "sum", "avg": "avg", "max": "min", "min": "max"}


@register_rule(*UNARY_OPS)
def unary_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    (meta,) = kinds
    xp = array_module()
    if op == "astype":
        (dt,) = params
        keep = meta.dtype.kind in "fc" and np.dtype(dt).kind in "fc"
        partial_rule = (lambda ops: ops[0]) if keep else (lambda ops: None)
        fn = lambda x: x.astype(dt)
    else:
        partial_rule = (lambda ops: _NEG[ops[0]]) if op == "neg" else (lambda ops: None)
        fn = unary_table(xp)[op]
    labels = tuple(range(meta.ndim))
    (target,), out = solve([(meta, labels)], frozenset(), partial_rule, labels)
    return Strategy((target,), out, meta.shape, fn)


# --------------------------------------------------------------------------- transpose, reshape

@register_rule("transpose")
def transpose_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    (meta,) = kinds
    (perm,) = params
    perm = tuple(range(meta.ndim - 1, -1, -1)) if perm is None else tuple(int(p) % max(meta.ndim, 1) for p in perm)
    if sorted(perm) != list(range(meta.ndim)):
        raise fail(op, kinds, f"axes {params[0]} are not a permutation of the {meta.ndim} dims")
    lay = meta.layout
    out = Layout(tuple(lay.dims[p] for p in perm), lay.partial)
    xp = array_module()
    return Strategy((lay,), out, tuple(meta.shape[p] for p in perm), lambda x: xp.transpose(x, perm))


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    i = j = 0
    groups = []
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


@register_rule("reshape")
def reshape_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    (meta,) = kinds
    (shape,) = params
    total = int(np.prod(meta.shape, dtype=np.int64))
    shape = list(shape)
    if shape.count(-1) > 1:
        raise fail(op, kinds, f"shape {tuple(shape)} has more than one -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
        if rest == 0 or total % rest:
            raise fail(op, kinds, f"cannot reshape {meta.shape} ({total} elements) into {tuple(shape)}")
        shape[shape.index(-1)] = total // rest
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) != total or any(s < 0 for s in shape):
        raise fail(op, kinds, f"cannot reshape {meta.shape} ({total} elements) into {shape}")
    lay, mesh = meta.layout, meta.mesh
    in_dims = [list(a) for a in lay.dims]
    out_dims: list[tuple] = [()] * len(shape)
    if total == 0:
        in_dims = [[] for _ in in_dims]
    else:
        for gi, gj in _reshape_groups(meta.shape, shape):
            for d in gi[1:]:
                in_dims[d] = []                       # only a group's major dim may stay sharded
            if not gi or not in_dims[gi[0]]:
                continue
            axes = tuple(in_dims[gi[0]])
            if gj and _same_pieces(meta.shape, gi, shape, gj, axes, mesh):
                out_dims[gj[0]] = axes
            else:
                in_dims[gi[0]] = []
    target = Layout(tuple(tuple(a) for a in in_dims), lay.partial)
    out = Layout(tuple(out_dims), lay.partial)
    lshape = local_shape(shape, out, mesh)
    return Strategy((target,), out, shape, lambda x: x.reshape(lshape))


def _same_pieces(src, gi, dst, gj, axes, mesh) -> bool:
    """Whether sharding src dim gi[0] and dst dim gj[0] over ``axes`` gives every rank the
    same flat range of the group (so the reshape is local)."""
    sizes = tuple(mesh.size(a) for a in axes)
    r_in = int(np.prod([src[d] for d in gi[1:]], dtype=np.int64))
    r_out = int(np.prod([dst[d] for d in gj[1:]], dtype=np.int64))
    ein, eout = dim_extents_all(src[gi[0]], sizes), dim_extents_all(dst[gj[0]], sizes)
    return all(ein[c][0] * r_in == eout[c][0] * r_out and ein[c][1] * r_in == eout[c][1] * r_out for c in ein)
