"""FP8 quantize on the GPU (kernels.fp8_cuda) against the NumPy reference, bit for bit, on a GPU or
in the CUDA emulation harness under the CuPy stand-in: every scale geometry (per tensor, per
column, per row in one launch, per channel of a middle axis), given scales, f32/f16/bf16
inputs read as they are, widths that do not fill a 16-byte access, several partial maxima,
all-zero channels, the launches (one with a given scale or per-row scales, else two) and no
host sync."""
import ml_dtypes
import numpy as np
import pytest

from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import fp8 as F, fp8_cuda as FC

from test_gpu import cp
from test_grouped_gemm_gpu import dev

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]

BF16 = resolve_dtype("bf16")


def rnd(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)).astype(dtype)


# (shape, scale, axis, launches): the scale's geometry and what it costs
CASES = [((300, 96), "per_tensor", -1, 2), ((300, 96), "per_channel", -1, 2), ((300, 96), "per_channel", 0, 1),
         ((6, 40, 24), "per_channel", 1, 2), ((6, 40, 24), "per_channel", 0, 1), ((37, 23), "per_channel", -1, 2),
         ((37, 23), "per_tensor", -1, 2), ((1000,), "per_tensor", -1, 2), ((5, 3), "per_channel", 0, 1)]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape,scale,axis,launches", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_bits_and_scales_equal_the_reference(fmt, dtype, shape, scale, axis, launches):
    x = rnd(shape, dtype, seed=len(shape) + shape[0])
    if scale == "per_channel":
        idx = [slice(None)] * len(shape)
        idx[axis] = 1
        x[tuple(idx)] = 0                               # an all-zero channel: scale 1
    dx = dev(x)
    with cp.testing.count_device_work() as work:
        q, s = FC.quantize_fp8_cuda(dx, fmt, scale=scale, axis=axis)
    assert work.syncs == 0 and work.launches == launches, work.report()
    qc, sc = F.quantize_fp8(x.astype(np.float32), fmt, scale=scale, axis=axis)
    assert s.shape == sc.shape and q.dtype == np.uint8 and q.shape == x.shape
    np.testing.assert_array_equal(s.get(), sc)
    got, want = q.get(), qc.view(np.uint8)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} of {got.size} differ, first at {bad[0]}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


@pytest.mark.parametrize("axis", [0, -1])
def test_given_scales_one_launch(axis):
    x = rnd((64, 40), np.float16, seed=3)
    s = (np.abs(rnd((64, 1) if axis == 0 else (1, 40), np.float32, seed=4)) + 0.1).astype(np.float32)
    ds = cp.asarray(s)
    with cp.testing.count_device_work() as work:
        q, got_s = FC.quantize_fp8_cuda(dev(x), "fp8_e4m3", scale=ds, axis=axis)
    assert work.launches == 1 and work.syncs == 0, work.report()
    qc, _ = F.quantize_fp8(x.astype(np.float32), "fp8_e4m3", scale=s, axis=axis)
    np.testing.assert_array_equal(q.get(), qc.view(np.uint8))
    q1, _ = FC.quantize_fp8_cuda(dev(x), "fp8_e5m2", scale=np.float32(2.5))
    np.testing.assert_array_equal(q1.get(), F.quantize_fp8(x.astype(np.float32), "fp8_e5m2", scale=np.float32(2.5))[0]
                                  .view(np.uint8))
    with pytest.raises(ValueError, match="given scales"):
        FC.quantize_fp8_cuda(dev(x), "fp8_e4m3", scale=cp.ones(7, np.float32), axis=axis)


@pytest.mark.parametrize("shape,axis", [((300, 96), -1), ((37, 23), -1), ((50, 64), 0)])
def test_stochastic_rounding_picks_a_neighbour_without_bias(shape, axis):
    x = np.full(shape, 1.0 + 1 / 32, np.float32)          # a quarter of the way from 1 to 1.125
    if axis == 0:                                          # every channel's amax is 448: scales 1
        x[:, 0] = 448.0
    else:
        x[0, :] = 448.0
    q, s = FC.quantize_fp8_cuda(cp.asarray(x), "fp8_e4m3", scale="per_channel", axis=axis, stochastic_round=True,
                                seed=5)
    assert (s.get() == 1).all()
    vals = q.get().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rest = vals[x != 448.0]
    assert set(np.unique(rest)) == {1.0, 1.125}
    np.testing.assert_allclose(rest.mean(), 1 + 1 / 32, rtol=2e-2)


def test_empty_and_errors():
    q, s = FC.quantize_fp8_cuda(cp.zeros((0, 8), np.float32), "fp8_e4m3", scale="per_channel")
    assert q.shape == (0, 8) and s.shape == (1, 8)
    with pytest.raises(ValueError, match="scale="):
        FC.quantize_fp8_cuda(cp.ones(4, np.float32), "fp8_e4m3", scale="per_row")
    with pytest.raises(TypeError, match="not FP8"):
        FC.quantize_fp8_cuda(cp.ones(4, np.float32), "bf16")


def test_grids_keep_partials_few_and_blocks_many():
    # per column: a column tile per 32 vectors, <= sqrt(row groups) (and 64) partial chunks
    vwp, ag, qg = FC.fp8_grids("column", 8192, 4096, 4, 132)
    assert vwp == 32 and ag == (32, 17) and qg == (32, 17)
    vwp, ag, qg = FC.fp8_grids("tensor", 8192, 4096, 4, 132)
    assert ag == qg and ag[0] * ag[1] >= 4 * 132
    assert FC.fp8_grids("row", 100, 4096, 8, 132) == (32, (1, 13), (1, 13))     # 8 rows a block
