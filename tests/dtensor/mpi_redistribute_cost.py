"""Redistribution choices by predicted time (issue 16, part 5), under mpiexec at 1-4 ranks.

* one direct all_to_all over the axes involved, for every pair of layouts without pending
  reductions, equal to NumPy's slices of the full tensor (uneven shapes; 2x2 mesh at 4);
* the model picks it only where it predicts it cheaper (counted with trace_collectives);
* conflicting operand layouts: the cheapest combination wins (a matmul where it is not the
  larger operand's), results equal to the single-process product; ties keep the old rule;
* explain prints each step's predicted time; plan.use_calibrated registers the planner's model.
"""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from tessera_rt import dist
from tessera_rt.dist.tensor import cost, dispatch
from tessera_rt.dist.tensor.layout import Layout
from tessera_rt.dist.tensor.redistribute import plan_redistribute

SIZE = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.timeout(120)
_MESHES: dict = {}


def mesh2():
    """2x2 at 4 ranks, n x 1 otherwise (the second axis of size 1 moves nothing)."""
    if "2" not in _MESHES:
        dist.init()
        shape = {"x": 2, "y": 2} if SIZE == 4 else {"x": SIZE, "y": 1}
        _MESHES["2"] = dist.Mesh(axes=["x", "y"], shape=shape)
    return _MESHES["2"]


def mesh1():
    if "1" not in _MESHES:
        dist.init()
        _MESHES["1"] = dist.Mesh(axes=["x"], shape={"x": SIZE})
    return _MESHES["1"]


class Zero:
    """Every step free: every choice ties, so the old rules decide."""
    name = "zero"

    def collective_time(self, op, size, n):
        return 0.0

    def copy_time(self, nbytes):
        return 0.0


@pytest.fixture(autouse=True)
def _builtin_model():
    old = cost.set_cost_model(None)
    yield
    cost.set_cost_model(old)


def layouts(mesh, ndim):
    """Every layout without pending reductions: each axis shards a dim or nothing, and the
    axes on one dim in every order."""
    out = set()
    for choice in itertools.product([None] + list(range(ndim)), repeat=len(mesh.axes)):
        per = [[a for a, c in zip(mesh.axes, choice) if c == d] for d in range(ndim)]
        for orders in itertools.product(*(itertools.permutations(p) for p in per)):
            out.add(Layout(tuple(tuple(o) for o in orders)))
    return sorted(out, key=repr)


def global_array(shape, seed=0):
    return np.random.RandomState(seed).randint(-9, 10, size=shape).astype(np.float64)


def check_direct(g, src, dst, mesh):
    plan = plan_redistribute(g.shape, src, dst, mesh, g.dtype, direct=True)
    x = g[dist.local_slices(g.shape, src, mesh)].copy()
    with dist.trace_collectives() as log:
        y = plan.run(x)
    assert [r.op for r in log.records] == list(plan.collectives), plan
    assert log.bytes_sent == plan.bytes_sent, (plan, [str(r) for r in log.records])
    np.testing.assert_array_equal(y, g[dist.local_slices(g.shape, dst, mesh)], err_msg=f"{src!r} -> {dst!r}\n{plan}")
    return plan


@pytest.mark.parametrize("shape", [(7, 5), (5, 3, 4)])
def test_direct_all_to_all_every_pair(shape):
    mesh = mesh2()
    g = global_array(shape)
    n_direct = 0
    for src, dst in itertools.product(layouts(mesh, len(shape)), repeat=2):
        plan = check_direct(g, src, dst, mesh)
        if any("direct" in s.detail for s in plan.steps):
            n_direct += 1
            assert plan.collectives == ("all_to_all",), plan       # one exchange, nothing else
    if SIZE > 1:
        assert n_direct > 0


def test_model_picks_direct_where_cheaper():
    """The swap (S(0)@x, S(1)@y) -> (S(0)@y, S(1)@x) takes three steps (gather, all_to_all,
    slice) one axis at a time; the built-in model takes one direct all_to_all when the
    bandwidth it saves outweighs the extra latency of a 4-rank exchange."""
    mesh = mesh2()
    src, dst = Layout((("x",), ("y",))), Layout((("y",), ("x",)))
    for shape in [(8, 12), (256, 260)]:
        g = global_array(shape, seed=1)
        X = dist.from_local(g[dist.local_slices(shape, src, mesh)].copy(), layout=src, mesh=mesh, shape=shape)
        steps = plan_redistribute(shape, src, dst, mesh, g.dtype, direct=False)
        direct = plan_redistribute(shape, src, dst, mesh, g.dtype, direct=True)
        chosen = X.explain_redistribute(dst)
        with dist.trace_collectives() as log:
            Y = X.redistribute(dst)
        np.testing.assert_array_equal(Y.full_tensor(), g)
        assert log.count() == len(chosen.collectives)
        if SIZE == 4:
            assert len(steps.steps) == 3 and steps.collectives == ("all_gather", "all_to_all"), steps
            assert direct.collectives == ("all_to_all",)
            want_direct = direct.predicted_s < steps.predicted_s
            # small: latency rules (3 rounds > 2); large: the 3/4 of the bytes saved win
            assert want_direct == (shape == (256, 260)), (steps, direct)
            assert log.count() == (1 if want_direct else 2), (chosen, [str(r) for r in log.records])
            assert log.count("all_to_all") == 1


def test_matmul_conflict_cheapest_not_larger():
    """A[64, 64] @ B[64, 56], both S(1)@x.  The old rule lets the larger A keep x on k: B
    moves by all_to_all and the product is left pending a sum over x.  Gathering A instead
    keeps B's columns and leaves nothing pending: cheaper by the model (one collective, not
    two).  Both give the single-process product."""
    mesh = mesh1()
    a, b = global_array((64, 64), 1), global_array((64, 56), 2)
    S1 = dist.ShardSpec(partition=(1,), mesh_axes=("x",))
    A, B = dist.distribute(a, layout=S1, mesh=mesh), dist.distribute(b, layout=S1, mesh=mesh)
    results = {}
    for name, model in [("old", Zero()), ("model", None)]:
        cost.set_cost_model(model)
        dec = dispatch.explain("matmul", (None, None), (A, B))
        with dist.trace_collectives() as log:
            C = A @ B
        results[name] = (dec.layout, log.count())
        np.testing.assert_allclose(C.full_tensor(), a @ b, rtol=1e-12, atol=1e-9)
    if SIZE > 1:
        assert results["old"][0] == Layout(((), ()), (("x", "sum"),)), results
        assert results["model"][0] == Layout(((), ("x",))), results
        assert results["old"][1] == 1 and results["model"][1] == 1         # a2a of B / all_gather of A
    else:
        assert results["old"][0] == results["model"][0]


def test_binary_ties_and_uneven_shards():
    """Same shapes and dtypes over even shards: a tie, the first operand's S(0) wins (the old
    rule).  (6, 10) at 3 ranks: S(0) pieces hold at most 2x10, S(1) pieces 6x4, so moving the
    S(0) operand sends less and the model keeps the second operand's S(1), unlike the old
    rule.  A float64 operand against a float32 one: the float32 one moves."""
    mesh = mesh1()
    S0, S1 = dist.ShardSpec(partition=(0,), mesh_axes=("x",)), dist.ShardSpec(partition=(1,), mesh_axes=("x",))
    for shape in [(12, 12), (6, 10)]:
        g, h = global_array(shape, 3), global_array(shape, 4)
        A, B = dist.distribute(g, layout=S0, mesh=mesh), dist.distribute(h, layout=S1, mesh=mesh)
        C = A + B
        np.testing.assert_array_equal(C.full_tensor(), g + h)
        cost.set_cost_model(Zero())
        old = (A + B).layout
        cost.set_cost_model(None)
        if SIZE > 1:
            assert old == Layout((("x",), ())), old
            uneven = shape == (6, 10) and SIZE == 3
            assert C.layout == (Layout(((), ("x",))) if uneven else old), (shape, C.layout)
    B64 = dist.distribute(h.astype(np.float64), layout=S1, mesh=mesh)
    A32 = dist.distribute(g.astype(np.float32), layout=S0, mesh=mesh)
    D = A32 * B64
    np.testing.assert_allclose(D.full_tensor(), g.astype(np.float32) * h)
    if SIZE > 1:
        assert D.layout == Layout(((), ("x",)))


def test_explain_prints_predicted_time_per_step():
    mesh = mesh2()
    g = global_array((9, 6))
    X = dist.distribute(g, layout=dist.ShardSpec(partition=(0,), mesh_axes=("x",)), mesh=mesh)
    plan = X.explain_redistribute(dist.ReplicateSpec())
    text = str(plan)
    times = plan.step_times()
    assert len(times) == len(plan.steps) and text.count("predicted") == len(plan.steps) + 1, text
    assert "sends" in text and "built-in alpha-beta" in text
    if SIZE > 1:
        m = cost.AlphaBeta(alpha=1e-3, bw=1e9)
        step = plan.steps[0]
        size = max(step.bytes_by_position) / dist.bus_factor("all_gather", mesh.size("x"))
        assert times[0] == pytest.approx(cost.AlphaBeta().collective_time("all_gather", size, mesh.size("x")))
        cost.set_cost_model(m)             # a new model: new predictions, caches cleared
        plan2 = X.explain_redistribute(dist.ReplicateSpec())
        assert plan2.step_times()[0] == pytest.approx(m.collective_time("all_gather", size, mesh.size("x")))
        assert "alpha-beta" not in str(plan2).splitlines()[-1] or m.name in str(plan2)


def test_plan_registers_its_model(tmp_path, monkeypatch):
    from tessera_rt import plan
    model = plan.use_calibrated("nvl72")
    assert cost.get_cost_model() is model
    t, _ = plan.collective_time(plan.get_cluster("nvl72"), "all_gather", 1e6, 4)
    assert model.collective_time("all_gather", 1e6, 4) == pytest.approx(t)
    monkeypatch.setenv("TESSERA_PLAN_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="tessera-plan --calibrate"):
        plan.use_calibrated("local")
    plan.use_builtin()
    assert cost.get_cost_model() is cost.DEFAULT
    with pytest.raises(TypeError, match="collective_time"):
        cost.set_cost_model(object())
