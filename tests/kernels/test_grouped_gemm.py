"""The grouped GEMM references (kernels.grouped_gemm), which are also the CPU kernels, against a
row-by-row loop, and their errors.  The GPU kernels: tests/kernels/test_grouped_gemm_gpu.py."""
import numpy as np
import pytest

from tessera_rt.backend import get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import grouped_gemm as G

BF16 = resolve_dtype("bf16")


def rnd(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def loop(x, w, sizes, trans=False):
    """Row by row, in f64: row r of group g times w[g]."""
    y, r = [], 0
    for g, s in enumerate(sizes):
        for _ in range(s):
            wg = w[g].astype(np.float64)
            y.append(x[r].astype(np.float64) @ (wg.T if trans else wg))
            r += 1
    return np.array(y).reshape(r, -1)


SIZES = [0, 3, 0, 7, 1, 0]
OFF = np.concatenate([[0], np.cumsum(SIZES)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16], ids=str)
def test_products_match_a_row_loop(dtype):
    x, x2 = rnd((11, 5), dtype, 1), rnd((11, 5), dtype, 2)
    w, w2 = rnd((6, 5, 4), dtype, 3), rnd((6, 5, 4), dtype, 4)
    tol = {np.float32: 1e-5, np.float64: 1e-12}.get(dtype, 3e-2)
    y = G.grouped_matmul(x, w, OFF)
    assert y.dtype == dtype and y.shape == (11, 4)
    np.testing.assert_allclose(y.astype(np.float64), loop(x, w, SIZES), rtol=tol, atol=tol)
    wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    w2t = np.ascontiguousarray(np.swapaxes(w2, 1, 2))
    y2 = G.grouped_matmul(x, wt, OFF, trans_w=True, x2=x2, w2=w2t)
    np.testing.assert_allclose(y2.astype(np.float64), loop(x, w, SIZES) + loop(x2, w2, SIZES), rtol=tol, atol=tol)
    h1, h3 = G.grouped_dual_matmul(x, w, w2, OFF)
    np.testing.assert_allclose(h3.astype(np.float64), loop(x, w2, SIZES), rtol=tol, atol=tol)
    a, b = loop(x, w, SIZES), loop(x, w2, SIZES)
    np.testing.assert_allclose(G.grouped_swiglu(x, w, w2, OFF).astype(np.float64), a / (1 + np.exp(-a)) * b,
                               rtol=tol, atol=tol)


def test_weight_gradient_is_the_per_group_outer_sum():
    x, dy = rnd((11, 5), seed=5), rnd((11, 4), seed=6)
    dw = G.grouped_matmul_wgrad(x, dy, OFF.astype(np.int32))
    assert dw.shape == (6, 5, 4)
    for g in range(6):
        lo, hi = OFF[g], OFF[g + 1]
        want = sum((np.outer(x[r], dy[r]) for r in range(lo, hi)), np.zeros((5, 4)))
        np.testing.assert_allclose(dw[g], want, rtol=1e-5, atol=1e-6)
    d1, d2 = G.grouped_matmul_wgrad_dual(x, dy, 2 * dy, OFF)
    np.testing.assert_array_equal(d1, dw)
    np.testing.assert_allclose(d2, 2 * dw, rtol=1e-6)


def test_cpu_kernel_table_serves_the_references():
    be = get_backend()
    for op in ("grouped_matmul", "grouped_dual_matmul", "grouped_swiglu", "grouped_matmul_wgrad",
               "grouped_matmul_wgrad_dual"):
        assert be.kernel(op, like=np.zeros(1)) is getattr(G, op)


@pytest.mark.parametrize("offsets, match", [
    (np.array([0, 3, 2, 11] + [11] * 3), "never decrease"),
    (np.array([1, 3, 3, 10, 11, 11, 11]), "start at 0"),
    (np.array([0, 3, 3, 10, 11, 11, 12]), "end at the number of rows"),
    (np.array([0, 11]), "7 entries"),
    (np.zeros(7, np.float32), "int32 or int64"),
])
def test_offset_errors(offsets, match):
    with pytest.raises((ValueError, TypeError), match=match):
        G.grouped_matmul(rnd((11, 5)), rnd((6, 5, 4)), offsets)


def test_shape_and_dtype_errors():
    x, w = rnd((11, 5)), rnd((6, 5, 4))
    with pytest.raises(ValueError, match="K=5"):
        G.grouped_matmul(x, w, OFF, trans_w=True)
    with pytest.raises(TypeError, match="cast one"):
        G.grouped_matmul(x, w.astype(np.float64), OFF)
    with pytest.raises(ValueError, match="together"):
        G.grouped_matmul(x, w, OFF, x2=x)
    with pytest.raises(ValueError, match="must match w1"):
        G.grouped_dual_matmul(x, w, w[:, :, :3], OFF)
    with pytest.raises(ValueError, match="same rows"):
        G.grouped_matmul_wgrad(x, rnd((10, 4)), OFF)
