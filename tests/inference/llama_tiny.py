"""Tiny random Llama checkpoints built locally with transformers (CPU, no download), and the
Hugging Face reference outputs the inference tests compare against."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# A: GQA 12/2 (kv heads replicated at tp=4), Llama 3 rope scaling, untied head, sharded files
# B: 6/3 heads (tp=3 works), default rope, tied head, one file
CONFIGS = {
    "A": dict(vocab_size=101, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=12,
              num_key_value_heads=2, head_dim=8, rope_theta=500000.0, tie_word_embeddings=False,
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=16)),
    "B": dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=3, head_dim=8, rope_theta=10000.0, tie_word_embeddings=True),
}
PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [8, 2, 96, 50, 3, 3, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
LOGIT_IDS = np.random.default_rng(0).integers(0, 97, (2, 11))


def build(root: Path, name: str, sharded: bool | None = None, tag: str = "", **overrides) -> Path:
    """Save a random LlamaForCausalLM ``name`` (fields changed by ``overrides``) under
    ``root/(name + tag)``; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(CONFIGS[name], initializer_range=0.25, **overrides)
    torch.manual_seed(len(name) + sum(map(ord, name)))
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    out = Path(root) / (name + tag)
    sharded = name == "A" if sharded is None else sharded
    model.save_pretrained(out, max_shard_size="40KB" if sharded else "1GB")
    return out


def hf_reference(path: Path, max_new_tokens: int = 32, ids=LOGIT_IDS) -> dict:
    """transformers' logits on ``ids`` and greedy tokens for PROMPTS (eos disabled)."""
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.numpy()
        tokens = [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                  for p in PROMPTS]
    return {"logits": logits, "tokens": tokens}


def cached_bundle() -> dict:
    """``{"A": (dir, ref), "B": (dir, ref), "big": (dir, ref)}``, built once per version of this
    file and of transformers and kept in the temp dir, so each multi-rank launch after the first
    skips importing torch (about 20 s on a loaded 2-core machine)."""
    import hashlib
    import json
    import os
    import tempfile
    from importlib.metadata import version
    key = hashlib.sha256(Path(__file__).read_bytes() + version("transformers").encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"tessera_llama_{key}"
    if not (root / "refs.json").is_file():
        work = Path(tempfile.mkdtemp(prefix="tessera_llama_build_"))
        refs = {}
        for n in ("A", "B"):
            r = hf_reference(build(work, n))
            refs[n] = {"tokens": r["tokens"]}
            np.save(work / f"{n}_logits.npy", r["logits"])
        big = build(work, "A", tag="big", hidden_size=256, intermediate_size=512, vocab_size=1001,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32)
        r = hf_reference(big, ids=LOGIT_IDS * 10)
        refs["big"] = {"tokens": r["tokens"]}
        np.save(work / "big_logits.npy", r["logits"])
        (work / "refs.json").write_text(json.dumps(refs))
        try:
            os.rename(work, root)                 # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    refs = json.loads((root / "refs.json").read_text())
    out = {n: (root / (n if n != "big" else "Abig"), {"tokens": refs[n]["tokens"],
                                                      "logits": np.load(root / f"{n}_logits.npy")}) for n in refs}
    return out


def paged(rng, lens, bs, hkv, d, nb=40):
    """Block tables (a random permutation of ``nb`` pages) for sequences of ``lens`` positions,
    and random f32 K and V pages ``(nb, hkv, bs, d)``."""
    perm = rng.permutation(nb)
    tables = np.full((len(lens), max(-(-n // bs) for n in lens)), -1, np.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        tables[i, :k] = perm[used:used + k]
        used += k
    kp = rng.standard_normal((nb, hkv, bs, d)).astype(np.float32)
    vp = rng.standard_normal((nb, hkv, bs, d)).astype(np.float32)
    return tables, kp, vp


def gathered(p, table, n, bs):
    """The first ``n`` positions of a sequence's pages ``p`` through its ``table``: ``(Hkv, n, D)``."""
    return np.concatenate([p[b] for b in table[:-(-n // bs)]], axis=1)[:, :n]       # (Hkv, n, D)


@pytest.fixture(scope="module", name="ckpts")
def fixture_ckpts():
    """The bundle (``cached_bundle``) for a test module: ``from llama_tiny import fixture_ckpts``
    (named apart from the ``ckpts`` its tests ask for, which would shadow the import)."""
    pytest.importorskip("torch", reason="the transformers oracle needs torch (scripts/test.sh installs the CPU wheel)")
    return cached_bundle()
