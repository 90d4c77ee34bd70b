"""The CuPy stand-in's CUDA graphs (``Stream.begin_capture`` / ``end_capture``,
``cupy.cuda.Graph.launch``): nothing runs while capturing, a launch replays the captured work
on the memory as it is at launch time, and what CUDA refuses during a capture fails here
(and invalidates the capture), so code proven on the stand-in is safe to capture on a GPU.
Multi-rank NCCL capture: tests/inference/test_inference_gpu.py's tp=2 run."""
import gc
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "gpu_emu") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "gpu_emu"))
if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "__tessera_standin__", False):
    pytest.skip("the real CuPy is loaded in this process; the stand-in's own tests run where CuPy is "
                "not installed", allow_module_level=True)

import cupy
from cupy import _capture
from cupy.cuda import runtime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _idle():
    cupy.cuda.Stream.null.use()
    yield
    left = dict(_capture._tracker.CAPTURING)
    _capture._tracker.CAPTURING.clear()
    cupy.cuda.Stream.null.use()
    assert not left, "a test left a capture open"


def _pinned(n, dtype=np.float32):
    return np.frombuffer(cupy.cuda.alloc_pinned_memory(n * np.dtype(dtype).itemsize), dtype, n)


def _capture_on(stream, fn):
    with stream:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def test_a_capture_runs_nothing_and_a_launch_reads_memory_at_launch_time():
    s = cupy.cuda.Stream(non_blocking=True)
    a = cupy.arange(6, dtype=cupy.float32)
    b = cupy.zeros(6, cupy.float32)
    host = _pinned(6)
    host[...] = 5
    out = {}

    def work():
        cupy.multiply(a, 2, out=b)          # reads a, writes b
        out["c"] = b + 1                    # a fresh array: allocated now, filled by each launch
        a.set(host)                         # a pinned copy node: reads the host buffer at launch
        assert s.is_capturing()
    g = _capture_on(s, work)
    assert not s.is_capturing()
    assert g.standin_nodes() == ["cupy.multiply", "cupy.add", "ndarray.set (host->device copy)"]
    assert (b.get() == 0).all() and (a.get() == np.arange(6)).all(), "nothing ran while capturing"
    with cupy.testing.count_device_work() as w:
        g.launch(s)
    s.synchronize()
    assert (w.graph_launches, w.launches, w.h2d, w.syncs) == (1, 2, 1, 0)
    np.testing.assert_array_equal(b.get(), np.arange(6) * 2)
    np.testing.assert_array_equal(out["c"].get(), np.arange(6) * 2 + 1)
    np.testing.assert_array_equal(a.get(), 5)
    host[...] = 1                           # the replay reads a and the pinned buffer as they are now
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(b.get(), 10)
    np.testing.assert_array_equal(a.get(), 1)


def test_raw_kernels_are_graph_nodes():
    k = cupy.RawKernel(r'extern "C" __global__ void inc(float* x, int n) {'
                       r' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.f; }', "inc")
    x = cupy.zeros(40, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    g = _capture_on(s, lambda: k((2,), (32,), (x, np.int32(40))))
    assert (x.get() == 0).all()
    for _ in range(3):
        g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(x.get(), 3)


@pytest.mark.parametrize("what", ["sync", "get", "float", "mask", "pageable_set", "asarray", "device_sync",
                                  "query", "host_index"])
def test_what_cuda_refuses_during_capture_fails_and_invalidates_it(what):
    s = cupy.cuda.Stream(non_blocking=True)
    a = cupy.arange(4, dtype=cupy.float32)
    act = {"sync": s.synchronize, "get": a.get, "float": lambda: float(a.sum()), "mask": lambda: a[a > 1],
           "pageable_set": lambda: a.set(np.ones(4, np.float32)), "asarray": lambda: cupy.asarray(np.ones(3)),
           "device_sync": cupy.cuda.Device().synchronize, "query": lambda: s.done,
           "host_index": lambda: a[np.array([0, 2])]}[what]
    with s:
        s.begin_capture()
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureUnsupported"):
            act()
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    assert not s.is_capturing()


def test_a_graph_that_uses_freed_memory_is_refused_at_launch():
    s = cupy.cuda.Stream(non_blocking=True)
    a = cupy.arange(4, dtype=cupy.float32)
    keep = {}

    def work():
        tmp = a * 3                          # allocated during the capture ...
        keep["out"] = tmp + 1
    g = _capture_on(s, work)                 # ... and dropped when work() returns
    gc.collect()
    with pytest.raises(_capture.GraphMemoryError, match="freed since the capture"):
        g.launch(s)
    assert g.standin_allocations() == 2


def test_the_pool_growing_is_refused_in_global_mode_but_not_in_relaxed():
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(runtime.streamCaptureModeGlobal)
        with pytest.raises(runtime.CUDARuntimeError, match="cudaMalloc"):
            cupy.empty(1 << 20, cupy.float32)
        with pytest.raises(runtime.CUDARuntimeError, match="Invalidated"):
            s.end_capture()
        s.begin_capture()                    # relaxed: CuPy's default
        x = cupy.empty(1 << 20, cupy.float32)
        s.end_capture()
    assert x.size == 1 << 20


def test_work_forked_to_another_stream_must_join_back():
    s, t = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s:
        a = cupy.ones(4, cupy.float32)

    def forked(join: bool):
        with s:
            s.begin_capture()
            t.wait_event(s.record())         # t joins the capture
            with t:
                cupy.multiply(a, 2, out=a)   # captured on t
            if join:
                s.wait_event(t.record())
            return s.end_capture()
    g = forked(True)
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(a.get(), 2)
    assert not t.is_capturing()
    with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureUnjoined"):
        forked(False)


def test_events_and_streams_across_the_capture_boundary():
    s, t = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    outside = t.record()
    with s:
        s.begin_capture()
        inside = s.record()
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorCapturedEvent"):
            inside.synchronize()
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureIsolation"):
            s.wait_event(outside)            # a dependency on uncaptured work
        with pytest.raises(runtime.CUDARuntimeError, match="Invalidated"):
            s.end_capture()
    with pytest.raises(RuntimeError, match="legacy"):
        cupy.cuda.Stream.null.begin_capture()
    blocking = cupy.cuda.Stream()            # capturing a blocking stream: the legacy stream may not be used
    with blocking:
        blocking.begin_capture()
    with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureImplicit"):
        cupy.zeros(3)                        # issued on the legacy null stream
    with pytest.raises(runtime.CUDARuntimeError, match="Invalidated"):
        blocking.end_capture()


def test_a_pinned_download_node_lands_when_the_host_sees_the_launch_complete():
    s = cupy.cuda.Stream(non_blocking=True)
    with s:                                  # made where the graph will read it
        a = cupy.arange(3, dtype=cupy.int32)
    host = _pinned(3, np.int32)
    host[...] = -7
    g = _capture_on(s, lambda: (cupy.add(a, 1, out=a), a.get(out=host, blocking=False)))
    assert (host == -7).all()
    g.launch(s)
    assert not (host == np.arange(3) + 1).all(), "not before the host waits"
    s.synchronize()
    np.testing.assert_array_equal(host, np.arange(3) + 1)


def test_set_allocator_routes_every_array():
    pool = cupy.get_default_memory_pool()
    sizes = []

    def counting(n):
        sizes.append(n)
        return pool.malloc(n)
    cupy.cuda.set_allocator(counting)
    try:
        cupy.empty(10, cupy.float32)
        cupy.zeros(0)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert sizes == [40, 0] and cupy.cuda.get_allocator() == pool.malloc


def test_end_capture_on_the_wrong_stream_or_thread():
    s, t = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(runtime.streamCaptureModeThreadLocal)
        t.wait_event(s.record())
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureUnmatched"):
            t.end_capture()
        err = []
        th = threading.Thread(target=lambda: err.append(pytest.raises(runtime.CUDARuntimeError, s.end_capture)))
        th.start()
        th.join()
        assert "WrongThread" in str(err[0].value)
        with pytest.raises(runtime.CUDARuntimeError, match="Invalidated"):
            s.end_capture()
