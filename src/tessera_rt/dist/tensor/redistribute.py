"""Redistribution plans: from one layout to another, one mesh axis per step.

Each step is exactly one collective (all_gather, reduce_scatter, all_reduce, all_to_all)
or one local action (slice, or turning a replicated value into a pending reduction).
The planner works on the per-dim axis tuples of a Layout:

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

When that plan takes several steps, the same change without a change of pending reductions
can also run as one direct all_to_all(v) over the group of axes that shard the changed dims
(each rank sends each peer exactly the part of its piece the peer will hold).  The
registered cost model (``dist.cost``) picks the cheaper of the two; ties keep the steps.
Each step's predicted time is part of the plan's printout.

Plans are pure functions of (global shape, layouts, mesh, itemsize, cost model) and this
rank's mesh position, so they are cached (a new cost model clears the cache).  A plan runs
one way (``Plan.run``): compiled once, on its first run, into communicator calls and local
copies (``compiled_plan``), which every run takes -- watched or not; ``dist/_hot.c`` runs
the same compiled form for a repeat.
"""
from __future__ import annotations

import math
from functools import lru_cache
from itertools import product
from typing import Callable

from ..comm import collectives as C
from ..comm.hooks import SEAM
from .cost import get_cost_model, on_change, plan_time, step_time
from .layout import Layout
from .shard import dim_extent, local_shape_at, split_sizes

# Plan.run's repeat path in C (guard, the check's remembered site, the compiled function),
# with the collectives' C path; None keeps it in Python (TESSERA_HOT=0, no compiler)
_fast_run = C._hot.run_compiled if C._hot is not None else None

__all__ = ["Step", "Plan", "plan_redistribute"]

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


class Plan:
    """The steps from ``src`` to ``dst`` for a tensor of global ``shape`` on ``mesh``
    (``plan_redistribute`` makes them; ``run`` runs one on a rank's piece).

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    src, dst : Layout
        The layouts before and after.
    mesh : Mesh
        The mesh.
    steps : iterable of Step
        In order.
    dtype_name : str
        The element type's name.
    """

    __slots__ = ("shape", "src", "dst", "mesh", "steps", "dtype_name", "check_meta", "_exec", "_verified")

    def __init__(self, shape: tuple, src: Layout, dst: Layout, mesh: Mesh, steps: tuple, dtype_name: str) -> None:
        self.shape, self.src, self.dst, self.mesh = shape, src, dst, mesh
        self.steps: tuple[Step, ...] = tuple(steps)
        self.dtype_name = dtype_name
        # what the agreement check reports for a collective run by this plan (SEAM.moving)
        self.check_meta = (dtype_name, tuple(shape), repr(src), repr(dst))
        # (array type, dtype, input shape, compiled function, check arguments per collective)
        # once compiled (compiled_plan)
        self._exec = None
        self._verified = None            # consistency.check_run's record of the last verified run

    def run(self, x: object, out: object = None) -> object:
        """This rank's piece ``x`` in ``dst`` (written into ``out``, a C-contiguous array of the
        result's local shape and dtype, when given).  Every run takes the compiled form
        (``compiled_plan``, made on the first run; a repeat on a plain array runs it from C):
        the agreement check for every collective of the plan before the first moves data,
        then the steps; while something watches collectives each communicator call reports
        to the watchers as the array collective's does.

        Parameters
        ----------
        x : array
            This rank's piece in ``src``.
        out : array, optional
            Receives the result.

        Returns
        -------
        array
            This rank's piece in ``dst``.
        """
        ex = self._exec
        if ex is not None and _fast_run is not None:     # this path in C (dist/comm/_hot.c), or NotImplemented
            # (1: this frame, as check_run counts)
            res = _fast_run(self, x, 1) if out is None else _fast_run(self, x, 1, out)
            if res is not NotImplemented:
                return res
        if not self.steps:
            return x if out is None else _into(out, x)
        watched = SEAM.watchers
        if watched:                              # the watchers' records name the DTensor moved
            moving, SEAM.moving = SEAM.moving, self.check_meta
        try:
            if ex is None or x.__class__ is not ex[0] or x.dtype != ex[1] or x.shape != ex[2]:
                ex = self._compile(x)
            check_run = SEAM.check_run
            if check_run is not None:            # (the agreement check is on)
                check_run(self, ex[4])
            x = x if x.flags.c_contiguous else C.backend().xp.ascontiguousarray(x)
            return ex[3](x) if out is None else ex[3](x, out)
        finally:
            if watched:
                SEAM.moving = moving

    def _compile(self, x):
        """The compiled form for pieces like ``x`` (kept for the next run); makes the groups its
        steps need that do not exist yet (collectively, as on every rank)."""
        from .compiled_plan import compile_plan
        fn, in_shape, checks = compile_plan(self, C.backend(), x)
        self._exec = (x.__class__, x.dtype, in_shape, fn, checks)
        return self._exec

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps if s.is_collective)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends over the whole plan."""
        return sum(s.bytes_sent for s in self.steps)

    def step_times(self) -> list[float]:
        """Seconds the registered cost model (dist.cost) predicts for each step.

        Returns
        -------
        list of float
            One per step.
        """
        return [step_time(s, self.mesh) for s in self.steps]

    @property
    def predicted_s(self) -> float:
        """Seconds the registered cost model predicts for the whole plan."""
        return sum(self.step_times())

    @property
    def max_bytes_sent(self) -> int:
        """The most any one rank sends over the whole plan."""
        if not self.steps:
            return 0
        return max(sum(col) for col in zip(*(s.bytes_by_position for s in self.steps)))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __repr__(self) -> str:
        head = (f"redistribute {self.dtype_name}{list(self.shape)} on {self.mesh!r}: "
                f"{self.src!r} -> {self.dst!r}")
        if not self.steps:
            return head + "\n  (nothing to do)"
        lines = [head]
        times = self.step_times()
        for i, (s, t) in enumerate(zip(self.steps, times), 1):
            lines.append(f"  {i}. {s.kind:<14} over {s.axis:<6} {s.src!r} -> {s.dst!r}  [{s.detail}]  "
                         f"sends {s.bytes_sent} B (max over ranks {max(s.bytes_by_position)} B)  "
                         f"predicted {_fmt_s(t)}")
        n = len(self.collectives)
        lines.append(f"  total: {n} collective{'s' * (n != 1)}, {self.bytes_sent} B sent by this rank, "
                     f"at most {self.max_bytes_sent} B by any rank, predicted {_fmt_s(sum(times))} "
                     f"({get_cost_model().name})")
        return "\n".join(lines)

    __str__ = __repr__


def _fmt_s(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _into(out, x):
    C.backend().xp.copyto(out, x)
    return out


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


def _direct_step(shape, src: Layout, dst: Layout, mesh, itemsize: int) -> Step | None:
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
    me = dict(mesh.coords)
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


@lru_cache(maxsize=4096)
def _plan_cached(shape: tuple, src: Layout, dst: Layout, mesh, itemsize: int, dtype_name: str,
                 direct: bool | None = None) -> Plan:
    if src == dst:
        return Plan(shape, src, dst, mesh, [], dtype_name)
    stepwise = Plan(shape, src, dst, mesh, _Planner(shape, src, dst, mesh, itemsize).plan(), dtype_name)
    if direct is False or len(stepwise.collectives) == 0 or (direct is None and len(stepwise.steps) < 2):
        return stepwise
    one = _direct_step(shape, src, dst, mesh, itemsize)
    if one is None:
        return stepwise
    alt = Plan(shape, src, dst, mesh, [one], dtype_name)
    # ties keep the one-axis-per-step plan; every rank compares the same numbers
    return alt if direct or plan_time(alt) < plan_time(stepwise) * (1 - 1e-9) else stepwise


on_change(_plan_cached.cache_clear)


def plan_redistribute(shape: tuple, src: Layout, dst: Layout, mesh: Mesh, dtype: object, *,
                      direct: bool | None = None) -> Plan:
    """The (cached) plan taking a tensor of global ``shape`` from ``src`` to ``dst``.

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    src, dst : Layout
        The layouts before and after.
    mesh : Mesh
        The mesh.
    dtype : str or dtype
        The element type.
    direct : bool, optional
        None picks, by the registered cost model (``dist.cost``), between the
        one-axis-per-step plan and one direct all_to_all over the axes involved (ties: the
        steps); False forces the steps, True the direct all_to_all where one applies (the
        same pending reductions before and after).

    Returns
    -------
    Plan
        The plan (cached per shape, layouts, mesh and dtype).
    """
    from ...dtypes import dtype_name
    import numpy as np
    dt = np.dtype(dtype)
    return _plan_cached(tuple(shape), src, dst, mesh, dt.itemsize, dtype_name(dt), direct)
