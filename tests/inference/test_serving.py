"""Serving on the packed/graph path: chunked prefill against transformers and its interleaving
with decode, the fused decoder ops' and the paged prefill attention's references, gpu_check's
tie-aware token comparison, and the GPU tests (tests/inference/test_inference_gpu.py) and a
tp=2 graph-captured decode run on the CuPy stand-in in subprocesses."""
import numpy as np
import pytest

from tessera_rt import nn
from tessera_rt.kernels import flash_attention

import llama_tiny as L
from llama_tiny import fixture_ckpts  # noqa: F401  (the ckpts fixture: pytest looks in this module)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_inference_on_the_standin():
    """tests/inference/test_inference_gpu.py as written for a GPU: packed prefill, captured decode
    steps, device sampling and the launch budgets, on the CuPy stand-in (captures record, replays
    read the buffers at launch) with every RawKernel run by the emulation harness."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import mpi_env, standin_env
    here = Path(__file__).resolve().parent
    env = mpi_env(1, "cuda", standin_env())
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(here)
    proc = subprocess.run(["timeout", "-k", "5", "850", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(here / "test_inference_gpu.py")], capture_output=True, text=True, env=env,
                          cwd=here.parents[1])
    tail = proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and " passed" in tail and "skipped" not in tail, tail


TP_GRAPH_SCRIPT = """
import json, sys
import llama_tiny as L
from mpi4py import MPI
from tessera_rt import dist, nn
dist.init()
mesh = dist.Mesh(axes=["tp"], shape={"tp": MPI.COMM_WORLD.Get_size()})
m = nn.Llama.from_pretrained(sys.argv[1], mesh=mesh)
c = nn.KVCache(m, max_tokens=256, block_size=4)
out = m.generate(c, L.PROMPTS, max_new_tokens=16)
nodes = [n for r in c.runners.values() if r.graph is not None for n in r.graph.standin_nodes()]
row = dict(tokens=out, graphs=sum(r.graph is not None for r in c.runners.values()), runners=len(c.runners),
           reduce=nodes.count("nccl.allReduce"), gather=nodes.count("nccl.allGather"))
rows = MPI.COMM_WORLD.gather(row)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(rows))
"""


@pytest.mark.mpi(ranks=2)
@pytest.mark.timeout(300)
def test_tensor_parallel_decode_is_captured_with_its_nccl_collectives(ckpts):
    """tp=2 on two emulated GPUs: the decode step's graph holds its NCCL all_reduces (two a layer,
    one for the embedding) and the sampling all_gather; every rank replays it in step with the
    other, and the tokens are transformers' greedy ones."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import MPIEXEC, mpi_env, standin_env
    here = Path(__file__).resolve().parent
    env = mpi_env(2, "cuda", standin_env(2))
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(here)
    proc = subprocess.run(["timeout", "-k", "5", "250", MPIEXEC, "-n", "2", sys.executable, "-c", TP_GRAPH_SCRIPT,
                           str(ckpts["big"][0])], capture_output=True, text=True, env=env, cwd=here)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [t[:16] for t in ckpts["big"][1]["tokens"]]
    layers = 2
    for r in rows:
        assert r["tokens"] == want
        assert r["graphs"] == r["runners"] >= 1
        assert r["reduce"] == r["graphs"] * (2 * layers + 1) and r["gather"] == r["graphs"], r


@pytest.mark.parametrize("name", ["A", "B"])
def test_chunked_prefill_gives_transformers_tokens(ckpts, name):
    """Prompts prefilled in chunks of at most 3 (or 7) tokens a step, the later chunks attending
    to the earlier ones through the paged cache: transformers' 32 greedy tokens."""
    path, ref = ckpts[name]
    model = nn.Llama.from_pretrained(path)
    for cap in (3, 7):
        cache = nn.KVCache(model, max_tokens=256, block_size=4)
        assert model.generate(cache, L.PROMPTS, max_new_tokens=32, max_prefill_tokens=cap) == ref["tokens"]
    with pytest.raises(ValueError, match="max_prefill_tokens must be a positive int"):
        model.generate(cache, L.PROMPTS, max_prefill_tokens=0)


def test_chunked_prefill_does_not_starve_decoding_sequences(ckpts, monkeypatch):
    """A long prompt admitted while another sequence decodes is prefilled 4 tokens a step, and
    the decoding sequence gets its token in every one of those steps."""
    import sys

    from tessera_rt.inference import decode
    G = sys.modules["tessera_rt.inference.generate"]       # (the package's `generate` is the function)
    path, ref = ckpts["A"]
    model = nn.Llama.from_pretrained(path)
    log = []
    real_prefill, real_run = G.run_prefill, decode.DecodeRunner.run

    def prefill(model, cache, chunks, *a, **k):
        log.append(("prefill", sum(len(c.tokens) for c in chunks)))
        return real_prefill(model, cache, chunks, *a, **k)

    def run(self):
        log.append(("decode", self.batch.b))
        return real_run(self)
    monkeypatch.setattr(G, "run_prefill", prefill)
    monkeypatch.setattr(decode.DecodeRunner, "run", run)
    long = L.PROMPTS[2] * 2                              # 34 tokens: 9 chunks of 4
    out = model.generate(nn.KVCache(model, max_tokens=256, block_size=4), [L.PROMPTS[1], long], max_new_tokens=12,
                         max_prefill_tokens=4)
    assert out[0] == ref["tokens"][1][:12]
    steps = [kind for kind, _ in log]
    assert all(n <= 4 for kind, n in log if kind == "prefill")
    chunks = [i for i, s in enumerate(steps) if s == "prefill"]
    assert len(chunks) == 9                              # 2 + 34 prompt tokens, 4 a step
    for a, b in zip(chunks, chunks[1:]):
        assert steps[a + 1:b] == ["decode"], steps       # a decode step between every two chunks


def test_decoder_op_references(ckpts):
    """The fused decoder ops' CPU entries against plain formulas: RoPE as transformers'
    rotate_half with cos/sin in f32, K/V into the slots asked (none for -1), the residual add
    in the norm, silu * up, a decode step's keys/starts/slots, argmax with the lowest id among
    equals, the Gumbel hash's mean (Euler-Mascheroni) and its independence of the mesh."""
    from tessera_rt.kernels import decoder_ops as D
    rng = np.random.default_rng(0)
    t, nq, nkv, d, bs = 5, 4, 2, 8, 4
    qkv = rng.standard_normal((t, (nq + 2 * nkv) * d)).astype(np.float32)
    pos = np.array([0, 3, 4, 9, 31], np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    kp, vp = np.zeros((8, nkv, bs, d), np.float32), np.zeros((8, nkv, bs, d), np.float32)
    slots = np.array([0, 5, -1, 9, 30], np.int32)
    q_out, work = np.empty((t, nq, d), np.float32), qkv.copy()
    D.rope_kv(work, pos, inv, nq, nkv, q_out=q_out, k_pages=kp, v_pages=vp, slots=slots)
    ang = pos[:, None].astype(np.float32) * inv
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]
    rot = lambda x: np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    q, k = qkv[:, :nq * d].reshape(t, nq, d), qkv[:, nq * d:(nq + nkv) * d].reshape(t, nkv, d)
    np.testing.assert_allclose(q_out, q * cos + rot(q) * sin, rtol=1e-6, atol=1e-6)
    k_want = k * cos + rot(k) * sin
    for i, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_allclose(kp[s // bs, :, s % bs], k_want[i], rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(vp[s // bs, :, s % bs], qkv[i, (nq + nkv) * d:].reshape(nkv, d))
    assert np.count_nonzero(kp.any(-1)) == 4 * nkv
    x, delta, w = (rng.standard_normal(s).astype(np.float32) for s in ((3, 16), (3, 16), (16,)))
    x0, out = x.copy(), np.empty((3, 16), np.float32)
    D.add_rmsnorm(x, delta, w, eps=1e-5, out=out)
    np.testing.assert_allclose(x, x0 + delta, rtol=1e-6)
    np.testing.assert_allclose(out, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w, rtol=1e-5, atol=1e-6)
    gu, act = rng.standard_normal((3, 8)).astype(np.float32), np.empty((3, 4), np.float32)
    D.silu_mul(gu, out=act)
    np.testing.assert_allclose(act, gu[:, :4] / (1 + np.exp(-gu[:, :4])) * gu[:, 4:], rtol=1e-5)
    lens, starts, sl = (np.empty(3, np.int32) for _ in range(3))
    D.decode_prepare(np.array([5, 2, 0], np.int32), np.array([[3, 7], [1, -1], [-1, -1]], np.int32), 4, 3,
                     lens=lens, starts=starts, slots=sl)
    assert (lens.tolist(), starts.tolist(), sl.tolist()) == ([6, 3, 0], [3, 0, 0], [29, 6, -1])
    logits = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    pairs = np.empty((1, 2))
    D.sample_argmax(logits, v0=10, out=pairs)
    assert pairs.tolist() == [[3.0, 11.0]]                       # the lower of the two equal ids
    tok, hist, n = np.zeros(1, np.int32), np.zeros((1, 4), np.int32), np.zeros(1, np.int32)
    D.sample_pick(np.array([[[3.0, 11.0]], [[3.0, 7.0]], [[2.0, 1.0]]]), tok=tok, hist=hist, hist_n=n)
    assert tok.tolist() == [7] and hist[0, 0] == 7 and n.tolist() == [1]
    g = D.gumbel_hash(3, 1, 2, np.arange(200000))
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.std() - np.pi / np.sqrt(6)) < 0.01
    np.testing.assert_array_equal(D.gumbel_hash(3, 1, 2, np.arange(100, 200)), g[100:200])


def test_paged_prefill_attention_reference_reads_the_cache():
    """A chunk's queries against their sequence's cached positions (context + the chunk), read
    through its block table: causal attention over the gathered keys."""
    from tessera_rt.kernels import paged_prefill_attention
    rng = np.random.default_rng(2)
    h, hkv, d, bs = 4, 2, 8, 4
    ctx, lq = np.array([3, 0, 9], np.int32), np.array([2, 5, 4])
    n = ctx + lq
    tables, kp, vp = L.paged(rng, list(n), bs, hkv, d)
    cu = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], h, d)).astype(np.float32)
    got = paged_prefill_attention(q, kp, vp, tables, cu, ctx)
    for i in range(3):
        k, v = (L.gathered(p, tables[i], n[i], bs) for p in (kp, vp))
        want = flash_attention(q[cu[i]:cu[i + 1]].transpose(1, 0, 2)[None], k[None], v[None], causal=True)
        np.testing.assert_allclose(got[cu[i]:cu[i + 1]], want[0].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


def test_gpu_check_compares_tokens_tie_aware():
    """scripts/_gpu_check_decode.py (gpu_check's decode part) accepts sequences that part from
    transformers only where its top-two logits were within fp16 rounding, and fails otherwise."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("gpu_check_decode",
                                                  Path(__file__).resolve().parents[2] / "scripts" / "_gpu_check_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    scores = [np.array([[0.0, 5.0, 4.99], [3.0, 1.0, 0.0]]), np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])]
    ok, text = mod.check_tokens([[1, 0], [0, 1]], [[1, 0], [0, 1]], scores)
    assert ok and "2/2 sequences equal" in text
    ok, text = mod.check_tokens([[2, 0], [0, 1]], [[1, 0], [0, 1]], scores)          # parts at a 0.01 tie
    assert ok and "seq 0 parts at step 0" in text
    ok, text = mod.check_tokens([[1, 0], [0, 0]], [[1, 0], [0, 1]], scores)          # parts where the gap is 2
    assert not ok and "seq 1 parts at step 1" in text
