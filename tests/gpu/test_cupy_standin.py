"""The CuPy stand-in (tests/gpu_emu/cupy): strictness, the pool, the stream-order tracker,
RawModule launches, and NCCL over MPI at 2 and 3 ranks (tests/gpu/mpi_nccl_standin.py, launched by tests/multirank.py)."""
import gc
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "gpu_emu"
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "__tessera_standin__", False):
    # a GPU machine: an earlier test loaded the real CuPy, and one process holds one ``cupy``
    pytest.skip(f"the real CuPy ({sys.modules['cupy'].__file__}) is loaded in this process; the "
                "stand-in's own tests run where CuPy is not installed", allow_module_level=True)

import cupy  # the stand-in: tests/gpu_emu is first on sys.path
from cupy import _raw

assert getattr(cupy, "__tessera_standin__", False), f"imported the real CuPy from {cupy.__file__}"


@pytest.fixture(autouse=True)
def _fresh_streams():
    """Each test starts on the null stream with the device idle."""
    cupy.cuda.Stream.null.use()
    cupy.cuda.Device().synchronize()
    yield
    cupy.cuda.Stream.null.use()
    cupy.cuda.Device().synchronize()


# --------------------------------------------------------------------------- strictness

def test_marked_as_standin():
    assert cupy.__version__ == "14.2.0+standin"
    assert b"stand-in" in cupy.cuda.runtime.getDeviceProperties(0)["name"]
    assert cupy.cuda.runtime.getDeviceCount() == 1
    assert cupy.cuda.Device().compute_capability == "90"


def test_implicit_host_conversion_refused():
    a = cupy.arange(4, dtype=np.float32)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.array([a, a])
    np.testing.assert_array_equal(a.get(), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(cupy.asnumpy(a), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("call", [
    lambda a, h: a + h, lambda a, h: h + a, lambda a, h: a * h, lambda a, h: cupy.add(a, h),
    lambda a, h: np.add(h, a), lambda a, h: cupy.matmul(a, h), lambda a, h: cupy.concatenate([a, h]),
    lambda a, h: cupy.where(a > 0, a, h), lambda a, h: a.__iadd__(h), lambda a, h: cupy.maximum(a, h),
])
def test_host_arrays_refused_in_device_functions(call):
    a, h = cupy.ones(3, np.float32), np.ones(3, np.float32)
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        call(a, h)


def test_scalars_accepted_and_numpy_dispatch():
    a = cupy.arange(3, dtype=np.float32)
    np.testing.assert_allclose((a * np.float32(2) + 1 - 0.5).get(), [0.5, 2.5, 4.5])
    assert isinstance(np.exp(a), cupy.ndarray)          # __array_ufunc__ -> cupy.exp
    assert isinstance(np.sum(a), cupy.ndarray)           # __array_function__ -> cupy.sum
    assert isinstance(np.concatenate([a, a]), cupy.ndarray)


def test_zero_d_results_stay_on_device():
    a = cupy.arange(6, dtype=np.float32).reshape(2, 3)
    for r in (a.sum(), cupy.max(a), a[1, 2], cupy.mean(a)):
        assert isinstance(r, cupy.ndarray) and r.shape == ()
    assert float(a.sum()) == 15.0 and int(a[1, 2]) == 5 and bool(a[0, 1])
    with pytest.raises(ValueError):
        bool(a)
    v = a[1, 2]
    v[...] = 42                                          # a[i, j] is a view, as in CuPy
    assert a.get()[1, 2] == 42


def test_array_surface():
    a = cupy.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert a.shape == (3, 4) and a.ndim == 2 and a.size == 12 and a.nbytes == 48
    assert a.strides == (16, 4) and a.flags.c_contiguous and a.T.flags.f_contiguous
    assert a.astype(np.float32, copy=False) is a and a.astype(np.float16).dtype == np.float16
    assert cupy.ascontiguousarray(a) is a
    b = cupy.ascontiguousarray(a.T)
    assert b.flags.c_contiguous and b.data.ptr != a.data.ptr
    with pytest.raises(TypeError, match="incorrect type"):
        cupy.ascontiguousarray(np.ones(3))
    v = a.reshape(-1)
    assert v.data.mem is a.data.mem and v.data.ptr == a.data.ptr
    assert a[1].data.ptr == a.data.ptr + 16
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[0] = np.arange(4, dtype=np.float32)            # basic index: CuPy's fill takes scalars only
    a[np.array([0])] = np.arange(4, dtype=np.float32)    # an index array: core.array(value) copies it in
    c = a.copy()
    c += 1
    c.fill(3)
    a.set(np.zeros((3, 4), np.float32))
    assert float(a.sum()) == 0.0 and float(c.sum()) == 36.0
    with pytest.raises(TypeError, match="cannot be set"):
        a.set(np.zeros((3, 4), np.float64))
    cai = a.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (a.data.ptr, False) and cai["stream"] == 1
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        assert a.__cuda_array_interface__["stream"] == s.ptr
    y = cupy.fft.irfft2(cupy.fft.rfft2(a + 1), s=(3, 4))
    np.testing.assert_allclose(y.get(), np.ones((3, 4)), atol=1e-5)
    z = cupy.zeros(4, np.float32)
    cupy.add.at(z, cupy.asarray([0, 0, 3]), 1.0)
    np.testing.assert_array_equal(z.get(), [2, 0, 0, 1])


def test_fp8_bytes_move_but_kernels_and_allocation_refuse():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = cupy.zeros(4, np.uint8).view(ml_dtypes.float8_e4m3fn)     # a view of raw bytes is fine
    assert a.reshape(2, 2).dtype == ml_dtypes.float8_e4m3fn
    with pytest.raises(ValueError, match="Unsupported dtype float8_e4m3fn.*cupy.add"):
        a + 1
    with pytest.raises(ValueError, match="Unsupported dtype float8_e4m3fn"):
        cupy.empty(4, ml_dtypes.float8_e4m3fn)                    # CuPy 14 checks at allocation
    assert (cupy.zeros(2, ml_dtypes.bfloat16) + 1).dtype == ml_dtypes.bfloat16


# --------------------------------------------------------------------------- pool

def test_pool_rounds_and_reuses_per_stream():
    pool = cupy.get_default_memory_pool()
    a = cupy.empty(100, np.uint8)
    assert a.data.mem.size == 512
    ptr = a.data.ptr
    del a
    gc.collect()
    b = cupy.empty(300, np.uint8)                         # fits the freed 512-byte block
    assert b.data.ptr == ptr
    other = cupy.cuda.Stream(non_blocking=True)
    del b
    with other:
        c = cupy.empty(300, np.uint8)                     # another stream's arena: a new block
    assert c.data.ptr != ptr
    assert pool.used_bytes() >= 512


# --------------------------------------------------------------------------- tracker

def _comm_reads(buf, stream):
    """A stand-in for an async collective: an op on ``stream`` reading ``buf`` (ordered after
    the current stream's work, as tessera_rt's collectives order their inputs)."""
    stream.wait_event(cupy.cuda.get_current_stream().record())
    k = cupy.RawModule(code="extern \"C\" __global__ void consume(const float* x, int n) {}").get_function("consume")
    k((1,), (32,), (buf, np.int32(buf.size)), stream=stream)


@pytest.fixture
def fake_emulator():
    launches = []

    class Function:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, args, shared_mem=0, buffers=()):
            launches.append(dict(name=self.name, grid=grid, block=block, args=args,
                                 shared_mem=shared_mem, buffers=list(buffers)))

    class Module:
        def get_function(self, name):
            return Function(name)

    class Emu:
        @staticmethod
        def compile_module(code, options=(), name=None):
            return Module()

    previous = _raw.set_emulator(Emu)
    yield launches
    _raw.set_emulator(previous)


def test_reuse_while_other_stream_reads_is_reported(fake_emulator):
    compute, comm = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        x = cupy.ones(1024, np.float32)
        _comm_reads(x, comm)          # issued on comm, reads x
        del x                         # dropped: the block goes back to compute's arena
        gc.collect()
        with pytest.raises(cupy.StreamOrderError) as info:
            cupy.empty(1024, np.float32)
    msg = str(info.value)
    assert "RawKernel consume" in msg and f"{comm.ptr:#x}" in msg and f"{compute.ptr:#x}" in msg
    assert "4096-byte block" in msg and "test_cupy_standin.py" in msg and "_comm_reads" in msg


@pytest.mark.parametrize("order", ["event", "synchronize", "device", "event_sync"])
def test_ordered_reuse_is_fine(fake_emulator, order):
    compute, comm = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        x = cupy.ones(1024, np.float32)
        ptr = x.data.ptr
        _comm_reads(x, comm)
        if order == "event":
            compute.wait_event(comm.record())
        elif order == "synchronize":
            comm.synchronize()
        elif order == "device":
            cupy.cuda.Device().synchronize()
        else:
            comm.record().synchronize()
        del x
        gc.collect()
        assert cupy.empty(1024, np.float32).data.ptr == ptr


def test_event_recorded_before_the_op_does_not_order_it(fake_emulator):
    compute, comm = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        x = cupy.ones(1024, np.float32)
        early = comm.record()
        _comm_reads(x, comm)
        compute.wait_event(early)
        del x
        gc.collect()
        with pytest.raises(cupy.StreamOrderError):
            cupy.empty(1024, np.float32)


def test_cross_stream_write_hazard(fake_emulator):
    compute, comm = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        x = cupy.ones(1024, np.float32)
        _comm_reads(x, comm)
        _ = x + 1                                    # read-read: fine
        with pytest.raises(cupy.StreamOrderError, match="writes bytes that"):
            x += 1                                   # overwrites what comm may still read
        compute.wait_event(comm.record())
        x += 1


def test_events_and_elapsed_time():
    s = cupy.cuda.Stream()
    e1, e2 = cupy.cuda.Event(), cupy.cuda.Event()
    e1.record(s)
    e2.record(s)
    e2.synchronize()
    assert e1.done and s.done and cupy.cuda.get_elapsed_time(e1, e2) >= 0.0
    quiet = cupy.cuda.Event(disable_timing=True)
    quiet.record(s)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="cudaErrorInvalidResourceHandle"):
        cupy.cuda.get_elapsed_time(e1, quiet)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="cudaErrorInvalidResourceHandle"):
        cupy.cuda.get_elapsed_time(cupy.cuda.Event(), e2)


def test_queries_and_nonblocking_get_model_pending_work():
    # planted bug: a host array read after get(blocking=False) with no synchronize, and a
    # first `done` taken as "finished"; the old stand-in copied at once and answered True
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(4, dtype=np.float32) + 1
    host = x.get(stream=s, blocking=False)
    assert np.isnan(host).all()                     # the copy is still running
    e = s.record()
    assert not s.done and not e.done                # first queries: still running
    assert np.isnan(host).all()                     # ... which told the host nothing
    assert s.done and e.done and s.done             # the next ones: complete, and the copy landed
    np.testing.assert_array_equal(host, [1, 2, 3, 4])
    out = np.zeros(4, np.float32)
    assert x.get(stream=s, out=out, blocking=False) is out and np.isnan(out).all()
    s.record().synchronize()                        # an event after the copy: it has landed
    np.testing.assert_array_equal(out, [1, 2, 3, 4])


def test_pinned_memory_and_host_writes_during_an_async_copy():
    # planted bug: the host refills a pinned buffer right after ndarray.set, before the copy
    # (asynchronous from pinned memory) is known complete; the old stand-in had no pinned memory
    import cupyx
    mem = cupy.cuda.alloc_pinned_memory(16)
    assert mem.size() == 16 and np.frombuffer(mem, np.float32, 4).ctypes.data == mem.ptr
    s = cupy.cuda.Stream(non_blocking=True)
    pinned, d = cupyx.zeros_pinned((4,), np.float32), cupy.empty(4, np.float32)
    d.set(pinned, stream=s)
    pinned[...] = 1
    with pytest.raises(cupy.StreamOrderError, match="pinned-memory race.*test_cupy_standin.py"):
        s.synchronize()
    d.set(pinned, stream=s)
    s.synchronize()
    pinned[...] = 2                                 # after the synchronize: fine
    np.testing.assert_array_equal(d.get(), 1)
    with pytest.raises(AttributeError, match="stand-in's cupyx has only"):
        cupyx.scipy


def test_streams_current_and_external():
    s = cupy.cuda.Stream(non_blocking=True)
    assert s.ptr != 0 and cupy.cuda.get_current_stream() is cupy.cuda.Stream.null
    with s:
        assert cupy.cuda.get_current_stream() is s
        ext = cupy.cuda.ExternalStream(s.ptr)
        assert ext.ptr == s.ptr and ext == s
    assert cupy.cuda.get_current_stream() is cupy.cuda.Stream.null
    assert cupy.cuda.ExternalStream(0).ptr == 0
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        cupy.cuda.ExternalStream(0xDEAD)
    s.use()
    assert cupy.cuda.get_current_stream() is s


# --------------------------------------------------------------------------- RawModule

def test_rawkernel_packs_args_like_cupy(fake_emulator):
    mod = cupy.RawModule(code='extern "C" __global__ void k(float* y, const float* x) {}',
                         options=("-std=c++17", "--use_fast_math"))
    k = mod.get_function("k")
    x = cupy.ones(8, np.float32)
    k((2,), (64,), (x, x, np.int32(-1), np.float32(1.5), 7, 2.5, True, None, np.array([3], np.int16)))
    launch = fake_emulator[-1]
    assert launch["grid"] == (2, 1, 1) and launch["block"] == (64, 1, 1)
    assert launch["args"] == [struct.pack("<Q", x.data.ptr)] * 2 + [
        struct.pack("<i", -1), struct.pack("<f", 1.5), struct.pack("<q", 7), struct.pack("<d", 2.5),
        struct.pack("<?", True), bytes(8), struct.pack("<h", 3)]     # CuPy 14: a bool is one byte
    assert (x.data.mem.ptr, x.nbytes) in launch["buffers"]          # the bytes asked for, not the 512 rounded
    with pytest.raises(TypeError, match="Only numpy.ndarrays of size one"):
        k((1,), (1,), (np.ones(3, np.float32),))
    with pytest.raises(TypeError, match="expected tuple"):
        k(1, (1,), (x,))


@pytest.mark.parametrize("grid, block, smem, match", [
    ((1,), (1025,), 0, "block"), ((1,), (32, 32, 2), 0, "block"), ((1, 65536), (32,), 0, "grid"),
    ((1,), (32,), 48 * 1024 + 1, "shared_mem"),
])
def test_rawkernel_launch_limits(fake_emulator, grid, block, smem, match):
    k = cupy.RawModule(code='extern "C" __global__ void k() {}').get_function("k")
    with pytest.raises(cupy.cuda.driver.CUDADriverError, match=f"CUDA_ERROR_INVALID_VALUE.*{match}"):
        k(grid, block, (), shared_mem=smem)


def test_rawkernel_dynamic_smem_opt_in(fake_emulator):
    k = cupy.RawModule(code='extern "C" __global__ void k() {}').get_function("k")
    assert k.max_dynamic_shared_size_bytes == 48 * 1024
    k.max_dynamic_shared_size_bytes = 100 * 1024
    k((1,), (32,), (), shared_mem=100 * 1024)
    assert fake_emulator[-1]["shared_mem"] == 100 * 1024
    with pytest.raises(cupy.cuda.driver.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE"):
        k.max_dynamic_shared_size_bytes = 228 * 1024


SAXPY = r'''
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
'''


def test_real_emulator_saxpy():
    k = cupy.RawModule(code=SAXPY, options=("-std=c++17",)).get_function("saxpy")
    x = cupy.arange(100, dtype=np.float32)
    y = cupy.ones(100, np.float32)
    k((2,), (64,), (np.float32(2.0), x, y, np.int32(100)))
    np.testing.assert_allclose(y.get(), 2 * np.arange(100) + 1)


def test_bounds_are_the_requested_size_not_the_pools_rounding():
    # planted bug: the bounds test is `i <= n`, one element past the array; the pool rounds the
    # 400 bytes up to a 512-byte block, which the old bounds check allowed
    import cuda_emu
    k = cupy.RawModule(code=SAXPY.replace("i < n", "i <= n")).get_function("saxpy")
    x, y = cupy.arange(100, dtype=np.float32), cupy.ones(100, np.float32)
    assert y.data.mem.size == 512
    with pytest.raises(cuda_emu.OutOfBounds, match="out-of-bounds"):
        k((2,), (64,), (np.float32(2.0), x, y, np.int32(100)))


