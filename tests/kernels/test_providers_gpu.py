"""Each vendor provider against the NumPy reference (the GPU machine: scripts/gpu_check.sh).

On a GPU with ``nvidia-cudnn-frontend`` / ``nvmath-python`` installed these run the real
libraries; a test whose library is missing (or too old for the GPU) skips with the
provider's reason, which names the library.  On the CuPy stand-in they run against the fake
libraries of tests/gpu_emu/fake_vendor.  Every test also checks, through the precision
notes, that the provider ran: a silent fallback to the own kernel fails it.
"""
import math

import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.backend import get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import providers

from vendor_mocks import (
    FAKE,
    _drop,
    fixture_notes,  # noqa: F401  (a fixture: pytest looks for it in this module)
    gpu_cupy,
)

cp = gpu_cupy()
EMULATED = bool(getattr(cp, "__tessera_standin__", False))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]
BF16 = resolve_dtype("bf16")


@pytest.fixture
def lib(monkeypatch):
    """``lib(op)``: skip unless ``op``'s first provider can run here (the reason names the
    library); the fake libraries stand in on the CuPy stand-in."""
    if EMULATED:
        monkeypatch.syspath_prepend(FAKE)
        _drop(monkeypatch)
    providers.reset()

    def need(op):
        why = providers.providers_for(op)[0].unavailable()
        if why:
            pytest.skip(f"{op}: {why}")
    yield need
    providers.reset()
    if EMULATED:
        _drop()


def rnd(shape, dtype=np.float16, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def f64(*xs):
    return tuple(x.astype(np.float64) for x in xs)


def tol(dtype):
    return (2e-2, 2e-2) if dtype == BF16 else (5e-3, 5e-3)


def ran(notes, op, provider):
    assert notes.of(op), f"{op} made no note"
    assert notes.of(op)[-1][2] == provider, f"{op} ran {notes.of(op)[-1]}, not {provider}"


ATTN = [(1, 4, 4, 128, 128, 64), (2, 8, 2, 64, 192, 128), (1, 4, 1, 96, 96, 96)]


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ATTN)
def test_cudnn_attention_forward(lib, notes, dtype, causal, shape):
    lib("flash_attention")
    b, h, hkv, sq, sk, d = shape
    q, k, v = rnd((b, h, sq, d), dtype, 1), rnd((b, hkv, sk, d), dtype, 2), rnd((b, hkv, sk, d), dtype, 3)
    o, lse = get_backend().kernel("flash_attention")(*(cp.asarray(x) for x in (q, k, v)), causal=causal,
                                                     return_lse=True)
    ran(notes, "flash_attention", "cudnn")
    wo, wl = K.flash_attention(*f64(q, k, v), causal=causal, return_lse=True)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(o.get().astype(np.float64), wo, rtol=rtol, atol=atol)
    np.testing.assert_allclose(lse.get(), wl, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("shape", ATTN[:2])
def test_cudnn_attention_backward(lib, notes, dtype, shape):
    lib("flash_attention_backward")
    b, h, hkv, sq, sk, d = shape
    q, k, v = rnd((b, h, sq, d), dtype, 4), rnd((b, hkv, sk, d), dtype, 5), rnd((b, hkv, sk, d), dtype, 6)
    do = rnd((b, h, sq, d), dtype, 7)
    wo, wl = K.flash_attention(*f64(q, k, v), causal=True, return_lse=True)
    got = get_backend().kernel("flash_attention_backward")(
        *(cp.asarray(x) for x in (q, k, v, wo.astype(dtype), do)), cp.asarray(wl.astype(np.float32)), causal=True)
    ran(notes, "flash_attention_backward", "cudnn")
    want = K.flash_attention_backward(*f64(q, k, v), wo.astype(dtype).astype(np.float64), do.astype(np.float64),
                                      wl, causal=True)
    rtol, atol = tol(dtype)
    for g_, w_ in zip(got, want):
        scale = max(1.0, float(np.abs(w_).max()))
        np.testing.assert_allclose(g_.get().astype(np.float64), w_, rtol=rtol, atol=atol * 2 * scale)


def test_cudnn_lse_drives_the_own_backward(lib):
    """cuDNN's stats are the project's natural-log lse: the own backward accepts them as they are."""
    lib("flash_attention")
    from tessera_rt.kernels.attention_cuda import flash_attention_backward_cuda
    q, k, v, do = (rnd((1, 2, 64, 64), np.float16, s) for s in (8, 9, 10, 11))
    o, lse = get_backend().kernel("flash_attention")(*(cp.asarray(x) for x in (q, k, v)), causal=True,
                                                     return_lse=True)
    got = flash_attention_backward_cuda(*(cp.asarray(x) for x in (q, k, v)), o, cp.asarray(do), lse, causal=True)
    wo, wl = K.flash_attention(*f64(q, k, v), causal=True, return_lse=True)
    want = K.flash_attention_backward(*f64(q, k, v), wo, do.astype(np.float64), wl, causal=True)
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(g_.get().astype(np.float64), w_, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_varlen(lib, notes, causal):
    lib("flash_attention_varlen")
    lq, lk = [17, 64, 1, 40], [17, 80, 9, 40]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = rnd((cq[-1], 8, 128), seed=12), rnd((ck[-1], 2, 128), seed=13), rnd((ck[-1], 2, 128), seed=14)
    got = get_backend().kernel("flash_attention_varlen")(*(cp.asarray(x) for x in (q, k, v)), cq, ck, causal=causal)
    ran(notes, "flash_attention_varlen", "cudnn")
    want = K.flash_attention_varlen(*f64(q, k, v), cq, ck, causal=causal)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_cudnn_paged_decode(lib, notes, dtype):
    lib("paged_decode_attention")
    b, h, hkv, d, bs, mb = 4, 8, 2, 128, 16, 6
    kp, vp = rnd((32, hkv, bs, d), dtype, 15), rnd((32, hkv, bs, d), dtype, 16)
    rng = np.random.default_rng(17)
    tables = rng.permutation(32)[:b * mb].reshape(b, mb).astype(np.int32)
    lens = np.array([1, 17, 96, 50], np.int32)
    tables[0, 1:] = -1
    q = rnd((b, h, d), dtype, 18)
    got = get_backend().kernel("paged_decode_attention")(*(cp.asarray(x) for x in (q, kp, vp, tables, lens)))
    ran(notes, "paged_decode_attention", "cudnn")
    want = K.paged_decode_attention(*f64(q, kp, vp), tables, lens)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
@pytest.mark.parametrize("act,bias", [("relu", True), ("gelu_tanh", True), ("identity", True), ("gelu_tanh", False)])
def test_cublaslt_bias_act(lib, notes, dtype, act, bias):
    lib("matmul_bias_act")
    x, w, bvec = rnd((3, 40, 256), dtype, 19), rnd((256, 192), dtype, 20, 1 / 16), rnd((192,), dtype, 21)
    got = get_backend().kernel("matmul_bias_act")(cp.asarray(x), cp.asarray(w), cp.asarray(bvec) if bias else None,
                                                  act=act)
    ran(notes, "matmul_bias_act", "cublaslt")
    want = K.matmul_bias_act(*f64(x, w), bvec.astype(np.float64) if bias else None, act=act)
    rtol, atol = tol(dtype) if dtype != np.float32 else (1e-4, 1e-4)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=rtol, atol=atol * 4)


@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_cublaslt_fp8(lib, notes, out_dtype):
    lib("matmul_fp8")
    be = get_backend()
    qa, sa = be.kernel("quantize_fp8")(cp.asarray(rnd((128, 256), np.float32, 22)))
    qb, sb = be.kernel("quantize_fp8")(cp.asarray(rnd((256, 192), np.float32, 23)))
    got = be.kernel("matmul_fp8")(qa, qb, sa, sb, out_dtype=out_dtype)
    ran(notes, "matmul_fp8", "cublaslt")
    import ml_dtypes
    want = K.matmul_fp8(qa.get().view(ml_dtypes.float8_e4m3fn), qb.get().view(ml_dtypes.float8_e4m3fn), sa.get(),
                        sb.get())
    rtol = 1e-2 if out_dtype == "bf16" else 1e-4
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=rtol, atol=rtol * math.sqrt(256))
