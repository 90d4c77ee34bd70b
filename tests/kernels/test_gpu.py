"""GPU kernels against the NumPy references (run on the lent GPU machine; skipped without a GPU)."""
import ml_dtypes
import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.kernels.numerics import tolerance


def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:
        return None


cp = _cupy()
BF16 = np.dtype(ml_dtypes.bfloat16)
# the strict CuPy stand-in (tests/gpu_emu): kernels run in the CPU emulation harness
EMULATED = bool(getattr(cp, "__tessera_standin__", False))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]


def rnd(shape, dtype=np.float16, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("tile", [(128, 256, 32), (128, 128, 32), (64, 64, 32), (128, 64, 32), (64, 128, 32),
                                  (64, 64, 64)])
@pytest.mark.parametrize("shape", [(256, 256, 256), (100, 77, 130), (1, 8, 16), (3, 65, 33, 47)])
def test_tile_gemm_matches_reference(tile, shape):
    from tessera_rt.kernels.gemm_cuda import tile_gemm
    *batch, m, k, n = shape
    a, b = rnd(tuple(batch) + (m, k), seed=1), rnd((k, n), seed=2)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for out_dtype in (np.float16, np.float32):
        got = tile_gemm(cp.asarray(a), cp.asarray(b), tile, out_dtype=out_dtype).get()
        rtol, atol = tolerance(out_dtype if out_dtype == np.float16 else np.float16)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol * np.sqrt(k))


def test_tile_gemm_bf16_and_its_dual_forms():
    """bf16 operands: the tile GEMM writes bf16 (or f32), swiglu and dual_matmul run the dual kernel."""
    from tessera_rt.kernels.gemm_cuda import swiglu_cuda, tile_gemm
    a, b = rnd((3, 70, 96), BF16, seed=1), rnd((96, 88), BF16, seed=2)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for out_dtype in (None, np.float32):
        got = tile_gemm(cp.asarray(a), cp.asarray(b), (64, 64, 32), out_dtype=out_dtype)
        assert got.dtype == (BF16 if out_dtype is None else np.float32)
        np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.sqrt(96))
    x, w1, w3 = rnd((2, 50, 64), BF16), rnd((64, 96), BF16, seed=3, scale=0.2), rnd((64, 96), BF16, seed=4, scale=0.2)
    got = swiglu_cuda(cp.asarray(x), cp.asarray(w1), cp.asarray(w3))
    assert got.dtype == BF16
    want = K.swiglu(x.astype(np.float64), w1.astype(np.float64), w3.astype(np.float64))
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=4e-2, atol=4e-2)
    with pytest.raises(TypeError, match="out_dtype float16 for bf16 operands"):
        tile_gemm(cp.asarray(a), cp.asarray(b), (64, 64, 32), out_dtype=np.float16)


def test_matmul_cuda_default_is_cublas_and_tile_is_opt_in():
    from tessera_rt.backend import get_backend
    a, b = rnd((64, 96)), rnd((96, 32))
    fn = get_backend().kernel("matmul")
    for kw in ({}, {"tile_shape": (64, 64, 32)}):
        got = fn(cp.asarray(a), cp.asarray(b), **kw).get()
        np.testing.assert_allclose(got.astype(np.float64), a.astype(np.float64) @ b, rtol=1e-2, atol=5e-2)


def test_swiglu_dual_gemm():
    from tessera_rt.kernels.gemm_cuda import swiglu_cuda
    x, w1, w3 = rnd((2, 50, 64)), rnd((64, 96), seed=3, scale=0.2), rnd((64, 96), seed=4, scale=0.2)
    got = swiglu_cuda(cp.asarray(x), cp.asarray(w1), cp.asarray(w3)).get()
    want = K.swiglu(x.astype(np.float64), w1.astype(np.float64), w3.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)


def test_dual_matmul_one_pass_kernel():
    """The DUAL_OUT tile kernel: (x @ w1, x @ w3) from one pass over x, against NumPy."""
    from tessera_rt.kernels.gemm_cuda import dual_matmul_cuda
    x, w1, w3 = rnd((2, 50, 64)), rnd((64, 96), seed=3, scale=0.2), rnd((64, 96), seed=4, scale=0.2)
    y1, y3 = dual_matmul_cuda(cp.asarray(x), cp.asarray(w1), cp.asarray(w3))
    rtol, atol = tolerance(np.float16)
    for got, w in ((y1, w1), (y3, w3)):
        assert got.shape == (2, 50, 96)
        np.testing.assert_allclose(got.get().astype(np.float64), x.astype(np.float64) @ w, rtol=rtol, atol=atol * 8)


@pytest.mark.parametrize("name", ["swiglu", "dual_matmul"])
@pytest.mark.parametrize("w3_shape, w3_dtype, error", [((48, 20), np.float16, ValueError),
                                                        ((48, 24), np.float32, TypeError)])
def test_swiglu_and_dual_matmul_check_w3_before_the_launch(name, w3_shape, w3_dtype, error):
    """A w3 of another shape or dtype than w1 is refused as the CPU reference refuses it (the
    kernel indexes w3 with w1's shape: it would read past a smaller w3 and return garbage)."""
    from tessera_rt.kernels import gemm_cuda
    x, w1, w3 = rnd((8, 48)), rnd((48, 24), seed=3), rnd(w3_shape, w3_dtype, seed=4)
    with pytest.raises(error) as want:
        getattr(K, name)(x, w1, w3)
    with pytest.raises(error) as got:
        getattr(gemm_cuda, f"{name}_cuda")(cp.asarray(x), cp.asarray(w1), cp.asarray(w3))
    assert str(got.value) == str(want.value)


ATTN = [(2, 4, 4, 128, 128, 64, False), (1, 8, 2, 100, 130, 64, True), (1, 4, 1, 64, 256, 128, True),
        (2, 2, 2, 77, 77, 128, False), (1, 2, 2, 200, 50, 64, True)]


@pytest.mark.parametrize("case", ATTN)
def test_flash_forward(case):
    from tessera_rt.kernels.attention_cuda import flash_attention_cuda
    b, h, hkv, sq, sk, d, causal = case
    q, k, v = rnd((b, h, sq, d), seed=1), rnd((b, hkv, sk, d), seed=2), rnd((b, hkv, sk, d), seed=3)
    o, lse = flash_attention_cuda(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal, return_lse=True)
    wo, wl = K.flash_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                               causal=causal, return_lse=True)
    np.testing.assert_allclose(o.get().astype(np.float64), wo, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse.get(), wl, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ATTN)
def test_flash_backward(case):
    from tessera_rt.kernels.attention_cuda import flash_attention_backward_cuda, flash_attention_cuda
    b, h, hkv, sq, sk, d, causal = case
    q, k, v = rnd((b, h, sq, d), seed=1), rnd((b, hkv, sk, d), seed=2), rnd((b, hkv, sk, d), seed=3)
    do = rnd((b, h, sq, d), seed=4)
    g = [cp.asarray(t) for t in (q, k, v)]
    o, lse = flash_attention_cuda(*g, causal=causal, return_lse=True)
    got = flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=causal)
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o64, l64 = K.flash_attention(q64, k64, v64, causal=causal, return_lse=True)
    want = K.flash_attention_backward(q64, k64, v64, o64, do64, l64, causal=causal)
    for gg, ww in zip(got, want):
        np.testing.assert_allclose(gg.get().astype(np.float64), ww, rtol=3e-2, atol=3e-2)
    again = flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=causal)
    for x, y in zip(got, again):                      # no atomics: bitwise deterministic
        assert cp.array_equal(x, y)


@pytest.mark.parametrize("case", ATTN[1:3])
def test_flash_bf16_forward_and_backward(case):
    """bf16 inputs run the flash kernel at bf16 (bf16 I/O, f32 accumulation), not widened."""
    from tessera_rt.kernels.attention_cuda import flash_attention_backward_cuda, flash_attention_cuda
    b, h, hkv, sq, sk, d, causal = case
    q, k, v, do = (rnd(s, BF16, seed=i) for i, s in enumerate(((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d),
                                                                (b, h, sq, d)), 1))
    g = [cp.asarray(t) for t in (q, k, v)]
    o, lse = flash_attention_cuda(*g, causal=causal, return_lse=True)
    grads = flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=causal)
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o64, l64 = K.flash_attention(q64, k64, v64, causal=causal, return_lse=True)
    want = K.flash_attention_backward(q64, k64, v64, o64, do64, l64, causal=causal)
    assert o.dtype == BF16 and all(x.dtype == BF16 for x in grads)
    np.testing.assert_allclose(o.get().astype(np.float64), o64, rtol=4e-2, atol=4e-2)
    for got, w in zip(grads, want):
        np.testing.assert_allclose(got.get().astype(np.float64), w, rtol=6e-2, atol=6e-2)


@pytest.mark.parametrize("case", ATTN + [(1, 6, 2, 33, 47, 96, True)])
def test_f32_attention_is_f32(case):
    """f32 attention keeps f32: forward, logsumexp and all three gradients within a few ulp-level
    relative errors of float64 (the fp16 kernel it replaced was ~1e-3 off), head dims 64, 96 and
    128 on the f32 flash kernels (3xTF32), GQA, Sq != Sk with the causal mask aligned at the end."""
    from tessera_rt.kernels.attention_cuda import flash_attention_backward_cuda, flash_attention_cuda
    b, h, hkv, sq, sk, d, causal = case
    q, k, v, do = (rnd(s, np.float32, seed=i) for i, s in enumerate(((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d),
                                                                     (b, h, sq, d)), 1))
    g = [cp.asarray(t) for t in (q, k, v)]
    o, lse = flash_attention_cuda(*g, causal=causal, return_lse=True)
    grads = flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=causal)
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o64, l64 = K.flash_attention(q64, k64, v64, causal=causal, return_lse=True)
    want = K.flash_attention_backward(q64, k64, v64, o64, do64, l64, causal=causal)
    for got, w in [(o, o64), (lse, l64), *zip(grads, want)]:
        got = got.get().astype(np.float64)
        assert got.dtype == np.float64 and np.array_equal(np.isfinite(got), np.isfinite(w))
        fin = np.isfinite(w)
        assert np.max(np.abs(got[fin] - w[fin])) <= 2e-6 * max(1.0, np.max(np.abs(w[fin])))
    again = flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=causal)
    for x, y in zip(grads, again):                    # no atomics: bitwise deterministic
        assert cp.array_equal(x, y)


def test_float32_matmul_precision_reaches_gemms_and_attention():
    """"high" (TF32) and "medium" (bf16) trade f32 exactness for tensor cores, each measurably;
    "highest" (the default) keeps f32 (attention in 3xTF32); the profiler record names what
    each kernel ran in."""
    from tessera_rt.kernels import precision
    from tessera_rt.kernels.attention_cuda import flash_attention_cuda
    a, bm = rnd((64, 256), np.float32, seed=1), rnd((256, 64), np.float32, seed=2)
    q, k, v = (rnd((1, 2, 64, 64), np.float32, seed=i) for i in (3, 4, 5))
    want_mm = a.astype(np.float64) @ bm
    want_att = K.flash_attention(*(t.astype(np.float64) for t in (q, k, v)), causal=True)
    seen = []
    listen = lambda op, p: seen.append((op, p))
    precision.add_listener(listen)
    try:
        err = {}
        for level in ("highest", "high", "medium"):
            with precision.float32_matmul_precision(level):
                mm = get_backend_kernel("matmul")(cp.asarray(a), cp.asarray(bm))
                att = flash_attention_cuda(*(cp.asarray(t) for t in (q, k, v)), causal=True)
            assert mm.dtype == np.float32 and att.dtype == np.float32
            err[level] = (np.max(np.abs(mm.get() - want_mm)) / np.max(np.abs(want_mm)),
                          np.max(np.abs(att.get() - want_att)) / np.max(np.abs(want_att)))
    finally:
        precision.remove_listener(listen)
    assert err["highest"][0] < 1e-6 and err["highest"][1] < 1e-6
    assert 1e-5 < err["high"][0] < 3e-3 and 1e-5 < err["high"][1] < 3e-3          # TF32: 10 mantissa bits
    assert err["medium"][0] > err["high"][0] and err["medium"][1] > err["high"][1]  # bf16: 8 mantissa bits
    assert 1e-4 < err["medium"][1] < 3e-2
    assert seen == [("matmul", "f32"), ("flash_attention", "f32"), ("matmul", "tf32"), ("flash_attention", "tf32"),
                    ("matmul", "bf16"), ("flash_attention", "bf16")]


def get_backend_kernel(op):
    from tessera_rt.backend import get_backend
    return get_backend().kernel(op)


def test_flash_rejects_bad_head_dim_before_launch():
    from tessera_rt.kernels.attention import check_attention
    q = cp.zeros((1, 2, 8, 96), np.float16)
    with pytest.raises(ValueError, match="head_dim 96"):
        check_attention("flash_attention", q, q, q, gpu=True)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BF16])
@pytest.mark.parametrize("n", [7, 256, 1000, 4096])
def test_row_kernels(dtype, n):
    from tessera_rt.kernels import rows_cuda as R
    x, w, bb = rnd((33, n), dtype, scale=3), rnd((n,), dtype, seed=5), rnd((n,), dtype, seed=6)
    gx, gw, gb = cp.asarray(x), cp.asarray(w), cp.asarray(bb)
    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), bb.astype(np.float64)
    rtol, atol = tolerance(dtype)
    pairs = [(R.softmax_cuda(gx), K.softmax(x64)), (R.layernorm_cuda(gx, gw, gb), K.layernorm(x64, w64, b64)),
             (R.rmsnorm_cuda(gx, gw), K.rmsnorm(x64, w64)),
             (R.bias_act_cuda(gx, gb, act="gelu"), K.bias_gelu(x64, b64)),
             (R.bias_act_cuda(gx, gb, act="silu"), K.bias_silu(x64, b64))]
    for got, want in pairs:
        assert got.dtype == dtype
        np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=rtol * 4, atol=atol * 8)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BF16])
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 64), (2, 2, 128)])
def test_paged_decode_attention(dtype, h, hkv, d):
    from tessera_rt.kernels.paged_attention_cuda import paged_decode_attention_cuda
    rng = np.random.default_rng(d + h)
    lens, bs, nb = np.array([1, 37, 70], np.int32), 16, 12
    tables = np.full((3, 5), -1, np.int32)
    perm = rng.permutation(nb)
    tables[0, :1], tables[1, :3], tables[2, :5] = perm[:1], perm[1:4], perm[4:9]
    starts = np.array([0, 0, 40], np.int32)                      # a window on the longest: pages 0-1 dropped
    tables[2, :2] = -1
    q, kp, vp = rnd((3, h, d), dtype, seed=1), rnd((nb, hkv, bs, d), dtype, seed=2), rnd((nb, hkv, bs, d), dtype, seed=3)
    got = paged_decode_attention_cuda(cp.asarray(q), cp.asarray(kp), cp.asarray(vp), cp.asarray(tables),
                                      cp.asarray(lens), seq_starts=cp.asarray(starts))
    want = K.paged_decode_attention(q.astype(np.float64), kp.astype(np.float64), vp.astype(np.float64), tables, lens,
                                    seq_starts=starts)
    assert got.dtype == dtype and got.shape == q.shape
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=rtol * 4, atol=atol * 8)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", ["per_tensor", "per_channel"])
def test_fp8_quantize_matches_cpu(fmt, scale):
    from tessera_rt.dtypes import resolve_dtype
    from tessera_rt.kernels.rows_cuda import quantize_fp8_cuda
    x = rnd((64, 48), np.float32, scale=10)
    q, s = quantize_fp8_cuda(cp.asarray(x), fmt, scale=scale)
    qc, sc = K.quantize_fp8(x, fmt, scale=scale)
    np.testing.assert_allclose(s.get(), sc, rtol=1e-6)
    assert np.array_equal(q.get(), qc.view(np.uint8))
    xs = np.full(100_000, 1.0 + 1 / 32, np.float32)
    qs, _ = quantize_fp8_cuda(cp.asarray(xs), fmt, scale=np.float32(1.0), stochastic_round=True, seed=3)
    vals = qs.get().view(resolve_dtype(fmt)).astype(np.float32)
    np.testing.assert_allclose(vals.mean(), 1 + 1 / 32, rtol=3e-3)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_dequantize_bits_matches_cpu(fmt):
    from tessera_rt.kernels.fp8 import dequantize_fp8_bits
    from tessera_rt.kernels.rows_cuda import dequantize_fp8_bits_cuda, quantize_fp8_cuda
    x = rnd((40, 48), np.float32, scale=10)
    q, s = quantize_fp8_cuda(cp.asarray(x), fmt, scale="per_channel", axis=0)     # one scale per row
    got = dequantize_fp8_bits_cuda(q, s, fmt, axis=0).get()
    np.testing.assert_array_equal(got, dequantize_fp8_bits(q.get(), s.get(), fmt, axis=0))
    assert np.abs(got - x).max() <= np.abs(x).max(axis=1).max() * 2 ** -3


@pytest.mark.skipif(EMULATED, reason="Numba tile kernels need the CUDA driver; on the CPU they run in "
                    "Numba's simulator (tests/kernels/sim_tile_kernels.py)")
def test_tile_saxpy_on_gpu(monkeypatch):
    from numba.cuda.cudadrv import driver

    from tessera_rt.kernels.tile_kernels import saxpy_tile, staged_axpy_tile, tiled_matmul_tile
    x, y = cp.arange(10_000, dtype=cp.float32), cp.ones(10_000, cp.float32)
    cp.testing.assert_allclose(saxpy_tile(x, y, 2.0), 2 * x + 1)
    # compiled now: a launch with CuPy arrays makes Numba synchronize no stream on the host
    syncs, real = [], driver.Stream.synchronize
    monkeypatch.setattr(driver.Stream, "synchronize", lambda self: (syncs.append(self), real(self))[1])
    out = saxpy_tile(x, y, 2.0)
    assert syncs == []
    monkeypatch.undo()
    cp.testing.assert_allclose(out, 2 * x + 1)
    cp.testing.assert_allclose(staged_axpy_tile(x, y, 2.0, groups=7), 2 * x + 1)
    a, b = cp.asarray(rnd((100, 70), np.float32)), cp.asarray(rnd((70, 50), np.float32, seed=2))
    cp.testing.assert_allclose(tiled_matmul_tile(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_autotuned_matmul(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    from tessera_rt.kernels.gemm_cuda import tuned_matmul
    n = 128 if EMULATED else 512        # every candidate runs: keep the emulated problem small
    a, b = cp.asarray(rnd((n, n))), cp.asarray(rnd((n, n), seed=2))
    got = tuned_matmul(a, b)
    cp.testing.assert_allclose(got, a @ b, rtol=1e-2, atol=1e-1)
    assert (tmp_path / "autotune.json").exists()


def test_kernels_run_on_runtime_stream():
    from tessera_rt import runtime as rt
    from tessera_rt.kernels.gemm_cuda import tile_gemm
    s = rt.stream("compute")
    a = cp.asarray(rnd((128, 128)))
    c = tile_gemm(a, a, (64, 64, 32), stream=s)
    s.synchronize()
    cp.testing.assert_allclose(c, a @ a, rtol=1e-2, atol=1e-1)


# ---------------------------------------------------------------- the GPU path's defects
# Each test below failed before its fix; on the stand-in they run in the emulation harness.

def test_fp16_matmul_goes_straight_to_cublas(monkeypatch):
    # cupy.matmul already accumulates fp16 in f32 on the tensor cores: widening first costs
    # two copies and turns the HGEMM into an SGEMM
    from tessera_rt.kernels.gemm_cuda import matmul_cuda
    seen = []
    real = cp.matmul
    monkeypatch.setattr(cp, "matmul", lambda a, b, **kw: seen.append((a.dtype, b.dtype)) or real(a, b, **kw))
    a, b = cp.asarray(rnd((32, 48))), cp.asarray(rnd((48, 16), seed=2))
    c = matmul_cuda(a, b)
    assert seen == [(np.float16, np.float16)] and c.dtype == np.float16
    np.testing.assert_allclose(c.get().astype(np.float64), rnd((32, 48)).astype(np.float64) @ rnd((48, 16), seed=2),
                               rtol=1e-2, atol=5e-2)


def test_row_and_fp8_kernels_check_out_and_read_strided_weights():
    from tessera_rt.kernels import rows_cuda as R
    x = cp.asarray(rnd((4, 64)))
    with pytest.raises(ValueError, match="out has shape"):
        R.softmax_cuda(x, out=cp.empty((4, 32), np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        R.softmax_cuda(x, out=cp.empty((64, 4), np.float16).T)
    with pytest.raises(TypeError, match="out has dtype"):
        R.quantize_fp8_cuda(cp.asarray(rnd((4, 64), np.float32)), out=cp.empty((4, 64), np.float32))
    with pytest.raises(ValueError, match="out has shape"):
        R.quantize_fp8_cuda(cp.asarray(rnd((4, 64), np.float32)), out=cp.empty((4, 63), np.uint8))
    w2 = rnd((128,), seed=5)
    got = R.rmsnorm_cuda(x, cp.asarray(w2)[::2])          # a strided weight: read as given, not densely
    want = K.rmsnorm(rnd((4, 64)).astype(np.float64), w2[::2].astype(np.float64))
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=2e-2)


def test_outputs_are_allocated_on_the_launch_stream():
    # an output allocated on the current stream but written on another goes back to the
    # current stream's pool when freed, where the next allocation may reuse it mid-write
    from tessera_rt.kernels import rows_cuda as R
    other = cp.cuda.Stream(non_blocking=True)
    x, w = cp.asarray(rnd((8, 256))), cp.asarray(rnd((256,), seed=1))
    other.wait_event(cp.cuda.get_current_stream().record())     # x and w are ready
    y = R.rmsnorm_cuda(x, w, stream=other)
    block = y.data.ptr
    del y
    z = cp.empty_like(x)                # must not get the block the kernel may still write
    z.fill(0)
    assert z.data.ptr != block, ("rmsnorm_cuda(stream=other) allocated its output on the current stream: the "
                                 "freed block went back to the current stream's arena while the kernel may still write it")
    other.synchronize()
    y = R.rmsnorm_cuda(x, w, stream=other)
    other.synchronize()
    np.testing.assert_allclose(y.get().astype(np.float64), K.rmsnorm(rnd((8, 256)).astype(np.float64),
                                                                     rnd((256,), seed=1).astype(np.float64)),
                               rtol=1e-2, atol=2e-2)


def test_launches_stay_within_the_grid_limits(monkeypatch):
    # CUDA caps gridDim.y/z at 65535; batches past it are launched in slices (made tiny here
    # so the emulator can run them)
    from tessera_rt.kernels import attention_cuda, gemm_cuda
    monkeypatch.setattr(gemm_cuda, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(attention_cuda, "MAX_GRID_YZ", 4)
    a, b = rnd((5, 20, 32), seed=1), rnd((5, 32, 24), seed=2)
    got = gemm_cuda.tile_gemm(cp.asarray(a), cp.asarray(b), (64, 64, 32))
    np.testing.assert_allclose(got.get().astype(np.float64), a.astype(np.float64) @ b, rtol=1e-2, atol=5e-2)
    q, k, v = rnd((3, 2, 20, 64), seed=1), rnd((3, 1, 20, 64), seed=2), rnd((3, 1, 20, 64), seed=3)
    o = attention_cuda.flash_attention_cuda(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True)
    want = K.flash_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    np.testing.assert_allclose(o.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)
    g = [cp.asarray(t) for t in (q, k, v)]
    o, lse = attention_cuda.flash_attention_cuda(*g, causal=True, return_lse=True)
    do = rnd((3, 2, 20, 64), seed=4)
    got = attention_cuda.flash_attention_backward_cuda(*g, o, cp.asarray(do), lse, causal=True)
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o64, l64 = K.flash_attention(q64, k64, v64, causal=True, return_lse=True)
    for gg, ww in zip(got, K.flash_attention_backward(q64, k64, v64, o64, do64, l64, causal=True)):
        np.testing.assert_allclose(gg.get().astype(np.float64), ww, rtol=3e-2, atol=3e-2)


def test_misaligned_views_are_copied_before_vector_loads():
    # a contiguous view starting one half past an aligned address: the kernels' 32-bit and
    # 16-byte loads would fault there
    from tessera_rt.kernels import attention_cuda, gemm_cuda
    def offset_view(a):
        flat = cp.asarray(np.concatenate([np.zeros(1, a.dtype), a.ravel()]))
        return flat[1:].reshape(a.shape)
    a, b = rnd((40, 32), seed=1), rnd((32, 24), seed=2)
    got = gemm_cuda.tile_gemm(offset_view(a), offset_view(b), (64, 64, 32))
    np.testing.assert_allclose(got.get().astype(np.float64), a.astype(np.float64) @ b, rtol=1e-2, atol=5e-2)
    q, k, v = rnd((1, 2, 20, 64), seed=1), rnd((1, 2, 20, 64), seed=2), rnd((1, 2, 20, 64), seed=3)
    o = attention_cuda.flash_attention_cuda(offset_view(q), offset_view(k), offset_view(v))
    want = K.flash_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(o.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_stream_map_keeps_cupy_on_the_compute_stream():
    from tessera_rt import runtime as rt
    try:
        rt.stream("compute"), rt.stream("io")
        rt.set_stream_map({"compute": rt.stream_map()["io"]})      # onto a slot that exists already
        assert cp.cuda.get_current_stream().ptr == rt.stream("compute").ptr
    finally:
        rt.reset()


def test_ordering_events_skip_timing_and_timed_ones_time():
    from tessera_rt import runtime as rt
    s = rt.stream("compute")
    a, b = s.record(), s.record()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):     # cudaEventDisableTiming: cheaper
        cp.cuda.get_elapsed_time(a._event, b._event)
    t0, t1 = s.record(timing=True), s.record(timing=True)
    assert t0.elapsed_ms(t1) >= 0


def test_nccl_refuses_tags_it_cannot_honour():
    from mpi4py import MPI

    from tessera_rt import runtime as rt
    from tessera_rt.dist.comm.nccl import NcclCommunicator
    comm = NcclCommunicator(MPI.COMM_SELF)
    with pytest.raises(ValueError, match="no message tags"):
        comm.send(cp.zeros(4, np.float32), 0, tag=7, stream=rt.stream("compute"))


def test_clipping_and_loss_scaling_stay_on_the_device():
    from tessera_rt import optim
    grads = {"w": cp.asarray(rnd((8, 4), np.float32, scale=10)), "b": cp.asarray(rnd((4,), np.float32))}
    host = {k: v.get().astype(np.float64) for k, v in grads.items()}
    clipped, norm = optim.clip_grad_norm(grads, 1.0)
    assert np.isclose(norm, np.sqrt(sum((h * h).sum() for h in host.values())), rtol=1e-5)
    assert all(isinstance(g, cp.ndarray) for g in clipped.values())
    scaler = optim.DynamicLossScaler(init_scale=4.0)
    unscaled, finite = scaler.unscale(grads)
    assert finite and isinstance(unscaled["w"], cp.ndarray)
    np.testing.assert_allclose(unscaled["w"].get(), host["w"] / 4, rtol=1e-6)
    grads["b"][0] = np.inf
    assert scaler.unscale(grads)[1] is False
