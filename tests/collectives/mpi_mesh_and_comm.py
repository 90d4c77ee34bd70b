"""Meshes at 1-4 ranks, and the host-staged communicator checked against plain MPI."""
import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist
from tessera_rt.dist.comm.communicators import HostStagedCommunicator, MpiCommunicator


def test_default_devices_follow_topology_order(world):
    m = dist.Mesh(axes=["x"], shape=(world.size,))
    assert m.devices == tuple(world.topology_order())
    rows = m.rank_map()
    assert [r["rank"] for r in rows] == list(m.devices)
    assert all(r["host"] == world.seats[r["rank"]].host for r in rows)


def test_ranks_that_make_different_meshes_all_get_the_same_error(world):
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    devices = list(range(world.size))
    if world.rank == 1:
        devices.reverse()
    with pytest.raises(ValueError, match=r"ranks made different meshes \(ranks \[0"):
        dist.Mesh(axes=["x"], shape=(world.size,), devices=devices)


def test_sub_mesh_leaves_other_ranks_out(world):
    if world.size < 2:
        pytest.skip("needs a rank outside the mesh")
    m = dist.Mesh(axes=["pair"], shape=(2,), devices=[world.size - 1, 0])
    if world.rank in (0, world.size - 1):
        assert m.is_member and m.coordinate("pair") == (0 if world.rank == world.size - 1 else 1)
        y = dist.all_gather(ts.get_backend().xp.asarray([world.rank]), "pair", mesh=m)
        assert list(ts.get_backend().to_host(y)) == [world.size - 1, 0]
    else:
        assert not m.is_member and m.coords is None
        with pytest.raises(ValueError, match=f"rank {world.rank} is not in Mesh"):
            dist.all_reduce(ts.get_backend().xp.ones(1), "pair", mesh=m)


def test_four_axis_mesh_of_the_seeds(world):
    m = dist.Mesh(axes=["tp", "ep", "pp", "dp"], shape={"tp": world.size, "ep": 1, "pp": 1, "dp": 1})
    assert m.size("tp") == world.size and m.size(("ep", "pp")) == 1
    x, host = ts.get_backend().xp.ones(1), ts.get_backend().to_host
    assert float(host(dist.all_reduce(x, "tp", mesh=m))[0]) == world.size
    assert float(host(dist.all_reduce(x, "ep", mesh=m))[0]) == 1.0


def _copy_to_host(a, stream):
    return np.array(a)          # stands in for a device->host copy


def _copy_to_device(h, a, stream):
    a[...] = h


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_host_staged_path_matches_mpi(world, dtype):
    """The staging logic of the GPU fallback, with NumPy arrays standing in for device ones."""
    comm = MPI.COMM_WORLD
    staged = HostStagedCommunicator(comm, _copy_to_host, _copy_to_device)
    plain = MpiCommunicator(comm)
    n, rng = world.size, np.random.default_rng(world.rank)
    x = rng.standard_normal(4 * n).astype(dtype)
    counts = [4] * n
    for name, args, out_len in [
        ("all_reduce", ("sum",), 4 * n), ("all_reduce", ("max",), 4 * n),
        ("reduce_scatter", (counts, "sum"), 4), ("all_gather", (counts,), 4 * n * n),
        ("all_to_all", (counts, counts), 4 * n),
    ]:
        src = x if name != "all_gather" else x[:4 * n]
        if name == "all_gather":
            args = ([4 * n] * n,)
        a, b = np.empty(out_len, dtype), np.empty(out_len, dtype)
        getattr(staged, name)(src, a, *args)
        getattr(plain, name)(src, b, *args)
        np.testing.assert_array_equal(a, b, err_msg=name)
    buf = x.copy()
    staged.broadcast(buf, 0)
    ref = x.copy()
    plain.broadcast(ref, 0)
    np.testing.assert_array_equal(buf, ref)
    staged.barrier()
