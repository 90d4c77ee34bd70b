"""FP8 quantize/dequantize (scales, saturation, stochastic rounding) and FFT conv2d."""
import ml_dtypes
import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels.fp8 import compute_scale, fp8_max
from tessera_rt.kernels.numerics import numeric


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

E4M3, E5M2 = resolve_dtype("fp8_e4m3"), resolve_dtype("fp8_e5m2")


@pytest.mark.parametrize("dtype,bits", [(E4M3, 3), (E5M2, 2)])
@pytest.mark.parametrize("scale", ["per_tensor", "per_channel"])
def test_roundtrip_error_is_half_ulp(rng, dtype, bits, scale):
    x = rng.standard_normal((16, 24)).astype(np.float32) * np.geomspace(1e-2, 1e2, 24, dtype=np.float32)
    q, s = K.quantize_fp8(x, dtype, scale=scale, axis=-1)
    assert q.dtype == dtype
    assert s.shape == (() if scale == "per_tensor" else (1, 24))
    y = K.dequantize_fp8(q, s)
    # normal numbers: relative error <= 2^-(bits+1); the smallest ones fall in subnormals
    err = np.abs(y - x)
    bound = np.maximum(np.abs(x) * 2.0 ** -(bits + 1), s * float(ml_dtypes.finfo(dtype).smallest_subnormal))
    assert np.all(err <= bound * 1.0001)
    assert np.abs(q.astype(np.float32)).max() == pytest.approx(fp8_max(dtype))


def test_per_channel_beats_per_tensor_for_spread_channels(rng):
    x = rng.standard_normal((64, 8)).astype(np.float32) * np.float32([1e-3, 1, 1, 1, 1, 1, 1, 1e3])
    errs = {}
    for scale in ("per_tensor", "per_channel"):
        q, s = K.quantize_fp8(x, "fp8_e4m3", scale=scale, axis=-1)
        errs[scale] = np.abs(K.dequantize_fp8(q, s)[:, 0] - x[:, 0]).max()
    assert errs["per_channel"] < errs["per_tensor"] / 10


def test_saturates_and_zero_channel():
    x = np.array([[1e6, -1e6, 0.0]], np.float32)
    q, s = K.quantize_fp8(x, "fp8_e4m3", scale=np.float32(1.0))
    assert np.isfinite(q.astype(np.float32)).all()
    assert q.astype(np.float32).tolist() == [[448.0, -448.0, 0.0]]
    s2 = compute_scale(np.zeros((3, 2), np.float32), "fp8_e4m3", "per_channel")
    assert np.all(s2 == 1.0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_stochastic_rounding_is_unbiased_and_picks_neighbours(dtype):
    x = np.full(200_000, 1.0 + 1 / 32, np.float32)        # between two e4m3/e5m2 values
    x[::2] *= -1
    q, s = K.quantize_fp8(x, dtype, scale=np.float32(1.0), stochastic_round=True, seed=7)
    vals = q.astype(np.float32)
    lo = float(np.float32(1.0 + 1 / 32).astype(dtype).astype(np.float32))
    assert set(np.abs(vals).tolist()) <= {1.0, 1.0 + 2.0 ** -(3 if dtype == E4M3 else 2), lo}
    assert len(set(np.abs(vals).tolist())) == 2
    np.testing.assert_allclose(np.abs(vals).mean(), 1 + 1 / 32, rtol=2e-3)
    nearest = np.abs(x.astype(dtype).astype(np.float32)).mean()
    assert abs(nearest - (1 + 1 / 32)) > 0.02                 # round-to-nearest is biased here


def test_policy_drives_quantize(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    q, s = K.quantize_fp8(x, policy=numeric(dtype="fp8_e5m2", scale="per_channel"), axis=0)
    assert q.dtype == E5M2 and s.shape == (4, 1)


def test_fp8_errors():
    with pytest.raises(TypeError, match="not FP8"):
        K.quantize_fp8(np.ones(3, np.float32), "bf16")
    with pytest.raises(ValueError, match="per_row"):
        K.quantize_fp8(np.ones(3, np.float32), scale="per_row")
    with pytest.raises(TypeError, match="int32"):
        K.quantize_fp8(np.ones(3, np.int32))


@pytest.mark.parametrize("padding", ["same", "valid", "full"])
@pytest.mark.parametrize("kernel", [(3, 3), (5, 2), (1, 1)])
def test_conv2d_fft_matches_direct(rng, padding, kernel):
    x = rng.standard_normal((2, 3, 12, 10))
    w = rng.standard_normal((4, 3) + kernel)
    bias = rng.standard_normal(4)
    want = K.conv2d_direct(x, w, bias, padding=padding)
    got = K.conv2d_fft(x, w, bias, padding=padding)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    got32 = K.conv2d_fft(x.astype(np.float32), w.astype(np.float32), padding=padding)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, want - bias.reshape(1, 4, 1, 1), rtol=1e-4, atol=1e-4)


def test_conv2d_direct_against_explicit_loop(rng):
    x = rng.standard_normal((1, 2, 5, 6))
    w = rng.standard_normal((3, 2, 3, 3))
    got = K.conv2d_direct(x, w, padding="valid")
    want = np.zeros((1, 3, 3, 4))
    for o in range(3):
        for i in range(3):
            for j in range(4):
                want[0, o, i, j] = (x[0, :, i:i + 3, j:j + 3] * w[o]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    same = K.conv2d_direct(x, w, padding="same")
    np.testing.assert_allclose(same[..., 1:-1, 1:-1], want, rtol=1e-12)


def test_fft2d_roundtrip_and_conv_errors(rng):
    x = rng.standard_normal((3, 8, 8))
    np.testing.assert_allclose(K.ifft2d(K.fft2d(x)).real, x, atol=1e-12)
    with pytest.raises(ValueError, match="input channels"):
        K.conv2d_fft(np.ones((1, 2, 4, 4)), np.ones((1, 3, 3, 3)))
    with pytest.raises(ValueError, match="padding"):
        K.conv2d_fft(np.ones((1, 2, 4, 4)), np.ones((1, 2, 3, 3)), padding="reflect")
