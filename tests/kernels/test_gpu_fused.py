"""The fused GPU kernels of a training step (kernels.fused_cuda, xent_cuda, embedding_cuda, optim_cuda)
against their float64 references, with their launch counts, determinism and host syncs.

Written for a GPU; on the CuPy stand-in every launch runs in the CUDA emulation harness (blocks
in a shuffled order, every access checked), which is where the suite runs them
(tests/gpu/test_gpu_path_standin.py).  bf16 device arrays are made from uint16 views: the
stand-in models CuPy 13, whose ufuncs refuse bf16 (RawKernel launches take it).
"""
import math

import numpy as np
import pytest

from tessera_rt.backend import KERNELS
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import (
    embedding as E,
    embedding_cuda as EC,
    fused_cuda as F,
    fused_ref as R,
    multi_tensor as MT,
    optim_cuda as O,
    xent_cuda as X,
)
from tessera_rt.kernels.numerics import tolerance

from test_gpu import cp  # CuPy on a GPU machine, the stand-in under it, None without either

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]

BF16 = resolve_dtype("bf16")
DTYPES = [np.float32, np.float16, BF16]
IDS = {np.float32: "f32", np.float16: "f16", BF16: "bf16"}


def dev(a: np.ndarray):
    """A device copy of host ``a`` (bf16 through its bits)."""
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else cp.asarray(a)


def scalar(value, dtype):
    """A 0-d device array (``cupy.asarray`` of a NumPy scalar is 1-d on the stand-in)."""
    return dev(np.array([value], dtype)).reshape(())


def host(x) -> np.ndarray:
    return x.view(np.uint16).get().view(BF16) if x.dtype == BF16 else x.get()


def rnd(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def f64(a):
    return np.asarray(a).astype(np.float64)


def close(got, want, dtype, atol_scale=1.0, rtol_scale=1.0):
    """got (device or host, of ``dtype``) against the float64 ``want``; returns the max abs error."""
    got = host(got) if not isinstance(got, np.ndarray) else got
    assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(f64(got), want, rtol=rtol * rtol_scale, atol=atol * atol_scale)
    return float(np.abs(f64(got) - want).max()) if got.size else 0.0


def same_bits(a, b) -> bool:
    return np.array_equal(host(a).reshape(-1).view(np.uint8), host(b).reshape(-1).view(np.uint8))


@pytest.fixture
def launches(monkeypatch):
    """Counts RawKernel launches by entry name, through the launchers' get_function (works on a
    GPU as on the stand-in: the launchers look it up in their own module)."""
    counts: dict = {}

    class Counted:
        def __init__(self, fn, entry):
            self.fn, self.entry = fn, entry

        def __call__(self, *args, **kw):
            counts[self.entry] = counts.get(self.entry, 0) + 1
            return self.fn(*args, **kw)

    for mod in (F, X, EC, O):
        real = mod.get_function
        monkeypatch.setattr(mod, "get_function",
                            lambda name, entry, config, render, _real=real, **kw: Counted(
                                _real(name, entry, config, render, **kw), entry))
    return counts


# ---------------------------------------------------------------- SwiGLU

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("shape", [(5, 37), (3, 64), (1027,), (2, 3, 33)])
def test_swiglu_gate_and_backward(dtype, shape, launches):
    rng = np.random.default_rng(sum(shape))
    h1, h3, g = rnd(rng, shape, dtype, 3.0), rnd(rng, shape, dtype), rnd(rng, shape, dtype)
    y = F.swiglu_gate_cuda(dev(h1), dev(h3))
    close(y, R.swiglu_gate(f64(h1), f64(h3)), dtype)
    dh1, dh3 = F.swiglu_backward_cuda(dev(g), dev(h1), dev(h3))
    want1, want3 = R.swiglu_backward(f64(g), f64(h1), f64(h3))
    close(dh1, want1, dtype)
    close(dh3, want3, dtype)
    assert launches == {"ts_swiglu_fwd": 1, "ts_swiglu_bwd": 1}


# ---------------------------------------------------------------- norm backward

NORM_CASES = [(37, 7), (37, 256), (300, 1000), (5, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("rows,n", NORM_CASES)
def test_rmsnorm_backward(dtype, rows, n, launches):
    rng = np.random.default_rng(rows + n)
    x, w, g = rnd(rng, (rows, n), dtype, 3.0), rnd(rng, (n,), dtype), rnd(rng, (rows, n), dtype)
    gx, gw = F.rmsnorm_backward_cuda(dev(g), dev(x), dev(w), eps=1e-6)
    wx, ww = R.rmsnorm_backward(f64(g), f64(x), f64(w), eps=1e-6)
    close(gx, wx, dtype, atol_scale=4)
    close(gw, ww, dtype, atol_scale=math.sqrt(rows))
    assert launches == {"ts_norm_bwd": 1, "ts_colsum": 1}
    gx0, gw0 = F.rmsnorm_backward_cuda(dev(g), dev(x))
    assert gw0 is None and launches["ts_norm_bwd"] == 2 and launches["ts_colsum"] == 1
    close(gx0, R.rmsnorm_backward(f64(g), f64(x))[0], dtype, atol_scale=4)
    again = F.rmsnorm_backward_cuda(dev(g), dev(x), dev(w), eps=1e-6)
    assert same_bits(gx, again[0]) and same_bits(gw, again[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("rows,n", NORM_CASES)
def test_layernorm_backward(dtype, rows, n, launches):
    rng = np.random.default_rng(rows * n)
    x, g = rnd(rng, (rows, n), dtype, 3.0), rnd(rng, (rows, n), dtype)
    w, b = rnd(rng, (n,), dtype), rnd(rng, (n,), dtype)
    gx, gw, gb = F.layernorm_backward_cuda(dev(g), dev(x), dev(w), dev(b), eps=1e-5)
    wx, ww, wb = R.layernorm_backward(f64(g), f64(x), f64(w), f64(b), eps=1e-5)
    close(gx, wx, dtype, atol_scale=4)
    close(gw, ww, dtype, atol_scale=math.sqrt(rows))
    close(gb, wb, dtype, atol_scale=math.sqrt(rows))
    assert launches == {"ts_norm_bwd": 1, "ts_colsum": 1}
    again = F.layernorm_backward_cuda(dev(g), dev(x), dev(w), dev(b), eps=1e-5)
    assert all(same_bits(a, b) for a, b in zip((gx, gw, gb), again))
    gx1, gw1, gb1 = F.layernorm_backward_cuda(dev(g), dev(x), None, dev(b))
    assert gw1 is None
    wx1, _, wb1 = R.layernorm_backward(f64(g), f64(x), None, f64(b))
    close(gx1, wx1, dtype, atol_scale=4)
    close(gb1, wb1, dtype, atol_scale=math.sqrt(rows))


def test_norm_backward_partials_in_global_memory_and_an_f32_weight(monkeypatch):
    # rows wider than the shared-memory partials keep them in global memory; a bf16 input with
    # an f32 weight (the master) gives an f32 weight gradient
    monkeypatch.setattr(F, "NORM_SMEM_COLS", 16)
    rng = np.random.default_rng(5)
    x, g, w = rnd(rng, (300, 40), BF16, 3.0), rnd(rng, (300, 40), BF16), rnd(rng, (40,), np.float32)
    gx, gw = F.rmsnorm_backward_cuda(dev(g), dev(x), dev(w))
    wx, ww = R.rmsnorm_backward(f64(g), f64(x), f64(w))
    close(gx, wx, BF16, atol_scale=4)
    close(gw, ww, np.float32, rtol_scale=50, atol_scale=50)    # f32 sums of bf16 products
    gx, gw, gb = F.layernorm_backward_cuda(dev(g), dev(x), dev(w), dev(w))
    wx, ww, wb = R.layernorm_backward(f64(g), f64(x), f64(w), f64(w))
    close(gx, wx, BF16, atol_scale=4)
    for got, want in ((gw, ww), (gb, wb)):
        close(got, want, np.float32, rtol_scale=50, atol_scale=50)


# ---------------------------------------------------------------- cross-entropy

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("V", [1000, 1001, 4096])
def test_cross_entropy_forward_and_backward(dtype, V, launches):
    rng = np.random.default_rng(V)
    rows = 37
    logits = rnd(rng, (rows, V), dtype, 4.0)
    targets = rng.integers(0, V, rows).astype(np.int64 if V % 2 else np.int32)
    loss, lse = X.softmax_cross_entropy_cuda(dev(logits), cp.asarray(targets), return_lse=True)
    want, want_lse = R.softmax_cross_entropy(f64(logits), targets, return_lse=True)
    assert loss.shape == () and loss.dtype == np.float32 and lse.dtype == np.float32     # f32 loss for 16-bit too
    close(loss, want, np.float32, atol_scale=10)
    close(lse, want_lse, np.float32, atol_scale=math.log(V))
    assert launches == {"ts_xent_fwd": 1, "ts_mean": 1}
    assert same_bits(loss, X.softmax_cross_entropy_cuda(dev(logits), cp.asarray(targets)))
    # g as a Python float and as a 0-d device array (read on the device)
    for g in (2.5, scalar(2.5, np.float32), scalar(2.5, BF16)):
        got = X.cross_entropy_backward_cuda(g, dev(logits), cp.asarray(targets), lse)
        close(got, R.cross_entropy_backward(2.5, f64(logits), targets, f64(lse.get())), dtype)
    assert launches["ts_xent_bwd"] == 3


def test_a_target_outside_the_vocab_makes_the_loss_and_its_row_nan():
    rng = np.random.default_rng(1)
    logits, targets = rnd(rng, (4, 100), np.float32), np.array([3, 100, 7, -1], np.int32)
    loss, lse = X.softmax_cross_entropy_cuda(cp.asarray(logits), cp.asarray(targets), return_lse=True)
    assert np.isnan(loss.get()) and np.isfinite(lse.get()).all()
    d = X.cross_entropy_backward_cuda(1.0, cp.asarray(logits), cp.asarray(targets), lse).get()
    assert np.isnan(d[[1, 3]]).all() and np.isfinite(d[[0, 2]]).all()
    with pytest.raises(ValueError, match="outside"):           # the CPU kernel can raise
        KERNELS["softmax_cross_entropy"]["cpu"](logits, targets)


# ---------------------------------------------------------------- embedding

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("dim", [40, 64, 33])
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_embedding_gather_and_scatter_add(dtype, dim, ids_dtype, launches):
    rng = np.random.default_rng(dim)
    rows, lo = 150, 50                                   # this rank's vocab slice [50, 200)
    table = rnd(rng, (rows, dim), dtype)
    ids = rng.integers(0, 260, (3, 101)).astype(ids_dtype)   # repeats, and ids outside the slice
    ids[0, :20] = 77                                         # one id many times
    out = EC.embedding_cuda(cp.asarray(ids), dev(table), lo=lo)
    assert out.shape == (3, 101, dim)
    np.testing.assert_array_equal(f64(host(out)), E.embedding(ids, f64(table), lo=lo))
    g = rnd(rng, (3, 101, dim), dtype)
    dt = EC.embedding_backward_cuda(dev(g), cp.asarray(ids), rows, lo=lo)
    assert dt.shape == (rows, dim)
    close(dt, E.embedding_backward(f64(g), ids, rows, lo=lo), dtype, atol_scale=math.sqrt(20))
    assert launches == {"ts_embed_fwd": 1, "ts_embed_bwd": 1}
    assert same_bits(dt, EC.embedding_backward_cuda(dev(g), cp.asarray(ids), rows, lo=lo))


def test_strided_inputs_are_read_densely(launches):
    # views (a transpose, every other column, a slice of a wider row) are copied dense first
    rng = np.random.default_rng(21)
    a, b = rnd(rng, (40, 24), np.float32), rnd(rng, (40, 24), np.float32)
    y = F.swiglu_gate_cuda(cp.asarray(a).T, cp.asarray(b).T)
    close(y, R.swiglu_gate(f64(a).T, f64(b).T), np.float32)
    w2 = rnd(rng, (48,), np.float32)
    gx, gw = F.rmsnorm_backward_cuda(cp.asarray(b), cp.asarray(a), cp.asarray(w2)[::2])
    for got, want in zip((gx, gw), R.rmsnorm_backward(f64(b), f64(a), f64(w2[::2]))):
        close(got, want, np.float32, atol_scale=8)
    wide, t = rnd(rng, (40, 30), np.float32, 3.0), rng.integers(0, 24, 40)
    loss, lse = X.softmax_cross_entropy_cuda(cp.asarray(wide)[:, :24], cp.asarray(t)[:, None][:, 0],
                                             return_lse=True)
    close(loss, R.softmax_cross_entropy(f64(wide[:, :24]), t), np.float32)
    table = rnd(rng, (30, 16), np.float32)
    out = EC.embedding_cuda(cp.asarray(t.reshape(5, 8)).T, cp.asarray(table)[::-1])
    np.testing.assert_array_equal(host(out), table[::-1][t.reshape(5, 8).T])
    assert launches == {"ts_swiglu_fwd": 1, "ts_norm_bwd": 1, "ts_colsum": 1, "ts_xent_fwd": 1, "ts_mean": 1,
                        "ts_embed_fwd": 1}


def test_f64_runs_the_references_on_the_device(launches):
    rng = np.random.default_rng(22)
    x, g, w = rnd(rng, (6, 10), np.float64), rnd(rng, (6, 10), np.float64), rnd(rng, (10,), np.float64)
    t = rng.integers(0, 10, 6)
    dx, dg, dw, dt = (cp.asarray(a) for a in (x, g, w, t))
    checks = [(F.swiglu_gate_cuda(dx, dg), R.swiglu_gate(x, g)),
              (F.rmsnorm_backward_cuda(dg, dx, dw)[1], R.rmsnorm_backward(g, x, w)[1]),
              (F.layernorm_backward_cuda(dg, dx, dw, dw)[0], R.layernorm_backward(g, x, w, w)[0]),
              (X.softmax_cross_entropy_cuda(dx, dt), R.softmax_cross_entropy(x, t)),
              (EC.embedding_backward_cuda(dg, dt, 10), E.embedding_backward(g, t, 10))]
    loss, lse = X.softmax_cross_entropy_cuda(dx, dt, return_lse=True)
    checks.append((X.cross_entropy_backward_cuda(loss, dx, dt, lse), R.cross_entropy_backward(float(loss.get()), x, t,
                                                                                              lse.get())))
    for got, want in checks:
        assert got.dtype == np.float64
        np.testing.assert_allclose(got.get(), want, rtol=1e-12, atol=1e-14)
    assert launches == {}


# ---------------------------------------------------------------- multi-tensor optimizer ops

SIZES = [(7,), (33, 5), (1000,), (O.CHUNK + 6,), (0,), (3, 3)]


def _adam_state(rng, grad_dtypes):
    ws = [rnd(rng, s, np.float32) for s in SIZES]
    gs = [rnd(rng, s, grad_dtypes[i % len(grad_dtypes)], 0.1) for i, s in enumerate(SIZES)]
    ms = [rnd(rng, s, np.float32, 0.01) for s in SIZES]
    vs = [np.abs(rnd(rng, s, np.float32, 1e-4)) for s in SIZES]
    return ws, gs, ms, vs


def ulps(a, b) -> int:
    a, b = np.asarray(a, np.float32).view(np.int32).astype(np.int64), np.asarray(b, np.float32).view(np.int32)
    return int(np.abs(a - b).max()) if a.size else 0


@pytest.mark.parametrize("grad_dtypes", [[np.float32], [np.float32, BF16, np.float16]], ids=["f32", "mixed"])
@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_multi_matches_the_cpu_step(grad_dtypes, scaled, launches):
    rng = np.random.default_rng(len(grad_dtypes))
    ws, gs, ms, vs = _adam_state(rng, grad_dtypes)
    hyper = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    scale = np.float32(0.37) if scaled else None
    dws, dms, dvs = [cp.asarray(a) for a in ws], [cp.asarray(a) for a in ms], [cp.asarray(a) for a in vs]
    O.adamw_multi_cuda(dws, [dev(g) for g in gs], dms, dvs, **hyper,
                       grad_scale=None if scale is None else scalar(scale, np.float32))
    assert launches == {"ts_adamw": len(grad_dtypes)}
    want = MT.adamw_multi(ws, gs, ms, vs, **hyper, grad_scale=scale)
    cw, cm, cv = [a.copy() for a in ws], [a.copy() for a in ms], [a.copy() for a in vs]
    MT.adamw_multi_cpu(cw, gs, cm, cv, **hyper, grad_scale=scale)
    for got, cpu, ref in ((dws, cw, want[0]), (dms, cm, want[1]), (dvs, cv, want[2])):
        for d, c, r in zip(got, cpu, ref):
            assert ulps(d.get(), c) <= 1            # the CPU's operations, IEEE-rounded
            close(d.get(), r, np.float32, atol_scale=4)


def test_adamw_multi_on_unaligned_views():
    # views one float past an aligned start take the scalar path; same result
    rng = np.random.default_rng(3)
    n = 1001
    base = [cp.asarray(rnd(rng, n + 1, np.float32, s)) for s in (1.0, 0.01, 1e-4)]
    base[2] = cp.abs(base[2])
    w, m, v = (b[1:] for b in base)
    g = rnd(rng, n, np.float32, 0.1)
    hyper = dict(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    cw, cm, cv = (b.get()[1:].copy() for b in base)
    O.adamw_multi_cuda([w], [cp.asarray(g)], [m], [v], **hyper)
    MT.adamw_multi_cpu([cw], [g], [cm], [cv], **hyper)
    for d, c in ((w, cw), (m, cm), (v, cv)):
        assert ulps(d.get(), c) <= 1


ARRAYS = [((7,), np.float32), ((33, 5), BF16), ((O.CHUNK + 6,), np.float32), ((0,), np.float16),
          ((1000,), np.float16), ((3, 3), np.float64), ((2 * O.CHUNK + 1,), BF16)]


def _arrays(rng, scale=1.0):
    return [rnd(rng, s, dt, scale) for s, dt in ARRAYS]


def test_sum_squares_and_clip_stay_on_the_device(launches):
    rng = np.random.default_rng(11)
    arrs = _arrays(rng)
    dgs = [dev(a) for a in arrs]
    total = O.sum_squares_multi_cuda(dgs)
    assert total.shape == () and total.dtype == np.float64
    want = MT.sum_squares_multi(arrs)
    np.testing.assert_allclose(total.get(), want, rtol=1e-12)
    assert launches == {"ts_sumsq": 4, "ts_sum_partials": 1}       # 4 dtypes with elements, then the total
    assert same_bits(total, O.sum_squares_multi_cuda(dgs))
    max_norm = 0.5 * math.sqrt(float(want))
    scale = O.clip_scale_multi_cuda(dgs, total, max_norm)
    assert launches["ts_clip"] == 4 and scale.dtype == np.float32 and scale.shape == ()
    s = MT.clip_scale(float(want), max_norm)
    assert scale.get() == np.float32(s) and s < 1
    cpu = [a.copy() for a in arrs]
    MT.clip_scale_multi_cpu(cpu, want, max_norm)
    for d, c, a in zip(dgs, cpu, arrs):
        close(host(d), f64(a) * s, d.dtype)
        if c.dtype in (np.float32, np.float64):
            assert np.array_equal(host(d), c)         # x * f32(scale) (f64: by the f64 scale), as NumPy
    np.testing.assert_allclose(O.sum_squares_multi_cuda(dgs).get(), float(want) * s * s, rtol=1e-5)


def test_clip_leaves_small_and_nonfinite_norms_alone():
    rng = np.random.default_rng(12)
    arrs = _arrays(rng)
    dgs = [dev(a) for a in arrs]
    for total, max_norm in ((scalar(4.0, np.float64), 2.0), (scalar(np.nan, np.float64), 1.0),
                            (scalar(np.inf, np.float64), 1.0), (scalar(1.0, np.float32), 2.0)):
        assert O.clip_scale_multi_cuda(dgs, total, max_norm).get() == 1.0
    for d, a in zip(dgs, arrs):
        assert np.array_equal(host(d).view(np.uint8), a.view(np.uint8))
    assert O.clip_scale_multi_cuda([], scalar(16.0, np.float64), 1.0).get() == np.float32(1 / (4 + 1e-6))
    assert O.sum_squares_multi_cuda([]).get() == 0.0


def test_clip_scale_feeds_adamw_without_touching_the_gradients():
    rng = np.random.default_rng(13)
    ws, gs, ms, vs = _adam_state(rng, [np.float32])
    dgs = [cp.asarray(g) for g in gs]
    total = O.sum_squares_multi_cuda(dgs)
    scale = O.clip_scale_multi_cuda([], total, 0.1)      # the factor only; gradients untouched
    hyper = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    dws, dms, dvs = [cp.asarray(a) for a in ws], [cp.asarray(a) for a in ms], [cp.asarray(a) for a in vs]
    O.adamw_multi_cuda(dws, dgs, dms, dvs, **hyper, grad_scale=scale)
    cw, cm, cv = [a.copy() for a in ws], [a.copy() for a in ms], [a.copy() for a in vs]
    MT.adamw_multi_cpu(cw, gs, cm, cv, **hyper, grad_scale=scale.get())
    for d, c in zip(dws, cw):
        assert ulps(d.get(), c) <= 1


# ---------------------------------------------------------------- the whole set: syncs, streams

def _every_op(rng, stream=None):
    """Runs each op once on small inputs (device arrays in, device arrays out) on ``stream``."""
    x, g = cp.asarray(rnd(rng, (9, 24), np.float32)), cp.asarray(rnd(rng, (9, 24), np.float32))
    w = cp.asarray(rnd(rng, (24,), np.float32))
    targets = cp.asarray(rng.integers(0, 24, 9).astype(np.int32))
    s = dict(stream=stream)
    out = [F.swiglu_gate_cuda(x, g, **s), *F.swiglu_backward_cuda(g, x, x, **s), *F.rmsnorm_backward_cuda(g, x, w, **s),
           *F.layernorm_backward_cuda(g, x, w, w, **s)]
    loss, lse = X.softmax_cross_entropy_cuda(x, targets, return_lse=True, **s)
    out += [loss, lse, X.cross_entropy_backward_cuda(loss, x, targets, lse, **s)]
    out += [EC.embedding_cuda(targets, x, **s), EC.embedding_backward_cuda(x, targets, 30, lo=-3, **s)]
    ws, ms, vs = [x.copy(), w.copy()], [cp.zeros_like(x), cp.zeros_like(w)], [cp.zeros_like(x), cp.zeros_like(w)]
    total = O.sum_squares_multi_cuda([g, w], **s)
    scale = O.clip_scale_multi_cuda([g, w], total, 0.5, **s)
    O.adamw_multi_cuda(ws, [g, w], ms, vs, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, step=1,
                       grad_scale=scale, **s)
    return out + [total, scale] + ws


def test_no_op_synchronizes_with_the_host(monkeypatch):
    from tessera_rt import runtime as rt
    compute = rt.stream("compute")          # a runtime stream: launched on through an ExternalStream
    syncs = []

    def counted(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, **k: (syncs.append(f"{owner.__name__}.{name}"),
                                                                real(self, *a, **k))[1])
    for owner, name in ((cp.cuda.Stream, "synchronize"), (cp.cuda.ExternalStream, "synchronize"),
                        (cp.cuda.Event, "synchronize"), (cp.cuda.Device, "synchronize"), (cp.ndarray, "get"),
                        (cp.ndarray, "item"), (cp.ndarray, "__float__"), (cp.ndarray, "__int__"),
                        (cp.ndarray, "__bool__")):
        counted(owner, name)
    out = _every_op(np.random.default_rng(0)) + _every_op(np.random.default_rng(1), stream=compute)
    assert syncs == [], syncs
    monkeypatch.undo()
    compute.synchronize()
    assert all(np.isfinite(o.get()).all() for o in out if o is not None)


def test_outputs_are_allocated_on_the_launch_stream():
    # on another stream than the current one, every output comes from that stream's pool: the
    # stand-in reports a block reused by the current stream while the launch stream may write it
    other = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    x, g = cp.asarray(rnd(rng, (9, 24), np.float32)), cp.asarray(rnd(rng, (9, 24), np.float32))
    w, targets = cp.asarray(rnd(rng, (24,), np.float32)), cp.asarray(rng.integers(0, 24, 9).astype(np.int32))
    other.wait_event(cp.cuda.get_current_stream().record())
    outs = [F.swiglu_gate_cuda(x, g, stream=other), *F.rmsnorm_backward_cuda(g, x, w, stream=other),
            *X.softmax_cross_entropy_cuda(x, targets, return_lse=True, stream=other),
            EC.embedding_backward_cuda(x, targets, 24, stream=other),
            O.sum_squares_multi_cuda([x, w], stream=other)]
    blocks = {o.data.ptr for o in outs}
    del outs
    fresh = [cp.empty_like(x) for _ in range(8)]
    for f in fresh:
        f.fill(0)
    assert not blocks & {f.data.ptr for f in fresh}
    other.synchronize()
