"""The provider machinery and the new ops' references, on the CPU.

The dispatcher (first available provider that supports the call, else the own kernel, with
the reasons in the note), the switch (``TESSERA_KERNELS=own``, ``use_providers``), the
precision record's provider field (two-argument listeners keep working), the profile line,
``TESSERA_DEBUG=kernels``; and the NumPy references of ``matmul_bias_act``, ``matmul_fp8``
and ``flash_attention_varlen`` against independent float64 formulas.
"""
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.kernels import precision, providers


def rnd(shape, dtype=np.float32, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------- the dispatcher

class Fake(providers.Provider):
    def __init__(self, op, name, why=None, raises=None):
        super().__init__(op)
        self.name, self.why, self.raises, self.calls = name, why, raises, 0

    def unavailable(self):
        return None

    def supports(self, x):
        return self.why

    def run(self, x):
        if self.raises:
            raise providers.Unsupported(self.raises)
        self.calls += 1
        precision.note(self.op, "f16", self.name)
        return ("vendor", x)


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(providers, "REGISTRY", {})
    seen = []
    fn = lambda *a: seen.append(a)
    precision.add_listener(fn)
    yield seen
    precision.remove_listener(fn)


def own_that_notes(x):
    precision.note("op", "f32")
    return ("own", x)


def test_the_first_provider_that_supports_the_call_runs(registry):
    a = providers.register_provider(Fake("op", "a", why="head_dim 100"))
    b = providers.register_provider(Fake("op", "b"))
    assert providers.dispatch("op", own_that_notes, (1,), {}) == ("vendor", 1)
    assert (a.calls, b.calls) == (0, 1) and registry[-1] == ("op", "f16", "b", None)
    c = providers.register_provider(Fake("op", "c"), first=True)
    providers.dispatch("op", own_that_notes, (2,), {})
    assert c.calls == 1 and [p.name for p in providers.providers_for("op")] == ["c", "a", "b"]


def test_the_own_kernel_runs_with_every_reason_in_order(registry):
    providers.register_provider(Fake("op", "a", why="f32 keeps the exact path"))
    providers.register_provider(Fake("op", "b", raises="cuDNN refused the graph"))
    assert providers.dispatch("op", own_that_notes, (3,), {}) == ("own", 3)
    assert registry == [("op", "f32", "own", "a: f32 keeps the exact path; b: cuDNN refused the graph")]


def test_an_own_path_that_records_nothing_is_noted_as_the_reference(registry):
    providers.register_provider(Fake("op", "a", why="no"))
    assert providers.dispatch("op", lambda x: ("ref", x), (4,), {}) == ("ref", 4)
    assert registry == [("op", "reference", "own", "a: no")]


def test_use_providers_switches_and_restores(registry):
    p = providers.register_provider(Fake("op", "a"))
    with K.use_providers(False):
        assert not K.providers_enabled()
        assert providers.dispatch("op", own_that_notes, (5,), {}) == ("own", 5)
        with K.use_providers(True):
            assert providers.dispatch("op", own_that_notes, (6,), {}) == ("vendor", 6)
        assert not K.providers_enabled()
    assert K.providers_enabled() and p.calls == 1
    assert registry[0][2:] == ("own", providers.FORCED_WHY)
    K.use_providers(False)           # a plain call sets it until changed
    assert not K.providers_enabled()
    K.use_providers(True)


def run_python(code, **env):
    e = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"), **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_tessera_kernels_env():
    code = "import tessera_rt.kernels as K; print(K.providers_enabled())"
    assert run_python(code, TESSERA_KERNELS="own").stdout.strip() == "False"
    assert run_python(code, TESSERA_KERNELS="auto").stdout.strip() == "True"
    bad = run_python(code, TESSERA_KERNELS="cudnn-please")
    assert bad.returncode != 0 and "TESSERA_KERNELS='cudnn-please'" in bad.stderr and "'own'" in bad.stderr


def test_tessera_debug_kernels_prints_each_call():
    code = ("from tessera_rt.kernels import precision\n"
            "precision.note('flash_attention', 'bf16', 'cudnn')\n"
            "precision.note('flash_attention', 'f32', 'own', 'cudnn: float32')\n")
    err = run_python(code, TESSERA_DEBUG="kernels").stderr
    assert "[tessera kernels] flash_attention bf16 -> cudnn\n" in err
    assert "[tessera kernels] flash_attention f32 -> own  (cudnn: float32)" in err
    assert "[tessera kernels]" not in run_python(code).stderr
    from tessera_rt.dist.checks.debug import parse_debug
    assert parse_debug("collectives,kernels") == {"collectives"} and parse_debug("kernels") == set()
    with pytest.raises(ValueError, match="'kernels'"):
        parse_debug("kernel")


def test_two_argument_listeners_keep_working():
    got = []
    two = lambda op, prec: got.append((op, prec))
    precision.add_listener(two)
    try:
        precision.note("matmul", "tf32", "cublas")
        with precision.own_kernel_of("matmul", "why"):
            precision.note("matmul", "f32")
    finally:
        precision.remove_listener(two)
    precision.note("matmul", "f32")
    assert got == [("matmul", "tf32"), ("matmul", "f32")]


def test_the_profile_line_names_providers_and_fallbacks():
    from tessera_rt.profiler import Profile
    p = Profile(print_table=False, nvtx=False)
    p._noted("flash_attention", "bf16", "cudnn")
    p._noted("flash_attention", "bf16", "cudnn")
    p._noted("flash_attention", "f32", "own", "cudnn: float32 keeps the exact path")
    p._noted("matmul", "tf32", "cublas")
    p._noted("softmax", "f16")                       # a caller that names no provider
    lines = p._precision_lines("")
    assert lines[0] == ("kernels ran in (rank 0): flash_attention bf16/cudnn x2, f32/own x1; matmul tf32/cublas x1; "
                        "softmax f16 x1")
    assert lines[1] == "  flash_attention: own kernel x1 because cudnn: float32 keeps the exact path"


# --------------------------------------------------------------------------- references

def _act(y, act):
    if act == "relu":
        return np.maximum(y, 0)
    if act == "gelu":
        return 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    if act == "gelu_tanh":
        return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    if act == "silu":
        return y / (1 + np.exp(-y))
    return y


@pytest.mark.parametrize("act", ["identity", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_matmul_bias_act_reference(act, bias):
    x, w, b = rnd((2, 3, 16), seed=1), rnd((16, 8), seed=2), rnd((8,), seed=3)
    want = _act(x.astype(np.float64) @ w.astype(np.float64) + (b if bias else 0), act)
    got = K.matmul_bias_act(x, w, b if bias else None, act=act)
    assert got.shape == (2, 3, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_matmul_bias_act_errors_name_the_problem():
    x, w = rnd((4, 16)), rnd((16, 8))
    with pytest.raises(ValueError, match="matmul_bias_act: act='tanh'"):
        K.matmul_bias_act(x, w, act="tanh")
    with pytest.raises(ValueError, match=r"bias has shape \(16,\), expected \(8,\)"):
        K.matmul_bias_act(x, w, rnd((16,)))
    with pytest.raises(TypeError, match="share a dtype"):
        K.matmul_bias_act(x, w.astype(np.float16))


def _quant(x, fmt, axis=None):
    """FP8 bits and f32 scales, computed here independently of kernels.fp8."""
    dt = ml_dtypes.float8_e4m3fn if fmt == "fp8_e4m3" else ml_dtypes.float8_e5m2
    amax = np.abs(x).max() if axis is None else np.abs(x).max(axis=1 - axis, keepdims=True)
    s = (amax / float(ml_dtypes.finfo(dt).max)).astype(np.float32)
    return (x / s).astype(dt).view(np.uint8), s, dt


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("fmt_b", ["fp8_e4m3", "fp8_e5m2"])
def test_matmul_fp8_reference(per_channel, fmt_b):
    a, b = rnd((8, 32), seed=4), rnd((32, 12), seed=5)
    qa, sa, da = _quant(a, "fp8_e4m3", 0 if per_channel else None)
    qb, sb, db = _quant(b, fmt_b, 1 if per_channel else None)
    want = (qa.view(da).astype(np.float64) * sa) @ (qb.view(db).astype(np.float64) * sb)
    got = K.matmul_fp8(qa, qb, sa, sb, b_format=fmt_b)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, a @ b, rtol=0.3, atol=0.5 * math.sqrt(32))       # FP8 is coarse, not wrong
    via_ml = K.matmul_fp8(qa.view(da), qb.view(db), sa, sb, b_format=fmt_b, out_dtype="bf16")
    np.testing.assert_allclose(via_ml.astype(np.float64), want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(K.matmul_fp8(qa, qb, b_format=fmt_b),
                               qa.view(da).astype(np.float64) @ qb.view(db).astype(np.float64), rtol=1e-5)


def test_matmul_fp8_errors_name_the_problem():
    qa, qb = np.zeros((8, 32), np.uint8), np.zeros((32, 12), np.uint8)
    with pytest.raises(ValueError, match="inner dims differ"):
        K.matmul_fp8(qa, qa)
    with pytest.raises(TypeError, match="out_dtype float64"):
        K.matmul_fp8(qa, qb, out_dtype=np.float64)
    with pytest.raises(ValueError, match=r"a_scale has shape \(3,\)"):
        K.matmul_fp8(qa, qb, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="uint8 bit patterns"):
        K.matmul_fp8(qa.astype(np.float32), qb)


def _packed_oracle(q, k, v, cq, ck, causal):
    """Attention over the whole packed matrix with a block-diagonal (per-sequence causal) mask."""
    tq, h, d = q.shape
    hkv = k.shape[1]
    mask = np.zeros((tq, k.shape[0]), bool)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for i in range(lq):
            hi = i + lk - lq if causal else lk - 1
            mask[cq[b] + i, ck[b]:ck[b] + max(0, min(hi, lk - 1) + 1)] = True
    kk, vv = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk) / math.sqrt(d)
    s = np.where(mask[None], s, -np.inf)
    m = np.where(mask.any(1)[None, :, None], s.max(-1, keepdims=True), 0)
    p = np.where(mask[None], np.exp(s - m), 0)
    p = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    return np.einsum("hij,jhd->ihd", p, vv)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_varlen_reference(causal):
    lq, lk = [3, 5, 0, 2], [3, 7, 2, 2]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = rnd((cq[-1] + 2, 4, 8), np.float64, 1), rnd((ck[-1], 2, 8), np.float64, 2), rnd((ck[-1], 2, 8), np.float64, 3)
    got = K.flash_attention_varlen(q, k, v, cq, ck, causal=causal)
    want = _packed_oracle(q[:cq[-1]], k, v, cq, ck, causal)
    np.testing.assert_allclose(got[:cq[-1]], want, rtol=1e-12, atol=1e-12)
    assert not got[cq[-1]:].any()


def test_flash_attention_varlen_errors_name_the_problem():
    q, k = rnd((5, 2, 8)), rnd((5, 2, 8))
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        K.flash_attention_varlen(q, k, k, np.array([1, 5], np.int32), np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="1-D int32"):
        K.flash_attention_varlen(q, k, k, np.array([0, 5], np.int64), np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="3-D packed"):
        K.flash_attention_varlen(q[None], k, k, np.array([0, 5], np.int32), np.array([0, 5], np.int32))


def test_cpu_kernel_table_has_the_new_ops():
    from tessera_rt.backend import get_backend
    for op in ("matmul_bias_act", "matmul_fp8", "flash_attention_varlen"):
        assert get_backend().kernel(op) is getattr(K, op)
    assert any(line.startswith("flash_attention: cudnn") for line in providers.describe())
