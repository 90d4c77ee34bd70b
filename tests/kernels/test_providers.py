"""Vendor providers at their call boundary: cuDNN attention and cuBLASLt GEMMs, mocked.

On the CuPy stand-in (tests/gpu_emu) with fake ``cudnn`` / ``nvmath`` modules
(tests/gpu_emu/fake_vendor) that record what tessera_rt sends across (graph tensors' dims,
strides and types, the SDPA arguments, ragged offsets, page tables, the stream, the plans)
and compute what the libraries document from the values at the pointers they get.  These
tests check the project's side: what it sends, what it does with what comes back, the
caching, the fallbacks and the notes naming the provider.  tests/kernels/test_providers_gpu.py
runs the real libraries on a GPU.
"""
import math

import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.backend import get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import cublaslt_gemm, cudnn_attention, providers

from vendor_mocks import (
    fixture_compute_type_switch,  # noqa: F401  (a fixture: pytest looks for it in this module)
    fixture_fake_vendor,  # noqa: F401  (a fixture)
    fixture_notes,  # noqa: F401  (a fixture)
    standin_cupy,
)

cp = standin_cupy()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cp is None, reason="the vendor mocks run on the CuPy stand-in (tests/gpu_emu on "
                                 "PYTHONPATH); on a GPU, tests/kernels/test_providers_gpu.py checks the real libraries")]
BF16 = resolve_dtype("bf16")


def rnd(shape, dtype=np.float16, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def f64(*xs):
    return tuple(x.astype(np.float64) for x in xs)


def kernel(op):
    return get_backend().kernel(op)


def graph_of(cudnn, name):
    return [g for g in cudnn.LOG["graphs"] if g.op is not None and g.op[1].get("name") == name]


def tensor(g, name):
    return next(t for t in g.tensors if t.name == name)


# --------------------------------------------------------------------------- attention forward / backward

@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("h,hkv,sq,sk,causal", [(4, 4, 16, 16, True), (8, 2, 5, 9, True), (4, 2, 7, 7, False)])
def test_forward_sends_bhsd_bottom_right_causal_and_natural_lse(fake_vendor, notes, dtype, h, hkv, sq, sk, causal):
    b, d = 2, 64
    q, k, v = rnd((b, h, sq, d), dtype, 1), rnd((b, hkv, sk, d), dtype, 2), rnd((b, hkv, sk, d), dtype, 3)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:          # the inputs are written on this stream: reading them elsewhere is a race the stand-in reports
        g = [cp.asarray(x) for x in (q, k, v)]
    o, lse = kernel("flash_attention")(*g, causal=causal, return_lse=True, stream=stream)
    stream.synchronize()
    want_o, want_lse = K.flash_attention(*f64(q, k, v), causal=causal, return_lse=True)
    np.testing.assert_allclose(o.get().astype(np.float64), want_o, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse.get(), want_lse, rtol=1e-5, atol=1e-5)   # cuDNN's stats are the natural-log lse
    assert o.dtype == dtype and lse.shape == (b, h, sq) and lse.dtype == np.float32

    (graph,) = graph_of(fake_vendor.cudnn, "sdpa")
    args = graph.op[1]
    assert args["attn_scale"] == pytest.approx(1 / math.sqrt(d))          # cuDNN's default would be 1
    if causal:
        assert args["diagonal_alignment"] == fake_vendor.cudnn.diagonal_alignment.BOTTOM_RIGHT
        assert args["diagonal_band_right_bound"] == 0
    else:
        assert "diagonal_band_right_bound" not in args and "use_causal_mask" not in args
    assert args["generate_stats"] is True
    assert tensor(graph, "q").dim == [b, h, sq, d] and tensor(graph, "q").stride == [h * sq * d, sq * d, d, 1]
    assert tensor(graph, "k").dim == [b, hkv, sk, d]                     # grouped-query heads as they are
    assert args["stats"].dim == [b, h, sq, 1] and args["stats"].stride == [h * sq, sq, 1, 1]
    io = fake_vendor.cudnn.data_type.HALF if dtype == np.float16 else fake_vendor.cudnn.data_type.BFLOAT16
    assert graph.io == io and args["stats"].data_type == fake_vendor.cudnn.data_type.FLOAT
    (run,) = fake_vendor.cudnn.LOG["executions"]
    assert run["stream"] == stream.ptr, "cuDNN must run on the caller's stream"
    assert fake_vendor.cudnn.LOG["set_stream"][-1] == (run["handle"], stream.ptr)
    assert notes.of("flash_attention") == [("flash_attention", "f16" if dtype == np.float16 else "bf16", "cudnn", None)]


def test_a_graph_is_built_once_per_configuration(fake_vendor):
    q = cp.asarray(rnd((1, 2, 8, 64)))
    fa = kernel("flash_attention")
    before = cudnn_attention.graph_cache_info()["builds"]
    fa(q, q, q, causal=True)
    for _ in range(3):
        fa(q, q, q, causal=True)
    assert cudnn_attention.graph_cache_info()["builds"] == before + 1
    assert len(fake_vendor.cudnn.LOG["graphs"]) == 1 and len(fake_vendor.cudnn.LOG["executions"]) == 4
    fa(q, q, q, causal=False)                                          # another configuration: one more graph
    fa(cp.asarray(rnd((1, 2, 16, 64))), q, q)
    assert cudnn_attention.graph_cache_info()["builds"] == before + 3
    assert cudnn_attention.graph_cache_info()["graphs"] == 3


@pytest.mark.parametrize("h,hkv,sq,sk", [(4, 4, 8, 8), (8, 2, 6, 10)])
def test_backward_runs_cudnn_deterministic_with_grouped_heads(fake_vendor, notes, h, hkv, sq, sk):
    b, d = 1, 64
    q, k, v = rnd((b, h, sq, d), seed=4), rnd((b, hkv, sk, d), seed=5), rnd((b, hkv, sk, d), seed=6)
    do = rnd((b, h, sq, d), seed=7)
    o, lse = K.flash_attention(*f64(q, k, v), causal=True, return_lse=True)
    got = kernel("flash_attention_backward")(*(cp.asarray(x) for x in (q, k, v, o.astype(np.float16), do)),
                                             cp.asarray(lse), causal=True)
    want = K.flash_attention_backward(*f64(q, k, v), o, do.astype(np.float64), lse, causal=True)
    for g_, w_ in zip(got, want):
        assert g_.dtype == np.float16 and g_.shape == w_.shape
        np.testing.assert_allclose(g_.get().astype(np.float64), w_, rtol=2e-2, atol=2e-2)
    (graph,) = graph_of(fake_vendor.cudnn, "sdpa_backward")
    args = graph.op[1]
    assert args["use_deterministic_algorithm"] is True
    assert args["diagonal_alignment"] == fake_vendor.cudnn.diagonal_alignment.BOTTOM_RIGHT
    assert tensor(graph, "dK").dim == [b, hkv, sk, d] and tensor(graph, "stats").dim == [b, h, sq, 1]
    assert notes.of("flash_attention_backward")[-1][2] == "cudnn"


# --------------------------------------------------------------------------- varlen and paged

def test_varlen_sends_ragged_offsets_and_lengths(fake_vendor, notes):
    lq, lk = [3, 5, 1, 4], [3, 7, 4, 4]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    h, hkv, d = 4, 2, 64
    q, k, v = rnd((cq[-1] + 2, h, d), seed=8), rnd((ck[-1], hkv, d), seed=9), rnd((ck[-1], hkv, d), seed=10)
    got = kernel("flash_attention_varlen")(cp.asarray(q), cp.asarray(k), cp.asarray(v), cq, ck, causal=True)
    want = K.flash_attention_varlen(*f64(q, k, v), cq, ck, causal=True)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)
    assert not got.get()[cq[-1]:].any(), "rows past the last sequence are 0"
    (graph,) = graph_of(fake_vendor.cudnn, "sdpa_varlen")
    args, (run,) = graph.op[1], fake_vendor.cudnn.LOG["executions"]
    assert tensor(graph, "q").dim == [4, h, 64, d] and tensor(graph, "q").stride[1:] == [d, h * d, 1]
    assert tensor(graph, "q").ragged is tensor(graph, "q_offsets") and args["o"].ragged is tensor(graph, "q_offsets")
    assert tensor(graph, "k").ragged is tensor(graph, "kv_offsets")
    np.testing.assert_array_equal(run["read"]["q_offsets"].ravel(), cq.astype(np.int64) * h * d)
    np.testing.assert_array_equal(run["read"]["kv_offsets"].ravel(), ck.astype(np.int64) * hkv * d)
    np.testing.assert_array_equal(run["read"]["seq_len_q"].ravel(), lq)
    np.testing.assert_array_equal(run["read"]["seq_len_kv"].ravel(), lk)
    assert args["use_padding_mask"] is True and args["diagonal_band_right_bound"] == 0
    assert notes.of("flash_attention_varlen")[-1][2] == "cudnn"


def test_paged_decode_sends_page_tables_and_lengths(fake_vendor, notes):
    b, h, hkv, d, bs = 3, 4, 2, 64, 4
    kp, vp = rnd((10, hkv, bs, d), seed=11), rnd((10, hkv, bs, d), seed=12)
    tables = np.array([[2, 5, -1], [0, 1, 3], [7, -1, -1]], np.int32)
    lens = np.array([6, 12, 3], np.int32)
    q = rnd((b, h, d), seed=13)
    got = kernel("paged_decode_attention")(*(cp.asarray(x) for x in (q, kp, vp, tables, lens)))
    want = K.paged_decode_attention(*f64(q, kp, vp), tables, lens)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)
    (graph,) = graph_of(fake_vendor.cudnn, "sdpa_paged_decode")
    args, (run,) = graph.op[1], fake_vendor.cudnn.LOG["executions"]
    assert tensor(graph, "k").dim == [10, hkv, bs, d] and tensor(graph, "k_table").dim == [b, 1, 3, 1]
    assert args["paged_attention_max_seq_len_kv"] == 3 * bs
    assert (run["read"]["k_table"] >= 0).all(), "-1 entries past a sequence are never page indices for cuDNN"
    np.testing.assert_array_equal(run["read"]["seq_len_kv"].ravel(), lens)
    np.testing.assert_array_equal(run["read"]["seq_len_q"].ravel(), 1)
    assert notes.of("paged_decode_attention")[-1][2] == "cudnn"


# --------------------------------------------------------------------------- fallbacks and the switch

def _attention(dtype=np.float16, d=64):
    return [cp.asarray(rnd((1, 2, 8, d), dtype, s)) for s in (1, 2, 3)]


@pytest.mark.parametrize("case,reason", [
    ("head_dim", "head_dim 100"),
    ("not_installed", "nvidia-cudnn-frontend is not installed"),
    ("old_cudnn", "older than"),
    ("refused", "cuDNN refused the graph"),
    ("policy", "NumericPolicy"),
])
def test_attention_falls_back_to_the_own_kernel_and_says_why(fake_vendor, notes, monkeypatch, case, reason):
    d = 100 if case == "head_dim" else 64
    q, k, v = _attention(d=d)
    kw = {}
    if case == "not_installed":
        monkeypatch.setitem(__import__("sys").modules, "cudnn", None)        # import cudnn -> ImportError
    elif case == "old_cudnn":
        fake_vendor.cudnn.CONFIG["version"] = 90000
    elif case == "refused":
        fake_vendor.cudnn.CONFIG["refuse"] = lambda graph: "no engine for this configuration"
    elif case == "policy":
        kw["policy"] = K.numeric(accum="f32")
    got = kernel("flash_attention")(q, k, v, causal=True, **kw)
    want = K.flash_attention(*(f64(*(x.get() for x in (q, k, v)))), causal=True)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)
    assert not fake_vendor.cudnn.LOG["executions"]
    op, prec, provider, why = notes.of("flash_attention")[-1]
    assert provider == "own" and why.startswith("cudnn: ") and reason in why, why
    if case == "refused":        # a refused configuration is remembered: no second build
        kernel("flash_attention")(q, k, v, causal=True)
        assert len(fake_vendor.cudnn.LOG["graphs"]) == 1 and cudnn_attention.graph_cache_info()["refused"] == 1


def test_f32_keeps_the_own_f32_kernels(fake_vendor, notes, compute_type_switch):
    q, k, v = (x.astype(np.float32) for x in _attention())
    kernel("flash_attention")(q, k, v)
    assert not fake_vendor.cudnn.LOG["executions"]
    (note,) = notes.of("flash_attention")
    assert note[:3] == ("flash_attention", "f32", "own") and "float32" in note[3]


def test_f32_at_medium_precision_runs_cudnn_in_bf16(fake_vendor, notes):
    q, k, v = (x.astype(np.float32) for x in _attention())
    try:
        cp.zeros((1,), np.float32).astype(BF16)
    except TypeError as exc:
        pytest.skip(f"the stand-in models CuPy 13, which has no bf16 casts ({exc}); CuPy 14 has")
    with K.precision.float32_matmul_precision("medium"):           # bf16 allowed: cuDNN in bf16
        o = kernel("flash_attention")(q, k, v)
    assert o.dtype == np.float32 and notes.of("flash_attention")[-1][1:3] == ("bf16", "cudnn")


def test_the_switch_forces_the_own_kernels(fake_vendor, notes):
    q, k, v = _attention()
    assert K.providers_enabled()
    with K.use_providers(False):
        assert not K.providers_enabled()
        kernel("flash_attention")(q, k, v)
        kernel("matmul_bias_act")(q[0, 0], cp.asarray(rnd((64, 16))), cp.asarray(rnd(16)), act="relu")
    assert K.providers_enabled()
    assert not fake_vendor.cudnn.LOG["executions"] and not fake_vendor.nvmath.LOG["execute"]
    for op in ("flash_attention", "matmul_bias_act"):
        assert notes.of(op)[-1][2] == "own" and "TESSERA_KERNELS=own" in notes.of(op)[-1][3]
    kernel("flash_attention")(q, k, v)
    assert notes.of("flash_attention")[-1][2] == "cudnn"


def test_paged_sliding_window_stays_on_the_own_kernel(fake_vendor, notes):
    b, h, d, bs = 2, 2, 64, 4
    kp, vp = rnd((6, 1, bs, d), seed=1), rnd((6, 1, bs, d), seed=2)
    tables, lens, starts = np.array([[0, 1, 2], [3, 4, 5]], np.int32), np.array([9, 12], np.int32), \
        np.array([4, 0], np.int32)
    q = rnd((b, h, d), seed=3)
    got = kernel("paged_decode_attention")(*(cp.asarray(x) for x in (q, kp, vp, tables, lens)),
                                           seq_starts=cp.asarray(starts))
    want = K.paged_decode_attention(*f64(q, kp, vp), tables, lens, seq_starts=starts)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=1e-2)
    assert notes.of("paged_decode_attention")[-1][2] == "own" and "sliding window" in notes.of("paged_decode_attention")[-1][3]


# --------------------------------------------------------------------------- cuBLASLt

@pytest.mark.parametrize("act,bias,epilog", [("relu", True, "RELU_BIAS"), ("gelu_tanh", True, "GELU_BIAS"),
                                             ("identity", True, "BIAS"), ("relu", False, "RELU")])
def test_bias_act_fuses_the_epilogue_through_the_transposed_product(fake_vendor, notes, act, bias, epilog):
    x, w, bvec = rnd((2, 5, 32), seed=1), rnd((32, 48), seed=2, scale=0.3), rnd((48,), seed=3)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        args = [cp.asarray(x), cp.asarray(w), cp.asarray(bvec) if bias else None]
    got = kernel("matmul_bias_act")(*args, act=act, stream=stream)
    stream.synchronize()
    want = K.matmul_bias_act(*f64(x, w), bvec.astype(np.float64) if bias else None, act=act)
    assert got.shape == (2, 5, 48) and got.dtype == np.float16 and got.flags.c_contiguous
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=2e-2)
    log = fake_vendor.nvmath.LOG
    (init,) = log["init"]
    assert init["a"][0] == (48, 32) and init["a"][1] == (2, 96), "A is w^T, a column-major view (no copy)"
    assert init["b"][0] == (32, 10) and init["b"][1] == (2, 64), "B is x^T, a column-major view (no copy)"
    assert log["plan"][0]["epilog"] == epilog and log["plan"][0]["bias"] == (((48,), (2,), "float16") if bias else None)
    assert log["execute"][0]["stream"] == stream.ptr
    assert log["reset"][-1] == "released", "the plan cache must not keep the operands alive"
    planned = cublaslt_gemm.plan_cache_info()["planned"]
    kernel("matmul_bias_act")(*args, act=act, stream=stream)
    assert len(log["init"]) == 1 and cublaslt_gemm.plan_cache_info()["planned"] == planned, "one plan per shape"
    assert notes.of("matmul_bias_act")[-1] == ("matmul_bias_act", "f16", "cublaslt", None)


@pytest.mark.parametrize("level,compute", [("highest", "COMPUTE_32F"), ("high", "COMPUTE_32F_FAST_TF32")])
def test_f32_bias_act_asks_cublaslt_for_the_precision_level(fake_vendor, notes, level, compute):
    x, w, bvec = rnd((6, 32), np.float32, 1), rnd((32, 16), np.float32, 2), rnd((16,), np.float32, 3)
    with K.precision.float32_matmul_precision(level):
        got = kernel("matmul_bias_act")(cp.asarray(x), cp.asarray(w), cp.asarray(bvec), act="relu")
    np.testing.assert_allclose(got.get(), K.matmul_bias_act(*f64(x, w, bvec), act="relu"), rtol=1e-5, atol=1e-5)
    assert fake_vendor.nvmath.LOG["init"][0]["options"]["compute_type"].name == compute
    assert notes.of("matmul_bias_act")[-1][1:3] == ("f32" if level == "highest" else "tf32", "cublaslt")


@pytest.mark.parametrize("act,reason", [("gelu", "tanh approximation"), ("silu", "no SiLU")])
def test_bias_act_without_a_matching_epilogue_runs_matmul_then_the_row_kernel(fake_vendor, notes, act, reason):
    x, w, bvec = rnd((4, 32), seed=1), rnd((32, 16), seed=2, scale=0.3), rnd((16,), seed=3)
    got = kernel("matmul_bias_act")(cp.asarray(x), cp.asarray(w), cp.asarray(bvec), act=act)
    want = K.matmul_bias_act(*f64(x, w, bvec), act=act)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=1e-2, atol=2e-2)
    assert not fake_vendor.nvmath.LOG["execute"]
    op, _, provider, why = notes.of("matmul_bias_act")[-1]
    assert provider == "own" and reason in why
    assert notes.of("matmul")[-1][2] == "cublas"


def _fp8_operands(m=32, k=64, n=48, seed=0):
    be = get_backend()
    a, b = rnd((m, k), np.float32, seed), rnd((k, n), np.float32, seed + 1)
    qa, sa = be.kernel("quantize_fp8")(cp.asarray(a))
    qb, sb = be.kernel("quantize_fp8")(cp.asarray(b))
    return qa, qb, sa, sb


def _fp8_want(qa, qb, sa, sb, fmt_b="fp8_e4m3"):
    import ml_dtypes
    fb = ml_dtypes.float8_e4m3fn if fmt_b == "fp8_e4m3" else ml_dtypes.float8_e5m2
    return K.matmul_fp8(qa.get().view(ml_dtypes.float8_e4m3fn), qb.get().view(fb),
                        None if sa is None else sa.get(), None if sb is None else sb.get(), b_format=fmt_b)


@pytest.mark.parametrize("out_dtype", ["f32", "f16"])
def test_fp8_gemm_sends_tn_layout_and_device_scales(fake_vendor, notes, out_dtype):
    qa, qb, sa, sb = _fp8_operands()
    got = kernel("matmul_fp8")(qa, qb, sa, sb, out_dtype=out_dtype)
    want = _fp8_want(qa, qb, sa, sb)
    assert got.dtype == resolve_dtype(out_dtype)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=2e-3 if out_dtype == "f16" else 1e-5,
                               atol=1e-3)
    (init,) = fake_vendor.nvmath.LOG["init"]
    assert init["fp8"] and init["a"][2] == init["b"][2] == "float8_e4m3fn"
    assert init["b"][1] == (1, 64), "B column-major (cuBLASLt's FP8 layout)"
    assert init["scales"] == {"a": "device f32[1]", "b": "device f32[1]"}
    assert notes.of("matmul_fp8")[-1] == ("matmul_fp8", "fp8", "cublaslt", None)


@pytest.mark.parametrize("case,reason", [("no_scales", "without scales"), ("per_channel", "per-channel"),
                                         ("e5m2", "e5m2 x e5m2"), ("ragged", "multiples of 16")])
def test_fp8_cases_cublaslt_does_not_take_fall_back(fake_vendor, notes, compute_type_switch, case, reason):
    be = get_backend()
    qa, qb, sa, sb = _fp8_operands(m=24 if case == "ragged" else 32)
    kw = {}
    if case == "no_scales":
        sa = sb = None
    elif case == "per_channel":
        qb, sb = be.kernel("quantize_fp8")(cp.asarray(rnd((64, 48), np.float32, 5)), scale="per_channel", axis=-1)
    elif case == "e5m2":
        qa, sa = be.kernel("quantize_fp8")(cp.asarray(rnd((32, 64), np.float32, 6)), "fp8_e5m2")
        qb, sb = be.kernel("quantize_fp8")(cp.asarray(rnd((64, 48), np.float32, 7)), "fp8_e5m2")
        kw = dict(a_format="fp8_e5m2", b_format="fp8_e5m2")
    got = kernel("matmul_fp8")(qa, qb, sa, sb, **kw)
    import ml_dtypes
    fa = ml_dtypes.float8_e5m2 if case == "e5m2" else ml_dtypes.float8_e4m3fn
    want = K.matmul_fp8(qa.get().view(fa), qb.get().view(fa), None if sa is None else sa.get(),
                        None if sb is None else sb.get(), **kw)
    np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-4)
    assert not fake_vendor.nvmath.LOG["execute"]
    op, prec, provider, why = notes.of("matmul_fp8")[-1]
    assert provider == "own" and prec == "f32" and reason in why, why


def test_nvmath_missing_falls_back_with_the_install_hint(fake_vendor, notes, monkeypatch):
    import sys
    for name in [n for n in sys.modules if n.split(".")[0] == "nvmath"]:
        monkeypatch.setitem(sys.modules, name, None)
    providers.reset()
    x, w, bvec = rnd((4, 32), seed=1), rnd((32, 16), seed=2), rnd((16,), seed=3)
    kernel("matmul_bias_act")(cp.asarray(x), cp.asarray(w), cp.asarray(bvec), act="relu")
    why = notes.of("matmul_bias_act")[-1][3]
    assert "nvmath-python is not installed" in why and "tessera_rt[cuda13]" in why


# --------------------------------------------------------------------------- what a person sees

def test_debug_lines_and_the_profile_name_the_provider(fake_vendor, capsys):
    from tessera_rt.profiler import Profile
    providers.set_debug(True)
    try:
        with Profile(print_table=False, nvtx=False) as prof:
            q, k, v = _attention()          # made on the stream the profile runs (the compute stream)
            kernel("flash_attention")(q, k, v)
            kernel("flash_attention")(*_attention(d=100))
    finally:
        providers.set_debug(False)
    err = capsys.readouterr().err
    assert "[tessera kernels] flash_attention f16 -> cudnn" in err
    assert "[tessera kernels] flash_attention reference -> own  (cudnn: head_dim 100" in err
    lines = "\n".join(prof._precision_lines(""))
    assert "flash_attention f16/cudnn x1" in lines and "reference/own x1" in lines
    assert "flash_attention: own kernel x1 because cudnn: head_dim 100" in lines
    assert any("flash_attention: cudnn (available)" in s for s in providers.describe())
