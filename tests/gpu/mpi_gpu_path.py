"""The cuda backend's collectives on the stand-in (launched by tests/gpu/test_gpu_path_standin.py).

Runs under mpiexec with the strict CuPy/NCCL stand-in as ``cupy``: its memory pool hands a
freed block to the next allocation on the stream it came from, as CuPy's does, and reports
any reuse that a pending operation on another stream still reads."""
import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist


@pytest.fixture(autouse=True)
def _in_step():
    MPI.COMM_WORLD.Barrier()
    yield
    ts.runtime.reset()
    MPI.COMM_WORLD.Barrier()


def test_async_all_reduce_keeps_its_input_until_wait():
    import cupy
    w = dist.init()
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    work = dist.all_reduce(cupy.asarray(np.full(1024, w.rank + 1.0, np.float32)), axis="dp", mesh=mesh,
                           async_op=True)
    # the input above is dropped by the caller at once: compute's next allocations of the
    # same size must not be handed its block while NCCL may still read it
    scratch = [cupy.full(1024, -7.0, np.float32) for _ in range(4)]
    got = work.wait().get()
    assert scratch[0].get()[0] == -7.0
    np.testing.assert_array_equal(got, np.full(1024, w.size * (w.size + 1) / 2, np.float32))


def test_ring_of_irecv_then_isend_completes():
    # a lone NCCL recv blocks its stream until the peer's send runs: the sends and recvs of
    # an exchange must launch together (one NCCL group), or this ring hangs on a GPU
    import cupy
    w = dist.init()
    if w.size == 1:
        return
    mesh = dist.Mesh(axes=["x"], shape={"x": w.size})
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    buf = cupy.empty(6, np.float32)
    r = dist.recv(buf, left, axis="x", mesh=mesh, async_op=True)
    s = dist.send(cupy.full(6, float(w.rank), np.float32), right, axis="x", mesh=mesh, async_op=True)
    r.wait(), s.wait()
    np.testing.assert_array_equal(buf.get(), np.full(6, left, np.float32))


def test_an_async_save_copies_on_the_io_stream_and_survives_changes_after_it_returns(tmp_path_factory):
    # dist.save(async_=True) on device arrays: device-to-host on the io stream after an event
    # from compute, into pinned memory; compute waits for that copy on the device.  The
    # stand-in reports a copy that reads before compute's writes land or a write of compute
    # that races the copy; the saved values are the ones at the call.
    import cupy
    w = dist.init()
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if w.rank == 0 else None, root=0)
    W = np.arange(12 * w.size, dtype=np.float32).reshape(4 * w.size, 3)
    X = dist.distribute(cupy.asarray(W), layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)), mesh=mesh)
    X.to_local()[...] *= 2                   # compute's work, still queued when the save starts
    handle = dist.save({"w": X, "step": 3}, path, async_=True)
    X.to_local()[...] = -1                   # the training changes the state once save returned
    while not handle.poll():
        pass
    got = dist.load(path, like={"w": dist.zeros(W.shape, mesh=mesh), "step": 0})
    assert got["step"] == 3 and isinstance(got["w"].to_local(), cupy.ndarray)
    np.testing.assert_array_equal(got["w"].full_tensor().get(), 2 * W)
