"""op.moe in one process: the forward against the dense NumPy reference (with and without
drops), gradients against central finite differences (f64), the aux statistics and losses,
persistent dispatch buffers, FP8 on the wire, the transport interface, deterministic noisy
gating, the router hooks, and the errors.  The multi-rank checks are tests/moe/mpi_moe.py."""
import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import op
from tessera_rt.moe import Transport, dense_reference

pytestmark = pytest.mark.timeout(120)


def layer(e=6, k=2, cf=None, d=16, f=24, **kw):
    return op.moe(num_experts=e, top_k=k, capacity_factor=cf, d_model=d, d_ff=f, **kw)


def tokens(t=20, d=16, dtype=np.float32, seed=1):
    return np.random.default_rng(seed).standard_normal((t, d)).astype(dtype)


@pytest.mark.parametrize("cf", [None, 3.0, 1.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_forward_matches_dense_reference(cf, k):
    m = layer(k=k, cf=cf)
    p, x = m.init(0), tokens()
    y, aux = m(p, x)
    yr, load, dropped = dense_reference(p, x, k, cf)
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(aux["load"], load)
    assert aux["dropped"] == dropped
    if cf is not None and cf >= 6 / k:
        assert dropped == 0
    if cf == 0.5:
        assert dropped > 0                  # the capacity rule really drops here


def test_capacity_rule_is_gshards():
    from tessera_rt.moe.routing import capacity
    assert capacity(1.25, 20, 2, 6) == 9     # ceil(1.25 * 20 * 2 / 6)
    assert capacity(None, 20, 2, 6) is None


def _fd(f, arr, idx, eps=1e-6):
    old = arr[idx]
    arr[idx] = old + eps
    fp = f()
    arr[idx] = old - eps
    fm = f()
    arr[idx] = old
    return (fp - fm) / (2 * eps)


@pytest.mark.parametrize("cf", [None, 1.0])
def test_gradients_match_finite_differences(cf):
    m = layer(e=5, k=2, cf=cf, d=6, f=7)
    p = {k: v.astype(np.float64) for k, v in m.init(0).items()}
    x = tokens(9, 6, np.float64)
    r = np.random.default_rng(2).standard_normal((9, 6))

    def loss(p, x):
        y, aux = m(p, x)
        return op.add(op.sum(op.mul(y, r)), op.add(aux["balance_loss"], op.mul(aux["z_loss"], 0.1)))

    g = ts.grad(loss, argnums=(0, 1))(p, x)

    def value():
        y, load, _ = dense_reference(p, x, 2, cf)
        logits = x @ p["gate"]
        pr = np.exp(logits - logits.max(1, keepdims=True))
        pr /= pr.sum(1, keepdims=True)
        bal = 5 * np.sum(load / (9 * 2) * pr.mean(0))
        lse = np.log(np.exp(logits).sum(1))
        return (y * r).sum() + bal + 0.1 * np.mean(lse ** 2)

    rng = np.random.default_rng(3)
    for name, arr, ga in [("gate", p["gate"], g[0]["gate"]), ("w1", p["w1"], g[0]["w1"]),
                          ("w3", p["w3"], g[0]["w3"]), ("w2", p["w2"], g[0]["w2"]), ("x", x, g[1])]:
        for _ in range(4):
            idx = tuple(int(rng.integers(s)) for s in arr.shape)
            np.testing.assert_allclose(ga[idx], _fd(value, arr, idx), rtol=1e-5, atol=1e-8, err_msg=name)


def test_dispatch_buffers_are_persistent_and_double_buffered():
    m = layer(cf=1.25)
    p, x = m.init(0), tokens()
    m(p, x)
    m(p, x)
    after_two = m.buffers.allocations
    ids = m.buffers.ids()
    assert ids[0] and ids[1] and not ids[0] & ids[1]     # two distinct sets, used in turn
    for _ in range(4):
        m(p, x)
    assert m.buffers.allocations == after_two           # no allocation per step after the first
    assert m.buffers.ids() == ids


def test_fp8_wire_accuracy():
    m32, m8 = layer(d=64, f=32), layer(d=64, f=32, quantize_fp8=True)
    p, x = m32.init(0), tokens(32, 64)
    y32, _ = m32(p, x)
    y8, _ = m8(p, x)
    rel = np.linalg.norm(y8 - y32) / np.linalg.norm(y32)
    assert 0 < rel < 0.06


class _Recording(Transport):
    """A second transport, at one position: it copies, and records every exchange."""

    def __init__(self, *args, zero=False):
        super().__init__(*args)
        self.calls, self.zero = [], zero

    def exchange(self, buf, split, recv, out):
        self.calls.append((buf.dtype.name, list(split), list(recv)))
        out[...] = 0 if self.zero else buf
        return out


def test_a_new_transport_carries_every_exchange():
    """The dispatcher sends everything through ``layer.transport`` and reads what it returns: a
    Transport subclass set there sees the counts, both forward payloads and both backward
    exchanges, and the results equal the all_to_all transport's.  With one position the counts
    stay on the device (nothing to exchange; the multi-rank suite sees the counts exchange)."""
    with pytest.raises(TypeError):
        Transport("ep", None, 1, 0)                      # exchange is the one method to write
    x, r = tokens(dtype=np.float64), tokens(seed=2, dtype=np.float64)

    def loss(m):
        return lambda p, x: op.sum(op.mul(m(p, x)[0], r))

    for cf, kinds in [(None, ["float64"] * 4), (1.0, ["float64"] * 4)]:
        ref, m = layer(cf=cf), layer(cf=cf)
        m.transport = toy = _Recording("ep", None, 1, 0)
        p = {k: v.astype(np.float64) for k, v in ref.init(0).items()}
        want, got = ts.grad(loss(ref), argnums=(0, 1))(p, x), ts.grad(loss(m), argnums=(0, 1))(p, x)
        for k in p:
            np.testing.assert_array_equal(got[0][k], want[0][k])
        np.testing.assert_array_equal(got[1], want[1])
        assert [c[0] for c in toy.calls] == kinds
        assert all(split == recv for _, split, recv in toy.calls)        # one position: sent == received
    m = layer(quantize_fp8=True)
    m.transport = toy = _Recording("ep", None, 1, 0)
    m(m.init(0), tokens())
    assert [c[0] for c in toy.calls] == ["uint8", "uint8"]               # FP8 rows travel as wire bytes
    m.transport = _Recording("ep", None, 1, 0, zero=True)                # nothing arrives: y is 0
    assert not np.asarray(m(m.init(0), tokens())[0]).any()


def test_noisy_gating_deterministic_and_seeded():
    p, x = layer().init(0), tokens()
    with op.numeric(deterministic=True):
        a, _ = layer(gate="topk_softmax_noisy", seed=7)(p, x)
        b, _ = layer(gate="topk_softmax_noisy", seed=7)(p, x)
        c, _ = layer(gate="topk_softmax_noisy", seed=8)(p, x)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    clean, _ = layer()(p, x)
    assert not np.allclose(a, clean)


def test_router_hook_and_locality_regularizer():
    m = layer()
    p, x = m.init(0), tokens()
    bias = np.zeros(6, np.float32)
    bias[3] = 50.0
    op.set_router(m, lambda logits, meta: op.add(logits, bias))
    y, aux = m(p, x)
    assert aux["load"][3] == 20                          # every token picked expert 3
    yr, _, _ = dense_reference(p, x, 2, None, logits_add=bias)
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)
    op.set_router_regularizer(m, kind="topology_distance", weight=0.5)
    assert m(p, x)[1]["remote_fraction"] == 0.0          # one process: one group, nothing remote


def test_balance_statistics():
    m = layer(e=4, k=1)
    p, x = m.init(0), tokens(64)
    _, aux = m(p, x)
    load = aux["load"]
    assert load.sum() == 64
    assert aux["load_cv"] == pytest.approx(load.std() / load.mean())
    assert float(aux["balance_loss"]) >= 1.0 - 1e-6     # Switch's loss is >= 1, == 1 when balanced


@pytest.mark.parametrize("kw, msg", [
    (dict(e=4, k=5), "top_k must be in 1..num_experts"),
    (dict(cf=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(cf=-1.0), "must be > 0"),
    (dict(gate="hash"), "gate='hash'"),
])
def test_bad_configuration(kw, msg):
    with pytest.raises(ValueError, match=msg):
        layer(**kw)


def test_bad_params_and_tokens():
    m = layer()
    p = m.init(0)
    bad = dict(p, w2=p["w1"])
    with pytest.raises(ValueError, match=r"params\['w2'\] has shape \[6, 16, 24\], expected \[6, 24, 16\]"):
        m(bad, tokens())
    with pytest.raises(ValueError, match="params must be a dict"):
        m({"gate": p["gate"]}, tokens())
    with pytest.raises(ValueError, match=r"expected \(tokens, 16\)"):
        m(p, tokens(d=8))




@pytest.mark.parametrize("budget", [0, 1, 3, 8])
def test_expert_tiers_leave_outputs_and_gradients_unchanged(budget):
    from tessera_rt import runtime as rt
    plain, tiered = layer(e=8, k=1), layer(e=8, k=1)
    tiers = rt.register_prefetch(tiered, window=2, tier_order=["HBM", "Grace"], policy="lru_hotness",
                                 stream="io", budget=budget)
    p = plain.init(0)
    bias = np.array([2.5, 2.0, 0, 0, 0, 0, 0, 0], np.float32)     # a skewed router: experts 0, 1 hot
    for m in (plain, tiered):
        op.set_router(m, lambda logits, meta: op.add(logits, bias))
    for step in range(4):
        x = tokens(12, seed=step)
        y0, _ = plain(p, x)
        y1, _ = tiered(p, x)
        np.testing.assert_array_equal(y0, y1)
        g0 = ts.grad(lambda w: op.sum(plain(w, x)[0]))(p)
        g1 = ts.grad(lambda w: op.sum(tiered(w, x)[0]))(p)
        for k in p:
            np.testing.assert_allclose(g1[k], g0[k], rtol=1e-6, atol=1e-7)
    st = tiers.stats()
    assert len(st["resident"]) <= budget and st["hits"] + st["misses"] > 0
    if budget == 0:
        assert st["hits"] == 0
    if budget == 8:
        assert st["hit_ratio"] > 0.5                  # after the first call everything hot stays


def test_register_prefetch_errors():
    from tessera_rt import runtime as rt
    m = layer()
    with pytest.raises(ValueError, match="policy"):
        rt.register_prefetch(m, policy="fifo")
    with pytest.raises(ValueError, match="tier_order"):
        rt.register_prefetch(m, tier_order=["HBM"])
    with pytest.raises(ValueError, match="stream"):
        rt.register_prefetch(m, stream="disk")


def test_prefetch_ahead_over_a_chain_of_layers():
    """Three layers with different hot experts share a budget of 4: looking one layer ahead
    prefetches the next layer's hot experts on io, which then hit; outputs never change."""
    from tessera_rt import runtime as rt

    def run(window):
        tiered = [layer(e=8, k=1) for _ in range(3)]
        plain = [layer(e=8, k=1) for _ in range(3)]
        tiers = rt.register_prefetch(tiered, window=window, budget=4)
        ps = [m.init(i) for i, m in enumerate(tiered)]
        for i, (m, q) in enumerate(zip(tiered, plain)):
            bias = np.zeros(8, np.float32)
            bias[[2 * i, 2 * i + 1]] = 4.0                # layer i's hot experts: 2i, 2i+1
            for mm in (m, q):
                op.set_router(mm, lambda logits, meta, b=bias: op.add(logits, b))
        for step in range(6):
            x = tokens(32, seed=step)
            for m, q, p in zip(tiered, plain, ps):
                np.testing.assert_array_equal(m(p, x)[0], q(p, x)[0])
        return tiers.stats()

    blind, ahead = run(0), run(1)
    assert blind["prefetched"] == 0 and blind["hit_ratio"] == 0.0    # each layer evicts the last one's
    assert ahead["prefetched"] > 0 and ahead["hits"] > 0 and ahead["hit_ratio"] > blind["hit_ratio"]
    assert len(ahead["resident"]) <= 4
