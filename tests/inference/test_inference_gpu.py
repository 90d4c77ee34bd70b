"""nn.Llama on the GPU backend: batched variable-length prefill, decode steps captured as CUDA
graphs, sampling on the device, and what a step costs.

gpu-marked: on a GPU machine these run on the GPU (``pytest -m gpu``); in the suite they run on
the CuPy stand-in and the CUDA emulation harness (tests/inference/test_inference.py starts
them), where every RawKernel executes from its source, a capture records instead of running
and a replay reads the buffers as they are at launch.  The counting tests need the stand-in's
``cupy.testing.count_device_work``.
"""
import dataclasses

import numpy as np
import pytest

from tessera_rt import nn
from tessera_rt.inference import Llama
from tessera_rt.inference.decode import DecodeRunner
from tessera_rt.inference.prefill import Chunk, run_prefill
from tessera_rt.inference.sampling import DeviceSampler

import llama_tiny as L
from llama_tiny import fixture_ckpts  # noqa: F401  (the ckpts fixture: pytest looks in this module)


def _cupy():
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


cp = _cupy()
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy (or the stand-in)")]
counting = pytest.mark.skipif(cp is None or not hasattr(getattr(cp, "testing", None), "count_device_work"),
                              reason="counting launches needs the CuPy stand-in's counters (tests/gpu_emu)")


def _graphs(cache) -> dict:
    return {rows: r.graph is not None for (rows, _), r in cache.runners.items()}


def test_generate_equals_transformers_greedy_tokens(ckpts):
    """Packed prefill, graph-captured decode, device sampling: transformers' 32 greedy tokens,
    whether the three prompts decode together, one at a time, or prefill in 5-token chunks
    while the others decode; the graphs are captured (and replayed) for each batch size."""
    path, ref = ckpts["big"]
    model = nn.Llama.from_pretrained(path)
    np.testing.assert_allclose(cp.asnumpy(model.logits(L.LOGIT_IDS * 10)), ref["logits"], rtol=1e-4, atol=1e-4)
    cache = nn.KVCache(model, max_tokens=256, block_size=4)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32) == ref["tokens"]
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32, max_batch=1) == ref["tokens"]
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32, max_prefill_tokens=5) == ref["tokens"]
    graphs = _graphs(cache)
    assert {1, 2, 4} <= set(graphs) and all(graphs.values()), graphs
    assert cache.stats()["blocks_device"] == 0


def test_a_step_that_allocates_is_run_eagerly(ckpts):
    """Checkpoint A's head_dim 8 takes the paged-attention reference, which allocates: a capture
    of it is not kept (its arrays are freed after the capture while the graph would still use
    them); the steps run eagerly and give transformers' tokens."""
    path, ref = ckpts["A"]
    model = nn.Llama.from_pretrained(path)
    cache = nn.KVCache(model, max_tokens=256, block_size=4)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=12) == [t[:12] for t in ref["tokens"]]
    (runner,) = cache.runners.values()
    assert runner.graph is None and "allocated" in runner.refused


@pytest.mark.parametrize("dtype,tol", [("bf16", 0.15), ("fp16", 0.02)])
def test_16bit_weights(ckpts, dtype, tol):
    """bf16 and fp16 weights and cache: logits within the dtype's rounding of transformers'
    f32 ones, decode captured, and the first greedy tokens transformers' where its top two
    logits are not within that rounding."""
    path, ref = ckpts["big"]
    model = nn.Llama.from_pretrained(path, dtype=dtype)
    lg = np.asarray(cp.asnumpy(model.logits(L.LOGIT_IDS * 10)), np.float64)
    scale = np.abs(ref["logits"]).max()
    assert np.abs(lg - ref["logits"]).max() < tol * scale       # (the CPU's bf16 path: 0.135 on this model)
    cache = nn.KVCache(model, max_tokens=256, block_size=4)
    out = model.generate(cache, L.PROMPTS, max_new_tokens=4)
    assert all(_graphs(cache).values()) and [len(o) for o in out] == [4, 4, 4]
    assert sum(o[0] == r[0] for o, r in zip(out, ref["tokens"])) >= 2


def _shallow(model: Llama, layers: int) -> Llama:
    """``model`` with its first ``layers`` layers (the same arrays)."""
    cfg = dataclasses.replace(model.config, num_hidden_layers=layers)
    params = dict(model.params, layers=model.params["layers"][:layers])
    return Llama(cfg, params, model.shard, mesh=model.mesh, tp_axis=model.tp_axis, dtype=model.dtype)


def _decode_work(model: Llama, b: int):
    """Device work of an eager decode step, of its capture, and of a graph replay at batch ``b``."""
    cache = nn.KVCache(model, max_tokens=64 * b, block_size=4)
    sids = [cache.add() for _ in range(b)]
    pos = [int(cache.reserve(s, 3 + i % 5)[-1]) for i, s in enumerate(sids)]
    runner = DecodeRunner(model, cache, b, DeviceSampler(model, 0.0, 0), graphs=True)
    runner.batch.upload_state(np.arange(b) % 50, pos, [(i, 0) for i in range(b)], cache.slot_table(sids, cache.num_blocks))
    cp.cuda.Device().synchronize()
    out = []
    for _ in range(3):                   # eager, captured (+ launched), replayed
        with cp.testing.count_device_work() as w:
            runner.run()
        out.append(w)
    assert runner.graph is not None and runner.graph.standin_allocations() == 0
    return out


@counting
@pytest.mark.parametrize("b", [1, 16])
def test_decode_step_is_one_graph_launch_within_the_launch_budget(ckpts, b):
    """A decode step, counted: at most 15 kernels per layer (a 2-layer model against its first
    layer alone) at batch 1 and 16 alike; no host->device copy and no sync in the step (the
    state is on the device); replayed, the whole step is one graph launch whose nodes are the
    eager step's kernels, and the capture allocated nothing."""
    model = nn.Llama.from_pretrained(ckpts["big"][0])
    (e2, _, g2), (e1, _, g1) = _decode_work(model, b), _decode_work(_shallow(model, 1), b)
    per_layer = e2.launches - e1.launches
    assert per_layer <= 15, e2.report()
    assert (g2.launches, g2.graph_launches, g2.syncs, g2.h2d, g2.d2h) == (e2.launches, 1, 0, 0, 0), g2.report()
    assert (e2.syncs, e2.h2d, e2.d2h) == (0, 0, 0), e2.report()
    assert g2.launches - g1.launches == per_layer


def _prefill_work(model: Llama, prompts, cap=None):
    cache = nn.KVCache(model, max_tokens=1024, block_size=4)
    chunks = []
    for i, p in enumerate(prompts):
        sid = cache.add()
        n = len(p) if cap is None else cap
        cache.reserve(sid, n)
        chunks.append(Chunk(i, sid, np.asarray(p[:n], np.int32), 0, n == len(p)))
    if cap is not None:                  # the first chunks, then count the continuation (cached context)
        run_prefill(model, cache, chunks, DeviceSampler(model, 0.0, 0))
        for c, p in zip(chunks, prompts):
            cache.reserve(c.sid, len(p) - cap)
        chunks = [Chunk(c.index, c.sid, np.asarray(p[cap:], np.int32), cap, True) for c, p in zip(chunks, prompts)]
    cp.cuda.Device().synchronize()
    with cp.testing.count_device_work() as w:
        firsts = run_prefill(model, cache, chunks, DeviceSampler(model, 0.0, 0))
    return w, firsts


@counting
@pytest.mark.parametrize("cap", [None, 1])
def test_prefill_launches_do_not_grow_with_the_batch(ckpts, cap):
    """A packed prefill, counted: at most 20 kernels per layer whether it holds 1 prompt or 16
    (each GEMM once for all of them, one K/V write and one attention a layer), no host->device
    copy inside the layer loop (one upload a step), one sync (the first tokens); the first
    tokens equal transformers'.  cap=4: a continuation chunk, attending to cached context."""
    path, ref = ckpts["big"]
    model = nn.Llama.from_pretrained(path)
    one = _shallow(model, 1)
    many = [L.PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(16)]
    per = {}
    for n, prompts in (("1", many[:1]), ("16", many)):
        (w2, firsts), (w1, _) = _prefill_work(model, prompts, cap), _prefill_work(one, prompts, cap)
        per[n] = w2.launches - w1.launches
        assert per[n] <= 20 and w2.h2d - w1.h2d == 0 and (w2.h2d, w2.syncs) == (1, 1), w2.report()
        if n == "16":                    # prompts 0, 4 and 8 are L.PROMPTS
            assert [firsts[i] for i in (0, 4, 8)] == [t[0] for t in ref["tokens"]]
    assert per["1"] == per["16"], per


def test_a_graph_replays_the_state_uploaded_before_each_launch(ckpts):
    """The captured step reads its static buffers as they are at launch: fed other tokens and
    positions before a replay, it gives the logits an eager step gives for them."""
    model = nn.Llama.from_pretrained(ckpts["big"][0])
    cache = nn.KVCache(model, max_tokens=128, block_size=4)
    sids = [cache.add() for _ in range(2)]
    for s in sids:
        cache.reserve(s, 9)
    graphed = DecodeRunner(model, cache, 2, DeviceSampler(model, 0.0, 0), graphs=True)
    eager = DecodeRunner(model, cache, 2, DeviceSampler(model, 0.0, 0), graphs=False)
    rng = np.random.default_rng(3)
    for step in range(4):
        tok, pos = rng.integers(0, 1000, 2), rng.integers(0, 9, 2)
        got = []
        for r in (graphed, eager):
            r.batch.upload_state(tok, pos, [(0, step), (1, step)], cache.slot_table(sids, cache.num_blocks))
            r.run()
            got.append((cp.asnumpy(r.batch.logits), cp.asnumpy(r.batch.tok)))
        np.testing.assert_allclose(got[0][0], got[1][0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[0][1], got[1][1])
    assert graphed.graph is not None and eager.graph is None


def test_temperature_sampling_on_the_device(ckpts):
    """Device sampling draws the host sampler's Gumbel noise: temperature tokens are seeded,
    differ by seed, and the eager and graphed steps agree (top-k / top-p take the host path)."""
    model = nn.Llama.from_pretrained(ckpts["big"][0])
    cache = nn.KVCache(model, max_tokens=256, block_size=4)
    kw = dict(max_new_tokens=8, temperature=0.9, seed=5)
    a = model.generate(cache, L.PROMPTS, **kw)
    assert a == model.generate(cache, L.PROMPTS, **kw)
    assert a != model.generate(cache, L.PROMPTS, **dict(kw, seed=6))
    assert all(r.graph is not None for k, r in cache.runners.items() if k[1] == (0.9, 5))
    top = model.generate(cache, L.PROMPTS, max_new_tokens=6, temperature=0.9, top_k=20, seed=5)
    assert [len(t) for t in top] == [6, 6, 6]


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_decoder_kernels_match_their_references(dtype):
    """Each fused decoder kernel against its CPU reference on the same inputs (one rounding of
    the dtype apart at most)."""
    from tessera_rt.backend import get_backend
    from tessera_rt.dtypes import resolve_dtype
    from tessera_rt.kernels import decoder_ops as R
    dt, be = resolve_dtype(dtype), get_backend()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    f = lambda a: np.asarray(cp.asnumpy(a) if hasattr(a, "get") else a, np.float32)
    rng = np.random.default_rng(5)
    t, nq, nkv, d, bs = 7, 4, 2, 32, 4
    qkv = rng.standard_normal((t, (nq + 2 * nkv) * d)).astype(dt)
    pos, slots = np.array([0, 1, 5, 8, 13, 40, 2], np.int32), np.array([0, 3, -1, 9, 14, 30, 2], np.int32)
    inv = (1.0 / 500000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    host = dict(q=np.empty((t, nq, d), dt), kp=np.zeros((8, nkv, bs, d), dt), vp=np.zeros((8, nkv, bs, d), dt))
    dev = {k: cp.asarray(v) for k, v in host.items()}
    w_host, w_dev = qkv.copy(), cp.asarray(qkv)
    R.rope_kv(w_host, pos, inv, nq, nkv, q_out=host["q"], k_pages=host["kp"], v_pages=host["vp"], slots=slots)
    be.kernel("rope_kv")(w_dev, cp.asarray(pos), cp.asarray(inv), nq, nkv, q_out=dev["q"], k_pages=dev["kp"],
                         v_pages=dev["vp"], slots=cp.asarray(slots))
    for k in host:
        np.testing.assert_allclose(f(dev[k]), f(host[k]), **tol)
    np.testing.assert_allclose(f(w_dev), f(w_host), **tol)
    x, delta, w = (rng.standard_normal(s).astype(dt) for s in ((5, 96), (5, 96), (96,)))
    outs = []
    for xp_, k in ((np, R.add_rmsnorm), (cp, be.kernel("add_rmsnorm"))):
        xx, o = xp_.asarray(x.copy()), xp_.empty((5, 96), dt)
        k(xx, xp_.asarray(delta), xp_.asarray(w), eps=1e-6, out=o)
        outs.append((f(xx), f(o)))
    np.testing.assert_allclose(outs[1][0], outs[0][0], **tol)
    np.testing.assert_allclose(outs[1][1], outs[0][1], **tol)
    gu = rng.standard_normal((5, 64)).astype(dt)
    a, b = np.empty((5, 32), dt), cp.empty((5, 32), dt)
    R.silu_mul(gu, out=a)
    be.kernel("silu_mul")(cp.asarray(gu), out=b)
    np.testing.assert_allclose(f(b), f(a), **tol)
    logits, keys = rng.standard_normal((3, 300)).astype(dt), np.array([[1, 0], [2, 5], [9, 9]], np.int32)
    for temp in (0.0, 0.8):
        p1, p2 = np.empty((3, 2)), cp.empty((3, 2), np.float64)
        R.sample_argmax(logits, v0=7, temperature=temp, seed=4, keys=keys, out=p1)
        be.kernel("sample_argmax")(cp.asarray(logits), v0=7, temperature=temp, seed=4, keys=cp.asarray(keys), out=p2)
        np.testing.assert_array_equal(cp.asnumpy(p2)[:, 1], p1[:, 1])
        np.testing.assert_allclose(cp.asnumpy(p2)[:, 0], p1[:, 0], rtol=1e-12)


@pytest.mark.parametrize("hd,h,hkv", [(8, 4, 2), (64, 4, 1), (96, 2, 2)])
def test_varlen_and_paged_prefill_kernels(hd, h, hkv):
    """The own varlen kernel (one launch, boundaries read on the device, q/k/v as strided rows of
    a fused projection) and the paged prefill kernel (keys through block tables, after a cached
    context) against the references; rows past the last sequence come back 0."""
    from tessera_rt.kernels import flash_attention_varlen, paged_prefill_attention
    from tessera_rt.kernels.varlen_attention import flash_attention_varlen_cuda
    from tessera_rt.kernels.varlen_attention_cuda import paged_prefill_attention_cuda
    rng = np.random.default_rng(hd)
    lq = [5, 17, 1, 33]
    t = sum(lq)
    cu = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    qkv = rng.standard_normal((t + 3, (h + 2 * hkv) * hd)).astype(np.float32)
    views = lambda a: (a[:, :h * hd].reshape(-1, h, hd), a[:, h * hd:(h + hkv) * hd].reshape(-1, hkv, hd),
                       a[:, (h + hkv) * hd:].reshape(-1, hkv, hd))
    q, k, v = views(qkv)
    dq, dk, dv = views(cp.asarray(qkv))
    for causal in (True, False):
        want = flash_attention_varlen(*(np.ascontiguousarray(x[:t]) for x in (q, k, v)), cu, cu, causal=causal)
        got = flash_attention_varlen_cuda(dq, dk[:t], dv[:t], cp.asarray(cu), cp.asarray(cu), max_seqlen_q=max(lq),
                                          causal=causal)
        np.testing.assert_allclose(cp.asnumpy(got)[:t], want, rtol=2e-5, atol=2e-5)
        assert not cp.asnumpy(got)[t:].any()
    host = flash_attention_varlen_cuda(dq, dk[:t], dv[:t], cu, cu, causal=True)        # host offsets: read, then copied
    np.testing.assert_allclose(cp.asnumpy(host)[:t], flash_attention_varlen(*(np.ascontiguousarray(x[:t])
                                                                               for x in (q, k, v)), cu, cu, causal=True),
                               rtol=2e-5, atol=2e-5)
    bs, ctx = 4, np.array([3, 0, 9, 20], np.int32)
    n = ctx + np.array(lq)
    pages = rng.permutation(64)
    tables = np.full((4, int(max(-(-n // bs)))), -1, np.int32)
    used = 0
    for i in range(4):
        c = -(-n[i] // bs)
        tables[i, :c] = pages[used:used + c]
        used += c
    kp, vp = (rng.standard_normal((64, hkv, bs, hd)).astype(np.float32) for _ in range(2))
    qq = rng.standard_normal((t, h, hd)).astype(np.float32)
    want = paged_prefill_attention(qq, kp, vp, tables, cu, ctx)
    got = paged_prefill_attention_cuda(*(cp.asarray(x) for x in (qq, kp, vp, tables, cu, ctx)), max_seqlen_q=max(lq))
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=2e-5, atol=2e-5)


def test_a_step_cuda_refuses_to_capture_runs_eagerly(ckpts, monkeypatch):
    """Work CUDA refuses inside the capture (here a host read of a device value) invalidates it:
    the runner keeps no graph, says why, and runs its steps eagerly with the right logits."""
    model = nn.Llama.from_pretrained(ckpts["big"][0])
    cache = nn.KVCache(model, max_tokens=64, block_size=4)
    sid = cache.add()
    cache.reserve(sid, 5)
    runner = DecodeRunner(model, cache, 1, DeviceSampler(model, 0.0, 0), graphs=True)
    eager = DecodeRunner(model, cache, 1, DeviceSampler(model, 0.0, 0), graphs=False)
    real = runner._step

    def step_with_a_sync():
        real()
        float(runner.batch.logits[0, 0])      # a blocking device->host read
    monkeypatch.setattr(runner, "_step", step_with_a_sync)
    for r in (runner, eager):
        for _ in range(2):
            r.batch.upload_state([7], [4], [(0, 0)], cache.slot_table([sid], cache.num_blocks))
            r.run()
    assert runner.graph is None and "refused the capture" in runner.refused
    np.testing.assert_allclose(cp.asnumpy(runner.batch.logits), cp.asnumpy(eager.batch.logits), rtol=1e-6)
