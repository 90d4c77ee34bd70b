"""Sharding rules: one registry, one rule per op family (seed 000 §4.2, PyTorch's strategies).

A rule sees only global metadata (TensorMeta for DTensor arguments, a kind marker for
scalars and constants) and static parameters, and returns a ``Strategy``: the layout each
DTensor input must have, the output layout and shape, and the local function to run on
the local pieces.  Rules never look at data and never communicate, so the same inputs give
the same decision on every rank, a bad input raises the same error on every rank before
any collective, and the dispatcher caches the decision.

Elementwise ops, unary math and matmul share one solver (``dist.tensor.solve``): every tensor dim
carries a label (an output dim, or matmul's contracted ``k``); per mesh axis one operand's
use wins (the cheapest by the cost model, the largest operand's on ties), the others follow
it by a free local slice or give theirs up, and a pending reduction survives where the op
is linear in it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...backend import get_backend
from ..checks import determinism as _det
from ..comm.hooks import count_copy
from .layout import Layout
from ..comm.process_group import world
from .shard import dim_extents_all, local_shape
from .solve import solve

__all__ = ["Strategy", "RuleError", "RULES", "register_rule", "solve", "ScalarKind", "ConstKind"]


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
    args = ", ".join(repr(m) for m in metas)
    return cls(f"rank {world().rank}: {op}({args}): {msg}")


def _xp():
    return get_backend().xp


def _kernel(name: str):
    return get_backend().kernel(name)


# --------------------------------------------------------------------------- elementwise

_BINARY = {      # op -> array-module function name
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
    "maximum": "maximum", "minimum": "minimum",
    "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
    "eq": "equal", "ne": "not_equal",
}
_LINEAR = ("sum", "avg")


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
            return a if both and a == b and a in _LINEAR else None
        if op == "mul":
            nz = [o for o in full if o]
            return nz[0] if len(nz) == 1 and nz[0] in _LINEAR else None
        if op == "div":
            return a if a in _LINEAR and b is None else None
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
    return Strategy(inputs, out, out_shape, getattr(_xp(), _BINARY[op]))


def _unary_table(xp) -> dict[str, Callable]:
    return {
        "neg": xp.negative, "abs": xp.abs, "exp": xp.exp, "log": xp.log, "sqrt": xp.sqrt,
        "rsqrt": lambda x: 1.0 / xp.sqrt(x), "tanh": xp.tanh, "sin": xp.sin, "cos": xp.cos,
        "square": xp.square, "relu": lambda x: xp.maximum(x, 0), "sigmoid": lambda x: 1.0 / (1.0 + xp.exp(-x)),
        "silu": lambda x: x / (1.0 + xp.exp(-x)),
    }


UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "square", "relu",
             "sigmoid", "silu", "astype")
_NEG = {"sum": "sum", "avg": "avg", "max": "min", "min": "max"}


@register_rule(*UNARY_OPS)
def unary_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    (meta,) = kinds
    xp = _xp()
    if op == "astype":
        (dt,) = params
        keep = meta.dtype.kind in "fc" and np.dtype(dt).kind in "fc"
        partial_rule = (lambda ops: ops[0]) if keep else (lambda ops: None)
        fn = lambda x: x.astype(dt)                                      # noqa: E731
    else:
        partial_rule = (lambda ops: _NEG[ops[0]]) if op == "neg" else (lambda ops: None)
        fn = _unary_table(xp)[op]
    labels = tuple(range(meta.ndim))
    (target,), out = solve([(meta, labels)], frozenset(), partial_rule, labels)
    return Strategy((target,), out, meta.shape, fn)


# --------------------------------------------------------------------------- matmul

@register_rule("matmul")
def matmul_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    a, b = kinds
    if any(isinstance(k, (ScalarKind, ConstKind)) for k in kinds):
        raise fail(op, kinds, "both operands must be DTensors; distribute the plain array first", TypeError)
    if a.ndim < 2 or b.ndim < 2:
        raise fail(op, kinds, "DTensor matmul needs operands with at least 2 dims; reshape a vector "
                   "of length k to (1, k) or (k, 1)")
    if a.shape[-1] != b.shape[-2]:
        raise fail(op, kinds, f"inner dims do not match: {a.shape} @ {b.shape} contracts "
                   f"{a.shape[-1]} with {b.shape[-2]}; transpose or reshape one operand")
    try:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except ValueError:
        raise fail(op, kinds, f"batch dims {a.shape[:-2]} and {b.shape[:-2]} do not broadcast") from None
    nb = len(batch)

    def labels(meta, last):
        off = nb - (meta.ndim - 2)
        lab = tuple(("b", d + off) if s == batch[d + off] else None for d, s in enumerate(meta.shape[:-2]))
        return lab + last
    tile_shape, policy = params
    det = _det.active(policy)        # fixed order: keep k whole (gathered), no pending sum
    k = None if det else "k"
    operands = [(a, labels(a, ("m", k))), (b, labels(b, (k, "n")))]

    def partial_rule(ops):
        nz = [o for o in ops if o]
        return nz[0] if len(nz) == 1 and nz[0] in _LINEAR else None
    out_labels = tuple(("b", j) for j in range(nb)) + ("m", "n")
    targets, out = solve(operands, frozenset() if det else frozenset({"k"}), partial_rule, out_labels)
    kw = {}
    if tile_shape is not None:
        kw["tile_shape"] = tile_shape
    if policy is not None:
        kw["policy"] = policy

    def local(x, y):
        xp = _xp()
        if tile_shape is not None and xp is not np:      # the GPU tile kernel reads C-contiguous operands
            return _kernel("matmul")(_contiguous(xp, x), _contiguous(xp, y), **kw)
        if xp is np:                   # BLAS takes a transposed matrix as it is; other strides it cannot
            x, y = _blas_operand(x), _blas_operand(y)
        if kw or x.ndim < 3 or y.ndim != 2 or not _rows_fold(x):
            return _kernel("matmul")(x, y, **kw)
        # (..., m, k) @ (k, n) as one (rows, k) @ (k, n) GEMM: faster than the batched loop
        return _kernel("matmul")(x.reshape(-1, x.shape[-1]), y).reshape(x.shape[:-1] + (y.shape[-1],))
    if det:
        def local(x, y):
            return _det.matmul(x, y, policy)
    return Strategy(tuple(targets), out, batch + (a.shape[-2], b.shape[-1]), local)


def _contiguous(xp, x):
    if x.flags.c_contiguous:
        return x
    count_copy(x.nbytes)
    return xp.ascontiguousarray(x)


def _blas_operand(x):
    """``x`` if BLAS can read each of its matrices in place (unit stride along rows or along
    columns: a plain or a transposed matrix), else a counted contiguous copy (NumPy's matmul
    would run its slow loop without BLAS on it)."""
    if x.size == 0 or x.flags.c_contiguous:
        return x
    it, (m, n), (sm, sn) = x.itemsize, x.shape[-2:], x.strides[-2:]
    rows = (sn == it or n == 1) and sm % it == 0 and sm >= n * it       # a strided-row matrix
    cols = (sm == it or m == 1) and sn % it == 0 and sn >= m * it       # a transposed one
    if rows or cols:
        return x
    return _contiguous(np, x)


def _rows_fold(x) -> bool:
    """Whether ``x``'s batch dims merge with its row dim without a copy (a reshape view)."""
    dims = [(n, s) for n, s in zip(x.shape[:-1], x.strides[:-1]) if n != 1]     # size-1 dims have any stride
    return all(s == s_in * n_in for (_, s), (n_in, s_in) in zip(dims, dims[1:]))


# --------------------------------------------------------------------------- reductions

def norm_axes(op: str, kinds, axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for d in axes:
        if not -ndim <= d < max(ndim, 1) or (ndim == 0):
            raise fail(op, kinds, f"axis {d} is out of range for a {ndim}-dim tensor")
        out.append(int(d) % ndim)
    if len(set(out)) != len(out):
        raise fail(op, kinds, f"axis {axis} names a dim twice")
    return tuple(sorted(out))


_RED_PARTIAL = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}
_RED_KEEP = {"sum": _LINEAR, "mean": _LINEAR, "max": ("max",), "min": ("min",)}


@register_rule("sum", "mean", "max", "min")
def reduce_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    (meta,) = kinds
    axis, keepdims = params
    axes = norm_axes(op, kinds, axis, meta.ndim)
    lay = meta.layout
    partial = {a: o for a, o in lay.partial if o in _RED_KEEP[op]}
    if op in ("sum", "mean") and _det.active():
        return _det_reduce(meta, axes, keepdims, partial, op)
    target = Layout(lay.dims, tuple(sorted(partial.items())))
    out_partial = dict(partial)
    sharded_reduced = False
    for d in axes:
        for a in lay.dims[d]:
            out_partial[a] = _RED_PARTIAL[op]
            sharded_reduced = True
    out_dims = tuple(() if d in axes else lay.dims[d] for d in range(meta.ndim) if keepdims or d not in axes)
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(meta.shape) if keepdims or d not in axes)
    out = Layout(out_dims, tuple(sorted(out_partial.items())))
    xp, ax = _xp(), axes
    if op in ("sum", "mean"):
        n = int(np.prod([meta.shape[d] for d in axes])) if op == "mean" else 1
        if op == "mean" and n == 0:
            raise fail(op, kinds, "mean over an empty dim")
        # the array's method: the same reduction as xp.sum without NumPy's function wrapper
        # (~1.2 us a call)
        fn = ((lambda x: x.sum(axis=ax, keepdims=keepdims)) if op == "sum" else
              (lambda x: x.sum(axis=ax, keepdims=keepdims) / n))
    else:
        red = xp.max if op == "max" else xp.min
        if sharded_reduced:
            # a rank may hold an empty piece of a reduced dim: start from the op's identity
            dt = meta.dtype
            big = np.inf if dt.kind == "f" else np.iinfo(dt).max if dt.kind in "iu" else True
            ident = (-big if op == "max" else big) if dt.kind != "b" else (op == "min")
            # (not ``initial=``: CuPy's max/min lack it)
            def fn(x):
                if x.size:
                    return red(x, axis=ax, keepdims=keepdims)
                shape = tuple(1 if d in ax else n for d, n in enumerate(x.shape) if keepdims or d not in ax)
                return xp.full(shape, ident, dtype=x.dtype)
        else:
            fn = lambda x: red(x, axis=ax, keepdims=keepdims)                   # noqa: E731
    return Strategy((target,), out, out_shape, fn)


def _det_reduce(meta, axes, keepdims: bool, partial: dict, op: str) -> Strategy:
    """Fixed-order sum/mean: the reduced dims are gathered, then summed in global order."""
    lay = meta.layout
    target = Layout(tuple(() if d in axes else lay.dims[d] for d in range(meta.ndim)), tuple(sorted(partial.items())))
    out_dims = tuple(() if d in axes else lay.dims[d] for d in range(meta.ndim) if keepdims or d not in axes)
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(meta.shape) if keepdims or d not in axes)
    n = int(np.prod([meta.shape[d] for d in axes])) if op == "mean" else 0
    return Strategy((target,), Layout(out_dims, target.partial), out_shape,
                    lambda x: _det.reduce_sum(x, axes, keepdims, mean_of=n))


# --------------------------------------------------------------------------- softmax and norms

def _free_dim_target(meta, d: int) -> Layout:
    """The layout with dim d unsharded and no pending reduction: its axes and pending
    reductions move to the largest other dim (one all_to_all / reduce_scatter each), or
    are gathered / all-reduced when there is no other dim."""
    lay = meta.layout
    others = [e for e in range(meta.ndim) if e != d]
    moving = list(lay.dims[d]) + [a for a, _ in lay.partial]
    dims = [list(x) for x in lay.dims]
    dims[d] = []
    if others and moving:
        e = max(others, key=lambda e: (meta.shape[e], -e))
        dims[e] += moving
    return Layout(tuple(tuple(x) for x in dims), ())


@register_rule("softmax", "layernorm", "rmsnorm")
def norm_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    meta, *extra = kinds
    if isinstance(meta, (ScalarKind, ConstKind)):
        raise fail(op, kinds, "the input must be a DTensor")
    if meta.ndim == 0:
        raise fail(op, kinds, "needs at least one dim")
    if op == "softmax":
        (axis, policy) = params
        d = norm_axes(op, kinds, axis, meta.ndim)[0]
    else:
        (eps, policy) = params
        d = meta.ndim - 1
    for k in extra:
        shp = k.shape if not isinstance(k, ConstKind) else k.shape
        if shp is not None and tuple(shp) != (meta.shape[-1],):
            raise fail(op, kinds, f"weight/bias must have shape ({meta.shape[-1]},), got {tuple(shp)}")
        if not isinstance(k, (ConstKind, ScalarKind)) and k.mesh != meta.mesh:
            raise fail(op, kinds, "weight/bias live on another mesh")
    target = _free_dim_target(meta, d)
    inputs = (target,) + tuple(None if isinstance(k, (ConstKind, ScalarKind)) else Layout(((),)) for k in extra)
    kw: dict = {} if policy is None else {"policy": policy}
    if op == "softmax":
        def local(x):
            return _kernel("softmax")(x, axis=d, **kw)
    else:
        def local(x, *wb):
            return _kernel(op)(x, *wb, eps=eps, **kw)
    return Strategy(inputs, target, meta.shape, local)


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
    xp = _xp()
    return Strategy((lay,), out, tuple(meta.shape[p] for p in perm), lambda x: xp.transpose(x, perm))


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    i = j = 0
    groups = []
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1          # noqa: E702
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1          # noqa: E702
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1      # noqa: E702
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1      # noqa: E702
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


# --------------------------------------------------------------------------- attention

@register_rule("flash_attention")
def attention_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    """q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``: batch and heads may stay sharded (each
    rank attends with its own heads); sequence and head_dim are gathered.  q's batch/head
    sharding wins; grouped-query attention (H != Hkv) keeps heads whole."""
    if any(isinstance(k, (ScalarKind, ConstKind)) for k in kinds):
        raise fail(op, kinds, "q, k and v must all be DTensors", TypeError)
    q, k, v = kinds
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise fail(op, kinds, "q, k, v must be 4-D (batch, heads, seq, head_dim)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise fail(op, kinds, "shapes must be q (B, H, Sq, D), k and v (B, Hkv, Sk, D) with H % Hkv == 0")
    causal, scale, policy = params
    heads = q.layout.dims[1] if q.shape[1] == k.shape[1] else ()
    target = Layout((q.layout.dims[0], heads, (), ()))
    kw: dict = {} if policy is None else {"policy": policy}

    def local(x, y, z):
        return _kernel("flash_attention")(x, y, z, causal=causal, scale=scale, **kw)
    return Strategy((target, target, target), target, q.shape, local)
