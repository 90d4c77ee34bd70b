"""The steps of a redistribution plan: one mesh axis per step, or one direct all_to_all.

Each step is exactly one collective (all_gather, reduce_scatter, all_reduce, all_to_all)
or one local action (slice, or turning a replicated value into a pending reduction).
The one-axis planner (``_Planner``) works on the per-dim axis tuples of a Layout:

1. pending reductions that end replicated (or as another op) are all_reduced first, while
   the tensor is still small;
2. free local slices are taken as early as possible (they shrink later steps);
3. shard axes leave their dims from the minor end: straight into the dim they are going
   to with one all_to_all when that dim is ready for them, otherwise by all_gather;
4. axes are appended to dims: by slice when replicated, by reduce_scatter when pending;
5. replicated axes that end pending become so locally (sum: rank 0 of the axis keeps the
   value, the others hold zeros).

A step over a mesh axis of size 1 moves nothing and is a local "relabel".  Bytes per step
are counted as ``trace_collectives`` counts them (the nccl-tests bus factor times the data).

The same change without a change of pending reductions can also run as one direct
all_to_all(v) over the group of axes that shard the changed dims (``direct_step``: each
rank sends each peer exactly the part of its piece the peer will hold).  Which of the two
a plan takes is ``redistribute``'s choice; this module only builds steps, from global
metadata and this rank's mesh position.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from itertools import product

from ..comm import collectives as C
from ..comm.mesh import Mesh
from .layout import Layout
from .shard import dim_extent, local_shape_at, split_sizes

__all__ = ["Step", "one_axis_steps", "direct_step"]

_COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class Step:
    """One step of a plan: ``kind`` over mesh ``axis``, taking layout ``src`` to ``dst``.
    The planner makes steps; they are read, not built by hand.

    Parameters
    ----------
    kind : str
        The collective (all_gather, all_to_all, reduce_scatter, ...) or local step (slice, ...).
    axis : str
        The mesh axis (or axes, joined) it runs over.
    src, dst : Layout
        The layouts before and after.
    detail : str
        What it does, for display.
    bytes_sent : int
        The most any rank sends.
    bytes_by_position : tuple
        What each position of the group sends.
    local : callable, optional
        A local step's function on this rank's piece (slice, partialize); None for a
        collective (its ``spec``) or a relabel.
    copy_bytes : int
        The most any rank copies locally (slices, packing).
    spec : tuple, optional
        A collective's arguments, which ``compiled_plan`` compiles (None: not a collective).
    """

    __slots__ = ("kind", "axis", "src", "dst", "detail", "bytes_sent", "bytes_by_position", "local", "copy_bytes",
                 "spec")

    def __init__(self, kind: str, axis: str, src: Layout, dst: Layout, detail: str, bytes_sent: int,
                 bytes_by_position: tuple, local: Callable | None = None, copy_bytes: int = 0,
                 spec: tuple | None = None) -> None:
        self.kind, self.axis, self.src, self.dst, self.detail = kind, axis, src, dst, detail
        self.bytes_sent, self.bytes_by_position, self.local = bytes_sent, bytes_by_position, local
        self.copy_bytes = copy_bytes          # the most any rank copies locally (slices, packing)
        self.spec = spec

    @property
    def is_collective(self) -> bool:
        return self.kind in _COLLECTIVE_KINDS

    def __repr__(self) -> str:
        return (f"{self.kind}({self.axis}) {self.src!r} -> {self.dst!r} [{self.detail}] "
                f"sends {self.bytes_sent} B")


# --------------------------------------------------------------------------- planning

class _State:
    def __init__(self, lay: Layout):
        self.dims = [list(a) for a in lay.dims]
        self.partial = dict(lay.partial)

    def layout(self) -> Layout:
        return Layout(tuple(tuple(a) for a in self.dims), tuple(sorted(self.partial.items())))

    def is_free(self, a: str) -> bool:
        return a not in self.partial and all(a not in axes for axes in self.dims)


class _Planner:
    def __init__(self, shape, src: Layout, dst: Layout, mesh, itemsize: int):
        self.shape, self.src, self.dst, self.mesh, self.itemsize = shape, src, dst, mesh, itemsize
        self.cur = _State(src)
        self.coords = mesh.coords
        self.positions = list(product(*(range(n) for n in mesh.sizes)))
        self.tgt_pos = {a: (d, i) for d, axes in enumerate(dst.dims) for i, a in enumerate(axes)}
        self.steps: list[Step] = []

    # geometry of the current state ------------------------------------------------
    def extent(self, d: int, axes, coords: dict | None = None) -> int:
        """Length along dim d of this rank's piece when d is sharded over ``axes``."""
        coords = coords or self.coords
        sizes = tuple(self.mesh.size(a) for a in axes)
        return dim_extent(self.shape[d], sizes, tuple(coords[a] for a in axes))[1]

    def _bytes(self, kind: str, axis: str, before: Layout, after: Layout) -> tuple[int, ...]:
        if kind not in _COLLECTIVE_KINDS:
            return (0,) * len(self.positions)
        n = self.mesh.size(axis)
        f = C.bus_factor(kind, n)
        lay = after if kind == "all_gather" else before
        out = []
        for pos in self.positions:
            numel = 1
            for s in local_shape_at(self.shape, lay, self.mesh, pos):
                numel *= s
            out.append(int(round(numel * self.itemsize * f)))
        return tuple(out)

    def _do(self, kind: str, axis: str, detail: str, mutate: Callable, spec=None, local=None) -> None:
        if kind in _COLLECTIVE_KINDS and self.mesh.size(axis) == 1:
            # an axis of size 1: every placement holds the same data, so only the label changes
            kind, detail, spec = "relabel", f"{kind} over an axis of size 1: nothing moves", None
        before = self.cur.layout()
        mutate()
        after = self.cur.layout()
        by_pos = self._bytes(kind, axis, before, after)
        mine = by_pos[self.positions.index(tuple(self.coords[a] for a in self.mesh.axes))]
        copy = 0
        if kind == "slice":
            copy = self.itemsize * max(math.prod(local_shape_at(self.shape, after, self.mesh, p))
                                       for p in self.positions)
        self.steps.append(Step(kind, axis, before, after, detail, mine, by_pos, local, copy, spec))

    # the five kinds of step ------------------------------------------------------
    def all_reduce(self, a: str) -> None:
        op = self.cur.partial[a]
        self._do("all_reduce", a, f"op={op}", lambda: self.cur.partial.pop(a), (a, op))

    def all_gather(self, d: int) -> None:
        a = self.cur.dims[d][-1]
        sizes = split_sizes(self.extent(d, self.cur.dims[d][:-1]), self.mesh.size(a))
        self._do("all_gather", a, f"dim {d}, sizes {list(sizes)}", lambda: self.cur.dims[d].pop(), (a, d, tuple(sizes)))

    def slice(self, d: int, a: str) -> None:
        n = self.mesh.size(a)
        off, size = dim_extent(self.extent(d, self.cur.dims[d]), (n,), (self.coords[a],))
        index = (slice(None),) * d + (slice(off, off + size),)

        def run(x):
            return x[index].copy()
        self._do("slice", a, f"dim {d}, [{off}:{off + size}]", lambda: self.cur.dims[d].append(a), local=run)

    def reduce_scatter(self, d: int, a: str) -> None:
        op = self.cur.partial[a]
        sizes = split_sizes(self.extent(d, self.cur.dims[d]), self.mesh.size(a))

        def mutate():
            self.cur.partial.pop(a)
            self.cur.dims[d].append(a)
        self._do("reduce_scatter", a, f"op={op}, dim {d}, sizes {list(sizes)}", mutate, (a, op, d, tuple(sizes)))

    def all_to_all(self, d: int, e: int) -> None:
        a = self.cur.dims[d][-1]
        n = self.mesh.size(a)
        split = split_sizes(self.extent(e, self.cur.dims[e]), n)
        recv = split_sizes(self.extent(d, self.cur.dims[d][:-1]), n)

        def mutate():
            self.cur.dims[d].pop()
            self.cur.dims[e].append(a)
        self._do("all_to_all", a, f"dim {d} -> {e}", mutate, (a, d, e, tuple(split), tuple(recv)))

    def partialize(self, a: str, op: str) -> None:
        xp_zero = op == "sum" and self.coords[a] != 0

        def run(x):
            if not xp_zero:
                return x
            from ...backend import get_backend
            return get_backend().xp.zeros_like(x)
        self._do("partialize", a, f"op={op}" + (", zeros here" if xp_zero else ""),
                 lambda: self.cur.partial.__setitem__(a, op), local=run)

    # the plan --------------------------------------------------------------------
    def prefix_len(self, d: int) -> int:
        cur, tgt = self.cur.dims[d], self.dst.dims[d]
        n = 0
        while n < len(cur) and n < len(tgt) and cur[n] == tgt[n]:
            n += 1
        return n

    def add_ready(self, d: int, upto: int | None = None) -> None:
        """Append free (slice) or pending (reduce_scatter) axes to dim d while it is a prefix
        of its target, up to position ``upto``."""
        tgt = self.dst.dims[d]
        upto = len(tgt) if upto is None else upto
        while len(self.cur.dims[d]) < upto and self.prefix_len(d) == len(self.cur.dims[d]):
            a = tgt[len(self.cur.dims[d])]
            if a in self.cur.partial:
                self.reduce_scatter(d, a)
            elif self.cur.is_free(a):
                self.slice(d, a)
            else:
                break

    def can_reach(self, e: int, i: int) -> bool:
        cur, tgt = self.cur.dims[e], self.dst.dims[e]
        if len(cur) > i or cur != list(tgt[:len(cur)]):
            return False
        return all(a in self.cur.partial or self.cur.is_free(a) for a in tgt[len(cur):i])

    def plan(self) -> list[Step]:
        cur, dst, ndim = self.cur, self.dst, len(self.shape)
        want_partial = dict(dst.partial)
        for a in [a for a in self.mesh.axes if a in cur.partial]:
            if a not in self.tgt_pos and want_partial.get(a) != cur.partial[a]:
                self.all_reduce(a)
        for d in range(ndim):
            self.add_ready(d)
        while True:
            pending = [d for d in range(ndim) if len(cur.dims[d]) > self.prefix_len(d)]
            if not pending:
                break
            progressed = False
            for d in pending:
                if len(cur.dims[d]) <= self.prefix_len(d):
                    continue
                a = cur.dims[d][-1]
                e, i = self.tgt_pos.get(a, (d, -1))
                if e != d:
                    if self.can_reach(e, i):
                        self.add_ready(e, i)
                        self.all_to_all(d, e)
                        progressed = True
                    continue          # its dim is not ready yet: let others move first
                self.all_gather(d)
                progressed = True
            if not progressed:
                self.all_gather(pending[0])
            for d in range(ndim):
                self.add_ready(d)
        for a, op in dst.partial:
            if cur.partial.get(a) != op:
                assert a not in cur.partial, (a, cur.partial)
                self.partialize(a, op)
        assert cur.layout() == dst, (cur.layout(), dst)
        return self.steps


def one_axis_steps(shape: tuple, src: Layout, dst: Layout, mesh: Mesh, itemsize: int) -> list[Step]:
    """The steps from ``src`` to ``dst``, one mesh axis each (the module docstring's order).

    Parameters
    ----------
    shape : tuple of int
        The tensor's global shape.
    src, dst : Layout
        Its layout now and the one wanted.
    mesh : Mesh
        The mesh; this rank's coordinates on it pick its slices.
    itemsize : int
        Bytes per element, for the steps' byte counts.

    Returns
    -------
    list of Step
        In order; empty when ``src == dst``.
    """
    return _Planner(shape, src, dst, mesh, itemsize).plan()


# --------------------------------------------------------------------------- one direct all_to_all
# Any change of sharded dims without a change of pending reductions can also run as ONE
# all_to_all(v) over the group of the mesh axes that shard the changed dims in ``src``:
# each rank sends every peer the part of its piece that the peer's ``dst`` piece covers.
# Axes that shard a changed dim only in ``dst`` are outside that group, so a receiver's
# coordinates on them equal its senders' and the senders' pieces tile its own exactly.

def _box(shape, lay: Layout, mesh, coords: dict) -> list[tuple[int, int]]:
    return [dim_extent(shape[d], tuple(mesh.size(a) for a in axes), tuple(coords[a] for a in axes))
            for d, axes in enumerate(lay.dims)]


def _meet(b1, b2):
    """The intersection of two boxes as (offset, length) per dim, or None when empty."""
    out = []
    for (o1, n1), (o2, n2) in zip(b1, b2):
        lo, hi = max(o1, o2), min(o1 + n1, o2 + n2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return out


def _rel(box, base) -> tuple:
    return tuple(slice(o - b, o - b + n) for (o, n), (b, _) in zip(box, base))


def direct_step(shape: tuple, src: Layout, dst: Layout, mesh: Mesh, itemsize: int) -> Step | None:
    """The one all_to_all(v) step taking ``src`` to ``dst``, or None where none applies (the
    pending reductions change, nothing changes, or the group of axes is one rank).

    Parameters
    ----------
    shape, src, dst, mesh, itemsize
        As for ``one_axis_steps``; this rank's coordinates pick its send and receive boxes.

    Returns
    -------
    Step or None
        The step, its ``spec`` the group, this rank's boxes and counts, and its piece's shape.
    """
    if src.partial != dst.partial or src == dst:
        return None
    changed = [d for d in range(len(shape)) if src.dims[d] != dst.dims[d]]
    involved = {a for d in changed for a in src.dims[d] + dst.dims[d]}
    group = tuple(a for a in mesh.axes if a in involved and src.dim_of(a) is not None)
    sizes = tuple(mesh.size(a) for a in group)
    n = math.prod(sizes)
    if n <= 1:
        return None

    def peers(coords: dict) -> list[dict]:
        return [{**coords, **dict(zip(group, idx))} for idx in product(*(range(s) for s in sizes))]

    def counts(coords: dict) -> tuple[list, list]:
        """(send parts, receive parts) of the rank at ``coords``: (box or None) per peer."""
        mine_src, mine_dst = _box(shape, src, mesh, coords), _box(shape, dst, mesh, coords)
        ps = peers(coords)
        return ([_meet(mine_src, _box(shape, dst, mesh, q)) for q in ps],
                [_meet(_box(shape, src, mesh, q), mine_dst) for q in ps])

    def numel(box) -> int:
        return 0 if box is None else math.prod(n for _, n in box)

    f = C.bus_factor("all_to_all", n)
    by_pos, most = [], 0
    for pos in product(*(range(s) for s in mesh.sizes)):
        sent = sum(numel(b) for b in counts(dict(zip(mesh.axes, pos)))[0])
        by_pos.append(int(round(sent * itemsize * f)))
        most = max(most, sent * itemsize)
    coords = mesh.coords
    assert coords is not None                       # (a plan is made on a member rank)
    me = dict(coords)
    send_boxes, recv_boxes = counts(me)
    src_base, dst_base = _box(shape, src, mesh, me), _box(shape, dst, mesh, me)
    send = [(_rel(b, src_base), numel(b), tuple(n for _, n in b)) for b in send_boxes if b is not None]
    recv = [(_rel(b, dst_base), numel(b), tuple(n for _, n in b)) for b in recv_boxes if b is not None]
    send_counts, recv_counts = [numel(b) for b in send_boxes], [numel(b) for b in recv_boxes]
    out_shape = tuple(n for _, n in dst_base)
    axis = ",".join(group)

    mine = by_pos[list(product(*(range(s) for s in mesh.sizes))).index(tuple(me[a] for a in mesh.axes))]
    return Step("all_to_all", axis, src, dst, f"direct: dims {changed} over ({axis}) in one exchange",
                mine, tuple(by_pos), None, 2 * most, (group, send, recv, tuple(send_counts), tuple(recv_counts), out_shape))
