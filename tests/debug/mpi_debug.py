"""Flight recorder and desync detection (issue 7, item 1), at 1-4 ranks."""
import numpy as np
import pytest

from tessera_rt import dist
from tessera_rt.dist.checks import debug


@pytest.fixture
def desync(world):
    dist.init(debug="collectives")
    yield world
    dist.init(debug=False)


def test_flight_recorder_keeps_op_axis_shape_and_call_site(world):
    dist.init(debug="flight")
    try:
        before = len(debug.flight_records())
        dist.all_reduce(np.ones((2, 3), np.float32))
        dist.barrier()
        recs = debug.flight_records()[before:] if before < 32 else debug.flight_records()[-2:]
        ar, bar = recs[-2], recs[-1]
        assert (ar.op, ar.axis, ar.dtype, ar.shape) == ("all_reduce", "world", "float32", (2, 3))
        assert ar.site.startswith("mpi_debug.py:") and ar.t1 >= ar.t0 > 0
        assert bar.op == "barrier" and bar.seq == ar.seq + 1
        assert "all_reduce(world) float32[2,3] at mpi_debug.py:" in debug.format_call(ar)
    finally:
        dist.init(debug=False)
    assert not debug.recorder_enabled()


def test_matching_collectives_pass_the_check(desync):
    w = desync
    y = dist.all_reduce(np.full(4, w.rank, np.float64))
    assert y[0] == sum(range(w.size))
    work = dist.all_gather(np.full(2, w.rank, np.int32), async_op=True)
    assert list(work.wait()) == [r for r in range(w.size) for _ in range(2)]
    # uneven all_gather: shapes differ along the gathered dim, which is allowed with sizes=
    sizes = [r + 1 for r in range(w.size)]
    g = dist.all_gather(np.ones(w.rank + 1), sizes=sizes)
    assert g.shape == (sum(sizes),)


def test_a_rank_issuing_another_op_raises_on_every_rank(desync):
    w = desync
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    x = np.ones(4, np.float32)
    with pytest.raises(debug.CollectiveMismatchError) as e:
        if w.rank == 1:
            dist.all_gather(x)
        else:
            dist.all_reduce(x)
    msg = str(e.value)
    others = [r for r in range(w.size) if r != 1]
    who = f"rank {others[0]}" if len(others) == 1 else "ranks [" + ",".join(map(str, others)) + "]"
    assert f"{who} all_reduce(world) float32[4] at mpi_debug.py:" in msg, msg
    assert "rank 1 all_gather(world) float32[4] at mpi_debug.py:" in msg, msg
    assert "disagree on op" in msg and "call site" in msg
    # the ranks stay in step: the next collective works
    assert dist.all_reduce(np.ones(1))[0] == w.size


def test_ranks_on_different_mesh_axes_are_reported_not_deadlocked(desync):
    w = desync
    if w.size != 4:
        pytest.skip("the issue's example: a 2x2 mesh")
    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    with pytest.raises(debug.CollectiveMismatchError) as e:
        if w.rank == 1:
            dist.all_gather(np.ones(16, np.float32), axis="tp", mesh=mesh)
        else:
            dist.all_reduce(np.ones((64, 32), np.float32), axis="dp", mesh=mesh)
    msg = str(e.value)
    assert "ranks [0,2,3] all_reduce(dp) float32[64,32] at mpi_debug.py:" in msg, msg
    assert "rank 1 all_gather(tp) float32[16] at mpi_debug.py:" in msg, msg
    assert "Mesh(tp=2, dp=2)" in msg


def test_shapes_that_do_not_fit_within_a_group_are_named(desync):
    w = desync
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    n = 4 if w.rank != w.size - 1 else 5
    with pytest.raises(debug.CollectiveMismatchError) as e:
        dist.all_reduce(np.ones(n, np.float32))
    msg = str(e.value)
    assert "shapes that do not fit" in msg and f"rank {w.size - 1} float32[5]" in msg, msg


def test_dtensor_collectives_are_checked_with_the_user_call_site(desync):
    w = desync
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    with dist.trace_collectives() as log:
        X = dist.distribute(np.arange(12.0).reshape(4, 3), layout=dist.ShardSpec(partition=("row",),
                                                                                   mesh_axes=("dp",)), mesh=mesh)
        full = X.full_tensor()
    assert np.array_equal(full, np.arange(12.0).reshape(4, 3))
    recs = [c for c in debug.flight_records() if c.op == "all_gather"]
    if w.size > 1:
        assert log.count("all_gather") == 1
        assert recs[-1].site.startswith("mpi_debug.py:")


# --------------------------------------------------------------------------- the default check (no debug mode)

def _odd(w, expect: str, fn):
    """fn() disagrees on rank 1: every rank raises, naming rank 1, and the ranks stay in step."""
    with pytest.raises(debug.CollectiveMismatchError) as e:
        fn()
    msg = str(e.value)
    if w.size > 2:
        assert "rank 1 differs from the others" in msg, msg
    assert f"disagree on {expect}" in msg, msg
    assert msg.count("mpi_debug.py:") >= 2, msg                  # both call sites
    assert dist.all_reduce(np.ones(1))[0] == w.size               # still in step
    return msg


def test_default_mode_catches_each_kind_of_disagreement_before_data_moves(world):
    w = world
    assert not debug.desync_enabled()                         # the default mode
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    x = np.ones(4, np.float32)
    msg = _odd(w, "dtype", lambda: dist.all_reduce(x.view(np.int32) if w.rank == 1 else x))
    assert "rank 1 all_reduce(world) int32[4]" in msg and "float32[4]" in msg
    msg = _odd(w, "arguments (op)", lambda: dist.all_reduce(x, op="max" if w.rank == 1 else "sum"))
    assert "with op='max'" in msg and "with op='sum'" in msg
    for coll in (dist.all_gather, dist.all_reduce):
        msg = _odd(w, "shape", lambda: coll(np.ones((4, 8) if w.rank == 1 else (8, 4), np.float32)))
        assert "float32[4,8]" in msg and "float32[8,4]" in msg
    msg = _odd(w, "shape", lambda: dist.all_reduce(np.ones(5 if w.rank == 1 else 4, np.float32)))
    msg = _odd(w, "arguments (root)", lambda: dist.broadcast(np.ones(2), root=1 if w.rank == 1 else 0))
    # a call site that is verified once is not verified again (until the sampled call)
    for _ in range(3):
        assert dist.all_reduce(np.ones(2))[0] == w.size


def test_the_sampled_check_on_the_c_path_catches_a_later_disagreement(world):
    # a call site verified once takes the C path (dist/comm/_hot.c) with the remembered-site check;
    # its sampled verification (every call here) must still meet a rank that now disagrees
    from tessera_rt.dist.checks import consistency
    from tessera_rt.dist.comm import collectives as C
    w = world
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    mesh = dist.Mesh(axes=["x"], shape=(w.size,))
    site = lambda x: dist.all_reduce(x, "x", mesh=mesh)
    old, consistency.STATE.mask = consistency.STATE.mask, 0     # TESSERA_CHECK_EVERY=1
    try:
        for _ in range(3):
            site(np.ones(4, np.float32))
        hits = C.all_reduce.hits
        msg = _odd(w, "shape", lambda: site(np.ones(5 if w.rank == 1 else 4, np.float32)))
        assert "float32[5]" in msg and "float32[4]" in msg
        if w.rank != 1 and C.HOT is not None:
            assert C.all_reduce.hits > hits                   # the odd call met the C path's check
    finally:
        consistency.STATE.mask = old


def test_default_mode_catches_dtensors_of_different_global_shapes(world):
    w = world
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    Col = dist.ShardSpec(partition=("col",), mesh_axes=("dp",))
    X = dist.tensor(shape=(8, 18) if w.rank == 1 else (8, 16), layout=Col, mesh=mesh)
    with pytest.raises(debug.CollectiveMismatchError) as e:
        X.sum().full_tensor()
    msg = str(e.value)
    assert "DTensor global shape/layout" in msg and "float32[8, 18] S(1)@dp" in msg, msg
    Y = dist.tensor(shape=(8, 16), layout=Col, mesh=mesh)
    assert float(Y.sum().full_tensor()) == 0.0


def test_ops_on_a_ranks_own_sub_mesh_do_not_crowd_out_what_the_ranks_share(world):
    # a pipeline stage runs other ops on each rank; the metadata the next shared collective
    # carries must still be the same on every rank (it was capped across all meshes at once)
    w = world
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    mine = [dist.Mesh(axes=["s"], shape={"s": 1}, devices=[r]) for r in range(w.size)][w.rank]
    for i in range(20 if w.rank == 1 else 0):
        dist.distribute(np.zeros(i + 1, np.float32), mesh=mine) + 1.0
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    X = dist.distribute(np.ones((8, 6), np.float32), dist.ShardSpec(partition=("col",), mesh_axes=("dp",)), mesh)
    assert float((X * 2.0).sum().full_tensor()) == 96.0


def test_debug_mode_names_the_odd_rank_for_a_different_reduction(desync):
    w = desync
    if w.size < 3:
        pytest.skip("needs 3 ranks to have an odd one out")
    with pytest.raises(debug.CollectiveMismatchError) as e:
        dist.all_reduce(np.ones(2), op="max" if w.rank == 1 else "sum")
    msg = str(e.value)
    others = ",".join(str(r) for r in range(w.size) if r != 1)
    assert "rank 1 differs from the others: rank 1 all_reduce(world) float64[2]" in msg, msg
    assert "with op='max'" in msg and f"ranks [{others}] all_reduce(world) float64[2]" in msg, msg


def test_debug_mode_checks_send_and_recv(desync):
    w = desync
    if w.size < 2:
        pytest.skip("needs 2 ranks")
    if w.rank == 0:
        dist.send(np.arange(4.0), 1, tag=3)
        dist.send(np.ones(8, np.float32), 1, tag=4)
    elif w.rank == 1:
        buf = dist.recv(np.zeros(4), 0, tag=3)
        assert list(buf) == [0, 1, 2, 3]
        with pytest.raises(debug.CollectiveMismatchError, match=r"rank 0 sent float32\[8\] at mpi_debug.py:"):
            dist.recv(np.zeros(4, np.float64), 0, tag=4)
        dist.init(debug=False)                              # its header was taken: take the data unchecked
        dist.recv(np.zeros(8, np.float32), 0, tag=4)
