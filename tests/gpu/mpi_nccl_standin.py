"""The stand-in's cupy.cuda.nccl against NumPy, at 2 and 3 ranks (every rank runs this)."""
import numpy as np
import pytest

mpi = pytest.importorskip("mpi4py.MPI")
import cupy
from cupy.cuda import nccl

WORLD = mpi.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
F32, BF16, U8 = 7, 9, 1


def make_comm(mpi_comm):
    uid = mpi_comm.bcast(nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None, root=0)
    return nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())


@pytest.fixture(scope="module")
def comm():
    return make_comm(WORLD)


@pytest.fixture(autouse=True)
def _on_the_null_stream():
    # the tests make their arrays on the null stream; a suite before this one in the same
    # launch leaves the runtime's compute stream current (tessera_rt.runtime.reset)
    with cupy.cuda.Stream.null:
        yield


@pytest.fixture
def stream():
    # a blocking stream: ordered after the null stream, where the test's arrays are made
    s = cupy.cuda.Stream()
    yield s
    s.synchronize()


def contribution(rank, n=10):
    return (np.arange(n, dtype=np.float32) + 1) * (rank + 1)


def test_identity(comm):
    assert comm.rank_id() == RANK and comm.size() == SIZE and nccl.available


@pytest.mark.parametrize("op, reduce", [(0, np.sum), (1, np.prod), (2, np.max), (3, np.min), (4, np.mean)])
def test_all_reduce(comm, stream, op, reduce):
    x = cupy.asarray(contribution(RANK))
    y = cupy.empty_like(x)
    comm.allReduce(x.data.ptr, y.data.ptr, x.size, F32, op, stream.ptr)
    expect = reduce(np.stack([contribution(r) for r in range(SIZE)]), axis=0)
    np.testing.assert_allclose(y.get(stream), expect, rtol=1e-6)
    comm.allReduce(x.data.ptr, x.data.ptr, x.size, F32, op, stream.ptr)     # in place
    np.testing.assert_allclose(x.get(stream), expect, rtol=1e-6)


def test_all_reduce_bf16_in_float32(comm, stream):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    host = contribution(RANK).astype(ml_dtypes.bfloat16)
    x = cupy.asarray(host.view(np.uint16))
    comm.allReduce(x.data.ptr, x.data.ptr, x.size, BF16, 0, stream.ptr)
    expect = np.sum([contribution(r).astype(ml_dtypes.bfloat16).astype(np.float32) for r in range(SIZE)], axis=0)
    np.testing.assert_array_equal(x.get(stream).view(ml_dtypes.bfloat16), expect.astype(ml_dtypes.bfloat16))


def test_reduce_scatter_all_gather_broadcast(comm, stream):
    n = 4
    send = cupy.asarray(np.tile(contribution(RANK, n), SIZE))
    recv = cupy.empty(n, np.float32)
    comm.reduceScatter(send.data.ptr, recv.data.ptr, n, F32, 0, stream.ptr)
    np.testing.assert_allclose(recv.get(stream), sum(contribution(r, n) for r in range(SIZE)))
    gathered = cupy.empty(n * SIZE, np.float32)
    part = cupy.asarray(contribution(RANK, n))
    comm.allGather(part.data.ptr, gathered.data.ptr, part.nbytes, U8, stream.ptr)     # as bytes
    np.testing.assert_array_equal(gathered.get(stream), np.concatenate([contribution(r, n) for r in range(SIZE)]))
    buf = cupy.asarray(contribution(RANK, n))
    comm.broadcast(buf.data.ptr, buf.data.ptr, n, F32, SIZE - 1, stream.ptr)
    np.testing.assert_array_equal(buf.get(stream), contribution(SIZE - 1, n))


def test_grouped_uneven_reduce_and_broadcast(comm, stream):
    counts = [r + 2 for r in range(SIZE)]                    # uneven parts, as reduce_scatter(counts=)
    offs = np.cumsum([0] + counts[:-1])
    total = sum(counts)
    send = cupy.asarray(contribution(RANK, total))
    recv = cupy.empty(counts[RANK], np.float32)
    item = 4
    nccl.groupStart()
    for root, (count, off) in enumerate(zip(counts, offs)):
        dst = recv.data.ptr if root == RANK else send.data.ptr + int(off) * item
        comm.reduce(send.data.ptr + int(off) * item, dst, count, F32, 0, root, stream.ptr)
    nccl.groupEnd()
    full = sum(contribution(r, total) for r in range(SIZE))
    np.testing.assert_allclose(recv.get(stream), full[offs[RANK]:offs[RANK] + counts[RANK]])
    # uneven all-gather: one broadcast per root, grouped
    mine = cupy.asarray(contribution(RANK, counts[RANK]))
    out = cupy.empty(total, np.float32)
    nccl.groupStart()
    for root, (count, off) in enumerate(zip(counts, offs)):
        dst = out.data.ptr + int(off) * item
        src = mine.data.ptr if root == RANK else dst
        comm.broadcast(src, dst, count, F32, root, stream.ptr)
    nccl.groupEnd()
    np.testing.assert_array_equal(out.get(stream), np.concatenate([contribution(r, c) for r, c in enumerate(counts)]))


def test_grouped_send_recv_all_to_all(comm, stream):
    n = 3
    send = cupy.asarray(np.concatenate([contribution(RANK, n) + 100 * peer for peer in range(SIZE)]))
    recv = cupy.empty(n * SIZE, np.float32)
    nccl.groupStart()
    for peer in range(SIZE):       # every rank sends before it receives: only a group makes this safe
        comm.send(send.data.ptr + peer * n * 4, n * 4, U8, peer, stream.ptr)
        comm.recv(recv.data.ptr + peer * n * 4, n * 4, U8, peer, stream.ptr)
    nccl.groupEnd()
    expect = np.concatenate([contribution(peer, n) + 100 * RANK for peer in range(SIZE)])
    np.testing.assert_array_equal(recv.get(stream), expect)


def test_ungrouped_send_recv_ring(comm, stream):
    buf = cupy.asarray(contribution(RANK, 5))
    got = cupy.empty(5, np.float32)
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    if RANK % 2 == 0:
        comm.send(buf.data.ptr, 5, F32, right, stream.ptr)
        comm.recv(got.data.ptr, 5, F32, left, stream.ptr)
    else:
        comm.recv(got.data.ptr, 5, F32, left, stream.ptr)
        comm.send(buf.data.ptr, 5, F32, right, stream.ptr)
    np.testing.assert_array_equal(got.get(stream), contribution(left, 5))


def test_subgroup_communicators_rendezvous_by_id():
    """One communicator per subgroup, not every world rank in each (as per mesh axis)."""
    color = RANK % 2
    sub = WORLD.Split(color, RANK)
    c = make_comm(sub)
    x = cupy.asarray(np.full(3, RANK, np.float32))
    s = cupy.cuda.Stream()
    c.allReduce(x.data.ptr, x.data.ptr, 3, F32, 0, s.ptr)
    members = [r for r in range(SIZE) if r % 2 == color]
    np.testing.assert_array_equal(x.get(s), np.full(3, sum(members), np.float32))
    c.destroy()


def test_buffer_overrun_refused(comm, stream):
    x = cupy.empty(128, np.float32)                       # one 512-byte block
    with pytest.raises(nccl.NcclError, match="runs past"):
        comm.allReduce(x.data.ptr + 4, x.data.ptr, 128, F32, 0, stream.ptr)
    WORLD.Barrier()


def test_dropped_async_input_is_caught(comm):
    """The defect the tracker exists for: an allReduce on the comm stream reads a buffer the
    compute stream drops; the pool hands that block to compute's next allocation."""
    import gc
    compute, comm_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        x = cupy.ones(256, np.float32)
        out = cupy.empty(256, np.float32)
        comm_stream.wait_event(compute.record())          # x is ready (collectives.py does this)
        comm.allReduce(x.data.ptr, out.data.ptr, 256, F32, 0, comm_stream.ptr)
        del x
        gc.collect()
        with pytest.raises(cupy.StreamOrderError, match="nccl.allReduce"):
            cupy.empty(256, np.float32)
        compute.wait_event(comm_stream.record())
        cupy.empty(256, np.float32)                        # ordered now: fine
