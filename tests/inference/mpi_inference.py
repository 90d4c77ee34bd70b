"""nn.Llama tensor-parallel on every tp the job's ranks allow (dp takes the rest, each replica
decoding its share of the prompts): logits and
32 greedy tokens equal transformers' on the same checkpoint, sampled tokens equal the
single-process ones, heads that the mesh cannot split raise the same clear error on every
rank, and a rank reads only its slices of the checkpoint (peak memory against the shard)."""
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from tessera_rt import dist, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tiny as L

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
TPS = [t for t in (1, 2, 3, 4) if SIZE % t == 0]
ALLOWED = {"A": (1, 2, 4), "B": (1, 3)}          # A: 12 heads / 2 kv heads; B: 6 / 3
_MESHES: dict = {}
pytestmark = pytest.mark.timeout(240)


def mesh_for(tp):
    if tp not in _MESHES:
        dist.init()
        _MESHES[tp] = dist.Mesh(axes=["dp", "tp"], shape={"dp": SIZE // tp, "tp": tp})
    return _MESHES[tp]


@pytest.fixture(scope="module")
def ckpts():
    """Rank 0 builds (or finds) the checkpoints and transformers' outputs; only it may import torch."""
    data = None
    if RANK == 0:
        try:
            import torch  # noqa: F401  (can torch be imported? find_spec would miss a broken install)
            data = {n: (str(p), r) for n, (p, r) in L.cached_bundle().items()}
        except ImportError:
            pass
    data = COMM.bcast(data)
    if data is None:          # every rank skips together
        pytest.skip("the transformers oracle needs torch (scripts/test.sh installs the CPU wheel)")
    return data


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", ["A", "B"])
def test_logits_and_greedy_tokens_equal_transformers(ckpts, name, tp):
    path, ref = ckpts[name]
    if tp not in ALLOWED[name]:
        with pytest.raises(ValueError, match=f"tp={tp}"):      # before any collective, on every rank
            nn.Llama.from_pretrained(path, mesh=mesh_for(tp))
        return
    model = nn.Llama.from_pretrained(path, mesh=mesh_for(tp))
    np.testing.assert_allclose(model.logits(L.LOGIT_IDS), ref["logits"], rtol=1e-4, atol=1e-4)
    cache = nn.KVCache(model, max_tokens=128, block_size=8)
    assert model.generate(cache, L.PROMPTS, max_new_tokens=32) == ref["tokens"]
    if tp > 1:                    # the host tier with the cache sharded (tp=1: tests/inference/test_inference.py)
        spill = nn.KVCache(model, max_tokens=192, block_size=4, device_budget_tokens=16)
        assert model.generate(spill, L.PROMPTS, max_new_tokens=32) == ref["tokens"]
        assert COMM.allreduce(spill.stats()["moved_to_host"], op=MPI.MAX) > 0   # a dp replica may hold no prompt


@pytest.mark.parametrize("tp", [t for t in TPS if t > 1] or [1])      # tp=1 is the single-process run itself
def test_sampled_tokens_are_the_same_on_any_mesh(ckpts, tp):
    name = "A" if tp in ALLOWED["A"] else "B"
    path = ckpts[name][0]
    single = nn.Llama.from_pretrained(path)
    model = nn.Llama.from_pretrained(path, mesh=mesh_for(tp))
    for kw in (dict(temperature=0.8), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=30, top_p=0.8)):
        want = single.generate(nn.KVCache(single, max_tokens=128), L.PROMPTS, max_new_tokens=10, seed=4, **kw)
        got = model.generate(nn.KVCache(model, max_tokens=128), L.PROMPTS, max_new_tokens=10, seed=4, **kw)
        assert got == want, kw


def _peak_load(path, mesh):
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    model = nn.Llama.from_pretrained(path, mesh=mesh)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    p = model.params
    held = sum(a.nbytes for a in [p["embed"], p["norm"], p["head"]] + [v for lay in p["layers"] for v in lay.values()])
    return peak, held


def test_each_rank_reads_only_its_slices(ckpts):
    path = ckpts["big"][0]
    full_peak, full = _peak_load(path, None)
    assert full_peak >= full                        # the measure sees a whole model load
    tp = max(t for t in TPS if t in ALLOWED["A"])
    if tp == 1:
        return
    peak, held = _peak_load(path, mesh_for(tp))
    assert held < 0.6 * full
    assert peak < full / tp + 0.3 * full, (peak, held, full)     # the shard and one tensor's temporaries


@pytest.mark.parametrize("tp", TPS)
def test_decode_steps_ask_the_runtime_for_no_buffers(ckpts, tp):
    """On CPU ranks: 5 decode steps more ask the backend for no array (every collective of a step,
    the tp all_reduces and the sampling all_gathers, writes into a persistent out=) and make no
    ccl buffer.  The CPU reference kernels' own NumPy temporaries are not counted here; the
    device-allocator count is tests/inference/test_inference.py's stand-in test."""
    from tessera_rt.backend import get_backend
    from tessera_rt.dist import ccl
    name = "A" if tp in ALLOWED["A"] else "B"
    model = nn.Llama.from_pretrained(ckpts[name][0], mesh=mesh_for(tp))
    be, calls = get_backend(), [0]
    real = be.empty, be.empty_like

    def counted(fn):
        def f(*a, **k):
            calls[0] += 1
            return fn(*a, **k)
        return f
    counts = []
    model.generate(nn.KVCache(model, max_tokens=128), L.PROMPTS[:2], max_new_tokens=2, temperature=0.7, top_k=5)
    be.empty, be.empty_like = counted(real[0]), counted(real[1])
    try:
        for new in (4, 9):
            calls[0], a0 = 0, ccl.allocations()
            model.generate(nn.KVCache(model, max_tokens=128, block_size=4, device_budget_tokens=16), L.PROMPTS[:2],
                           max_new_tokens=new, temperature=0.7, top_k=5)
            counts.append((calls[0], ccl.allocations() - a0))
    finally:
        be.empty, be.empty_like = real
    assert counts[1] == counts[0], counts


@pytest.mark.parametrize("tp", TPS)
def test_llama_training_model_on_the_mesh_equals_single_process(tp):
    """train.py --arch llama's model (RoPE, GQA) on tp x dp: loss, gradients and the exported
    Hugging Face tensors equal the single-process model's; heads the mesh cannot split raise."""
    import tessera_rt as ts
    from tessera_rt.dist.tensor.dtensor import DTensor
    from tessera_rt.models.llama import LlamaLM, hf_state_dict
    kv = 4 if tp == 4 else 6
    mesh = mesh_for(tp)
    single, model = (LlamaLM(29, 48, 12, 2, 8, n_kv_heads=kv, mesh=m) for m in (None, mesh))
    x = np.random.default_rng(1).integers(0, 29, (12, 8))
    y = np.roll(x, -1, 1)
    f1, f2 = (ts.value_and_grad(lambda p, a, b, m=m: m.loss(p, a, b)) for m in (single, model))
    p1, p2 = single.init(3), model.init(3)
    l1, g1 = f1(p1, x, y)
    l2, g2 = f2(p2, model.batch(x), model.batch(y))
    np.testing.assert_allclose(float(l2.full_tensor()), float(l1), rtol=1e-5)
    full = (lambda a: a.full_tensor() if isinstance(a, DTensor) else a)
    for a, b in zip(_leaves(g2), _leaves(g1)):
        np.testing.assert_allclose(full(a), b, rtol=1e-4, atol=1e-6)
    want, got = hf_state_dict(single, p1), hf_state_dict(model, p2)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    if tp > 1:
        with pytest.raises(ValueError, match=f"tp={tp}"):
            LlamaLM(29, 48, 12, 2, 8, n_kv_heads=1, mesh=mesh)


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _leaves(t)]
    return [tree]
