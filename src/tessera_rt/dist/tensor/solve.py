"""The layout solver shared by elementwise ops, unary math and matmul (see ``rules``).

Every tensor dim carries a label (an output dim, or matmul's contracted ``k``).  Per mesh
axis, an operand that shards a labelled dim over it proposes that label; the others follow
the winner by a free local slice or give theirs up, and a pending reduction survives where
the op is linear in it.  When operands propose different labels the combinations are priced
by the registered cost model (``dist.cost``); ties keep the old rule, the largest operand's.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import islice, product
from typing import Any

import numpy as np

from .cost import get_cost_model
from .layout import Layout
from .redistribute import plan_redistribute
from .shard import local_shape_at

__all__ = ["solve"]


def solve(operands, contracted: frozenset, partial_rule: Callable, out_labels: tuple):
    """operands: [(TensorMeta, labels)] with labels[d] a label or None (a broadcast dim).
    Returns (target layout per operand, output layout).

    Per mesh axis, an operand that shards a labelled dim over it proposes that label.  When
    operands propose different labels (a conflict), every combination of proposals is
    priced by the registered cost model (``dist.cost``): the operands' redistribution plus,
    for an axis left pending a sum over a contracted dim, one reduce_scatter of the output
    (the least a consumer pays to resolve it).  The cheapest wins; ties keep the old rule,
    the largest operand's proposal."""
    mesh = operands[0][0].mesh
    order = sorted(range(len(operands)), key=lambda i: (-operands[i][0].nbytes, i))
    label_of: dict[str, Any] = {}
    kept_partial: dict[str, tuple] = {}
    proposals: dict[str, list] = {}
    for a in mesh.axes:
        uses: list[tuple | None] = []
        for meta, labels in operands:
            d = meta.layout.dim_of(a)
            uses.append(("L", labels[d]) if d is not None and labels[d] is not None else
                        ("B",) if d is not None else
                        ("P", meta.layout.partial_op(a)) if meta.layout.partial_op(a) else None)
        labs = [u[1] for u in (uses[i] for i in order) if u and u[0] == "L"]
        if labs:
            label_of[a] = labs[0]
            distinct = list(dict.fromkeys(labs))
            if len(distinct) > 1:
                proposals[a] = distinct
            continue
        ops = tuple(u[1] if u and u[0] == "P" else None for u in uses)
        if any(ops):
            out_op = partial_rule(ops)
            if out_op is not None:
                kept_partial[a] = (out_op, ops)
    best = _assemble(operands, order, label_of, kept_partial, contracted, out_labels)
    if proposals:
        best = _cheapest(operands, order, label_of, proposals, kept_partial, contracted, out_labels, best)
    return best


def _assemble(operands, order, label_of, kept_partial, contracted, out_labels):
    seq: dict[Any, list[str]] = {}
    for i in order:
        meta, labels = operands[i]
        for d, axes in enumerate(meta.layout.dims):
            for a in axes:
                if labels[d] is not None and label_of.get(a) == labels[d]:
                    s = seq.setdefault(labels[d], [])
                    if a not in s:
                        s.append(a)
    targets = []
    for i, (meta, labels) in enumerate(operands):
        dims = tuple(tuple(seq.get(lab, ())) if lab is not None else () for lab in labels)
        partial = tuple(sorted((a, ops[i]) for a, (_, ops) in kept_partial.items() if ops[i]))
        targets.append(Layout(dims, partial))
    out_partial = {a: op for a, (op, _) in kept_partial.items()}
    for lab in contracted:
        for a in seq.get(lab, ()):
            out_partial[a] = "sum"
    out = Layout(tuple(tuple(seq.get(lab, ())) for lab in out_labels), tuple(sorted(out_partial.items())))
    return targets, out


_MAX_CANDIDATES = 64


def _cheapest(operands, order, label_of, proposals, kept_partial, contracted, out_labels, first):
    """The assignment of proposals with the lowest predicted time (``first``, the largest
    operand's, on ties).  Rules see no data: the prices are the same on every rank."""
    model = get_cost_model()
    mesh = operands[0][0].mesh
    out_dtype = np.result_type(*(m.dtype for m, _ in operands))
    out_shape = _out_shape(operands, out_labels)

    def price(targets, out) -> float:
        t = 0.0
        for (meta, _), tgt in zip(operands, targets):
            if tgt != meta.layout:
                t += plan_redistribute(meta.shape, meta.layout, tgt, mesh, meta.dtype).predicted_s
        new_pending = [a for a, _ in out.partial if a not in kept_partial]
        if new_pending and out_shape is not None:
            most = max(int(np.prod(s)) for s in _local_shapes(out_shape, out, mesh)) * out_dtype.itemsize
            for a in new_pending:
                t += model.collective_time("reduce_scatter", most, mesh.size(a))
        return t

    axes = list(proposals)
    best, best_t = first, price(*first)
    for combo in islice(product(*(proposals[a] for a in axes)), 1, _MAX_CANDIDATES):
        cand = _assemble(operands, order, {**label_of, **dict(zip(axes, combo))}, kept_partial, contracted,
                         out_labels)
        try:
            for (meta, _), tgt in zip(operands, cand[0]):
                tgt.validate(meta.shape, mesh, what="candidate")
        except ValueError:
            continue
        t = price(*cand)
        if t < best_t * (1 - 1e-9):
            best, best_t = cand, t
    return best


def _out_shape(operands, out_labels):
    """The output's global shape from the operands' labelled dims (None if one is missing)."""
    size = {}
    for meta, labels in operands:
        for d, lab in enumerate(labels):
            if lab is not None:
                size.setdefault(lab, meta.shape[d])
    if any(lab not in size for lab in out_labels):
        return None
    return tuple(size[lab] for lab in out_labels)


def _local_shapes(shape, lay, mesh):
    return [local_shape_at(shape, lay, mesh, pos) for pos in product(*(range(n) for n in mesh.sizes))]
