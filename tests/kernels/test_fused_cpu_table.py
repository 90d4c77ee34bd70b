"""The CPU kernel-table entries of the fused training-step ops (the names the GPU kernels of
kernels.fused_cuda, embedding_cuda and optim_cuda are registered under) against the same float64
references, and the optimizer ops against optim.AdamW and optim.clip_grad_norm themselves."""
import math

import numpy as np
import pytest

from tessera_rt import optim
from tessera_rt.backend import KERNELS, get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import embedding as E, fused_ref as R, multi_tensor as MT
from tessera_rt.kernels.numerics import tolerance

BF16 = resolve_dtype("bf16")
DTYPES = [np.float32, np.float64, np.float16, BF16]
IDS = {np.float32: "f32", np.float64: "f64", np.float16: "f16", BF16: "bf16"}
OPS = ("swiglu_gate", "swiglu_backward", "rmsnorm_backward", "layernorm_backward", "softmax_cross_entropy",
       "cross_entropy_backward", "embedding", "embedding_backward", "adamw_multi", "sum_squares_multi",
       "clip_scale_multi")


def cpu(op):
    return KERNELS[op]["cpu"]


def f64(a):
    return np.asarray(a).astype(np.float64)


def rnd(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def close(got, want, dtype, atol_scale=1.0):
    assert np.asarray(got).dtype == np.dtype(dtype)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(f64(got), want, rtol=rtol, atol=atol * atol_scale)


def test_every_op_has_a_cpu_and_a_cuda_entry():
    for op in OPS:
        assert set(KERNELS[op]) == {"cpu", "cuda"}, op
        if not get_backend().is_gpu:
            assert get_backend().kernel(op) is cpu(op)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_swiglu_gate_and_backward(dtype):
    rng = np.random.default_rng(0)
    h1, h3, g = rnd(rng, (5, 37), dtype, 3.0), rnd(rng, (5, 37), dtype), rnd(rng, (5, 37), dtype)
    close(cpu("swiglu_gate")(h1, h3), R.swiglu_gate(f64(h1), f64(h3)), dtype)
    for got, want in zip(cpu("swiglu_backward")(g, h1, h3), R.swiglu_backward(f64(g), f64(h1), f64(h3))):
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("rows,n", [(37, 7), (300, 1000)])
def test_norm_backward(dtype, rows, n):
    rng = np.random.default_rng(rows + n)
    x, g, w, b = (rnd(rng, (rows, n), dtype, 3.0), rnd(rng, (rows, n), dtype), rnd(rng, (n,), dtype),
                  rnd(rng, (n,), dtype))
    gx, gw = cpu("rmsnorm_backward")(g, x, w)
    wx, ww = R.rmsnorm_backward(f64(g), f64(x), f64(w))
    close(gx, wx, dtype, 4)
    close(gw, ww, dtype, math.sqrt(rows))
    for got, want in zip(cpu("layernorm_backward")(g, x, w, b), R.layernorm_backward(f64(g), f64(x), f64(w), f64(b))):
        close(got, want, dtype, math.sqrt(rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_cross_entropy(dtype):
    rng = np.random.default_rng(1)
    logits = rnd(rng, (37, 1001), dtype, 4.0)
    targets = rng.integers(0, 1001, 37)
    loss, lse = cpu("softmax_cross_entropy")(logits, targets, return_lse=True)
    want, want_lse = R.softmax_cross_entropy(f64(logits), targets, return_lse=True)
    close(np.asarray(loss), want, np.float64 if np.dtype(dtype) == np.float64 else np.float32,
          atol_scale=1 if np.dtype(dtype) == np.float64 else 10)      # the loss in the statistics' dtype
    np.testing.assert_allclose(f64(lse), want_lse, rtol=1e-5)
    close(cpu("cross_entropy_backward")(np.float32(2.5), logits, targets, lse),
          R.cross_entropy_backward(2.5, f64(logits), targets, f64(lse)), dtype)
    with pytest.raises(ValueError, match="outside"):
        cpu("softmax_cross_entropy")(logits, np.where(np.arange(37) == 5, 1001, targets))


def test_the_reference_gives_nan_rows_for_bad_targets():
    logits, targets = np.zeros((3, 4)), np.array([1, 4, -1])
    loss, lse = R.softmax_cross_entropy(logits, targets, return_lse=True)
    assert np.isnan(loss) and np.allclose(lse, np.log(4))
    d = R.cross_entropy_backward(1.0, logits, targets, lse)
    assert np.isnan(d[1:]).all() and np.allclose(d[0], (np.full(4, 0.25) - np.eye(4)[1]) / 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_embedding(dtype, ids_dtype):
    rng = np.random.default_rng(2)
    table, lo = rnd(rng, (150, 33), dtype), 50
    ids = rng.integers(0, 260, (3, 101)).astype(ids_dtype)
    ids[0, :20] = 77
    out = cpu("embedding")(ids, table, lo=lo)
    assert out.dtype == np.dtype(dtype) and out.shape == (3, 101, 33)
    np.testing.assert_array_equal(f64(out), E.embedding(ids, f64(table), lo=lo))
    inside = (ids >= lo) & (ids < lo + 150)
    assert (f64(out)[~inside] == 0).all() and inside.any() and (~inside).any()
    g = rnd(rng, (3, 101, 33), dtype)
    got = cpu("embedding_backward")(g, ids, 150, lo=lo)
    close(got, E.embedding_backward(f64(g), ids, 150, lo=lo), dtype, math.sqrt(20))
    assert np.array_equal(got.view(np.uint8), cpu("embedding_backward")(g, ids, 150, lo=lo).view(np.uint8))


def test_embedding_slices_sum_to_the_full_lookup():
    # tensor-parallel ranks each hold a vocab slice: their lookups add up to the whole table's
    rng = np.random.default_rng(3)
    table, ids = rnd(rng, (100, 8), np.float32), rng.integers(0, 100, 50)
    parts = [cpu("embedding")(ids, table[lo:lo + 25], lo=lo) for lo in range(0, 100, 25)]
    np.testing.assert_array_equal(sum(parts), table[ids])
    g = rnd(rng, (50, 8), np.float32)
    grads = [cpu("embedding_backward")(g, ids, 25, lo=lo) for lo in range(0, 100, 25)]
    np.testing.assert_allclose(np.concatenate(grads), E.embedding_backward(f64(g), ids, 100), rtol=1e-6, atol=1e-6)


def test_adamw_multi_is_optim_adamw():
    # the same bits as AdamW.step's update over two steps, for f32 and bf16 gradients
    rng = np.random.default_rng(4)
    shapes = [(7,), (33, 5), (1000,)]
    params = [rnd(rng, s, np.float32) for s in shapes]
    opt = optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ws = [p.copy() for p in params]
    ms, vs = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
    for step in (1, 2):
        grads = [rnd(rng, s, np.float32 if i % 2 else BF16, 0.1) for i, s in enumerate(shapes)]
        opt.step(params, grads)
        cpu("adamw_multi")(ws, grads, ms, vs, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=step)
        for got, want in ((ws, opt.masters), (ms, opt.m), (vs, opt.v)):
            for a, b in zip(got, want):
                assert np.array_equal(a, b)
    ref_w = MT.adamw_multi(ws, grads, ms, vs, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=3)[0]
    cpu("adamw_multi")(ws, grads, ms, vs, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=3)
    for a, b in zip(ws, ref_w):
        close(a, b, np.float32, 4)


def test_adamw_multi_numpy_fallback_and_grad_scale():
    # a strided master takes the NumPy formula; grad_scale multiplies the gradient first
    rng = np.random.default_rng(5)
    w = rnd(rng, (20,), np.float32)
    strided, dense = w.copy()[::1].reshape(4, 5).T, w.copy().reshape(4, 5).T.copy()
    g = rnd(rng, (5, 4), np.float32)
    state = [[np.zeros((5, 4), np.float32) for _ in range(2)] for _ in range(2)]
    kw = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    cpu("adamw_multi")([strided], [g], [state[0][0]], [state[0][1]], **kw, grad_scale=np.float32(0.5))
    cpu("adamw_multi")([dense], [g * np.float32(0.5)], [state[1][0]], [state[1][1]], **kw)
    assert np.array_equal(strided, dense)


def test_sum_squares_and_clip_are_clip_grad_norm():
    rng = np.random.default_rng(6)
    grads = [rnd(rng, (7,), np.float32, 10), rnd(rng, (33, 5), BF16, 10), rnd(rng, (3,), np.float64, 10)]
    total = cpu("sum_squares_multi")(grads)
    assert total.dtype == np.float64 and total.shape == ()
    np.testing.assert_allclose(total, MT.sum_squares_multi(grads), rtol=1e-13)
    np.testing.assert_allclose(math.sqrt(float(total)), optim.global_norm(grads), rtol=1e-12)
    clipped, _ = optim.clip_grad_norm(grads, 1.0, norm=math.sqrt(float(total)))
    mine = [g.copy() for g in grads]
    scale = cpu("clip_scale_multi")(mine, total, 1.0)
    assert scale.dtype == np.float32 and scale == np.float32(1.0 / (math.sqrt(float(total)) + 1e-6))
    for a, b in zip(mine, clipped):       # (clip_grad_norm returns the bf16 one scaled into f32)
        if a.dtype == BF16:
            close(a, f64(b), BF16)
        else:
            assert np.array_equal(a, b)
    same = [g.copy() for g in grads]
    assert cpu("clip_scale_multi")(same, total, 1e9) == 1.0 and all(np.array_equal(a, b) for a, b in zip(same, grads))
