"""Modules and optimizers on plain arrays (one process): AdamW/SGD against their formulas,
f32 masters for bf16 parameters, global-norm clipping, dynamic loss scaling, errors, and
(optional, with torch installed) the transformer's gradients against torch.autograd."""
import math

import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import nn, optim


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_adamw_matches_formula():
    w0, g = rand(3, 4, seed=1), rand(3, 4, seed=2)
    opt = optim.AdamW({"w": w0}, lr=0.1, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    p = {"w": w0}
    m = v = np.zeros_like(w0, np.float64)
    w = w0.astype(np.float64)
    for t in range(1, 4):
        p = opt.step(p, {"w": g * t})
        gt = g.astype(np.float64) * t
        m = 0.8 * m + 0.2 * gt
        v = 0.9 * v + 0.1 * gt * gt
        w = w * (1 - 0.1 * 0.1) - 0.1 * (m / (1 - 0.8 ** t)) / (np.sqrt(v / (1 - 0.9 ** t)) + 1e-8)
    np.testing.assert_allclose(p["w"], w, rtol=1e-5)
    assert p["w"] is not w0 and np.array_equal(w0, rand(3, 4, seed=1))     # the input is not mutated


def test_adamw_runs_one_fused_pass_per_parameter_with_the_formulas_bits(monkeypatch):
    """On the CPU each f32 parameter's AdamW update is one fused kernel call (not NumPy's ~12
    passes), and its bits equal the NumPy formula's, with and without weight decay; a
    non-contiguous gradient takes the formula."""
    from tessera_rt.kernels import cpu_fused
    params = {"w": rand(64, 48, seed=11), "b": rand(48, seed=12), "s": rand(3, 5, seed=13)}
    grads = [{k: rand(*v.shape, seed=20 + t + i) for i, (k, v) in enumerate(params.items())} for t in range(3)]
    grads[2]["s"] = np.asfortranarray(grads[2]["s"])
    calls = []
    adamw_step = cpu_fused.adamw_step

    def fused(*a, **k):
        done = adamw_step(*a, **k)
        calls.append(done)
        return done
    for wd in (0.1, 0.0):
        got = {}
        for kernel in (fused, lambda *a, **k: False):
            monkeypatch.setattr(cpu_fused, "adamw_step", kernel)
            opt, p = optim.AdamW(params, lr=1e-2, weight_decay=wd), params
            for g in grads:
                p = opt.step(p, g)
            got[kernel is fused] = (p, opt.m, opt.v)
        for a, b in zip(got[True], got[False]):
            for x, y in zip(a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b):
                assert np.array_equal(x, y)
    assert calls == ([True] * 8 + [False]) * 2, calls


def test_sgd_momentum():
    w0, g = rand(5, seed=3), rand(5, seed=4)
    opt = optim.SGD([w0], lr=0.5, momentum=0.9, weight_decay=0.0)
    p = opt.step(opt.step([w0], [g]), [g])
    np.testing.assert_allclose(p[0], w0 - 0.5 * g - 0.5 * (0.9 * g + g), rtol=1e-6)


def test_bf16_params_keep_f32_masters():
    w = np.full(4, 1.0, np.float32).astype("bfloat16")
    opt = optim.SGD({"w": w}, lr=1e-3)
    p = {"w": w}
    for _ in range(10):
        p = opt.step(p, {"w": np.ones(4, np.float32).astype("bfloat16")})
    # each update (1e-3) is below bf16's resolution at 1.0 (2^-7); the master accumulates them
    assert p["w"].dtype == w.dtype
    np.testing.assert_allclose(opt.masters[0], 0.99, rtol=1e-6)
    np.testing.assert_allclose(p["w"].astype(np.float32), 0.98828125)      # bf16(0.99)


def test_clip_grad_norm():
    g = {"a": np.full(3, 2.0, np.float32), "b": np.full(1, 4.0, np.float32)}
    assert math.isclose(optim.global_norm(g), math.sqrt(12 + 16))
    c, n = optim.clip_grad_norm(g, 1.0)
    assert math.isclose(optim.global_norm(c), 1.0, rel_tol=1e-5) and math.isclose(n, math.sqrt(28))
    same, _ = optim.clip_grad_norm(g, 100.0)
    assert same is g
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        optim.clip_grad_norm(g, 0)


def test_adamw_and_clip_update_in_place_and_allocate_nothing_per_step():
    import tracemalloc
    params = {"w": rand(256, 256, seed=5), "b": rand(256, seed=6)}
    opt = optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    p = opt.step(params, {"w": rand(256, 256, seed=7), "b": rand(256, seed=8)})     # makes its scratch
    optim.global_norm({"w": params["w"]})
    g = {"w": rand(256, 256, seed=9), "b": rand(256, seed=10)}
    expect = {k: v * (1.0 / (optim.global_norm(g) + 1e-6)) for k, v in g.items()}
    sgd = optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    s = sgd.step(params, g)
    tracemalloc.start()
    try:
        s = sgd.step(s, g)
        sgd_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        c, _ = optim.clip_grad_norm(g, 1.0, in_place=True)
        q = opt.step(p, c)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024, f"a step of a 256 KiB parameter allocated {peak} bytes"
    assert sgd_peak < 16 * 1024, f"an SGD step of a 256 KiB parameter allocated {sgd_peak} bytes"
    assert c["w"] is g["w"] and q["w"] is p["w"]
    np.testing.assert_allclose(c["w"], expect["w"], rtol=1e-6)
    # leaves sharing a buffer, or read-only (broadcast) ones, are scaled into new arrays, once each
    shared = np.full(4, 3.0, np.float32)
    c, n = optim.clip_grad_norm({"a": shared, "b": shared, "c": np.broadcast_to(np.float32(3.0), (4,))}, 1.0,
                                in_place=True)
    np.testing.assert_allclose([c["a"], c["b"], c["c"]], np.full((3, 4), 3.0 / n), rtol=1e-6)
    assert np.array_equal(shared, np.full(4, 3.0, np.float32))


def test_clip_in_place_scales_disjoint_views_of_one_buffer_in_place():
    """Gradients handed back as views of one all-reduce bucket are each their own: the clip
    scales them in place (no new arrays, no allocation); views that overlap are copied."""
    buf = np.arange(1, 13, dtype=np.float32)
    g = {"a": buf[:4].reshape(2, 2), "b": buf[4:10], "c": buf[10:]}
    expect = {k: v * (1.0 / (optim.global_norm(g) + 1e-6)) for k, v in g.items()}
    c, _ = optim.clip_grad_norm(g, 1.0, in_place=True)
    assert all(c[k] is g[k] for k in g), "a bucket's views were scaled into new arrays"
    for k in g:
        np.testing.assert_allclose(c[k], expect[k], rtol=1e-6)
    over = np.arange(1, 7, dtype=np.float32)
    c, n = optim.clip_grad_norm({"a": over[:4], "b": over[2:]}, 1.0, in_place=True)
    assert c["a"] is not over[:4] and np.array_equal(over, np.arange(1, 7, dtype=np.float32))
    np.testing.assert_allclose(c["b"], np.arange(3, 7) / n, rtol=1e-6)


def test_check_finite_costs_the_scalars_and_names_the_first_non_finite_gradient(monkeypatch):
    g = {"a": np.ones(3, np.float32), "b": [np.ones(2, np.float32), np.array([1.0, np.nan], np.float32)],
         "c": np.array([np.inf], np.float32)}
    search = optim.non_finite_leaves
    monkeypatch.setattr(optim.finite, "current_rank", lambda: None)    # the message without a world (another test may make one)

    def no_pass(tree):
        raise AssertionError("a finite step searched the gradients")
    monkeypatch.setattr(optim.finite, "non_finite_leaves", no_pass)
    optim.check_finite(loss=2.5, norm=np.float64(1e30), grads=g, step=1)     # finite: the scalars only
    with pytest.raises(AssertionError, match="searched the gradients"):
        optim.check_finite(loss=float("nan"), grads=g)
    monkeypatch.setattr(optim.finite, "non_finite_leaves", search)
    with pytest.raises(optim.NonFiniteError, match=r"^step 7: the loss is nan and the gradient norm is inf; the "
                       r"first non-finite gradient is \['b'\]\[1\] \(2 of 4 hold inf/nan\): stopped before this step's "
                       "update") as e:
        optim.check_finite(loss=float("nan"), norm=float("inf"), grads=g, step=7)
    assert (e.value.step, e.value.first, e.value.count, e.value.total) == (7, "['b'][1]", 2, 4)
    with pytest.raises(optim.NonFiniteError, match="the gradient norm is nan; every gradient is finite"):
        optim.check_finite(norm=float("nan"), grads={"a": np.ones(2, np.float32)})
    assert optim.non_finite_leaves(g) == ["['b'][1]", "['c']"] and optim.non_finite_leaves({"a": g["a"]}) == []
    with pytest.raises(optim.NonFiniteError, match=r"gradient norm is nan; the first non-finite gradient is \['b'\]"):
        optim.clip_grad_norm(g, 1.0, error_if_nonfinite=True)
    assert optim.clip_grad_norm({"a": g["a"]}, 1.0, error_if_nonfinite=True)[1] == pytest.approx(math.sqrt(3))


def test_the_loss_spike_guard_stops_at_a_loss_far_above_the_running_median(monkeypatch):
    monkeypatch.setattr(optim.finite, "current_rank", lambda: None)
    guard = optim.LossSpikeGuard(factor=5.0, window=4, warmup=3)
    guard.extend([4.0, float("nan")])                 # a resumed run's saved losses (inf/nan are not kept)
    guard.check(30.0, step=2)                         # before the warm-up: no median to compare with yet
    guard.check(3.0, step=3)
    guard.check(float("inf"), step=4)                 # check_finite's business
    assert list(guard.recent) == [4.0, 30.0, 3.0]
    guard.check(19.0, step=5)                         # 4.75 x the median 4: noise
    with pytest.raises(optim.LossSpikeError, match=r"^step 6: the loss 100 is 8.7 x the median 11.5 of the last 4 "
                       r"steps \(a spike: more than 5 x\): the run is diverging; stopped before this step's update") as e:
        guard.check(100.0, step=6)
    assert isinstance(e.value, optim.NonFiniteError) and (e.value.step, e.value.what) == (6, "loss")
    assert list(guard.recent) == [4.0, 30.0, 3.0, 19.0]     # a spike is not remembered
    with pytest.raises(ValueError, match="need factor > 1"):
        optim.LossSpikeGuard(factor=1.0)


def test_dynamic_loss_scaler():
    s = optim.DynamicLossScaler(init_scale=8.0, growth_interval=2)
    g, finite = s.unscale({"w": np.array([8.0, np.inf], np.float16)})
    assert not finite
    s.update(finite)
    assert s.scale_value == 4.0 and s.skipped == 1
    g, finite = s.unscale({"w": np.array([8.0, 4.0], np.float16)})
    assert finite and g["w"].dtype == np.float32
    np.testing.assert_allclose(g["w"], [2.0, 1.0])
    s.update(True)
    s.update(True)
    assert s.scale_value == 8.0
    x = np.float32(3.0)
    assert float(s.scale(x)) == 24.0


def test_fp16_training_with_loss_scaling_runs():
    model = nn.Transformer(11, 8, 2, 1, 6, dtype="fp16")
    p = model.init(0)
    opt, scaler = optim.AdamW(p, lr=1e-2), optim.DynamicLossScaler(init_scale=1024.0)
    tok = np.random.default_rng(0).integers(0, 11, (2, 7))
    losses = []
    for _ in range(3):
        loss, g = ts.value_and_grad(lambda p: scaler.scale(model.loss(p, tok[:, :-1], tok[:, 1:])))(p)
        g, finite = scaler.unscale(g)
        if finite:
            p = opt.step(p, g)
        scaler.update(finite)
        losses.append(float(loss) / scaler.scale_value)
    assert all(np.isfinite(losses)) and p["head"]["w"].dtype == np.float16


def test_optimizer_errors():
    with pytest.raises(TypeError, match="optimizers update"):
        optim.SGD({"i": np.arange(3)})
    opt = optim.SGD({"w": rand(3)})
    with pytest.raises(ValueError, match="has shape"):
        opt.step({"w": rand(3)}, {"w": rand(4)})
    with pytest.raises(ValueError, match="2 gradients for 1 parameters"):
        opt.step({"w": rand(3)}, [rand(3), rand(3)])


@pytest.mark.parametrize("make", [lambda p: optim.AdamW(p, lr=0.1), lambda p: optim.SGD(p, lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd-momentum"])
def test_an_optimizer_continues_exactly_from_its_state_dict(make):
    # a fresh optimizer given another's state_dict (masters, moments or momentum, step count)
    # takes the same next step; a state of another structure or shape is refused by name
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": [rng.standard_normal(4).astype(np.float32)]}
    grads = [{"w": rng.standard_normal((3, 4)).astype(np.float32), "b": [rng.standard_normal(4).astype(np.float32)]}
             for _ in range(3)]
    a = make(params)
    p = a.step(a.step(params, grads[0]), grads[1])
    b = make(params)
    b.load_state_dict(a.state_dict())
    assert b.t == 2
    np.testing.assert_array_equal(b.step(p, grads[2])["w"], a.step(p, grads[2])["w"])
    state = a.state_dict()
    with pytest.raises(ValueError, match=r"'masters' has the leaves \['w'\], the parameters \['w'\] \['b'\]\[0\]"):
        b.load_state_dict(dict(state, masters={"w": state["masters"]["w"]}))
    with pytest.raises(ValueError, match=r"masters\['w'\] is float32\[4, 3\], the optimizer keeps float32\[3, 4\]"):
        b.load_state_dict(dict(state, masters=dict(state["masters"], w=state["masters"]["w"].T.copy())))


def test_module_shapes_and_errors():
    with pytest.raises(ValueError, match="not a multiple of n_heads"):
        nn.Attention(10, 3)
    with pytest.raises(ValueError, match="parallel="):
        nn.Linear(2, 2, parallel="diagonal")
    m = nn.Transformer(7, 8, 2, 1, 4)
    p = m.init(0)
    assert m.logits(p, np.zeros((2, 4), np.int32)).shape == (2, 4, 7)
    with pytest.raises(ValueError, match="sequence length 3 != seq_len 4"):
        m.logits(p, np.zeros((2, 3), np.int32))


def test_cross_entropy_matches_log_softmax():
    logits, t = rand(3, 5, 9, seed=5).astype(np.float64), np.random.default_rng(6).integers(0, 9, (3, 5))
    z = logits - logits.max(-1, keepdims=True)
    ref = -np.mean(np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), t[..., None], -1))
    assert math.isclose(float(nn.cross_entropy(logits, t)), ref, rel_tol=1e-12)


def test_transformer_gradients_match_torch():
    torch = pytest.importorskip("torch")
    V, D, H, L, S = 13, 8, 2, 2, 6
    model = nn.Transformer(V, D, H, L, S, dtype="float64")
    p = model.init(1)
    tok = np.random.default_rng(7).integers(0, V, (3, S + 1))
    x, y = tok[:, :-1], tok[:, 1:]
    loss, grads = ts.value_and_grad(model.loss)(p, x, y)

    leaves, paths, struct = ts.autodiff.tree_flatten(p)
    tl = [torch.tensor(a, requires_grad=True) for a in leaves]
    tp = ts.autodiff.tree_unflatten(struct, tl)

    def rms(h, w, eps=1e-6):
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * w

    xt = torch.tensor(x)
    h = tp["embed"]["w"][xt] + tp["pos"]
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for bp in tp["blocks"]:
        a = rms(h, bp["norm1"]["w"])
        q, k, v = ((a @ bp["attn"][n]["w"]).reshape(3, S, H, D // H).transpose(1, 2) for n in "qkv")
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D // H)
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
        h = h + o.transpose(1, 2).reshape(3, S, D) @ bp["attn"]["o"]["w"]
        m = rms(h, bp["norm2"]["w"])
        h = h + (torch.nn.functional.silu(m @ bp["mlp"]["w1"]["w"]) * (m @ bp["mlp"]["w3"]["w"])) @ bp["mlp"]["w2"]["w"]
    logits = rms(h, tp["norm"]["w"]) @ tp["head"]["w"]
    tloss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    tloss.backward()
    assert math.isclose(float(loss), float(tloss.detach()), rel_tol=1e-12)
    # flash attention's backward recomputes P from the forward's logsumexp, which the kernel
    # keeps in f32 by design: f64 gradients agree to ~1e-7, not 1e-12
    for g, t, path in zip(ts.autodiff.tree_flatten(grads)[0], tl, paths):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-5, atol=1e-9, err_msg=path)
