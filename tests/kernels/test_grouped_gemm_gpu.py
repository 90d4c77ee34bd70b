"""The grouped GEMM kernels (kernels.grouped_gemm_cuda) against the float64 reference, on a GPU or
in the CUDA emulation harness under the CuPy stand-in: ragged groups (empty ones first, last and
in between), tails in every dim, unaligned widths, every mode, one launch and no host sync per
call, and the same bits on a rerun.

The bound is what the kernels promise: an f32 sum (error at most ``K * 2^-23`` of ``|x| @ |w|``)
rounded once to the output dtype (half an ulp), so a row read from the wrong group, a lost K
tile or a wrong pair order fails it.
"""
import numpy as np
import pytest

from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import grouped_gemm as G, grouped_gemm_cuda as GC

from test_gpu import cp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]

BF16 = resolve_dtype("bf16")
DTYPES = [np.float16, BF16, np.float32]
IDS = {np.float16: "f16", BF16: "bf16", np.float32: "f32"}
MANT = {np.dtype(np.float16): 10, BF16: 7, np.dtype(np.float32): 23}


def dev(a):
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else cp.asarray(a)


def host(a):
    return a.view(cp.uint16).get().view(BF16) if a.dtype == BF16 else a.get()


def rnd(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def offsets(sizes):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def assert_close(got, want, mag, dtype, k):
    """|got - want| <= half an ulp of the dtype at |want| plus the f32 sum's error on |x| @ |w|."""
    got = np.asarray(got, np.float64)
    e = np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -14)))
    bound = 0.5 * 2.0 ** (e - MANT[np.dtype(dtype)]) * 1.001 + k * 2.0 ** -23 * mag + 1e-30
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / bound), err.shape) if err.size else None
    assert err.size == 0 or np.all(err <= bound), (
        f"max err {err.max():.3g} at {worst}: got {got[worst]}, want {want[worst]} (bound {bound[worst]:.3g})")


# ragged groups: empty first / middle / last, one row, several row tiles, a lone big group
SIZES = {"ragged": [0, 5, 37, 0, 130, 1, 0], "one": [61], "tiles": [200, 129, 3], "empty": [0, 0, 0]}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: IDS[d])
@pytest.mark.parametrize("sizes", list(SIZES), ids=str)
@pytest.mark.parametrize("k,n", [(40, 72), (37, 21)], ids=["aligned", "odd"])
def test_forward_and_trans(dtype, sizes, k, n):
    sz = SIZES[sizes]
    off = offsets(sz)
    r, g = int(off[-1]), len(sz)
    x, w = rnd((r, k), dtype, 1), rnd((g, k, n), dtype, 2, 0.3)
    want = G.grouped_matmul(x.astype(np.float64), w.astype(np.float64), off)
    mag = G.grouped_matmul(np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64)), off)
    dx, dw_, doff = dev(x), dev(w), dev(off)
    with cp.testing.count_device_work() as work:
        y = GC.grouped_matmul_cuda(dx, dw_, doff)
    assert y.dtype == dtype and y.shape == (r, n)
    assert work.syncs == 0 and work.launches == (1 if r else 0), work.report()
    assert_close(host(y), want, mag, dtype, k)
    wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    yt = GC.grouped_matmul_cuda(dev(x), dev(wt), dev(off), trans_w=True)
    assert_close(host(yt), want, mag, dtype, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: IDS[d])
def test_sum_of_two_products(dtype):
    # dX = dh1 @ w1^T + dh3 @ w3^T in one accumulator, K spanning several tiles
    sz = [3, 0, 70, 18]
    off = offsets(sz)
    r, g, k, n = int(off[-1]), len(sz), 80, 24
    a1, a2 = rnd((r, k), dtype, 3), rnd((r, k), dtype, 4)
    w1, w2 = rnd((g, n, k), dtype, 5, 0.2), rnd((g, n, k), dtype, 6, 0.2)
    f = lambda t: t.astype(np.float64)
    want = G.grouped_matmul(f(a1), f(w1), off, trans_w=True, x2=f(a2), w2=f(w2))
    mag = G.grouped_matmul(abs(f(a1)), abs(f(w1)), off, trans_w=True, x2=abs(f(a2)), w2=abs(f(w2)))
    y = GC.grouped_matmul_cuda(dev(a1), dev(w1), dev(off), trans_w=True, x2=dev(a2), w2=dev(w2))
    assert_close(host(y), want, mag, dtype, 2 * k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: IDS[d])
@pytest.mark.parametrize("sizes", ["ragged", "tiles"])
def test_dual_and_swiglu(dtype, sizes):
    sz = SIZES[sizes]
    off = offsets(sz)
    r, g, k, n = int(off[-1]), len(sz), 48, 40
    x, w1, w3 = rnd((r, k), dtype, 7), rnd((g, k, n), dtype, 8, 0.3), rnd((g, k, n), dtype, 9, 0.3)
    f = lambda t: t.astype(np.float64)
    h1 = G.grouped_matmul(f(x), f(w1), off)
    h3 = G.grouped_matmul(f(x), f(w3), off)
    m1, m3 = (G.grouped_matmul(abs(f(x)), abs(f(w)), off) for w in (w1, w3))
    args = dev(x), dev(w1), dev(w3), dev(off)
    with cp.testing.count_device_work() as work:
        y1, y3 = GC.grouped_dual_matmul_cuda(*args)
    assert work.launches == 1 and work.syncs == 0, work.report()
    assert_close(host(y1), h1, m1, dtype, k)
    assert_close(host(y3), h3, m3, dtype, k)
    s = GC.grouped_swiglu_cuda(dev(x), dev(w1), dev(w3), dev(off))
    want = G.grouped_swiglu(f(x), f(w1), f(w3), off)
    # silu(h1) * h3 from the f32 products: their error carried through |silu'| <= 1.1 and |h3|
    sig = 1 / (1 + np.exp(-h1))
    carried = k * 2.0 ** -23 * (m1 * 1.1 * np.abs(h3) + m3 * np.abs(h1 * sig)) + 4 * 2.0 ** -23 * np.abs(want)
    assert_close(host(s), want, carried / (k * 2.0 ** -23), dtype, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: IDS[d])
@pytest.mark.parametrize("sizes", ["ragged", "tiles", "empty"])
def test_weight_gradient(dtype, sizes):
    sz = SIZES[sizes]
    off = offsets(sz)
    r, g, k, n = int(off[-1]), len(sz), 36, 70
    x, dy, dy2 = rnd((r, k), dtype, 10), rnd((r, n), dtype, 11), rnd((r, n), dtype, 12)
    f = lambda t: t.astype(np.float64)
    want = G.grouped_matmul_wgrad(f(x), f(dy), off)
    mag = G.grouped_matmul_wgrad(abs(f(x)), abs(f(dy)), off)
    args = dev(x), dev(dy), dev(off)
    with cp.testing.count_device_work() as work:
        dw = GC.grouped_matmul_wgrad_cuda(*args)
    assert work.syncs == 0 and work.launches == 1, work.report()
    assert dw.shape == (g, k, n) and dw.dtype == dtype
    assert_close(host(dw), want, mag, dtype, max(sz + [1]))
    d1, d2 = GC.grouped_matmul_wgrad_dual_cuda(dev(x), dev(dy), dev(dy2), dev(off))
    assert_close(host(d1), want, mag, dtype, max(sz + [1]))
    want2 = G.grouped_matmul_wgrad(f(x), f(dy2), off)
    mag2 = G.grouped_matmul_wgrad(abs(f(x)), abs(f(dy2)), off)
    assert_close(host(d2), want2, mag2, dtype, max(sz + [1]))


def test_same_bits_on_a_rerun_and_int32_offsets():
    sz = [9, 0, 150, 40]
    off = offsets(sz)
    x, w = rnd((int(off[-1]), 64), np.float16, 13), rnd((4, 64, 48), np.float16, 14, 0.2)
    a = GC.grouped_matmul_cuda(dev(x), dev(w), dev(off)).get()
    b = GC.grouped_matmul_cuda(dev(x), dev(w), dev(off.astype(np.int32))).get()
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_kernel_table_entries_and_errors():
    from tessera_rt.backend import get_backend
    be = get_backend()
    x, w = rnd((10, 16), np.float32, 15), rnd((2, 16, 8), np.float32, 16)
    off = offsets([4, 6])
    y = be.kernel("grouped_matmul", like=dev(x))(dev(x), dev(w), dev(off))
    np.testing.assert_allclose(y.get(), G.grouped_matmul(x, w, off), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="3 entries"):
        GC.grouped_matmul_cuda(dev(x), dev(w), dev(offsets([10])))
    with pytest.raises(TypeError, match="int32 or int64"):
        GC.grouped_matmul_cuda(dev(x), dev(w), dev(off.astype(np.float32)))
    with pytest.raises(TypeError, match="cast one"):
        GC.grouped_matmul_cuda(dev(x), dev(w.astype(np.float16)), dev(off))
    with pytest.raises(ValueError, match="K=16"):
        GC.grouped_matmul_cuda(dev(x), dev(w), dev(off), trans_w=True)


def test_f64_takes_the_reference():
    x, w = rnd((10, 8), np.float64, 17), rnd((2, 8, 4), np.float64, 18)
    off = offsets([7, 3])
    got = GC.grouped_matmul_cuda(dev(x), dev(w), dev(off)).get()
    np.testing.assert_allclose(got, G.grouped_matmul(x, w, off), rtol=1e-12)


@pytest.fixture
def ran():
    """(op, precision, provider) of every noted kernel call in the test."""
    from tessera_rt.kernels.precision import add_listener, remove_listener
    seen = []

    def listen(op, precision, provider, why):
        seen.append((op, precision, provider))
    add_listener(listen)
    yield seen
    remove_listener(listen)


def test_host_offsets_run_cublas_per_group_device_offsets_the_kernel(ran):
    from tessera_rt.backend import get_backend
    from tessera_rt.kernels import use_providers
    be = get_backend()
    sz = [6, 0, 19, 3]
    off = offsets(sz)
    r, k, n = int(off[-1]), 24, 16
    x, w, dy = rnd((r, k), np.float16, 19), rnd((4, k, n), np.float16, 20, 0.3), rnd((r, n), np.float16, 21)
    f = lambda t: t.astype(np.float64)
    want = G.grouped_matmul(f(x), f(w), off)
    mag = G.grouped_matmul(abs(f(x)), abs(f(w)), off)
    mm, wg = be.kernel("grouped_matmul", like=dev(x)), be.kernel("grouped_matmul_wgrad", like=dev(x))
    dx, dw_ = dev(x), dev(w)
    with cp.testing.count_device_work() as work:
        y_host = mm(dx, dw_, off)                  # NumPy offsets: one cuBLAS GEMM per non-empty group
    assert work.syncs == 0 and work.launches == 3, work.report()
    y_dev = mm(dev(x), dev(w), dev(off))                  # device offsets: the one-launch kernel
    with use_providers(False):
        y_own = mm(dev(x), dev(w), off)
    assert [p for op, _, p in ran if op == "grouped_matmul"] == ["cublas", "own", "own"]
    for y in (y_host, y_dev, y_own):
        assert_close(host(y), want, mag, np.float16, k)
    dw = wg(dev(x), dev(dy), off)
    np.testing.assert_allclose(host(dw).astype(np.float64), G.grouped_matmul_wgrad(f(x), f(dy), off),
                               rtol=2e-3, atol=2e-2)
    assert host(dw)[1].max() == 0 == host(dw)[1].min()      # the empty group's gradient is zero
    h1, h3 = be.kernel("grouped_dual_matmul", like=dev(x))(dev(x), dev(w), dev(w), off)
    assert_close(host(h1), want, mag, np.float16, k)
    assert ran[-1][2] == "cublas"
