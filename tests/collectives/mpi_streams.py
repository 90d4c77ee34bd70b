"""Streams per role that run beside the caller, ordered by events (issue 17, seed 000 §3.3).

On the CPU every role but ``compute`` has a worker thread; on a GPU (here: the CuPy/NCCL
stand-in, see tests/gpu/test_gpu_path_standin.py) the roles are CUDA streams.  The tests without
a ``cpu_only`` mark run the same program on both and check the same orderings and results;
the ``cpu_only`` ones check what only a worker thread has (it really runs while the caller
waits on something else, its exceptions come back to the caller, the watchdog sees a caller
blocked on it).  Results are compared with NumPy on the data every rank can rebuild.
"""
import threading
import time

import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import dist, runtime as rt
from tessera_rt.backend import CpuWorkerStream

BACKEND = ts.get_backend()
xp = BACKEND.xp
host = BACKEND.to_host
cpu_only = pytest.mark.skipif(BACKEND.is_gpu, reason="checks the CPU worker threads themselves")
pytestmark = pytest.mark.timeout(60)


def data(rank, n, salt=0):
    return np.random.default_rng(7919 * salt + rank).standard_normal(n).astype(np.float32)


@pytest.fixture(autouse=True, scope="module")
def worker_streams():
    # worker streams are opt-in on the CPU (TESSERA_CPU_STREAMS=threads): this file tests them
    was = ts.backend.cpu_workers()
    ts.backend.set_cpu_workers(True)
    rt.reset()
    yield
    ts.backend.set_cpu_workers(was)
    rt.reset()


@pytest.fixture
def line(world):
    return dist.Mesh(axes=["x"], shape={"x": world.size})


def test_non_compute_roles_get_workers_on_the_cpu(world):
    for role in ("tp_collective", "a2a", "io"):
        s = rt.stream(role)
        assert s is not rt.stream("compute")
        assert isinstance(s, CpuWorkerStream) is (not BACKEND.is_gpu)
    assert not isinstance(rt.stream("compute"), CpuWorkerStream)


def test_an_event_orders_a_collective_after_compute_and_compute_after_it(world, line):
    # compute writes x, the role's stream waits for that point, the collective reads x;
    # then compute waits for the collective's event before it reads the result
    n, p = world.size, 1 << 14
    compute, tp = rt.stream("compute"), rt.stream("tp_collective")
    x = xp.asarray(data(world.rank, p))
    x *= 2
    tp.wait_event(compute.record())
    work = dist.all_reduce(x, "x", mesh=line, async_op=True)
    y = work.wait()
    np.testing.assert_allclose(host(y), 2 * sum(data(r, p) for r in range(n)), rtol=1e-5, atol=1e-5)
    assert work.is_completed() and tp.record().query()
    tp.synchronize()


def test_timing_events_on_a_role_stream(world, line):
    tp = rt.stream("tp_collective")
    a = tp.record(timing=True)
    dist.all_reduce(xp.ones(1 << 12, np.float32), "x", mesh=line, async_op=True, role="tp_collective")
    b = tp.record(timing=True)
    b.synchronize()
    assert a.query() and b.query() and a.elapsed_ms(b) >= 0
    with pytest.raises(ValueError, match="timing=True"):
        tp.record().elapsed_ms(b)


def test_several_roles_issue_collectives_at_once(world, line):
    # three roles (and a fourth, new one on its own slot) each with collectives in flight
    # at once; waited for in an order unlike the issue order; repeated to shake out races
    rt.set_stream_map({"pipeline": 4})
    n, rank = world.size, world.rank
    for it in range(12):
        p = 64 * (1 + it % 5) * n
        issued = []
        for k, role in enumerate(("tp_collective", "a2a", "io", "pipeline") * 2):
            salt = 100 * it + k
            x = xp.asarray(data(rank, p, salt))
            if k % 3 == 0:
                issued.append(("sum", salt, dist.all_reduce(x, "x", mesh=line, async_op=True, role=role)))
            elif k % 3 == 1:
                issued.append(("gather", salt, dist.all_gather(x, "x", mesh=line, async_op=True, role=role)))
            else:
                issued.append(("a2a", salt, dist.all_to_all(x, "x", mesh=line, async_op=True, role=role)))
        for kind, salt, work in issued[::-1] if it % 2 else issued:
            got = host(work.wait())
            every = [data(r, p, salt) for r in range(n)]
            if kind == "sum":
                np.testing.assert_allclose(got, sum(every), rtol=1e-5, atol=1e-5)
            elif kind == "gather":
                np.testing.assert_array_equal(got, np.concatenate(every))
            else:
                q = p // n
                np.testing.assert_array_equal(got, np.concatenate([e[rank * q:(rank + 1) * q] for e in every]))
    rt.synchronize()


def test_a_blocking_collective_runs_after_its_roles_queue(world, line):
    # stream order: the blocking call on a role comes after that role's async ones
    n, p = world.size, 1 << 12
    x = xp.asarray(data(world.rank, p))
    works = [dist.all_reduce(x, "x", mesh=line, async_op=True) for _ in range(4)]
    y = dist.all_reduce(x, "x", mesh=line)
    expect = sum(data(r, p) for r in range(n))
    np.testing.assert_allclose(host(y), expect, rtol=1e-5, atol=1e-5)
    assert all(w.is_completed() for w in works) or BACKEND.is_gpu
    for w in works:
        np.testing.assert_allclose(host(w.wait()), expect, rtol=1e-5, atol=1e-5)


def test_ring_of_async_recv_then_blocking_send(world, line):
    # a worker must not hold the role's queue in a recv its peer's later send would feed
    n, rank = world.size, world.rank
    if n == 1:
        pytest.skip("a ring needs two ranks")
    buf = xp.zeros(256, np.float32)
    work = dist.recv(buf, (rank - 1) % n, axis="x", mesh=line, async_op=True)
    dist.send(xp.full(256, rank, np.float32), (rank + 1) % n, axis="x", mesh=line)
    np.testing.assert_array_equal(host(work.wait()), np.full(256, (rank - 1) % n, np.float32))


def test_a_send_after_a_collective_on_its_role_sends_the_result(world, line):
    # stream order across kinds: the send reads what the queued all_reduce writes
    n, rank = world.size, world.rank
    if n == 1:
        pytest.skip("a ring needs two ranks")
    p = 4096
    total, got = xp.empty(p, np.float32), xp.zeros(p, np.float32)
    reduce = dist.all_reduce(xp.asarray(data(rank, p, 5)), "x", mesh=line, out=total, async_op=True)
    rwork = dist.recv(got, (rank - 1) % n, axis="x", mesh=line, async_op=True)
    swork = dist.send(total, (rank + 1) % n, axis="x", mesh=line, async_op=True)
    for w in (rwork, swork, reduce):
        w.wait()
    np.testing.assert_allclose(host(got), sum(data(r, p, 5) for r in range(n)), rtol=1e-5, atol=1e-5)


def test_collectives_on_every_role_are_seen_by_the_hooks(world, line):
    x = xp.ones(64, np.float32)
    with dist.trace_collectives() as log:
        works = [dist.all_reduce(x, "x", mesh=line, async_op=True, role=r) for r in ("tp_collective", "a2a", "io")]
        for w in works:
            w.wait()
    assert log.count("all_reduce") == 3


# ----------------------------------------------------------------- the CPU workers themselves

@cpu_only
def test_a_worker_runs_while_the_caller_runs_and_events_order_workers(world):
    tp, a2a = rt.stream("tp_collective"), rt.stream("a2a")
    gate, order = threading.Event(), []
    tp.submit(lambda: (gate.wait(5), order.append("tp")))
    e = tp.record()
    a2a.wait_event(e)                    # a2a's later work waits for tp's, not the caller
    a2a.submit(lambda: order.append("a2a"))
    after = a2a.record()
    time.sleep(0.05)
    assert not e.query() and not after.query() and order == []     # the caller was not held
    gate.set()
    after.synchronize()
    assert order == ["tp", "a2a"] and e.query()


@cpu_only
def test_a_workers_exception_surfaces_at_the_next_wait_with_its_traceback(world):
    tp = rt.stream("tp_collective")
    before = tp.record()

    def failing_step():
        raise ZeroDivisionError("the worker's own error")

    tp.submit(failing_step)
    skipped = []
    tp.submit(lambda: skipped.append(1))
    covered = tp.record()
    before.synchronize()                                  # work before the failure is fine
    deadline = time.monotonic() + 10
    while not covered.query() and time.monotonic() < deadline:
        time.sleep(0.001)                                 # an event recorded after the failure...
    late = tp.record()
    with pytest.raises(ZeroDivisionError):                # ...raises too, however late
        late.synchronize()
    with pytest.raises(ZeroDivisionError, match="the worker's own error") as info:
        covered.synchronize()
    frames = [f.name for f in info.traceback]
    assert "failing_step" in frames, frames                 # the original traceback
    assert "worker thread" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(ZeroDivisionError):                  # the stream stays failed
        tp.synchronize()
    with pytest.raises(ZeroDivisionError):
        tp.submit(lambda: None)
    assert skipped == []
    rt.reset()                                              # a fresh stream works again
    assert rt.stream("tp_collective").record().query()


@cpu_only
def test_the_watchdog_sees_the_caller_blocked_on_a_worker(world):
    from tessera_rt.dist.checks import watchdog
    tp = rt.stream("tp_collective")
    gate, seen = threading.Event(), []
    tp.submit(lambda: gate.wait(5))

    def probe():
        time.sleep(0.1)
        seen.append(watchdog.in_collective(watchdog.main_frame()))
        gate.set()

    t = threading.Thread(target=probe)
    t.start()
    tp.synchronize()
    t.join()
    assert seen == [True]


@cpu_only
def test_an_async_collective_really_runs_under_compute(world, line):
    # the profiler counts the interval the worker really ran the collective in
    x = np.ones(1 << 12, np.float32)
    dist.all_reduce(x, "x", mesh=line, async_op=True).wait()     # the role's stream and communicator
    with ts.profiler.profile(print_table=False) as prof:
        with prof.region("compute"):
            work = dist.all_reduce(x, "x", mesh=line, async_op=True)
            deadline = time.monotonic() + 20       # compute that lasts until the worker is done
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.002)
        work.wait()
    if world.size > 1:
        assert prof.overlap_ratio == pytest.approx(1.0), prof.overlap_ratio


@cpu_only
def test_mpi_gives_the_thread_level_workers_need(world):
    from mpi4py import MPI
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert ts.backend.cpu_workers()


@cpu_only
def test_the_in_order_fallback_keeps_the_same_results(world, line):
    n, p = world.size, 1 << 10
    ts.backend.set_cpu_workers(False)
    try:
        rt.reset()
        assert not isinstance(rt.stream("tp_collective"), CpuWorkerStream)
        x = np.asarray(data(world.rank, p))
        y = dist.all_reduce(x, "x", mesh=line, async_op=True).wait()
        np.testing.assert_allclose(y, sum(data(r, p) for r in range(n)), rtol=1e-5, atol=1e-5)
    finally:
        ts.backend.set_cpu_workers(True)
        rt.reset()


def test_ranks_that_issue_an_async_collective_on_different_roles_get_an_error(world, line):
    # each CPU role has its own communicator: without the check these ranks would never match
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    role = "a2a" if world.rank == world.size - 1 else "tp_collective"
    with pytest.raises(dist.CollectiveMismatchError, match=r"all_reduce"):
        dist.all_reduce(xp.ones(4, np.float32), "x", mesh=line, async_op=True, role=role).wait()
    y = dist.all_reduce(xp.ones(4, np.float32), "x", mesh=line, async_op=True).wait()   # still usable
    np.testing.assert_array_equal(host(y), np.full(4, world.size, np.float32))
