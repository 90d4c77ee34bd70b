"""The fused CPU kernels (kernels.cpu_fused, kernels.cpu_attention) against their NumPy
references (the oracle), forward and backward, and the VJP rules that use them."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tessera_rt as ts
from tessera_rt import nn, op
from tessera_rt.backend import KERNELS, get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import attention, cpu_attention, cpu_fused, mlp, norms
from tessera_rt.kernels.numerics import numeric, tolerance

BF16 = resolve_dtype("bf16")
DTYPES = [np.float32, np.float64, np.float16, BF16]
SHAPES = [(1, 1), (3, 7), (2, 5, 33), (130, 257)]


def f64(a):
    return np.asarray(a, np.float64)


def close(got, want, dtype, scale=1.0):
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(f64(got), f64(want), rtol=rtol, atol=atol * scale)


def data(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def test_cpu_table_picks_the_fused_kernels():
    table = {name: KERNELS[name]["cpu"] for name in ("swiglu", "rmsnorm", "layernorm", "softmax",
                                                       "flash_attention", "flash_attention_backward")}
    assert table == {"swiglu": cpu_fused.swiglu, "rmsnorm": cpu_fused.rmsnorm, "layernorm": cpu_fused.layernorm,
                     "softmax": cpu_fused.softmax, "flash_attention": cpu_attention.flash_attention,
                     "flash_attention_backward": cpu_attention.flash_attention_backward}
    if not get_backend().is_gpu:
        assert get_backend().kernel("rmsnorm") is cpu_fused.rmsnorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norms_and_softmax_match_the_references(dtype, shape):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x, w, b = data(rng, shape, dtype, 3.0), data(rng, shape[-1:], dtype), data(rng, shape[-1:], dtype)
    n = shape[-1]
    for got, want in ((cpu_fused.rmsnorm(x, w), norms.rmsnorm(f64(x), f64(w))),
                      (cpu_fused.rmsnorm(x), norms.rmsnorm(f64(x))),
                      (cpu_fused.layernorm(x, w, b), norms.layernorm(f64(x), f64(w), f64(b))),
                      (cpu_fused.layernorm(x, None, b), norms.layernorm(f64(x), None, f64(b))),
                      (cpu_fused.softmax(x), norms.softmax(f64(x)))):
        assert got.dtype == np.dtype(dtype) and got.shape == x.shape
        close(got, want, dtype, scale=math.sqrt(n))


def test_outputs_written_in_place_and_policies_followed():
    rng = np.random.default_rng(0)
    x, w = data(rng, (4, 9), np.float32), data(rng, (9,), np.float32)
    out = np.empty_like(x)
    assert cpu_fused.rmsnorm(x, w, out=out) is out
    close(out, norms.rmsnorm(f64(x), f64(w)), np.float32)
    y = cpu_fused.softmax(x, policy=numeric(dtype="bf16"))
    assert y.dtype == BF16
    # softmax over another axis is the reference's
    np.testing.assert_array_equal(cpu_fused.softmax(x, axis=0), norms.softmax(x, axis=0))
    with pytest.raises(ValueError, match="weight has shape"):
        cpu_fused.rmsnorm(x, w[:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [((3, 5), (5, 7)), ((2, 3, 17), (17, 33)), ((1, 1), (1, 1))])
def test_swiglu_matches_the_reference(dtype, shape):
    rng = np.random.default_rng(7)
    (sx, sw) = shape
    x, w1, w3 = data(rng, sx, dtype), data(rng, sw, dtype), data(rng, sw, dtype)
    got = cpu_fused.swiglu(x, w1, w3)
    assert got.dtype == np.dtype(dtype)
    close(got, mlp.swiglu(f64(x), f64(w1), f64(w3)), dtype, scale=math.sqrt(sx[-1]))


def _ops_swiglu(x, w1, w3):
    return op.mul(op.silu(op.matmul(x, w1)), op.matmul(x, w3))


def _grads(fn, *args, seed=3):
    """The gradient of sum(fn(*args) * r) in every argument (r fixed)."""
    r = None

    def loss(*a):
        nonlocal r
        y = fn(*a)
        if r is None:
            r = np.random.default_rng(seed).standard_normal(tuple(y.shape))
        return op.sum(op.mul(y, r.astype(y.dtype)))
    return ts.grad(loss, argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vjp_rules_match_the_op_compositions(dtype):
    rng = np.random.default_rng(11)
    x, w1, w3 = data(rng, (2, 5, 12), dtype), data(rng, (12, 9), dtype), data(rng, (12, 9), dtype)
    w, b = data(rng, (12,), dtype), data(rng, (12,), dtype)
    pairs = [
        (_grads(op.swiglu, x, w1, w3), _grads(_ops_swiglu, x, w1, w3)),
        (_grads(lambda a, c: op.rmsnorm(a, c), x, w), _grads(
            lambda a, c: op.mul(op.mul(a, op.rsqrt(op.add(op.mean(op.mul(a, a), -1, True), 1e-6))), c), x, w)),
        (_grads(lambda a, c, d: op.layernorm(a, c, d), x, w, b), _grads(
            lambda a, c, d: op.add(op.mul(_ops_layernorm(a), c), d), x, w, b)),
        (_grads(op.softmax, x), _grads(lambda a: op.div(op.exp(a), op.sum(op.exp(a), -1, True)), x)),
    ]
    for got, want in pairs:
        for g, e in zip(got, want):
            close(g, e, dtype, scale=10.0)


def _ops_layernorm(a):
    c = op.sub(a, op.mean(a, -1, True))
    return op.mul(c, op.rsqrt(op.add(op.mean(op.mul(c, c), -1, True), 1e-5)))


def test_swiglu_backward_keeps_the_pre_activations(monkeypatch):
    """The backward runs the four GEMMs of the cotangents and does not recompute x@w1, x@w3."""
    rng = np.random.default_rng(5)
    x, w1, w3 = data(rng, (3, 4, 8), np.float32), data(rng, (8, 6), np.float32), data(rng, (8, 6), np.float32)
    calls = []
    inner = KERNELS["matmul"]["cpu"]
    monkeypatch.setitem(KERNELS["matmul"], "cpu", lambda *a, **k: calls.append(1) or inner(*a, **k))
    got = _grads(op.swiglu, x, w1, w3)
    assert len(calls) == 4
    want = _grads(_ops_swiglu, x, w1, w3)
    for g, e in zip(got, want):
        close(g, e, np.float32, scale=10.0)
    # rematerialized: the same gradient, and ts.remat's forward keeps nothing
    remat = _grads(ts.remat(lambda a, b_, c: op.swiglu(a, b_, c)), x, w1, w3)
    for g, e in zip(remat, want):
        close(g, e, np.float32, scale=10.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (2, 9, 33)])
def test_cross_entropy_forward_and_backward(dtype, shape):
    rng = np.random.default_rng(shape[-1])
    logits = data(rng, shape, dtype, 4.0)
    targets = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    lf = f64(logits)
    lse = np.log(np.exp(lf - lf.max(-1, keepdims=True)).sum(-1)) + lf.max(-1)
    want = np.mean(lse - np.take_along_axis(lf, targets[..., None].astype(np.int64), -1)[..., 0])
    close(cpu_fused.softmax_cross_entropy(logits, targets), want, dtype)
    got = ts.grad(lambda z: op.softmax_cross_entropy(z, targets))(logits)
    p = np.exp(lf - lse[..., None])
    np.put_along_axis(p, targets[..., None].astype(np.int64), np.take_along_axis(p, targets[..., None].astype(
        np.int64), -1) - 1, -1)
    close(got, p / targets.size, dtype)
    # nn.cross_entropy on host arrays is this kernel, and its value the composition's
    iota = nn.vocab_iota(shape[-1], len(shape) - 1)
    close(nn.cross_entropy(logits, targets, iota), want, dtype)
    with pytest.raises(ValueError, match="outside"):
        cpu_fused.softmax_cross_entropy(logits, np.full(shape[:-1], shape[-1], np.int32))


ATTN = [(2, 4, 4, 37, 37, 16, None), (1, 4, 2, 20, 300, 8, None), (2, 6, 2, 150, 150, 16, 64),
        (2, 2, 1, 5, 9, 4, 4), (1, 2, 2, 9, 3, 8, None), (1, 1, 1, 260, 260, 8, 100)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ATTN)
def test_attention_matches_the_reference(causal, case):
    b, h, hkv, sq, sk, d, block = case
    rng = np.random.default_rng(sq * 7 + sk)
    q, k, v = data(rng, (b, h, sq, d), np.float32), data(rng, (b, hkv, sk, d), np.float32), \
        data(rng, (b, hkv, sk, d), np.float32)
    o, lse = cpu_attention.flash_attention(q, k, v, causal=causal, return_lse=True, block_kv=block)
    ro, rlse = attention.flash_attention(f64(q), f64(k), f64(v), causal=causal, return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    close(o, ro, np.float32, scale=4.0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(rlse))     # rows that see no key
    fin = np.isfinite(rlse)
    close(lse[fin], rlse[fin], np.float32, scale=4.0)
    do = data(rng, o.shape, np.float32)
    got = cpu_attention.flash_attention_backward(q, k, v, o, do, lse, causal=causal)
    want = attention.flash_attention_backward(f64(q), f64(k), f64(v), ro, f64(do), rlse, causal=causal)
    for g, e in zip(got, want):
        assert g.dtype == np.float32
        close(g, e, np.float32, scale=4.0 * math.sqrt(sk))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, BF16])
def test_attention_low_and_high_precision(dtype):
    rng = np.random.default_rng(2)
    q, k, v = (data(rng, (1, 2, 11, 8), dtype) for _ in range(3))
    o, lse = cpu_attention.flash_attention(q, k, v, causal=True, return_lse=True)
    ro, rlse = attention.flash_attention(f64(q), f64(k), f64(v), causal=True, return_lse=True)
    assert o.dtype == np.dtype(dtype)
    close(o, ro, dtype, scale=4.0)
    got = cpu_attention.flash_attention_backward(q, k, v, o, o, lse, causal=True)
    want = attention.flash_attention_backward(f64(q), f64(k), f64(v), ro, ro, rlse, causal=True)
    for g, e in zip(got, want):
        close(g, e, dtype, scale=8.0)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 70), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_row_kernels_on_random_shapes(rows, n, scale):
    rng = np.random.default_rng(rows * 100 + n)
    x, w = data(rng, (rows, n), np.float32, scale), data(rng, (n,), np.float32)
    close(cpu_fused.rmsnorm(x, w), norms.rmsnorm(f64(x), f64(w)), np.float32, scale=math.sqrt(n))
    close(cpu_fused.softmax(x), norms.softmax(f64(x)), np.float32)
    g = data(rng, (rows, n), np.float32)
    gx, gw = cpu_fused.rmsnorm_backward(g, x, w)
    assert gx.dtype == np.float32 and gw.dtype == np.float32
    xf, gwx = f64(x), f64(g) * f64(w)
    r = 1 / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)
    close(gx, gwx * r - xf * (gwx * xf).mean(-1, keepdims=True) * r ** 3, np.float32, scale=10.0)
    close(gw, (f64(g) * xf * r).sum(0), np.float32, scale=10.0 * math.sqrt(rows))


@pytest.mark.parametrize("shape_q, shape_k", [((0, 2, 5, 3), (0, 1, 5, 3)), ((1, 2, 4, 3), (1, 1, 0, 3))])
def test_attention_on_an_empty_piece_matches_the_reference(shape_q, shape_k):
    # an uneven split of the batch leaves a rank no rows (3 ranks, batch 2); a sequence may be empty
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape_q).astype(np.float32)
    k, v = (rng.standard_normal(shape_k).astype(np.float32) for _ in range(2))
    o, lse = cpu_attention.flash_attention(q, k, v, return_lse=True)
    ro, rlse = attention.flash_attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o, ro)
    np.testing.assert_array_equal(lse, rlse)
    grads = cpu_attention.flash_attention_backward(q, k, v, o, np.ones_like(o), lse)
    ref = attention.flash_attention_backward(q, k, v, ro, np.ones_like(ro), rlse)
    for g, r in zip(grads, ref):
        assert g.shape == r.shape
        np.testing.assert_array_equal(g, r)


def _ulps(a, b):
    """Distance in units of the last place between two f32 arrays of finite values."""
    ia, ib = (np.asarray(x, np.float32).view(np.int32).astype(np.int64) for x in (a, b))
    ia, ib = (np.where(i < 0, np.int64(-2**31) - i, i) for i in (ia, ib))       # ordered like the floats
    return np.abs(ia - ib)


def test_fast_exp_is_within_one_ulp_with_numpys_special_values():
    from tessera_rt.kernels import cpu_math
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110, 95, 200_000), np.linspace(-104.5, -85, 20001),   # denormal results
                        np.linspace(85, 90, 2001), rng.standard_normal(10_000)]).astype(np.float32)
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64)).astype(np.float32)          # correctly rounded (as good as)
    got = cpu_math.exp_inplace(x.copy())
    assert _ulps(got, exact).max() <= 1
    special = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -1000.0, 1000.0], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(cpu_math.exp_inplace(special.copy()), np.exp(special))
    # f64 and strided arrays take NumPy's exp
    x64 = rng.standard_normal(100)
    np.testing.assert_array_equal(cpu_math.exp_inplace(x64.copy()), np.exp(x64))
    xs = rng.standard_normal((8, 8)).astype(np.float32).T
    want = np.exp(xs)
    assert cpu_math.exp_inplace(xs) is xs
    np.testing.assert_array_equal(xs, want)


def test_swiglu_kernels_are_as_accurate_as_float64_math():
    """The fused SwiGLU (its exponential inside the loop) against the formula in f64: the
    forward within a few ulps, the backward no worse than NumPy evaluating it in f32."""
    rng = np.random.default_rng(1)
    h1 = (rng.standard_normal((64, 512)) * 8).astype(np.float32)
    h3, g = (rng.standard_normal((64, 512)).astype(np.float32) for _ in range(2))
    a = f64(h1)
    s = 1 / (1 + np.exp(-a))
    np.testing.assert_allclose(cpu_fused.swiglu_gate(h1, h3), a * s * h3, rtol=1e-6, atol=1e-30)
    dh1, dh3 = cpu_fused.swiglu_backward(g, h1, h3)
    want1, want3 = g * h3 * s * (1 + a * (1 - s)), g * a * s
    s32 = 1 / (1 + np.exp(-h1))
    numpy_f32 = np.abs(g * h3 * s32 * (1 + h1 * (1 - s32)) - want1).max()
    assert np.abs(dh1 - want1).max() <= numpy_f32
    np.testing.assert_allclose(dh3, want3, rtol=1e-6, atol=1e-30)
