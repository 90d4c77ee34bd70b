import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from tessera_rt import backend as B, runtime as rt
from tessera_rt.dtypes import dtype_name, resolve_dtype


def test_cpu_backend_by_default_here():
    b = B.get_backend()
    assert b.name == "cpu" and b.xp is np and not b.is_gpu


def test_asking_for_cuda_without_gpu_is_one_clear_line():
    code = "import tessera_rt as ts; ts.get_backend()"
    # no usable GPU on a GPU machine too: no device visible, and not the stand-in's CuPy
    from conftest import GPU_EMU
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != str(GPU_EMU)]
    env = dict(os.environ, TESSERA_DEVICE="cuda", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(path))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("tessera_rt.backend.BackendUnavailable: TESSERA_DEVICE=cuda but")
    assert "TESSERA_DEVICE=cpu" in last
    assert "cupy/" not in p.stderr          # no traceback from inside cupy


def test_unknown_device_name(monkeypatch):
    monkeypatch.setenv("TESSERA_DEVICE", "tpu")      # restored afterwards, whatever it was
    try:
        B.reset_backend()
        with pytest.raises(B.BackendUnavailable, match="use 'cpu' or 'cuda'"):
            B.get_backend()
    finally:
        monkeypatch.undo()
        B.reset_backend()


@pytest.mark.parametrize("n", [1 << 18, 1 << 20])     # 1 MiB (malloc'd block), 4 MiB (mapped block)
def test_pool_reuses_a_block_only_when_every_view_is_gone(n):
    pool = B.HostBufferPool()
    a = pool.empty((n,), np.float32)
    a_ptr = a.ctypes.data
    if n * 4 >= pool.MAPPED_BYTES:
        assert a_ptr % (1 << 21) == 0 and isinstance(a.base.base, mmap.mmap)    # a block on its own mapping
    b = pool.empty((n,), np.float32)
    assert b.ctypes.data != a_ptr                     # a is alive: a new block
    view = a[10:20]
    del a
    c = pool.empty((n,), np.float32)
    assert c.ctypes.data != a_ptr                     # a view still holds a's block
    del view, c
    d = pool.empty((n // 512, 512), np.float32)       # same size class, other shape
    assert d.ctypes.data == a_ptr and d.shape == (n // 512, 512)
    small = pool.empty((4,), np.float64)              # small arrays bypass the pool
    assert small.base is None


def test_pool_allocator_leaves_blocks_below_the_mapped_size_to_numpy():
    pool = B.HostBufferPool()
    small = pool.allocator((1 << 16,), np.dtype(np.float32))()         # 256 KiB: malloc's recycled block
    assert small.base is None and small.shape == (1 << 16,)
    big = pool.allocator((1 << 20,), np.dtype(np.float32))            # 4 MiB: a pooled huge-page mapping
    a = big()
    assert a.ctypes.data % (1 << 21) == 0 and isinstance(a.base.base, mmap.mmap)
    ptr = a.ctypes.data
    del a
    assert big().ctypes.data == ptr                                   # handed back once it is dropped


def test_pool_size_classes_bound_the_slack():
    for n in [65536, 100_000, 1 << 20, 3_000_001, 64 << 20]:
        c = B.HostBufferPool._size_class(n)
        assert n <= c <= 1.25 * n + 4096


def test_cpu_stream_event_api():
    s = rt.stream("compute")
    e0 = s.record(timing=True)
    e1 = s.record(timing=True)
    assert e0.query() and e1.query()
    assert e0.elapsed_ms(e1) >= 0
    # ordering-only events (the default, and the cheap kind on a GPU) cannot be timed
    with pytest.raises(ValueError, match="timing=True"):
        s.record().elapsed_ms(e1)
    rt.stream("a2a").wait_event(e1)
    s.synchronize()


class _Req:
    """A request stand-in: ``done`` says whether test() finds it finished; tests are counted."""

    def __init__(self, done=False):
        self.done, self.tests, self.waited = done, 0, False

    def test(self):
        self.tests += 1
        return self.done

    def wait_done(self):
        self.waited = True


def test_cpu_stream_enqueue_polls_from_the_front_and_keeps_what_is_in_flight():
    from tessera_rt.cpu_streams import CpuStream
    s = CpuStream("probe")
    first, second, third = _Req(), _Req(done=True), _Req()
    for r in (first, second, third):
        s.enqueue(r)
    # the front is in flight: one poll per issue, nothing behind it is polled or dropped
    assert s._pending == [first, second, third] and second.tests == 0 and first.tests == 2
    first.done = True
    s.enqueue(_Req())
    assert s._pending[0] is third and len(s._pending) == 2      # finished ones leave from the front
    ev = s.record()
    s.synchronize()                                             # everything still tracked is waited for
    assert third.waited and all(w.waited for w in ev._pending)
    # a receive that waits at the front while later sends finish: a long list is swept whole
    stuck = _Req()
    s.enqueue(stuck)
    for _ in range(40):
        s.enqueue(_Req(done=True))
    assert stuck in s._pending and len(s._pending) <= 34


def test_stream_map_shares_slots_and_overlap_policy():
    try:
        rt.set_stream_map({"tp_collective": 0})
        assert rt.stream("tp_collective") is rt.stream("compute")
        assert rt.stream("a2a") is not rt.stream("compute")
        rt.enable_overlap([("a2a", "compute")])
        assert rt.overlaps("a2a") and not rt.overlaps("tp_collective")
        with pytest.raises(ValueError, match="unknown role 'nvlink'"):
            rt.enable_overlap([("nvlink", "compute")])
        with pytest.raises(ValueError, match="unknown stream role"):
            rt.stream("nope")
    finally:
        rt.reset()
    assert rt.overlaps("tp_collective")


def test_kernel_table_falls_back_to_cpu_reference():
    B.register_kernel("_test_double", "cpu", lambda x: 2 * x)
    assert B.get_backend().kernel("_test_double")(3) == 6
    with pytest.raises(KeyError, match="no kernel registered"):
        B.get_backend().kernel("_no_such_op")
    with pytest.raises(ValueError):
        B.register_kernel("x", "tpu", abs)


def test_dtype_map():
    assert dtype_name(resolve_dtype("bf16")) == "bf16"
    assert resolve_dtype("f32") == np.float32
    assert dtype_name(resolve_dtype("fp8_e4m3")) == "fp8_e4m3"
    with pytest.raises(TypeError, match="unknown dtype 'float12'"):
        resolve_dtype("float12")


def test_without_mpi_thread_multiple_cpu_streams_stay_in_order_and_say_so():
    # worker streams call MPI from several threads; at a lower thread level dist.init falls
    # back to the in-order streams (same results, no overlap) with a warning
    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "import warnings, numpy as np\n"
            "from tessera_rt import dist, runtime as rt, backend\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); dist.init()\n"
            "print('WARN', [str(x.message) for x in w])\n"
            "print('STREAM', type(rt.stream('tp_collective')).__name__, backend.cpu_workers())\n"
            "print('SUM', dist.all_reduce(np.ones(3, np.float32), async_op=True).wait().tolist())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TESSERA_DEVICE": "cpu", "TESSERA_CPU_STREAMS": "threads"})
    assert p.returncode == 0, p.stderr
    assert "not MPI_THREAD_MULTIPLE" in p.stdout and "serialized" in p.stdout, p.stdout
    assert "STREAM CpuStream False" in p.stdout and "SUM [1.0, 1.0, 1.0]" in p.stdout, p.stdout


_FAULTS = """
import resource, sys
import numpy as np
from tessera_rt import backend
tuned = backend.tune_host_malloc() if sys.argv[1] == "tuned" else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    xs = [np.ones(1 << 17, np.float32) for _ in range(4)]
    del xs
f0 = faults()
for _ in range(20):                      # a step's temporaries: 4 x 512 KiB, written, freed
    xs = [np.ones(1 << 17, np.float32) for _ in range(4)]
    del xs
print(tuned, (faults() - f0) / 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and page-fault counts are Linux's")
def test_tuned_malloc_keeps_freed_temporaries_mapped():
    """With glibc's defaults each step's freed 512 KiB temporaries go back to the kernel and
    are faulted in again (~128 faults each); the CPU backend's settings keep them."""
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                             timeout=60, env={**os.environ, "TESSERA_MALLOC": ""}).stdout.split()
        return out[0] == "True", float(out[1])
    tuned, few = run("tuned")
    if not tuned:
        pytest.skip("not glibc: no mallopt")
    _, many = run("default")
    assert few < 10 and many > 200, (few, many)


def test_tessera_malloc_default_keeps_glibcs_settings(monkeypatch):
    monkeypatch.setenv("TESSERA_MALLOC", "default")
    assert B.tune_host_malloc() is False
