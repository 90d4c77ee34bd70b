"""Single-process inference: nn.Llama against transformers' LlamaForCausalLM (tiny random
checkpoints built locally), the paged decode-attention reference, the paged cache (decode ==
full recompute, continuous batching, window), its block pool and tiers, sampling, and the errors
for bad input."""
import json
import shutil

import numpy as np
import pytest

from tessera_rt import nn
from tessera_rt.inference import KVCache, Llama, LlamaConfig, TPShard
from tessera_rt.inference.decode import DecodeRunner
from tessera_rt.inference.kv_blocks import BlockPool, PageTiers
from tessera_rt.inference.prefill import Chunk, run_prefill
from tessera_rt.inference.sampling import DeviceSampler, sample
from tessera_rt.kernels import flash_attention, paged_decode_attention

import llama_tiny as L
from llama_tiny import fixture_ckpts  # noqa: F401  (the ckpts fixture: pytest looks in this module)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("name", ["A", "B"])
def test_logits_and_greedy_tokens_equal_transformers(ckpts, name):
    path, ref = ckpts[name]
    model = nn.Llama.from_pretrained(path)
    np.testing.assert_allclose(model.logits(L.LOGIT_IDS), ref["logits"], rtol=1e-4, atol=1e-4)
    cache = nn.KVCache(model, max_tokens=256, block_size=4)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32) == ref["tokens"]
    assert cache.stats()["blocks_device"] == 0            # every finished sequence gave its pages back


def test_continuous_batching_gives_the_same_tokens(ckpts):
    path, ref = ckpts["A"]
    model = nn.Llama.from_pretrained(path)
    for max_batch in (1, 2):          # sequences wait, then join as others finish
        cache = nn.KVCache(model, max_tokens=128, block_size=8)
        assert model.generate(cache, L.PROMPTS, max_new_tokens=32, max_batch=max_batch) == ref["tokens"]
    # a cache too small for all three at once still serves them, by admitting them in turn
    cache = nn.KVCache(model, max_tokens=56, block_size=8)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32) == ref["tokens"]


def test_decode_through_the_cache_equals_full_recompute(ckpts):
    """A packed prefill of two prompts, then decode steps of both (the same layer stack, K/V
    through the paged cache): each step's logits equal a full causal forward of the sequence."""
    model = nn.Llama.from_pretrained(ckpts["A"][0])
    cache = nn.KVCache(model, max_tokens=64, block_size=4)
    seqs = [np.array(p) for p in L.PROMPTS[:2]]
    chunks = [Chunk(i, cache.add(), s.astype(np.int32), 0, True) for i, s in enumerate(seqs)]
    for c in chunks:
        cache.reserve(c.sid, len(c.tokens))
    first = run_prefill(model, cache, chunks, DeviceSampler(model, 0.0, 0))
    assert first == {i: int(model.logits(s[None])[0, -1].argmax()) for i, s in enumerate(seqs)}
    sids = [c.sid for c in chunks]
    runner = DecodeRunner(model, cache, 2, None, graphs=False)
    nxt = np.array([7, 42])
    for _ in range(5):                 # several steps, both sequences together, different lengths
        pos = [int(cache.reserve(s, 1)[0]) for s in sids]
        runner.batch.upload_state(nxt, pos, [(0, 0), (1, 0)], cache.slot_table(sids, runner.batch.width))
        runner.run()
        got = runner.batch.logits.copy()
        seqs = [np.append(s, t) for s, t in zip(seqs, nxt)]
        for g, s in zip(got, seqs):
            np.testing.assert_allclose(g, model.logits(s[None])[0, -1], rtol=1e-5, atol=1e-5)
        nxt = got.argmax(-1)


@pytest.mark.parametrize("h,hkv,bs", [(4, 4, 4), (8, 2, 16), (6, 1, 3)])
def test_paged_decode_kernel_reference_matches_flash_attention(h, hkv, bs):
    rng = np.random.default_rng(h * bs)
    lens, d = [1, 13, 40], 16
    tables, kp, vp = L.paged(rng, lens, bs, hkv, d)
    q = rng.standard_normal((3, h, d)).astype(np.float32)
    starts = np.array([0, 5, 31], np.int32)
    for st in (None, starts):
        got = paged_decode_attention(q, kp, vp, tables, np.array(lens, np.int32), seq_starts=st)
        for i, n in enumerate(lens):
            lo = 0 if st is None else st[i]
            k, v = (L.gathered(p, tables[i], n, bs)[:, lo:] for p in (kp, vp))
            want = flash_attention(q[i][None, :, None], k[None], v[None])[0, :, 0]
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


def test_window_drops_stale_pages_and_limits_look_back(ckpts):
    model = nn.Llama.from_pretrained(ckpts["B"][0])
    cache = nn.KVCache(model, max_tokens=64, block_size=4, window=6)
    sid = cache.add()
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 1, model.n_kv, 20, 8)).astype(np.float32)
    for t in range(20):
        pos = cache.reserve(sid, 1)[None]
        cache.write(0, [sid], pos, kv[0][..., t:t + 1, :], kv[1][..., t:t + 1, :])
    step = cache.step([sid])
    kp, vp, tables = step.layer(0)
    assert int(step.starts[0]) == 14 and (tables[0, :3] == -1).all()     # positions 0..11 dropped: 3 pages back
    assert cache.free_blocks == cache.num_blocks - 2
    q = rng.standard_normal((1, model.n_heads, 8)).astype(np.float32)
    got = paged_decode_attention(q, kp, vp, tables, step.lens, seq_starts=step.starts)
    want = flash_attention(q[:, :, None], kv[0][..., 14:, :], kv[1][..., 14:, :])[:, :, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # generation with a window runs past the cache's size: stale pages are recycled
    out = model.generate(nn.KVCache(model, max_tokens=16, block_size=4, window=8), [[1, 2, 3]], max_new_tokens=40)
    assert len(out[0]) == 40
    # the same tokens from a cache wide enough that the decode tables never grow
    assert out == model.generate(nn.KVCache(model, max_tokens=256, block_size=4, window=8), [[1, 2, 3]],
                                 max_new_tokens=40)


def test_sampling_is_seeded_and_respects_top_k_and_top_p(ckpts):
    model = nn.Llama.from_pretrained(ckpts["B"][0])
    cache = nn.KVCache(model, max_tokens=256)
    kw = dict(max_new_tokens=12, temperature=0.9, seed=5)
    a = model.generate(cache, L.PROMPTS, **kw)
    assert a == model.generate(cache, L.PROMPTS, **kw)
    assert a != model.generate(cache, L.PROMPTS, **dict(kw, seed=6))
    assert model.generate(cache, L.PROMPTS, max_new_tokens=8, temperature=1.0, top_k=1) == \
        model.generate(cache, L.PROMPTS, max_new_tokens=8)
    # the sampler on fixed logits: frequencies follow softmax(l / T) restricted as asked
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05] + [1e-9] * 92], np.float32))
    draw = lambda **k: np.array([sample(model, logits, keys=[(0, s)], seed=1, **k)[0] for s in range(3000)])
    freq = np.bincount(draw(temperature=1.0), minlength=97)[:5] / 3000
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)
    assert set(draw(temperature=1.0, top_k=2)) == {0, 1}
    assert set(draw(temperature=1.0, top_p=0.8)) == {0, 1, 2}           # 0.5 + 0.2 < 0.8 <= 0.85


def test_bad_inputs_raise_clear_errors(ckpts, tmp_path):
    path = ckpts["B"][0]
    with pytest.raises(ValueError, match="no config.json"):
        nn.Llama.from_pretrained(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(path / "config.json", bare)
    with pytest.raises(ValueError, match="has no weights"):
        nn.Llama.from_pretrained(bare)
    cfg = json.loads((path / "config.json").read_text())
    for field, val, msg in (("model_type", "gpt2", "model_type"), ("hidden_act", "gelu", "hidden_act"),
                            ("num_key_value_heads", 4, "num_key_value_heads"), ("vocab_size", 0, "vocab_size")):
        with pytest.raises(ValueError, match=msg):
            LlamaConfig.from_dict(dict(cfg, **{field: val}))
    c = LlamaConfig.from_dict(cfg)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by the mesh's tp=4"):
        TPShard.of(c, 4, 0)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and tp=2"):
        TPShard.of(c, 2, 0)
    model = Llama.from_pretrained(path)
    cache = KVCache(model, max_tokens=32, block_size=4)
    with pytest.raises(ValueError, match="more than the cache holds"):
        model.generate(cache, [list(range(30))], max_new_tokens=8)
    with pytest.raises(ValueError, match="token id 97 is outside the vocabulary"):
        model.generate(cache, [[1, 97]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(cache, [[1]], max_new_tokens=4, top_p=1.5)
    with pytest.raises(ValueError, match="non-empty list of ints"):
        model.generate(cache, [[]], max_new_tokens=4)


def test_a_config_that_disagrees_with_its_weights_is_refused_by_name(ckpts, tmp_path):
    """Each field changed alone over B's weights (2 layers, hidden 48, vocab 97, 6/3 heads of 8):
    loading names the file, the tensor and the field, instead of loading another model or
    failing in a reshape."""
    src = ckpts["B"][0]
    cfg = json.loads((src / "config.json").read_text())

    def variant(name, **fields):
        d = tmp_path / name
        shutil.copytree(src, d)
        (d / "config.json").write_text(json.dumps(dict(cfg, **fields)))
        return d
    cases = [("layers1", dict(num_hidden_layers=1), r"holds 9 tensor\(s\) the config does not use \(model\.layers\.1\..*"
                                                     r"num_hidden_layers=1 in .*config\.json but the weights hold 2 layers; "
                                                     r"fix config\.json, or pass allow_unused=True"),
             ("layers3", dict(num_hidden_layers=3), r"tensor 'model\.layers\.2\.input_layernorm\.weight' is not in the "
                                                     r"checkpoint .*num_hidden_layers=3 in .*but the weights hold 2 layers"),
             ("hidden", dict(hidden_size=96), r"tensor 'model\.embed_tokens\.weight' has shape \(97, 48\) but .*config"
                                               r"\.json implies \(97, 96\) \(dim 1: hidden_size = 96, the tensor has 48\)"),
             ("vocab", dict(vocab_size=100), r"'model\.embed_tokens\.weight' has shape \(97, 48\) .*dim 0: vocab_size"),
             ("kv", dict(num_key_value_heads=6), r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(24, 48\) "
                                                  r".*dim 0: num_key_value_heads x head_dim = 6 x 8 = 48"),
             ("heads", dict(num_attention_heads=3), r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape "
                                                     r"\(48, 48\) .*dim 0: num_attention_heads x head_dim = 3 x 8 = 24"),
             ("ffn", dict(intermediate_size=32), r"'model\.layers\.0\.mlp\.gate_proj\.weight' .*intermediate_size")]
    for name, fields, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            nn.Llama.from_pretrained(variant(name, **fields))
        if name not in ("layers1", "layers3"):                               # the file holding the tensor
            assert f"{tmp_path / name / 'model.safetensors'}: tensor" in str(e.value), str(e.value)
    one = Llama.from_pretrained(tmp_path / "layers1", allow_unused=True)        # asked for: the first layer only
    assert len(one.params["layers"]) == 1
    bad = variant("truncated")
    blob = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(blob[:5])
    with pytest.raises(ValueError, match=r"truncated/model\.safetensors cannot be read as safetensors \(.*\): it is "
                                         r"truncated or corrupt"):
        nn.Llama.from_pretrained(bad)


@pytest.mark.mpi(ranks=2)
def test_generate_script_prints_the_tokens_last(ckpts):
    import subprocess
    import sys
    from pathlib import Path
    path, ref = ckpts["A"]
    from conftest import mpi_env
    root = Path(__file__).resolve().parents[2]
    cmd = ["timeout", "-k", "5", "150", str(Path(sys.executable).parent / "tessera-run"), "-n", "2",
           str(root / "scripts" / "generate.py"), "--model", str(path), "--prompt-ids",
           ",".join(map(str, L.PROMPTS[0])), "--max-new-tokens", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=mpi_env(2))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "tokens: " + " ".join(map(str, ref["tokens"][0]))


def test_block_pool_hands_out_ids_fifo_counts_holders_and_names_misuse():
    pool = BlockPool(3, "page")
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(ValueError, match="no free page"):
        pool.allocate()
    pool.share(1)
    assert pool.refs(1) == 2
    assert pool.free(1) is False and pool.num_free == 0 and pool.refs(1) == 1     # still held once
    assert pool.free(2) and pool.free(1) and pool.num_free == 2
    assert pool.allocate() == 2                  # the block free the longest comes first
    with pytest.raises(ValueError, match="page 1 is already free"):
        pool.free(1)
    with pytest.raises(ValueError, match="page 1 is free; allocate it first"):
        pool.share(1)
    with pytest.raises(ValueError, match=r"no such page; ids are 0\.\.2"):
        pool.free(3)


def test_page_tiers_place_spill_the_oldest_and_release():
    t = PageTiers(4, n_dev=2, n_host=2)
    t.place(1)
    t.place(3)
    assert t.device_full() and list(t.slot[[1, 3]]) == [0, 1]
    assert t.victim(keep={3}) == 1 and t.victim(keep={1, 3}) is None
    assert t.spill(1) == (0, 0) and t.on_host[1] and not t.device_full()     # device slot 0 freed
    t.place(0)
    assert t.slot[0] == 0 and not t.on_host[0] and t.victim(keep=set()) == 3  # 3 is now the oldest
    for p in (1, 3, 0):
        t.release(p)
    assert (t.dev.num_free, t.host.num_free) == (2, 2) and t.victim(keep=set()) is None


def test_host_tier_spills_old_pages_and_prefetches_them_back(ckpts):
    path, ref = ckpts["A"]
    model = nn.Llama.from_pretrained(path)
    # 3 prompts, up to 49 positions each, 4-position pages: a device budget of 16 positions holds a
    # few pages per layer; the rest live on the host and come back through the staging area
    cache = nn.KVCache(model, max_tokens=192, block_size=4, device_budget_tokens=16)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32) == ref["tokens"]
    st = cache.stats()
    assert st["moved_to_host"] > 10 and 0 < st["hit_ratio"] < 0.5, st
    assert cache.k.shape[0] == model.config.num_hidden_layers * 4 + 2 * (48 - 4)   # budget + two staging layers
    assert st["blocks_device"] == st["blocks_host"] == 0                          # all pages back in the pool
    # one sequence, budget a quarter of its context: the hot tier serves the recent quarter
    cache = nn.KVCache(model, max_tokens=128, block_size=4, device_budget_tokens=32)
    out = model.generate(cache, [L.PROMPTS[2]], max_new_tokens=100)
    assert out == model.generate(nn.KVCache(model, max_tokens=128, block_size=4), [L.PROMPTS[2]], max_new_tokens=100)
    assert 0.25 < cache.stats()["hit_ratio"] < 0.6
    # with a window inside the budget nothing leaves the device
    cache = nn.KVCache(model, max_tokens=128, block_size=4, device_budget_tokens=32, window=24)
    model.generate(cache, [L.PROMPTS[2]], max_new_tokens=100)
    assert cache.stats()["hit_ratio"] == 1.0 and cache.stats()["moved_to_host"] == 0
    with pytest.raises(ValueError, match="holds only the last page"):
        model.generate(nn.KVCache(model, max_tokens=192, block_size=4, device_budget_tokens=4), L.PROMPTS,
                       max_new_tokens=4)


STANDIN_SCRIPT = """
import json, sys
import llama_tiny as L
from cupy.cuda.pinned_memory import is_pinned     # the stand-in's
from tessera_rt import nn
from tessera_rt.backend import get_backend
assert get_backend().is_gpu
out = {}
for name in ("A", "big"):          # A: head_dim 8 (the reference kernel); big: head_dim 32 (the RawKernel)
    m = nn.Llama.from_pretrained(sys.argv[1] if name == "A" else sys.argv[2])
    c = nn.KVCache(m, max_tokens=192, block_size=4, device_budget_tokens=16)
    out[name] = m.generate(c, L.PROMPTS[:2], max_new_tokens=5)
    assert c.stats()["moved_to_host"] > 0 and is_pinned(c.host_k) and is_pinned(c.host_v)   # not pageable
    c = nn.KVCache(m, max_tokens=256, block_size=4, device_budget_tokens=24)    # three rows: no padding there
    out[name + "3"] = m.generate(c, L.PROMPTS, max_new_tokens=5)
    c = nn.KVCache(m, max_tokens=64, block_size=4, window=8)                     # a window: eager steps
    out[name + "w"] = m.generate(c, [L.PROMPTS[2]], max_new_tokens=30)
    assert not any(r.graph for r in c.runners.values())
print(json.dumps(out))
"""


def test_decode_on_the_cuda_standin_matches_the_cpu(ckpts):
    """The cuda backend's path (CuPy arrays, the paged RawKernel run by the emulation harness,
    the host tier in pinned memory) on the strict CuPy stand-in gives the CPU backend's tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import mpi_env, standin_env
    here = Path(__file__).resolve().parent
    env = mpi_env(1, "cuda", standin_env())
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(here)
    proc = subprocess.run(["timeout", "-k", "5", "170", sys.executable, "-c", STANDIN_SCRIPT, str(ckpts["A"][0]),
                           str(ckpts["big"][0])], capture_output=True, text=True, env=env, cwd=here)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["A"] == [t[:5] for t in ckpts["A"][1]["tokens"][:2]]
    assert got["A3"] == [t[:5] for t in ckpts["A"][1]["tokens"]]
    big = nn.Llama.from_pretrained(ckpts["big"][0])
    assert got["big"] == big.generate(nn.KVCache(big, max_tokens=192, block_size=4), L.PROMPTS[:2], max_new_tokens=5)
    assert got["big3"] == [t[:5] for t in ckpts["big"][1]["tokens"]]
    for name in ("A", "big"):
        m = nn.Llama.from_pretrained(ckpts[name][0])
        assert got[name + "w"] == m.generate(nn.KVCache(m, max_tokens=64, block_size=4, window=8), [L.PROMPTS[2]],
                                             max_new_tokens=30)


def test_bf16_weights_and_cache(ckpts):
    path, ref = ckpts["A"]
    model = nn.Llama.from_pretrained(path, dtype="bf16")
    lg = model.logits(L.LOGIT_IDS)
    scale = np.abs(ref["logits"]).max()
    assert np.abs(lg - ref["logits"]).max() < 0.08 * scale          # bf16 rounding through two layers
    assert (lg.argmax(-1) == ref["logits"].argmax(-1)).mean() > 0.9
    cache = nn.KVCache(model, max_tokens=128)
    assert cache.k.dtype == model.dtype and cache.stats()["bytes_per_token"] == 2 * 2 * 2 * 8 * 2
    assert len(model.generate(cache, L.PROMPTS, max_new_tokens=4)[2]) == 4


ALLOC_SCRIPT = """
import json, sys
import cupy
import llama_tiny as L
from mpi4py import MPI
from tessera_rt import dist, nn
dist.init()
n = MPI.COMM_WORLD.Get_size()
mesh = dist.Mesh(axes=["tp"], shape={"tp": n}) if n > 1 else None
pool = cupy.get_default_memory_pool()          # every device array comes from this pool
malloc, count = pool.malloc, [0]
def counting(size):
    count[0] += 1
    return malloc(size)
pool.malloc = counting
m = nn.Llama.from_pretrained(sys.argv[1], mesh=mesh)
out = {}
for budget in (None, 16):                      # 16: the host tier evicts and prefetches every step
    m.generate(nn.KVCache(m, max_tokens=192, block_size=4, device_budget_tokens=budget), [L.PROMPTS[2]],
               max_new_tokens=2)               # ccl's sampling buffers are made once per process
    row = []
    for new in (4, 9):
        c = nn.KVCache(m, max_tokens=192, block_size=4, device_budget_tokens=budget)
        count[0] = 0
        toks = m.generate(c, [L.PROMPTS[2]], max_new_tokens=new)
        row.append([count[0], c.stats()["moved_to_host"], toks[0]])
    out[str(budget)] = row
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(out))
"""


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2])
def test_decode_steps_allocate_no_device_memory_after_the_first(ckpts, ranks):
    """Seed 004's persistent buffers, counted at the device allocator: on the CUDA path (the strict
    CuPy/NCCL stand-in, whose pool every device array comes from) a generate with 9 new tokens
    allocates exactly as much as one with 4 (same prefill, same first step), so the 5 extra decode
    steps allocate nothing: activations, tables, the tp all_reduces (in place) and the sampling
    all_gathers (ccl buffers), with and without host-tier eviction and prefetch.  tp = ranks."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import MPIEXEC, mpi_env, standin_env
    here = Path(__file__).resolve().parent
    env = mpi_env(ranks, "cuda", standin_env(ranks))
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(here)
    cmd = ["timeout", "-k", "5", "250"] + ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else [])
    proc = subprocess.run(cmd + [sys.executable, "-c", ALLOC_SCRIPT, str(ckpts["big"][0])], capture_output=True,
                          text=True, env=env, cwd=here)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    big = nn.Llama.from_pretrained(ckpts["big"][0])
    want = big.generate(nn.KVCache(big, max_tokens=192, block_size=4), [L.PROMPTS[2]], max_new_tokens=9)[0]
    for budget, ((n4, _, t4), (n9, moved, t9)) in got.items():
        assert n4 > 0, "the counter sees the prefill's allocations"
        assert n9 == n4, (budget, n4, n9)
        assert t9 == want and t4 == want[:4]
        assert (moved > 0) == (budget == "16")


@pytest.mark.slow
def test_llama_training_model_exports_a_checkpoint_both_loaders_read(tmp_path):
    """train.py --arch llama's model (RoPE, GQA, RMSNorm, SwiGLU) after a few AdamW steps, exported
    as a Hugging Face checkpoint: nn.Llama and transformers give the training model's logits; the
    character tokenizer round-trips; --export-hf without --arch llama is refused."""
    import tessera_rt as ts
    from tessera_rt import optim
    from tessera_rt.models.llama import LlamaLM, export_hf
    chars = list("abcdefgh ij\nklmnop")
    model = LlamaLM(len(chars), 32, 4, 2, 16, n_kv_heads=2)
    params = model.init(0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, len(chars), (4, 16))
    step = ts.value_and_grad(lambda p, a, b: model.loss(p, a, b))
    opt = optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(8):
        loss, grads = step(params, x, np.roll(x, -1, 1))
        params = opt.step(params, grads)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    out = export_hf(model, params, tmp_path / "hf", chars)
    want = np.asarray(model.logits(params, x[:2]))
    np.testing.assert_allclose(nn.Llama.from_pretrained(out).logits(x[:2]), want, rtol=1e-4, atol=1e-5)
    pytest.importorskip("torch")
    import torch
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(x[:2])).logits.numpy(), want, rtol=1e-4, atol=1e-5)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "abc ij\nkp"
    assert tok.encode(text).ids == [chars.index(c) for c in text] and tok.decode(tok.encode(text).ids) == text
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
    proc = subprocess.run([sys.executable, str(script), "--export-hf", str(tmp_path / "x"), "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--export-hf needs --arch llama" in proc.stderr


@pytest.mark.mpi
def test_generate_serves_a_train_run_as_its_hf_export(tmp_path):
    """issue 27 §5: generate.py --model takes a train.py --arch llama run directory or its
    checkpoint (the saved flags rebuild the model, dist.load reads it onto tp=2, the saved
    characters are the tokenizer): the same greedy tokens as the run's --export-hf export.  A
    char-model run, a missing directory, a hub id and a directory with neither say what was
    looked for and what to pass."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import mpi_env
    root = Path(__file__).resolve().parents[2]
    bin_dir = Path(sys.executable).parent

    def run(*cmd, ranks=1):
        launch = [str(bin_dir / "tessera-run"), "-n", str(ranks)] if ranks > 1 else [sys.executable]
        return subprocess.run(["timeout", "-k", "5", "150"] + launch + [str(c) for c in cmd], capture_output=True,
                              text=True, cwd=tmp_path, env=mpi_env(ranks))

    tiny = ["--steps", "6", "--batch", "4", "--seq", "16", "--d-model", "16", "--heads", "4", "--layers", "2",
            "--no-plot", "--data", root / "tests" / "data" / "tiny_corpus.txt"]
    train, gen = root / "scripts" / "train.py", root / "scripts" / "generate.py"
    p = run(train, "--arch", "llama", "--kv-heads", "2", "--run-dir", tmp_path / "run", "--export-hf",
            tmp_path / "hf", *tiny)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (root / "tests" / "data" / "tiny_corpus.txt").read_text()[:5]
    ask = ["--prompt", text, "--max-new-tokens", "12"]

    def tokens(model, ranks=1):
        p = run(gen, "--model", model, *ask, ranks=ranks)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout.strip().splitlines()[-1]

    want = tokens(tmp_path / "hf")
    assert want.startswith("tokens: ") and len(want.split()) == 13, want
    assert tokens(tmp_path / "run") == want
    assert tokens(tmp_path / "run" / "checkpoint") == want
    assert tokens(tmp_path / "run", ranks=2) == want

    p = run(train, "--run-dir", tmp_path / "char", *tiny)
    assert p.returncode == 0, p.stdout + p.stderr
    from tessera_rt.inference.runs import load_run
    with pytest.raises(ValueError, match=r"char/checkpoint is a train.py --arch transformer run \(a character "
                                         r"transformer with learned positions\); generate.py serves the Llama "
                                         r"architecture: train with --arch llama"):
        load_run(tmp_path / "char")
    import importlib.util
    spec = importlib.util.spec_from_file_location("generate_script", gen)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "empty").mkdir()
    cases = {tmp_path / "missing": "is not a directory; looked for a Hugging Face checkpoint",
             Path("meta-llama/Llama-3.2-1B"): "hub ids are not downloaded",
             tmp_path / "empty": "holds neither a Hugging Face checkpoint"}
    for model, msg in cases.items():
        with pytest.raises(SystemExit) as e:
            script.what_model(model)
        for part in (msg, f"({model}/config.json + *.safetensors)", f"{model}/checkpoint/index.json",
                     "--run-dir of a train.py --arch llama run"):
            assert part in str(e.value), (part, str(e.value))
    assert script.what_model(tmp_path / "char") == "run" and script.what_model(tmp_path / "hf") == "hf"
