"""The kernel-table contract the DTensor layer relies on: names, signatures, numerics policy."""
import inspect

import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.backend import get_backend
from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels.numerics import NumericPolicy, accum_dtype, numeric, result_dtype

BF16 = resolve_dtype("bf16")


@pytest.mark.parametrize("name", ["matmul", "softmax", "layernorm", "rmsnorm", "layernorm_safe",
                                  "rmsnorm_safe", "gemm", "swiglu", "flash_attention", "bias_act",
                                  "quantize_fp8", "conv2d_fft"])
def test_registered(name):
    assert callable(get_backend().kernel(name))


def test_signatures():
    def kwonly(fn):
        ps = inspect.signature(fn).parameters
        return {n for n, p in ps.items() if p.kind is p.KEYWORD_ONLY}
    assert {"tile_shape", "out", "stream", "policy"} <= kwonly(get_backend().kernel("matmul"))
    assert {"axis", "out", "stream", "policy"} <= kwonly(get_backend().kernel("softmax"))
    assert {"eps", "out", "stream", "policy"} <= kwonly(get_backend().kernel("layernorm"))
    assert {"eps", "out", "stream", "policy"} <= kwonly(get_backend().kernel("rmsnorm"))
    assert inspect.signature(K.layernorm).parameters["eps"].default == 1e-5
    assert inspect.signature(K.rmsnorm).parameters["eps"].default == 1e-6


def test_all_exports_exist():
    for name in K.__all__:
        assert hasattr(K, name), name


def test_numeric_policy_is_frozen_and_hashable():
    p = numeric(dtype="fp8_e4m3", accum="f32", scale="per_channel", stochastic_round=True,
                deterministic=True)
    assert isinstance(p, NumericPolicy)
    assert p == numeric(dtype="fp8_e4m3", accum="f32", scale="per_channel", stochastic_round=True,
                        deterministic=True)
    assert len({p, numeric(dtype="fp8_e4m3", accum="f32", scale="per_channel",
                           stochastic_round=True, deterministic=True)}) == 1
    with pytest.raises(Exception):
        p.accum = np.float64
    assert p.quantizes and "fp8_e4m3" in repr(p)


def test_numeric_rejects_bad_values():
    with pytest.raises(ValueError, match="accum"):
        numeric(accum="f16")
    with pytest.raises(ValueError, match="scale"):
        numeric(dtype="fp8_e4m3", scale="per_row")
    with pytest.raises(ValueError, match="FP8"):
        numeric(dtype="bf16", scale="per_tensor")
    with pytest.raises(TypeError, match="not a float"):
        numeric(dtype="int8")
    with pytest.raises(TypeError, match="unknown dtype"):
        numeric(dtype="fp5")


def test_policy_dtype_rules():
    assert accum_dtype(BF16) == np.float32
    assert accum_dtype(np.float64) == np.float64
    assert accum_dtype(np.float16, numeric(accum="f64")) == np.float64
    assert result_dtype(BF16) == BF16
    assert result_dtype(np.float32, numeric(dtype="bf16")) == BF16
    assert result_dtype(BF16, numeric(dtype="fp8_e4m3")) == BF16


def test_policy_changes_result_dtype():
    a = np.ones((4, 8), np.float32)
    assert K.matmul(a, a.T, policy=numeric(dtype="bf16")).dtype == BF16
    assert K.softmax(a, policy=numeric(dtype="f16")).dtype == np.float16
    with pytest.raises(TypeError, match="op.numeric"):
        K.matmul(a, a.T, policy="fp8")
