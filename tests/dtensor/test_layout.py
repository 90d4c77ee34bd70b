"""Layouts, shard math and redistribution plans, in one process.

Plans are checked on a stand-in mesh of any shape (only geometry is needed to plan); the
data movement itself is checked under mpiexec in tests/dtensor/mpi_dtensor_layouts.py.
"""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from tessera_rt import dist
from tessera_rt.dist.tensor.layout import Layout, LayoutError
from tessera_rt.dist.tensor.redistribute import plan_redistribute
from tessera_rt.dist.tensor.shard import dim_extent, split_offsets, split_sizes


class GridMesh:
    """Just the geometry of a mesh, seen from position ``coords`` (no communicators)."""

    def __init__(self, shape: dict, coords: dict | None = None):
        self.axes = tuple(shape)
        self.sizes = tuple(shape.values())
        self.coords = coords or {a: 0 for a in self.axes}

    def size(self, axis=None):
        if axis is None:
            n = 1
            for s in self.sizes:
                n *= s
            return n
        return self.sizes[self.axes.index(axis)]

    def _require_member(self, what):
        pass

    def __repr__(self):
        return "GridMesh(" + ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.sizes)) + ")"

    def __hash__(self):
        return hash((self.axes, self.sizes, tuple(self.coords.items())))

    def __eq__(self, other):
        return isinstance(other, GridMesh) and hash(self) == hash(other)


M22 = GridMesh({"tp": 2, "dp": 2})
M4 = GridMesh({"tp": 4})


# --------------------------------------------------------------------------- specs

def test_specs_are_frozen_hashable_with_short_reprs():
    col = dist.ShardSpec(partition=("col",), mesh_axes=("tp",))
    assert col == dist.ShardSpec(partition=("col",), mesh_axes=("tp",))
    assert hash(col) == hash(dist.ShardSpec(partition=["col"], mesh_axes=["tp"]))
    assert repr(col) == "S(col@tp)"
    assert repr(dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp"))) == "S(row@tp, col@dp)"
    assert repr(dist.ShardSpec(partition=("col",), mesh_axes=("tp", "dp"))) == "S(col@tp.dp)"
    assert repr(dist.ReplicateSpec(mesh_axes=("tp", "dp"))) == "R"
    assert repr(dist.PartialSpec("max", mesh_axes=("tp",))) == "P(max@tp)"
    with pytest.raises(Exception):
        col.partition = (0,)
    assert len({col, dist.ReplicateSpec(), dist.PartialSpec(), col}) == 3


def test_layout_reprs_and_placements():
    lay = Layout(((), ("tp",)))
    assert repr(lay) == "S(1)@tp"
    assert repr(Layout(((), ()))) == "R"
    assert repr(Layout((("dp",), ()), (("tp", "sum"),))) == "(S(0)@dp, P(sum)@tp)"
    assert repr(Layout(((), ("tp", "dp")))) == "S(1)@tp.dp"
    assert repr(Layout(((), ("tp",)), (("dp", "avg"),)).placements(M22)) == "(S(1), P(avg))"
    assert repr(dist.Shard(0)) == "S(0)" and repr(dist.Replicate()) == "R" and repr(dist.Partial()) == "P(sum)"


def test_resolve_row_col_ints_and_multi_axis():
    rc = dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp"))
    assert dist.as_layout(rc, (3, 8, 6), M22) == Layout(((), ("tp",), ("dp",)))
    assert dist.as_layout(dist.ShardSpec(partition=(0,), mesh_axes=(("tp", "dp"),)), (8, 6), M22) == \
        Layout((("tp", "dp"), ()))
    assert dist.as_layout(dist.ShardSpec(partition=("col",), mesh_axes=("dp", "tp")), (8, 6), M22) == \
        Layout(((), ("dp", "tp")))
    assert dist.as_layout(dist.ReplicateSpec(mesh_axes=("tp", "dp")), (8, 6), M22) == Layout(((), ()))
    assert dist.as_layout(dist.PartialSpec("sum", ("tp",)), (4,), M22) == Layout(((),), (("tp", "sum"),))
    assert dist.as_layout(dist.ShardSpec(partition=(0,), mesh_axes=("tp",), partial={"dp": "max"}), (4,),
                          M22) == Layout((("tp",),), (("dp", "max"),))


@pytest.mark.parametrize("spec, shape, words", [
    (dist.ShardSpec(partition=("col",), mesh_axes=("ep",)), (8, 6), ["dim 1", "'ep'", "size 6", "tp"]),
    (dist.ShardSpec(partition=(2,), mesh_axes=("tp",)), (8, 6), ["dim 2", "(8, 6)"]),
    (dist.ShardSpec(partition=("row",), mesh_axes=("tp",)), (8,), ["dim -2", "1-dim"]),
    (dist.ShardSpec(partition=(0, 1), mesh_axes=("tp", "tp")), (8, 6), ["'tp'", "size 2", "dim 0", "dim 1"]),
    (dist.ShardSpec(partition=(0,), mesh_axes=("tp",), partial={"tp": "sum"}), (8,), ["'tp'", "pending"]),
    (dist.ReplicateSpec(mesh_axes=("pp",)), (8,), ["'pp'", "tp"]),
    (dist.ShardSpec(partition=(0, 0), mesh_axes=("tp", "dp")), (8,), ["dim 0", "twice"]),
])
def test_bad_specs_name_dim_axis_and_sizes(spec, shape, words):
    with pytest.raises(LayoutError) as e:
        dist.as_layout(spec, shape, M22)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_mixed_pending_reductions_are_rejected():
    with pytest.raises(LayoutError, match="different kinds"):
        Layout(((),), (("tp", "max"), ("dp", "sum"))).validate((4,), M22)
    Layout(((),), (("tp", "avg"), ("dp", "sum"))).validate((4,), M22)     # linear ones commute


def test_spec_construction_errors():
    with pytest.raises(ValueError, match="partition entries"):
        dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp", "ep"))
    with pytest.raises(ValueError, match="not a dim"):
        dist.ShardSpec(partition=("cols",), mesh_axes=("tp",))
    with pytest.raises(ValueError, match="reduce op"):
        dist.PartialSpec("prod", ("tp",))


# --------------------------------------------------------------------------- shard math

@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.integers(1, 9))
def test_split_sizes_array_split_convention(length, n):
    sizes, offs = split_sizes(length, n), split_offsets(length, n)
    assert sum(sizes) == length and len(sizes) == n
    assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)
    assert list(offs) == list(itertools.accumulate((0,) + sizes[:-1]))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_nested_extents_tile_the_dim_in_order(length, axis_sizes):
    pieces = [dim_extent(length, tuple(axis_sizes), c)
              for c in itertools.product(*(range(n) for n in axis_sizes))]
    pos = 0
    for off, size in pieces:                         # row-major coords: contiguous, in order
        assert off == pos and size >= 0
        pos += size
    assert pos == length
    # the major axis alone gives the union of its minor pieces
    minor = 1
    for n in axis_sizes[1:]:
        minor *= n
    for i in range(axis_sizes[0]):
        group = pieces[i * minor:(i + 1) * minor]
        assert (group[0][0], sum(s for _, s in group)) == dim_extent(length, (axis_sizes[0],), (i,))


# --------------------------------------------------------------------------- plans

def kinds(plan):
    return [s.kind for s in plan.steps]


@pytest.mark.parametrize("src, dst, expected", [
    (Layout((("tp",), ())), Layout(((), ("tp",))), ["all_to_all"]),
    (Layout(((), ()), (("tp", "sum"),)), Layout((("tp",), ())), ["reduce_scatter"]),
    (Layout(((), ()), (("tp", "sum"),)), Layout(((), ())), ["all_reduce"]),
    (Layout((("tp",), ())), Layout(((), ())), ["all_gather"]),
    (Layout(((), ())), Layout(((), ("tp",))), ["slice"]),
    (Layout(((), ())), Layout(((), ()), (("tp", "sum"),)), ["partialize"]),
    (Layout((("tp",), ())), Layout((("tp",), ())), []),
])
def test_plan_1d_is_one_direct_step(src, dst, expected):
    assert kinds(plan_redistribute((7, 5), src, dst, M4, "float32")) == expected


@pytest.mark.parametrize("src, dst, expected", [
    # 2-D mesh: each axis moves on its own, by its own direct step
    (Layout((("dp",), ()), (("tp", "sum"),)), Layout((("dp",), ("tp",))), ["reduce_scatter"]),
    (Layout((("dp",), ()), (("tp", "sum"),)), Layout(((), ("tp",))), ["reduce_scatter", "all_gather"]),
    (Layout(((), ()), (("tp", "sum"), ("dp", "sum"))), Layout((("tp", "dp"), ())),
     ["reduce_scatter", "reduce_scatter"]),
    (Layout((("tp",), ("dp",))), Layout(((), ())), ["all_gather", "all_gather"]),
    (Layout((("tp",), ("dp",))), Layout((("tp",), ())), ["all_gather"]),
    (Layout((("tp",), ())), Layout((("tp",), ("dp",))), ["slice"]),
    (Layout((("tp",), ()), (("dp", "sum"),)), Layout((("tp", "dp"), ())), ["reduce_scatter"]),
    (Layout((("tp",), ("dp",), ())), Layout((("dp",), (), ("tp",))), ["all_to_all", "all_to_all"]),
    # a swap of nesting order needs one axis to step out of the way (one gather, minor piece)
    (Layout((("tp",), ("dp",))), Layout((("dp",), ("tp",))), ["all_gather", "all_to_all", "slice"]),
    (Layout((("tp", "dp"), ())), Layout(((), ("tp", "dp"))), ["all_gather", "all_to_all", "slice"]),
])
def test_plan_2d_one_axis_per_step(src, dst, expected):
    shape = (6, 5, 3)[:src.ndim]
    plan = plan_redistribute(shape, src, dst, M22, "float32")
    assert kinds(plan) == expected, plan
    assert (plan.steps[-1].dst if plan.steps else src) == dst


def test_size_one_axis_moves_nothing():
    m = GridMesh({"tp": 1, "dp": 4})
    plan = plan_redistribute((6, 5), Layout((("tp",), ())), Layout(((), ("tp",))), m, "float32")
    assert kinds(plan) == ["relabel"] and plan.bytes_sent == 0


def test_explain_lists_steps_and_bytes():
    plan = plan_redistribute((8, 4), Layout((("tp",), ())), Layout(((), ())), M4, "float32")
    text = str(plan)
    assert "all_gather" in text and "S(0)@tp -> R" in text and "sends" in text
    # ring all_gather: each rank sends (n-1)/n of the gathered tensor
    assert plan.bytes_sent == 8 * 4 * 4 * 3 // 4


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_plan_reaches_its_target_on_every_position(data):
    axes = {"tp": data.draw(st.integers(1, 3)), "dp": data.draw(st.integers(1, 3))}
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))

    def layout():
        dims = [[] for _ in range(ndim)]
        partial = {}
        for a in data.draw(st.permutations(list(axes))):
            c = data.draw(st.integers(-2, ndim - 1))
            if c >= 0:
                dims[c].append(a)
            elif c == -2:
                partial[a] = data.draw(st.sampled_from(["sum", "max"]))
        return Layout(tuple(tuple(d) for d in dims), tuple(sorted(partial.items())))
    src, dst = layout(), layout()
    for coords in itertools.product(*(range(n) for n in axes.values())):
        m = GridMesh(axes, dict(zip(axes, coords)))
        plan = plan_redistribute(shape, src, dst, m, "float32")
        assert (plan.steps[-1].dst if plan.steps else src) == dst
        for s in plan.steps:                # one axis (or one direct exchange's group) per step
            changed = {a for a in axes if s.src.dim_of(a) != s.dst.dim_of(a)
                       or s.src.partial_op(a) != s.dst.partial_op(a)}
            # a direct exchange also takes new shards of axes it did not shard (as slices would)
            sliced = {a for a in changed if s.src.dim_of(a) is None} if "direct" in s.detail else set()
            assert changed <= set(s.axis.split(",")) | sliced, s
