"""matmul, softmax, layernorm, rmsnorm, bias_act, swiglu against float64 NumPy."""
import math

import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.backend import get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels.numerics import numeric, tolerance


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

BF16 = resolve_dtype("bf16")
LOW = [np.float32, np.float16, BF16]


def close(got, want, dtype, scale=1.0):
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("dtype", LOW + [np.float64])
@pytest.mark.parametrize("shapes", [((7, 5), (5, 3)), ((2, 3, 8, 16), (16, 4)),
                                    ((4, 1, 6, 9), (3, 9, 2)), ((9,), (9, 4)), ((3, 9), (9,))])
def test_matmul_matches_float64(rng, dtype, shapes):
    sa, sb = shapes
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    got = get_backend().kernel("matmul")(a, b)
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
    close(got, want, dtype, scale=math.sqrt(sa[-1]))


def test_matmul_accumulates_low_precision_in_f32():
    # 4096 ones in bf16: a bf16 running sum stalls at 256; an f32 accumulator reaches 4096.
    a = np.ones((1, 4096), BF16)
    b = np.ones((4096, 1), BF16)
    assert float(K.matmul(a, b)[0, 0]) == 4096.0
    assert float(K.matmul(a, b, tile_shape=(64, 64, 32))[0, 0]) == 4096.0


def test_matmul_tile_shape_blocks_k_and_out(rng):
    a = rng.standard_normal((3, 16, 40)).astype(np.float32)
    b = rng.standard_normal((40, 8)).astype(np.float32)
    out = np.empty((3, 16, 8), np.float32)
    r = K.matmul(a, b, tile_shape=(16, 8, 16), out=out)
    assert r is out
    close(out, a.astype(np.float64) @ b, np.float32, scale=6)


def test_matmul_fp8_policy(rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal((32, 8)).astype(np.float32)
    want = a.astype(np.float64) @ b
    for scale in ("per_tensor", "per_channel"):
        got = K.matmul(a, b, policy=numeric(dtype="fp8_e4m3", scale=scale))
        assert got.dtype == np.float32
        # e4m3 keeps 3 mantissa bits: each product is off by <= ~2*2^-4 relative
        err = np.abs(got - want).max() / np.abs(a).max() / np.abs(b).max() / 32
        assert err < 2 ** -4, err
        assert not np.allclose(got, want, rtol=1e-4)   # the quantization really happened


def test_matmul_errors(rng):
    a = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"inner dims differ.*\(4, 5\).*\(4, 3\)"):
        K.matmul(a, np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="do not broadcast"):
        K.matmul(np.ones((2, 4, 5), np.float32), np.ones((3, 5, 2), np.float32))
    with pytest.raises(TypeError, match="int32"):
        K.matmul(a.astype(np.int32), np.ones((5, 2), np.int32))
    with pytest.raises(ValueError, match="shared memory"):
        K.matmul(a, np.ones((5, 2), np.float32), tile_shape=(256, 256, 256))
    with pytest.raises(ValueError, match="three ints"):
        K.matmul(a, np.ones((5, 2), np.float32), tile_shape=(64, 64))
    with pytest.raises(ValueError, match="out has shape"):
        K.matmul(a, np.ones((5, 2), np.float32), out=np.empty((4, 3), np.float32))
    with pytest.raises(TypeError, match="stream"):
        K.matmul(a, np.ones((5, 2), np.float32), stream="compute")


def test_matmul_accepts_runtime_stream(rng):
    from tessera_rt import runtime as rt
    a = rng.standard_normal((4, 5)).astype(np.float32)
    close(K.matmul(a, a.T, stream=rt.stream("compute")), a.astype(np.float64) @ a.T, np.float32)


def softmax64(x, axis=-1):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(rng, dtype, axis):
    x = (rng.standard_normal((5, 7, 33)) * 4).astype(dtype)
    got = K.softmax(x, axis=axis)
    assert got.dtype == np.dtype(dtype)
    close(got, softmax64(x, axis), dtype)


def test_softmax_large_logits_do_not_overflow():
    x = np.array([[1000.0, 1000.0, -1000.0], [88.0, 89.0, 90.0]], np.float32)
    got = K.softmax(x)
    assert np.isfinite(got).all()
    close(got, softmax64(x), np.float32)
    with pytest.raises(ValueError, match="axis 3"):
        K.softmax(x, axis=3)


def layernorm64(x, w, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return y * (1 if w is None else w.astype(np.float64)) + (0 if b is None else b.astype(np.float64))


@pytest.mark.parametrize("dtype", LOW + [np.float64])
@pytest.mark.parametrize("affine", [False, True])
def test_layernorm(rng, dtype, affine):
    x = (rng.standard_normal((4, 3, 96)) * 3 + 5).astype(dtype)
    w = rng.standard_normal(96).astype(dtype) if affine else None
    b = rng.standard_normal(96).astype(dtype) if affine else None
    got = get_backend().kernel("layernorm")(x, w, b, eps=1e-5)
    assert got.dtype == np.dtype(dtype)
    close(got, layernorm64(x, w, b, 1e-5), dtype, scale=4)


@pytest.mark.parametrize("dtype", LOW + [np.float64])
def test_rmsnorm(rng, dtype):
    x = (rng.standard_normal((6, 128)) * 3).astype(dtype)
    w = rng.standard_normal(128).astype(dtype)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w.astype(np.float64)
    got = K.rmsnorm_safe(x, w)
    assert got.dtype == np.dtype(dtype)
    close(got, want, dtype, scale=4)


def test_norm_statistics_are_f32_for_bf16():
    # mean of 8192 values of 1+small in bf16: f32 statistics give var ~ 0 exactly right.
    x = np.full((1, 8192), 300.0, BF16)
    x[0, ::2] = 302.0
    got = K.layernorm(x).astype(np.float64)
    np.testing.assert_allclose(np.abs(got), 1.0, rtol=2e-2)


def test_norm_errors():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\).*\(8,\)"):
        K.layernorm(x, np.ones(7, np.float32))
    with pytest.raises(TypeError, match="fp8_e4m3"):
        K.rmsnorm(x.astype(resolve_dtype("fp8_e4m3")))
    with pytest.raises(ValueError, match="eps"):
        K.rmsnorm(x, eps=-1)
    out = np.empty((2, 8), np.float16)
    with pytest.raises(TypeError, match="out has dtype float16"):
        K.softmax(x, out=out)


def test_bias_act(rng):
    x = rng.standard_normal((5, 16)).astype(np.float32) * 3
    b = rng.standard_normal(16).astype(np.float32)
    y = x.astype(np.float64) + b
    erf = np.vectorize(math.erf)
    gelu = 0.5 * y * (1 + erf(y / math.sqrt(2)))
    gelu_tanh = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    silu = y / (1 + np.exp(-y))
    close(K.bias_gelu(x, b), gelu, np.float32)
    close(K.bias_gelu(x, b, approximate=True), gelu_tanh, np.float32)
    close(K.bias_silu(x, b), silu, np.float32)
    close(K.bias_act(x, b, act="relu"), np.maximum(y, 0), np.float32)
    xb = x.astype(BF16)
    assert K.bias_silu(xb, b.astype(BF16)).dtype == BF16
    assert np.isfinite(K.silu(np.array([-1e4, 1e4], np.float32))).all()
    with pytest.raises(ValueError, match="act="):
        K.bias_act(x, b, act="tanh")
    with pytest.raises(ValueError, match="bias has shape"):
        K.bias_act(x, b[:3])


@pytest.mark.parametrize("dtype", LOW)
def test_swiglu(rng, dtype):
    x = rng.standard_normal((2, 5, 32)).astype(dtype)
    w1 = (rng.standard_normal((32, 24)) / 6).astype(dtype)
    w3 = (rng.standard_normal((32, 24)) / 6).astype(dtype)
    a = x.astype(np.float64) @ w1.astype(np.float64)
    b = x.astype(np.float64) @ w3.astype(np.float64)
    got = get_backend().kernel("swiglu")(x, w1, w3)
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 5, 24)
    close(got, a / (1 + np.exp(-a)) * b, dtype, scale=2)
    with pytest.raises(ValueError, match="same"):
        K.swiglu(x, w1, w3[:, :3])
