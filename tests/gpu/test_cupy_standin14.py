"""The CuPy stand-in's CuPy 14.2 model: bfloat16 where CuPy has loops (in its precision and
dtype), refused where it has none, GEMM compute types (TF32), and the counters of what a GPU
would pay (``cupy.testing.count_device_work``)."""
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
from cupy import _raw
from cupy._core import _routines_linalg as linalg

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32


@pytest.fixture(autouse=True)
def _idle_device():
    cupy.cuda.Stream.null.use()
    cupy.cuda.Device().synchronize()
    yield
    cupy.cuda.Stream.null.use()
    linalg.set_compute_type(F32, linalg.COMPUTE_TYPE_TBD)       # back to "read CUPY_TF32 on first use"


def _bf16(values) -> np.ndarray:
    return np.asarray(values, F32).astype(BF16)


def _rounded_once(np_func, *host):
    """float32 math on bfloat16 inputs, rounded once to bfloat16: what CuPy's loops compute."""
    return np.asarray(np_func(*(h.astype(F32) for h in host))).astype(BF16)


# --------------------------------------------------------------------------- bfloat16

@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide", "power", "maximum", "hypot",
                                  "arctan2"])
def test_bf16_binary_ufuncs_are_float32_math_rounded_once(name):
    rng = np.random.default_rng(0)
    x, y = _bf16(rng.uniform(0.5, 3, 257)), _bf16(rng.uniform(0.5, 3, 257))
    got = getattr(cupy, name)(cupy.asarray(x), cupy.asarray(y))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.get().view(np.uint16), _rounded_once(getattr(np, name), x, y).view(np.uint16))


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sin", "negative", "floor", "square"])
def test_bf16_unary_ufuncs_are_float32_math_rounded_once(name):
    x = _bf16(np.random.default_rng(1).uniform(0.1, 4, 300))
    got = getattr(cupy, name)(cupy.asarray(x))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.get().view(np.uint16), _rounded_once(getattr(np, name), x).view(np.uint16))
    assert (cupy.asarray(x) > 1).dtype == np.bool_


def test_bf16_loop_choice_follows_cupy():
    x = cupy.asarray(_bf16([1, 2, 3]))
    assert (x + 1).dtype == BF16                        # a weak int keeps the bfloat16 loop
    assert (x * ml_dtypes.bfloat16(2)).dtype == BF16
    # result_type(0.0, bfloat16) is float64 with ml_dtypes: a Python float takes the float32 loop
    assert (x * 0.5).dtype == F32 and (x * np.float32(0.5)).dtype == F32
    assert cupy.divmod(x, x)[0].dtype == F32           # no bfloat16 loop: the float32 one
    assert cupy.where(x > 1, x, x).dtype == F32         # cupy_where has no bfloat16 loop
    assert cupy.clip(x, 0, 2).dtype == F32 and cupy.tril(x.reshape(1, 3)).dtype == F32
    assert (x + x.astype(np.float16)).dtype == F32      # NumPy cannot promote these; CuPy's loops can


def test_bf16_reductions_accumulate_in_float32():
    rng = np.random.default_rng(2)
    x = _bf16(rng.uniform(0.5, 1.5, 4096))
    d = cupy.asarray(x)
    for name in ("sum", "prod", "mean"):
        got = getattr(d.reshape(64, 64), name)(axis=1)
        assert got.dtype == BF16
        np.testing.assert_array_equal(got.get(), _rounded_once(lambda v: getattr(v, name)(axis=1), x.reshape(64, 64)))
    exact = x.astype(np.float64).sum()
    stepwise = np.cumsum(x)[-1]            # NumPy with ml_dtypes: a bfloat16 add per element
    assert abs(float(d.sum()) - exact) < abs(float(stepwise) - exact) / 10
    assert abs(float(d.sum()) - exact) <= exact * 2 ** -8            # one rounding of the total
    assert cupy.var(d).dtype == np.float64              # _var picks its float64 core for bfloat16


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_16bit_matmul_accumulates_in_float32_and_rounds_once(dtype):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((48, 300)).astype(dtype), rng.standard_normal((300, 40)).astype(dtype)
    got = cupy.asarray(a) @ cupy.asarray(b)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.get(), (a.astype(F32) @ b.astype(F32)).astype(dtype))
    mixed = cupy.asarray(a) @ cupy.asarray(b.astype(F32))               # promoted: a float32 GEMM
    assert mixed.dtype == F32


def test_bf16_refusals_name_the_function_and_dtype():
    x = cupy.asarray(_bf16([3, 1, 2]))
    with pytest.raises(TypeError, match=r"Wrong type \(\(dtype\(bfloat16\), dtype\(bfloat16\)\)\) of arguments "
                                        r"for cupy_gcd.*on a real GPU this call fails"):
        cupy.gcd(x, x)
    with pytest.raises(NotImplementedError, match="Sorting arrays with dtype 'bfloat16' is not supported"):
        cupy.sort(x)
    with pytest.raises(TypeError, match="data type 'E' not understood.*batched matmul"):
        cupy.matmul(x.reshape(1, 1, 3), x.reshape(1, 3, 1))
    with pytest.raises(TypeError, match="cupy.add.at only supports .*bfloat16"):
        cupy.add.at(cupy.zeros(3, BF16), cupy.asarray([0, 1]), x[:2])
    with pytest.raises(ValueError, match="Unsupported dtype float8_e5m2"):
        cupy.asarray(np.zeros(3, ml_dtypes.float8_e5m2))


# --------------------------------------------------------------------------- TF32

def _tf32_model(x: np.ndarray) -> np.ndarray:
    """float32 -> TF32 (10 explicit mantissa bits), to nearest, ties away from zero."""
    m, e = np.frexp(x.astype(np.float64))                   # x = m * 2**e, 0.5 <= |m| < 1
    m = np.sign(m) * np.floor(np.abs(m) * 2 ** 11 + 0.5) / 2 ** 11
    return np.ldexp(m, e).astype(F32)


def test_tf32_compute_type_rounds_operands(monkeypatch):
    monkeypatch.delenv("CUPY_TF32", raising=False)
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((64, 512)).astype(F32), rng.standard_normal((512, 32)).astype(F32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    da, db = cupy.asarray(a), cupy.asarray(b)
    assert linalg.get_compute_type(F32) == linalg.COMPUTE_TYPE_DEFAULT
    f32 = (da @ db).get()
    linalg.set_compute_type(F32, linalg.COMPUTE_TYPE_TF32)
    tf32 = (da @ db).get()
    np.testing.assert_allclose(tf32, _tf32_model(a) @ _tf32_model(b), rtol=1e-6, atol=1e-5)
    err_f32, err_tf32 = np.abs(f32 - exact).max(), np.abs(tf32 - exact).max()
    assert err_tf32 > 50 * err_f32                       # TF32's 10 bits show; f32's 23 do not
    linalg.set_compute_type(F32, linalg.COMPUTE_TYPE_TBD)
    monkeypatch.setenv("CUPY_TF32", "1")                 # read on first use after TBD
    assert cupy._core.get_compute_type(F32) == linalg.COMPUTE_TYPE_TF32
    np.testing.assert_array_equal((da @ db).get(), tf32)
    with pytest.raises(TypeError, match="dtype is not supported"):
        linalg.get_compute_type(np.int32)


# --------------------------------------------------------------------------- counters

def test_launches_count_kernels_not_views():
    a = cupy.arange(12, dtype=F32)
    with cupy.testing.count_device_work() as work:
        a.reshape(3, 4).T[1:, ::2]                       # views: no kernel
        a.view(np.int32)
        b = a + 1
        a.astype(F32)                                    # a copy: one launch, no cast
    assert (work.launches, work.casts, work.h2d, work.d2h, work.syncs) == (2, 0, 0, 0, 0), work.report()
    assert work.by_kind == {"cupy.add": 1, "ndarray.astype": 1}
    assert any("test_cupy_standin14.py" in site for site in work.launch_sites)
    with cupy.testing.count_device_work() as gemm:
        cupy.matmul(b.reshape(3, 4), a.reshape(4, 3)[:, ::2])     # strided: copied, then one GEMM
    assert gemm.launches == 2 and gemm.by_kind["cupy.dot (cuBLAS gemmEx, COMPUTE_32F)"] == 1, gemm.report()


def test_float_of_a_device_scalar_is_one_sync_and_one_d2h():
    s = cupy.arange(4, dtype=F32).sum()
    with cupy.testing.count_device_work() as work:
        float(s)
    assert (work.syncs, work.d2h, work.d2h_bytes, work.launches) == (1, 1, 4, 0), work.report()


def test_syncs_count_host_waits_not_queries():
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.arange(8, dtype=F32)
    with cupy.testing.count_device_work() as work:
        stream.done                                      # a query: no wait
        stream.synchronize()
        stream.record().synchronize()
        cupy.cuda.Device().synchronize()
        x.tolist()
        cupy.nonzero(x > 3)                              # CuPy reads the count back
        x[x > 3]
    assert work.syncs == 6, work.report()
    assert work.syncs_by_kind["cupy.nonzero"] == 1 and work.syncs_by_kind["ndarray.__getitem__ (boolean mask)"] == 1


def test_host_to_device_copies():
    host = np.arange(6, dtype=F32)
    d = cupy.empty(6, F32)
    with cupy.testing.count_device_work() as work:
        cupy.asarray(host)
        d.set(host)
        d[np.array([0, 2])] = np.ones(2, F32)            # index and values copied in, then a kernel
        d * 2.0                                          # scalars ride as kernel arguments
        cupy.arange(6)                                   # made on the device
    assert (work.h2d, work.h2d_bytes) == (4, 24 + 24 + 16 + 8), work.report()
    assert work.launches == 3 and work.syncs == 0


def test_device_to_host_copies():
    x = cupy.arange(5, dtype=np.int64)
    import cupyx
    pinned = cupyx.empty_pinned((5,), np.int64)
    with cupy.testing.count_device_work() as work:
        x.get()
        x.get(out=pinned, blocking=False)                # to pinned memory: asynchronous
    assert (work.d2h, work.d2h_bytes, work.syncs) == (2, 80, 1), work.report()


def test_casts_count_astype_and_implicit_conversions():
    f32, f64 = cupy.ones(4, F32), cupy.ones(4, np.float64)
    x = cupy.ones(4, BF16)
    with cupy.testing.count_device_work() as work:
        f32.astype(BF16)                                 # a launch and a cast
        f32 + f64                                        # f32 read as float64 inside the kernel
        x * 0.5                                          # bfloat16 read as float32 (a Python float)
        x += 1                                           # stays in bfloat16: no cast
        cupy.mean(x)                                     # float32 mean, then astype back: 2 launches
    assert work.casts == 4 and work.launches == 6, work.report()
    assert work.casts_by_kind["float32->bfloat16 (astype)"] == 2
    assert work.casts_by_kind["float32->float64 (operand of cupy.add)"] == 1
    assert all("test_cupy_standin14.py" in site for site in work.cast_sites)


def test_rawkernel_launches_are_counted():
    class Emu:                                           # no compiler: the launch itself is what counts
        @staticmethod
        def compile_module(code, options=(), name=None):
            class Module:
                def get_function(self, fname):
                    return type("F", (), {"launch": lambda *a, **k: None})()
            return Module()
    previous = _raw.set_emulator(Emu)
    try:
        k = cupy.RawKernel('extern "C" __global__ void k(float* y) {}', "k")
        y = cupy.zeros(4, F32)
        with cupy.testing.count_device_work() as work:
            for _ in range(3):
                k((1,), (32,), (y,))
        assert work.launches == 3 and work.by_kind == {"RawKernel k": 3}
    finally:
        _raw.set_emulator(previous)


def test_counters_nest_and_see_other_threads():
    x = cupy.ones(4, F32)
    with cupy.testing.count_device_work() as outer:
        x + 1
        with cupy.testing.count_device_work() as inner:
            worker = threading.Thread(target=lambda: [x * 2 for _ in range(5)])
            worker.start()
            worker.join()
        x - 1
    assert (inner.launches, outer.launches) == (5, 7)
    x + 1                                                # after the block: not counted
    assert outer.launches == 7 and "7 launches" in outer.report()
