"""Optional: attention and the norms against PyTorch's CPU implementations.

Skipped, with that reason, when torch is not installed (it is not a dependency; the
float64 NumPy oracles in the other tests are the required check).
"""
import numpy as np
import pytest

import tessera_rt.kernels as K

torch = pytest.importorskip("torch", reason="torch is optional; pip install torch to compare against it")


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_attention_forward_backward_vs_sdpa(causal, heads, d):
    h, hkv = heads
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, h, 24, d)).astype(np.float32)
    k = rng.standard_normal((2, hkv, 24, d)).astype(np.float32)
    v = rng.standard_normal((2, hkv, 24, d)).astype(np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = K.flash_attention(q, k, v, causal=causal, return_lse=True, block_kv=8)
    tq, tk, tv = (t(x).requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=h != hkv)
    np.testing.assert_allclose(o, ref.detach().numpy(), rtol=1e-4, atol=1e-5)
    ref.backward(t(do))
    grads = K.flash_attention_backward(q, k, v, o, do, lse, causal=causal)
    for mine, theirs in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-3, atol=1e-4)


def test_norms_vs_torch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 256)).astype(np.float32) * 3 + 1
    w = rng.standard_normal(256).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    F = torch.nn.functional
    np.testing.assert_allclose(K.layernorm(x, w, b), F.layer_norm(t(x), (256,), t(w), t(b), 1e-5).numpy(),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(K.rmsnorm(x, w), F.rms_norm(t(x), (256,), t(w), 1e-6).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(K.softmax(x), torch.softmax(t(x), -1).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(K.bias_gelu(x, b), F.gelu(t(x) + t(b)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(K.bias_silu(x, b), F.silu(t(x) + t(b)).numpy(), rtol=1e-5, atol=1e-6)
