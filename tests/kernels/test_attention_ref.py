"""Flash attention forward (plain and online-softmax blocked) and backward against float64."""
import math

import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels.attention import check_attention
from tessera_rt.kernels.numerics import tolerance


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

BF16 = resolve_dtype("bf16")


def naive(q, k, v, causal, scale=None):
    """Textbook attention in float64, kv heads repeated for the query groups."""
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.swapaxes(-1, -2) * scale
    sq, sk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    return (p / p.sum(-1, keepdims=True)) @ v, lse


def qkv(rng, b, h, hkv, sq, sk, d, dtype):
    return (rng.standard_normal((b, h, sq, d)).astype(dtype),
            rng.standard_normal((b, hkv, sk, d)).astype(dtype),
            rng.standard_normal((b, hkv, sk, d)).astype(dtype))


CASES = [(1, 2, 2, 16, 16, 64, False), (2, 4, 2, 16, 24, 64, True), (1, 4, 1, 24, 16, 128, False),
         (1, 2, 2, 32, 32, 128, True), (2, 8, 2, 12, 40, 64, True)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("block_kv", [None, 8])
@pytest.mark.parametrize("case", CASES)
def test_forward(rng, case, block_kv, dtype):
    b, h, hkv, sq, sk, d, causal = case
    q, k, v = qkv(rng, b, h, hkv, sq, sk, d, dtype)
    o, lse = K.flash_attention(q, k, v, causal=causal, return_lse=True, block_kv=block_kv)
    want_o, want_lse = naive(q, k, v, causal)
    assert o.dtype == np.dtype(dtype) and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(o.astype(np.float64), want_o, rtol=rtol, atol=atol * 2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_causal_rows_without_keys_give_zero_and_neg_inf_lse(rng):
    q, k, v = qkv(rng, 1, 1, 1, 8, 4, 64, np.float32)   # Sq > Sk: first 4 rows see no key
    for block in (None, 2):
        o, lse = K.flash_attention(q, k, v, causal=True, return_lse=True, block_kv=block)
        assert np.all(o[0, 0, :4] == 0) and np.all(np.isneginf(lse[0, 0, :4]))
        want, _ = naive(q[:, :, 4:], k, v, causal=True)
        np.testing.assert_allclose(o[:, :, 4:], want, rtol=2e-5, atol=2e-6)


def test_blocked_equals_plain_in_float64(rng):
    q, k, v = qkv(rng, 1, 4, 2, 20, 37, 64, np.float64)
    for causal in (False, True):
        a = K.flash_attention(q, k, v, causal=causal)
        b = K.flash_attention(q, k, v, causal=causal, block_kv=5)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def loss(q, k, v, do, causal):
    return float((K.flash_attention(q, k, v, causal=causal) * do).sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_backward_matches_finite_differences(rng, causal, heads):
    h, hkv = heads
    q, k, v = qkv(rng, 1, h, hkv, 6, 8, 16, np.float64)
    do = rng.standard_normal(q.shape)
    o, lse = K.flash_attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = K.flash_attention_backward(q, k, v, o, do, lse, causal=causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    eps = 1e-6
    for grad, t, name in ((dq, q, "q"), (dk, k, "k"), (dv, v, "v")):
        direction = rng.standard_normal(t.shape)
        args = {"q": q, "k": k, "v": v}
        plus = dict(args, **{name: t + eps * direction})
        minus = dict(args, **{name: t - eps * direction})
        fd = (loss(plus["q"], plus["k"], plus["v"], do, causal)
              - loss(minus["q"], minus["k"], minus["v"], do, causal)) / (2 * eps)
        np.testing.assert_allclose((grad * direction).sum(), fd, rtol=1e-6, atol=1e-8)


def test_backward_low_precision_close_to_float64(rng):
    q, k, v = qkv(rng, 1, 4, 2, 16, 16, 64, np.float16)
    do = rng.standard_normal(q.shape).astype(np.float16)
    o, lse = K.flash_attention(q, k, v, causal=True, return_lse=True)
    got = K.flash_attention_backward(q, k, v, o, do, lse, causal=True)
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o64, lse64 = K.flash_attention(q64, k64, v64, causal=True, return_lse=True)
    want = K.flash_attention_backward(q64, k64, v64, o64, do64, lse64, causal=True)
    for g, w in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=2e-2, atol=2e-2)


def test_attention_errors():
    q = np.zeros((1, 4, 8, 64), np.float32)
    kv = np.zeros((1, 3, 8, 64), np.float32)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        K.flash_attention(q, kv, kv)
    with pytest.raises(ValueError, match="4-D"):
        K.flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="head_dim 96"):
        check_attention("flash_attention", *(np.zeros((1, 2, 8, 96), np.float16),) * 3, gpu=True)
    with pytest.raises(TypeError, match="share a dtype"):
        K.flash_attention(q, q.astype(np.float16), q)
    with pytest.raises(ValueError, match="lse has shape"):
        K.flash_attention_backward(q, q, q, q, q, np.zeros((1, 4), np.float32))
