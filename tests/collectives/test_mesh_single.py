"""Mesh validation at world size 1 (the multi-rank behaviour is in tests/collectives/mpi_mesh_and_comm.py)."""
import numpy as np
import pytest

from tessera_rt import dist


def test_one_rank_mesh_and_seed_spelling():
    m = dist.Mesh(axes=["tp", "dp"], shape={"tp": 1, "dp": 1})
    assert m.shape == {"tp": 1, "dp": 1} and m.coords == {"tp": 0, "dp": 0}
    assert m == dist.mesh(devices=["GPU0"], axes=("tp", "dp"), shape=(1, 1))
    assert repr(m) == "Mesh(tp=1, dp=1)" and hash(m) == hash(dist.Mesh(["tp", "dp"], (1, 1)))
    assert dist.Mesh(axes=["dp"]).shape == {"dp": 1}
    assert m.rank_map()[0]["rank"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(axes=["tp", "dp"], shape={"tp": 2, "dp": 2}), r"needs 4 devices but the job has 1 ranks; launch with tessera-run -n 4"),
    (dict(axes=["tp", "tp"], shape=(1, 1)), r"repeat \['tp'\]"),
    (dict(axes=["tp"], shape={"dp": 1}), r"missing \['tp'\]; unknown \['dp'\]"),
    (dict(axes=["tp"], shape=(0,)), r"axis 'tp' has size 0; every axis size must be an int >= 1"),
    (dict(axes=["tp", "dp"], shape=(1,)), r"1 sizes for 2 axes"),
    (dict(axes=["tp", "dp"]), r"give shape="),
    (dict(axes=["tp"], shape=(2,), devices=[0, 0]), r"repeat ranks \[0\]"),
    (dict(axes=["tp"], shape=(2,), devices=[0, 1]), r"name ranks \[1\] but the job has ranks 0..0"),
    (dict(axes=["tp"], shape=(3,), devices=[0, 1]), r"3 positions but devices names 2"),
    (dict(axes=[], shape=()), r"at least one axis"),
    (dict(axes=["tp"], shape=(1,), devices=["TPU:x"]), r"not a rank"),
])
def test_bad_mesh_input_says_what_was_given_and_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dist.Mesh(**kwargs)


def test_unknown_axis_names_the_mesh():
    m = dist.Mesh(axes=["tp"], shape=(1,))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'dp'; Mesh\(tp=1\) has axes \['tp'\]"):
        m.group("dp")


def test_nonmember_rank_is_told():
    # devices=[] is impossible at size 1, so check the guard directly
    m = dist.Mesh(axes=["x"], shape=(1,))
    m._coords = None
    with pytest.raises(ValueError, match="rank 0 is not in Mesh"):
        m.coordinate("x")


def test_collectives_at_world_size_one():
    m = dist.Mesh(axes=["x"], shape=(1,))
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(dist.all_reduce(x, "x", mesh=m), x)
    np.testing.assert_array_equal(dist.all_gather(x, "x", dim=1, mesh=m), x)
    np.testing.assert_array_equal(dist.reduce_scatter(x, "x", mesh=m), x)
    np.testing.assert_array_equal(dist.all_to_all(x, "x", mesh=m), x)


@pytest.mark.parametrize("spec", [dist.ShardSpec(partition=("row",), mesh_axes=("tp",)),
                                  dist.ShardSpec(partition=("col",), mesh_axes=("tp",)),
                                  dist.ReplicateSpec(mesh_axes=("tp",))])
def test_distribute_keeps_no_view_of_the_global_array(spec):
    # a row shard is a contiguous slice: as a view it would keep the whole global array alive
    g = np.arange(12.0).reshape(4, 3)
    X = dist.distribute(g, spec, dist.Mesh(axes=["tp"], shape={"tp": 1}))
    assert not np.shares_memory(X.to_local(), g) and X.to_local().flags.c_contiguous
    np.testing.assert_array_equal(X.full_tensor(), g)


def test_default_check_notes_each_ops_dtensors_without_a_hook():
    """The agreement check notes the global shape/layout of each DTensor op's arguments for
    the next collective's signature, inline in the dispatcher (a profiler-style hook cost
    ~3 us an op); turned off, nothing is noted."""
    from tessera_rt.dist.checks import consistency
    from tessera_rt.dist.tensor import dispatch
    mesh = dist.Mesh(axes=["tp"], shape={"tp": 1})
    x = dist.distribute(np.ones((4, 3), np.float32), layout=dist.ShardSpec((1,), ("tp",)), mesh=mesh)
    consistency.STATE.reset()
    try:
        y = x * 2.0
        assert dispatch.OP_WATCHERS == [] and consistency.STATE.metas == {id(mesh): {x._meta}}
        consistency.configure(False)
        consistency.STATE.reset()
        y + y
        assert consistency.STATE.metas == {}
    finally:
        consistency.configure(True)
        consistency.STATE.reset()


def test_a_dtensor_keeps_the_mesh_it_was_made_on_not_an_equal_earlier_one():
    first, second = dist.Mesh(axes=["tp"], shape=(1,)), dist.Mesh(axes=["tp"], shape=(1,))
    assert first == second and first is not second
    g = np.arange(6.0).reshape(2, 3)
    a, b = dist.distribute(g, mesh=first), dist.distribute(g, mesh=second)
    assert a.mesh is first and b.mesh is second and (b * 2).mesh is second


@pytest.mark.parametrize("bad, said", [(np.array([{"a": 1}, None], dtype=object), "dtype object (Python objects)"),
                                       (np.array(["ab", "cd"]), "dtype <U2 (strings)"),
                                       (np.array([1, 2], "datetime64[s]"), "dtype datetime64[s] (dates)")])
def test_collectives_refuse_non_numeric_dtypes_before_any_communication(bad, said):
    # MPI failed inside the call with "float() argument must be ... not 'dict'" or "could not
    # convert string to float": the call and the dtype are named before any group is made
    import re
    m = dist.Mesh(axes=["x"], shape=(1,))
    calls = {"all_reduce": lambda: dist.all_reduce(bad, "x", mesh=m),
             "reduce_scatter": lambda: dist.reduce_scatter(bad, "x", mesh=m),
             "all_gather": lambda: dist.all_gather(bad, "x", mesh=m),
             "all_to_all": lambda: dist.all_to_all(bad, "x", mesh=m),
             "broadcast": lambda: dist.broadcast(bad.copy(), "x", mesh=m)}
    for made in (False, True):             # the group's first call, and a group already made
        for name, call in calls.items():
            with pytest.raises(TypeError, match=rf"^rank 0: dist\.{name}: the array has {re.escape(said)}, which "
                               "collectives cannot move"):
                call()
            assert ("x" in m._groups) == made, name
        dist.all_reduce(np.ones(2), "x", mesh=m)
    with pytest.raises(TypeError, match=r"dist\.all_reduce: the array has dtype"):
        dist.all_reduce(bad)                                        # the world, no mesh
    import ml_dtypes  # low-precision floats are numbers
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.bool_, np.complex64):
        assert dist.all_gather(np.ones(4, dt), "x", mesh=m).dtype == dt
