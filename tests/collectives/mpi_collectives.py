"""Array collectives at any world size, each against the same computation done on one
process with NumPy on the full data every rank can build for itself.

Backend-agnostic: under TESSERA_DEVICE=cuda the same tests run on CuPy arrays (NCCL at one
rank per GPU, the host-staged path when ranks share a GPU); see BACKEND_AGNOSTIC in tests/multirank.py.
"""
import os

import ml_dtypes
import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import dist, runtime as rt

BACKEND = ts.get_backend()
xp = BACKEND.xp
host = BACKEND.to_host

DTYPES = [np.float32, np.float64, np.int32, np.float16, ml_dtypes.bfloat16]


def host_data(rank, shape, dtype, salt=0):
    """Deterministic per-rank data that every rank can recompute for any other rank."""
    rng = np.random.default_rng(1000 * salt + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def rank_data(rank, shape, dtype, salt=0):
    """host_data on the backend's device."""
    return xp.asarray(host_data(rank, shape, dtype, salt))


def tol(dtype):
    return {np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 5e-2}.get(np.dtype(dtype), 1e-6)


@pytest.fixture
def line(world):
    """A 1-D mesh over every rank."""
    return dist.Mesh(axes=["x"], shape={"x": world.size})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_all_reduce(line, world, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.raises(TypeError, dist.all_reduce, rank_data(0, (3,), dtype), "x", "avg", mesh=line)
        return
    x = rank_data(world.rank, (5, 7), dtype)
    everyone = np.stack([host_data(r, (5, 7), dtype).astype(np.float64) for r in range(world.size)])
    expect = {"sum": everyone.sum(0), "max": everyone.max(0), "min": everyone.min(0),
              "avg": everyone.mean(0)}[op]
    y = dist.all_reduce(x, axis="x", op=op, mesh=line)
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    np.testing.assert_allclose(host(y).astype(np.float64), expect, rtol=tol(dtype), atol=tol(dtype) * world.size)


def test_all_reduce_in_place_and_async(line, world):
    x = rank_data(world.rank, (64,), np.float32)
    expect = sum(host_data(r, (64,), np.float32) for r in range(world.size))
    work = dist.all_reduce(x, "x", mesh=line, out=x, async_op=True)
    assert isinstance(work, dist.Work)
    y = work.wait()
    assert y is x and work.is_completed()
    np.testing.assert_allclose(host(x), expect, rtol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("uneven", [False, True])
def test_reduce_scatter(line, world, dim, uneven):
    n = world.size
    shape = [2 * n, n, 2 * n]
    if uneven:
        sizes = [(i + 1) % 3 for i in range(n)]          # zeros included
        shape[dim] = sum(sizes)
    else:
        sizes = None
    x = rank_data(world.rank, shape, np.float32)
    total = sum(host_data(r, shape, np.float32).astype(np.float64) for r in range(n))
    parts = np.split(total, np.cumsum(sizes)[:-1] if uneven else n, axis=dim)
    y = dist.reduce_scatter(x, "x", dim=dim, sizes=sizes, mesh=line)
    np.testing.assert_allclose(host(y), parts[world.rank], rtol=1e-5, atol=1e-5)
    w = dist.reduce_scatter(x, "x", dim=dim, sizes=sizes, mesh=line, async_op=True).wait()
    np.testing.assert_array_equal(host(w), host(y))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_all_gather_even(line, world, dtype, dim):
    x = rank_data(world.rank, (2, 3, 4), dtype)
    expect = np.concatenate([host_data(r, (2, 3, 4), dtype) for r in range(world.size)], axis=dim)
    y = dist.all_gather(x, "x", dim=dim, mesh=line)
    np.testing.assert_array_equal(host(y), expect)
    np.testing.assert_array_equal(host(dist.all_gather(x, "x", dim=dim, mesh=line, async_op=True).wait()), expect)


@pytest.mark.parametrize("dim", [0, -1])
def test_all_gather_uneven_with_empty_parts(line, world, dim):
    sizes = [r % 3 for r in range(world.size)]         # rank 0 holds nothing
    def part(r):
        shape = [4, 4]
        shape[dim] = sizes[r]
        return host_data(r, shape, np.float32)
    y = dist.all_gather(xp.asarray(part(world.rank)), "x", dim=dim, sizes=sizes, mesh=line)
    np.testing.assert_array_equal(host(y), np.concatenate([part(r) for r in range(world.size)], axis=dim))


def test_all_to_all_even(line, world):
    n = world.size
    x = rank_data(world.rank, (3 * n, 2), np.float32)
    y = dist.all_to_all(x, "x", mesh=line)
    expect = np.concatenate([np.split(host_data(r, (3 * n, 2), np.float32), n)[world.rank] for r in range(n)])
    np.testing.assert_array_equal(host(y), expect)


def test_all_to_all_uneven_zero_parts(line, world):
    n = world.size

    def splits(r):   # rank r sends (r + d) % 3 rows to rank d: zeros included
        return [(r + d) % 3 for d in range(n)]

    def data(r):
        return host_data(r, (sum(splits(r)), 5), np.float64)

    expect = np.concatenate([np.split(data(r), np.cumsum(splits(r))[:-1])[world.rank] for r in range(n)])
    y = dist.all_to_all(xp.asarray(data(world.rank)), "x", split_sizes=splits(world.rank), mesh=line)   # sizes exchanged
    np.testing.assert_array_equal(host(y), expect)
    recv_sizes = [splits(r)[world.rank] for r in range(n)]
    y2 = dist.all_to_all(xp.asarray(data(world.rank)), "x", split_sizes=splits(world.rank), recv_sizes=recv_sizes,
                         mesh=line, async_op=True).wait()
    np.testing.assert_array_equal(host(y2), expect)


def test_all_to_all_changes_the_sharded_dim(line, world):
    """Split along dim 1, concatenate along dim 0: a row-sharded matrix becomes column-sharded."""
    n = world.size
    rows, cols = [r % 2 + 1 for r in range(n)], [(r + 1) % 3 for r in range(n)]
    full = host_data(7, (sum(rows), sum(cols)), np.float32)
    r0, c0 = np.cumsum([0] + rows), np.cumsum([0] + cols)
    mine = full[r0[world.rank]:r0[world.rank + 1]]
    y = dist.all_to_all(xp.asarray(mine), "x", split_dim=1, concat_dim=0, split_sizes=cols, recv_sizes=rows, mesh=line)
    np.testing.assert_array_equal(host(y), full[:, c0[world.rank]:c0[world.rank + 1]])


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast(line, world, root):
    root = root % world.size
    x = rank_data(world.rank, (10,), ml_dtypes.bfloat16)
    y = dist.broadcast(x, "x", root=root, mesh=line)
    assert y is x
    np.testing.assert_array_equal(host(x), host_data(root, (10,), ml_dtypes.bfloat16))


def test_send_recv_ring(line, world):
    n = world.size
    if n == 1:
        with pytest.raises(ValueError, match="another position"):
            dist.send(xp.zeros(2), 0, axis="x", mesh=line)
        return
    right, left = (world.rank + 1) % n, (world.rank - 1) % n
    x = rank_data(world.rank, (6,), np.float32)
    buf = xp.empty(6, np.float32)
    rwork = dist.recv(buf, left, axis="x", mesh=line, async_op=True)
    swork = dist.send(x, right, axis="x", mesh=line, async_op=True)
    rwork.wait(), swork.wait()
    np.testing.assert_array_equal(host(buf), host_data(left, (6,), np.float32))


def test_barrier_and_world_group(world):
    dist.barrier()
    y = dist.all_reduce(xp.asarray([world.rank], np.int64))    # no mesh: the whole world
    assert int(host(y)[0]) == world.size * (world.size - 1) // 2


def test_2d_mesh_axis_groups(world):
    if world.size != 4:
        pytest.skip("2x2 mesh runs in the 4-rank launch")
    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    c = mesh.coords
    assert mesh.group_ranks("dp") == tuple(mesh.device_grid[c["tp"], :])
    assert mesh.group_ranks("tp") == tuple(mesh.device_grid[:, c["dp"]])
    assert mesh.group_ranks(("tp", "dp")) == tuple(mesh.device_grid.reshape(-1))
    assert mesh.group_ranks(("dp", "tp")) == tuple(mesh.device_grid.T.reshape(-1))
    x = xp.asarray([world.rank], np.int64)
    with mesh:
        assert int(host(dist.all_reduce(x, "dp"))[0]) == sum(mesh.group_ranks("dp"))
        assert int(host(dist.all_reduce(x, "tp"))[0]) == sum(mesh.group_ranks("tp"))
        assert int(host(dist.all_reduce(x, ("tp", "dp")))[0]) == 6
        g = dist.all_gather(x, ("dp", "tp"))
    assert list(host(g)) == list(mesh.group_ranks(("dp", "tp")))


def test_overlap_policy_serializes(line, world):
    """With no overlap allowed for tp_collective, an async collective is complete on return."""
    rt.enable_overlap([("a2a", "compute")])
    work = dist.all_reduce(xp.ones(4, np.float32), "x", mesh=line, async_op=True)
    assert work.is_completed()
    np.testing.assert_array_equal(host(work.wait()), np.full(4, world.size, np.float32))


def test_trace_counts_and_bytes(line, world):
    n = world.size
    with dist.trace_collectives() as log:
        dist.all_reduce(xp.ones(8, np.float32), "x", mesh=line)
        dist.all_gather(xp.ones(2, np.float32), "x", mesh=line)
    assert log.count() == 2 and log.count("all_reduce") == 1
    ar, ag = log.records
    assert ar.bytes_sent == round(32 * 2 * (n - 1) / n)
    assert ag.bytes_sent == round(8 * n * (n - 1) / n)
    assert "all_reduce(x, n=" in str(ar)


def test_errors_name_rank_axis_and_shapes(line, world):
    x = xp.ones((3, 5), np.float32)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tp'"):
        dist.all_reduce(x, "tp", mesh=line)
    with pytest.raises(ValueError, match="op='prod'"):
        dist.all_reduce(x, "x", "prod", mesh=line)
    with pytest.raises(TypeError, match=f"takes a {xp.__name__} array"):
        dist.all_reduce([1.0, 2.0], "x", mesh=line)
    if world.size > 1:
        with pytest.raises(ValueError, match=rf"rank {world.rank}: reduce_scatter over mesh axis 'x'.*"
                                             r"float32\[3, 5\].*does not split evenly"):
            dist.reduce_scatter(x, "x", mesh=line, dim=0 if 3 % world.size else 1)
    with pytest.raises(ValueError, match="sizes="):
        dist.all_gather(x, "x", sizes=[7] * world.size, mesh=line)
    with pytest.raises(ValueError, match="needs a mesh"):
        dist.all_reduce(x, "dp")
    # every rank raised before communicating, so a collective still lines up afterwards
    assert float(host(dist.all_reduce(xp.ones(1), "x", mesh=line))[0]) == world.size


# --------------------------------------------------------------------------- cached plans

def _cases(n):
    """(name, shape (or rank -> shape), dtype, call(x, mesh), reference(every rank's data, my rank))."""
    sizes = [(i + 1) % 3 for i in range(n)]                      # uneven, zeros included
    splits = lambda r: [(r + d) % 3 + 1 for d in range(n)]      # rank r sends to rank d
    return [
        ("all_reduce", (3, 5), np.float32, lambda x, m: dist.all_reduce(x, "x", mesh=m),
         lambda d, me: sum(d)),
        ("all_reduce max out=", (7,), np.int32,
         lambda x, m: dist.all_reduce(x, "x", "max", mesh=m, out=xp.empty_like(x)), lambda d, me: np.max(d, axis=0)),
        ("reduce_scatter dim 1", (2, 2 * n, 3), np.float64, lambda x, m: dist.reduce_scatter(x, "x", dim=1, mesh=m),
         lambda d, me: np.split(sum(d), n, axis=1)[me]),
        ("reduce_scatter sizes", (sum(sizes), 2), np.float32,
         lambda x, m: dist.reduce_scatter(x, "x", sizes=sizes, mesh=m),
         lambda d, me: np.split(sum(d), np.cumsum(sizes)[:-1])[me]),
        ("all_gather dim 1", (2, 3), np.float32, lambda x, m: dist.all_gather(x, "x", dim=1, mesh=m),
         lambda d, me: np.concatenate(d, axis=1)),
        ("all_to_all dim 1", (2, 2 * n), np.int64, lambda x, m: dist.all_to_all(x, "x", split_dim=1, mesh=m),
         lambda d, me: np.concatenate([np.split(a, n, axis=1)[me] for a in d], axis=1)),
        ("all_to_all exchanged sizes", lambda r: (sum(splits(r)), 3), np.float32,
         lambda x, m: dist.all_to_all(x, "x", split_sizes=splits(m.group("x").index), mesh=m),
         lambda d, me: np.concatenate([np.split(a, np.cumsum(splits(r))[:-1])[me] for r, a in enumerate(d)])),
        ("broadcast", (4, 2), np.float32, lambda x, m: dist.broadcast(x, "x", root=n - 1, mesh=m),
         lambda d, me: d[n - 1]),
    ]


@pytest.mark.timeout(60)
def test_cached_plans_give_fresh_results(line, world):
    """A repeated call (its plan cached) gives what the first did, for new data each time,
    and builds no plan; each case's reference is computed on the full data with NumPy."""
    from tessera_rt.dist.comm import plans
    n, me = world.size, world.rank
    for name, shape, dtype, call, ref in _cases(n):
        for salt in range(3):
            data = [host_data(r, shape(r) if callable(shape) else shape, dtype, salt) for r in range(n)]
            made = plans.plans_made()
            y = call(xp.asarray(data[me]), line)
            np.testing.assert_allclose(host(y), ref(data, me), rtol=1e-5, atol=1e-5, err_msg=f"{name} call {salt}")
            if salt:
                assert plans.plans_made() == made, f"{name}: a repeated call built a plan"


@pytest.mark.timeout(60)
def test_changed_arguments_make_new_plans(line, world):
    """A new shape, dtype, dim or sizes is a new plan: nothing stale from the last one."""
    from tessera_rt.dist.comm import plans
    n, me = world.size, world.rank
    calls = [((2 * n, 3), np.float32, 0, None), ((4 * n, 3), np.float32, 0, None), ((4 * n, 3), np.float64, 0, None),
             ((3, 2 * n), np.float64, 1, None), ((3, 2 * n), np.float64, -1, None),
             ((n + 2, 2), np.float64, 0, [3] + [1] * (n - 1))]
    if n > 1:                                                  # only the sizes change
        calls.append(((n + 2, 2), np.float64, 0, [1] * (n - 1) + [3]))
    for shape, dtype, dim, sizes in calls:
        data = [host_data(r, shape, dtype, 5) for r in range(n)]
        made = plans.plans_made()
        y = dist.reduce_scatter(xp.asarray(data[me]), "x", dim=dim, sizes=sizes, mesh=line)
        assert plans.plans_made() == made + 1, (shape, dtype, dim, sizes)
        parts = np.split(sum(data), np.cumsum(sizes)[:-1] if sizes else n, axis=dim)
        assert y.dtype == np.dtype(dtype)
        np.testing.assert_allclose(host(y), parts[me], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
def test_bad_input_on_a_cached_plan_still_errors_first(line, world):
    x = xp.ones((2 * world.size, 3), np.float32)
    dist.all_reduce(x, "x", mesh=line)
    dist.reduce_scatter(x, "x", mesh=line)                    # both plans cached now
    with pytest.raises(ValueError, match=r"rank \d+: all_reduce over mesh axis 'x'.*"
                                         r"out= must be a contiguous float32\[\d+, 3\], got float32\[3, 2\]"):
        dist.all_reduce(x, "x", mesh=line, out=xp.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="out= must be"):
        dist.reduce_scatter(x, "x", mesh=line, out=xp.empty((2, 3), np.float64))
    with pytest.raises(TypeError, match="fills x in place"):
        dist.broadcast(xp.ones((3, 4 * world.size), np.float32)[:, ::2], "x", mesh=line)
    with pytest.raises(ValueError, match="op='prod'"):
        dist.all_reduce(x, "x", "prod", mesh=line)
    # a non-contiguous input of a cached shape is copied, not misread
    big = rank_data(world.rank, (2 * world.size, 6), np.float32)
    y = dist.all_reduce(big[:, ::2], "x", mesh=line)
    expect = sum(host_data(r, (2 * world.size, 6), np.float32)[:, ::2] for r in range(world.size))
    np.testing.assert_allclose(host(y), expect, rtol=1e-5)
    # every rank raised before communicating: the next collective lines up
    assert float(host(dist.all_reduce(xp.ones(1), "x", mesh=line))[0]) == world.size


@pytest.mark.timeout(60)
def test_ranks_passing_different_tags_get_the_agreement_error(line, world):
    """A tagged all-reduce on NCCL runs on a communicator of its own, made collectively: made
    before the agreement check, rank 0 (tag="tree") would wait in its creation while the
    others (no tag) wait in the check.  Every rank gets the check's error, and the group
    still works after it."""
    if world.size == 1:
        pytest.skip("a group of one has nothing to agree on")
    x = rank_data(world.rank, (4,), np.float32)
    with pytest.raises(dist.CollectiveMismatchError, match=r"rank 0 differs from the others.*'tag', 'tree'"
                       if world.size > 2 else r"'tag', 'tree'"):
        dist.all_reduce(x, "x", mesh=line, tag="tree" if world.rank == 0 else None)
    want = sum(host_data(r, (4,), np.float32) for r in range(world.size))
    np.testing.assert_allclose(host(dist.all_reduce(x, "x", mesh=line, tag="ring")), want, rtol=1e-6)


@pytest.mark.timeout(60)
def test_all_to_all_tag(line, world):
    """tag= on all_to_all: checked, recorded, and the same data as untagged (MPI and NCCL
    have no algorithm choice per all-to-all call)."""
    n = world.size
    x = rank_data(world.rank, (2 * n, 3), np.float32)
    plain = host(dist.all_to_all(x, "x", mesh=line))
    with dist.trace_collectives() as log:
        tagged = dist.all_to_all(x, "x", mesh=line, tag="tree")
    np.testing.assert_array_equal(host(tagged), plain)
    assert log.records[-1].op == "all_to_all" and log.records[-1].tag == "tree"
    with pytest.raises(ValueError, match=r"all_to_all over mesh axis 'x'.*tag='fast'"):
        dist.all_to_all(x, "x", mesh=line, tag="fast")
    D = dist.distribute(np.zeros((2 * n, 2), np.float32), layout=dist.ShardSpec(partition=(0,), mesh_axes=("x",)),
                        mesh=line)
    with pytest.raises(ValueError, match="tag applies to arrays"):
        dist.all_to_all(D, "x", tag="ring")


# --------------------------------------------------------------------------- the C path (dist/comm/_hot.c)

# TESSERA_HOT=0 (gpu_check.sh where no compiler built it) is a choice the launch accepts; an
# extension that failed to build is not (tests/collectives/test_hot.py fails for it too)
_NO_C_PATH = ("the C path is off (TESSERA_HOT=0)" if os.environ.get("TESSERA_HOT", "1").strip().lower()
              in ("0", "off", "false", "no") else "dist.comm._hot is not built (tests/collectives/test_hot.py fails for that)")

from tessera_rt.dist.comm import collectives as C
from tessera_rt.dist.comm.plans import clear_plans, plans_made

ON_CPU = not BACKEND.is_gpu


def _hot_cases(world, line):
    """(name, call, NumPy reference) for each plain collective over the line mesh."""
    n, r = world.size, world.rank
    full = [host_data(k, (2 * n, 3), np.float32, 7) for k in range(n)]
    total = sum(full)
    return [
        ("all_reduce", lambda **kw: dist.all_reduce(rank_data(r, (2 * n, 3), np.float32, 7), "x", **kw), total),
        ("reduce_scatter", lambda **kw: dist.reduce_scatter(rank_data(r, (2 * n, 3), np.float32, 7), "x", **kw),
         total[2 * r:2 * r + 2]),
        ("reduce_scatter", lambda **kw: dist.reduce_scatter(rank_data(r, (3, 2 * n), np.float32, 8), "x", dim=1,
                                                            **kw),               # packs first
         sum(host_data(k, (3, 2 * n), np.float32, 8) for k in range(n))[:, 2 * r:2 * r + 2]),
        ("all_gather", lambda **kw: dist.all_gather(rank_data(r, (2, 3), np.float32, 7), "x", **kw),
         np.concatenate([host_data(k, (2, 3), np.float32, 7) for k in range(n)])),
        ("all_to_all", lambda **kw: dist.all_to_all(rank_data(r, (2 * n, 3), np.float32, 7), "x", **kw),
         np.concatenate([f[2 * r:2 * r + 2] for f in full])),
        ("broadcast", lambda **kw: dist.broadcast(rank_data(r, (2 * n, 3), np.float32, 7), "x", root=n - 1, **kw),
         full[n - 1]),
    ]


@pytest.mark.timeout(60)
def test_repeat_calls_take_the_c_path_with_the_python_result(world, line):
    if C.HOT is None:
        pytest.skip(_NO_C_PATH)
    for name, call, want in _hot_cases(world, line):
        fn = getattr(C, name)
        for how in ({"mesh": line}, {}):            # mesh= given, then the current mesh
            with line:
                first = call(**how)                  # a miss: the Python function builds the plan
                hits = fn.hits
                again = call(**how)
                assert fn.hits == hits + (1 if ON_CPU else 0), (name, how)
            np.testing.assert_allclose(host(first), want, rtol=1e-5, err_msg=name)
            np.testing.assert_array_equal(host(again), host(first), err_msg=name)


@pytest.mark.timeout(60)
def test_the_c_path_hands_everything_else_to_python(world, line):
    if C.HOT is None:
        pytest.skip(_NO_C_PATH)
    x = rank_data(world.rank, (4, 6), np.float32, 3)
    want = sum(host_data(k, (4, 6), np.float32, 3) for k in range(world.size))
    dist.all_reduce(x, "x", mesh=line)
    hits = C.all_reduce.hits
    # a strided input, a bad out=, an unknown keyword, a DTensor, hooks on: all Python
    y = dist.all_reduce(xp.asarray(np.repeat(host(x), 2, axis=1))[:, ::2], "x", mesh=line)
    np.testing.assert_allclose(host(y), want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"out= must be a contiguous float32\[4, 6\]"):
        dist.all_reduce(x, "x", mesh=line, out=xp.empty((4, 5), np.float32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'axes'"):
        dist.all_reduce(x, axes="x", mesh=line)
    b = dist.broadcast(dist.from_local(xp.full(3, float(world.rank)), mesh=line, shape=(3,), validate=False),
                       axis="x", root=0)
    assert (host(b.to_local()) == 0).all()
    with dist.trace_collectives() as records:
        dist.all_reduce(x, "x", mesh=line)
    assert records.count("all_reduce") == 1
    assert C.all_reduce.hits == hits
    # in place through the C path
    z = xp.asarray(host(x).copy())
    dist.all_reduce(z, "x", mesh=line, out=z)
    dist.all_reduce(xp.asarray(host(x).copy()), "x", mesh=line, out=z.copy())
    z2 = xp.asarray(host(x).copy())
    assert dist.all_reduce(z2, "x", mesh=line, out=z2) is z2
    np.testing.assert_allclose(host(z2), want, rtol=1e-5)
    assert C.all_reduce.hits == hits + (3 if ON_CPU else 0)


@pytest.mark.timeout(60)
def test_clearing_the_plans_is_seen_by_the_c_path(world, line):
    x = rank_data(world.rank, (5,), np.float64, 1)
    dist.all_gather(x, "x", mesh=line)
    dist.all_gather(x, "x", mesh=line)
    made = plans_made()
    clear_plans()
    y = dist.all_gather(x, "x", mesh=line)            # rebuilt, not the remembered plan
    assert plans_made() == made + 1
    dist.all_gather(x, "x", mesh=line)
    assert plans_made() == made + 1
    np.testing.assert_array_equal(host(y), np.concatenate([host_data(k, (5,), np.float64, 1)
                                                           for k in range(world.size)]))
