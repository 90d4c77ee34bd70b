"""Sharding rules of the ops that reduce over a dim: matmul (over ``k``), sum/mean/max/min,
softmax and the norms (over their dim), flash attention (over the keys), and the embedding
(a gather whose row-sharded table leaves a pending sum) with its scatter-add backward.

Each is registered in ``rules.RULES`` on import (``dispatch`` imports this module, so the
rules are there whenever DTensor ops run).  Matmul shares the solver of the elementwise
rules (``dist.tensor.solve``): its contracted dim carries the label ``k``, which may stay
sharded as a pending sum; a fixed-order (deterministic) run keeps it whole instead.
Reductions over a sharded dim leave the reduction pending; softmax, the norms and
attention move their reduced dims' axes elsewhere first (``_free_dim_target``), so their
local kernels see whole rows.
"""
from __future__ import annotations

import numpy as np

from ...backend import get_backend
from ..checks import determinism as _det
from ..comm.hooks import count_copy
from .layout import Layout
from .rules import LINEAR, ConstKind, ScalarKind, Strategy, array_module, fail, register_rule
from .shard import local_offsets, local_shape
from .solve import solve

__all__ = ["matmul_rule", "reduce_rule", "norm_rule", "attention_rule", "norm_axes", "embedding_rule",
           "embedding_backward_rule"]


def _kernel(name: str):
    return get_backend().kernel(name)


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
        return nz[0] if len(nz) == 1 and nz[0] in LINEAR else None
    out_labels = tuple(("b", j) for j in range(nb)) + ("m", "n")
    targets, out = solve(operands, frozenset() if det else frozenset({"k"}), partial_rule, out_labels)
    kw = {}
    if tile_shape is not None:
        kw["tile_shape"] = tile_shape
    if policy is not None:
        kw["policy"] = policy

    def local(x, y):
        xp = array_module()
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
_RED_KEEP = {"sum": LINEAR, "mean": LINEAR, "max": ("max",), "min": ("min",)}


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
    xp, ax = array_module(), axes
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
            fn = lambda x: red(x, axis=ax, keepdims=keepdims)
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
    def softmax_local(x):
        return _kernel("softmax")(x, axis=d, **kw)

    def norm_local(x, *wb):
        return _kernel(op)(x, *wb, eps=eps, **kw)
    return Strategy(inputs, target, meta.shape, softmax_local if op == "softmax" else norm_local)


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


# --------------------------------------------------------------------------- embedding

def _embedding_layouts(op: str, kinds: tuple, ids, table):
    """(ids target, table target, the table's row axes, this rank's first row): the table's
    rows may stay sharded (a vocab-parallel table); its width and the ids over those axes are
    gathered."""
    if isinstance(ids, (ScalarKind, ConstKind)) or isinstance(table, (ScalarKind, ConstKind)):
        raise fail(op, kinds, "ids and table must both be DTensors (distribute the plain one first)", TypeError)
    if table.ndim != 2 or np.dtype(ids.dtype).kind not in "iu":
        raise fail(op, kinds, "needs integer ids and a 2-D (vocab, dim) table")
    if table.mesh != ids.mesh:
        raise fail(op, kinds, "ids and table live on different meshes")
    rows = tuple(table.layout.dims[0])
    ids_t = Layout(tuple(tuple(a for a in d if a not in rows) for d in ids.layout.dims), ())
    table_t = Layout((rows, ()), ())
    lo = local_offsets(table.shape, table_t, table.mesh)[0]
    return ids_t, table_t, rows, lo


@register_rule("embedding")
def embedding_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    """``table[ids]``: each rank gathers the ids in its rows of the table (zeros for the
    others), so a row-sharded table gives a pending sum over its row axes, no gather of the
    table (the vocab-parallel embedding without a one-hot GEMM)."""
    ids, table = kinds
    ids_t, table_t, rows, lo = _embedding_layouts(op, kinds, ids, table)
    out = Layout(ids_t.dims + ((),), tuple(sorted((a, "sum") for a in rows)))

    def local(i, t):
        return _kernel("embedding")(i, t, lo=lo)
    return Strategy((ids_t, table_t), out, tuple(ids.shape) + (table.shape[1],), local)


@register_rule("embedding_backward")
def embedding_backward_rule(op: str, kinds: tuple, params: tuple) -> Strategy:
    """The table's cotangent: a scatter-add of ``g``'s rows into this rank's table rows, pending
    a sum over the axes the ids are sharded on (each rank saw its own tokens)."""
    g, ids, table = kinds
    ids_t, table_t, rows, lo = _embedding_layouts(op, kinds, ids, table)
    g_t = Layout(ids_t.dims + ((),), ())
    n_rows = local_shape(table.shape, table_t, table.mesh)[0]
    out = Layout(table_t.dims, tuple(sorted((a, "sum") for a in ids_t.sharded_axes)))

    def local(gl, i, _t):
        return _kernel("embedding_backward")(gl, i, n_rows, lo=lo)
    return Strategy((g_t, ids_t, table_t), out, tuple(table.shape), local)
