"""scripts/gpu_check.py's decode part: nn.Llama against transformers' LlamaForCausalLM on the
same device, on a random fp16 Llama checkpoint written here (nothing is downloaded).

    python scripts/gpu_check.py --decode-only [--quick]

The model is the issue-39 1B class (hidden 2048, 16 layers, 32/8 heads, ffn 5632, vocab 32000),
or a tiny one with --quick.  First the greedy tokens of both are compared (a few steps, every
sequence): where they part, transformers' two best logits at that step must be within fp16
rounding of each other (a tie either may break), or the part fails and nothing is timed.
Then, at batch 1 and 16, 128-token prompts (8 with --quick), medians of a few repeats:

* prompt + first token: ``generate(max_new_tokens=1)`` on each side (tessera: the packed
  prefill, the first token sampled on the device and read back);
* decode ms/token: ``(t(1 + N) - t(1)) / N`` (tessera: CUDA-graph steps after the warm-up).

One ``DECODE {json}`` line per batch (gpu_check.py makes the table rows) and a ``TOKENS`` line.
transformers runs on the GPU where torch sees one, else on the CPU (a correctness peer only:
its times are then not compared).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32)
TIE = 0.05          # transformers' top-2 logit gap (absolute) under which fp16 may break a tie either way


def write_checkpoint(root: Path, cfg: dict) -> int:
    """A random fp16 Llama checkpoint (config.json + model.safetensors); returns its weight bytes
    read per decode step (the embedding is gathered, not read)."""
    from safetensors.numpy import save_file
    h, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
                       p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 22) * 0.02).astype(np.float16)      # transformers' initializer_range
    tensors = {}
    for k, s in shapes.items():
        if len(s) == 1:
            tensors[k] = (1 + 0.1 * rng.standard_normal(s)).astype(np.float16)
        else:        # a random offset into one block: distinct weights without drawing a billion numbers
            n = int(np.prod(s))
            start = int(rng.integers(0, block.size))
            tensors[k] = np.resize(np.roll(block, -start), n).reshape(s)
    save_file(tensors, str(root / "model.safetensors"))
    # no eos: neither side stops or masks a token (transformers' min_new_tokens would mask an eos id)
    (root / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                                                      max_position_embeddings=4096, tie_word_embeddings=False,
                                                      bos_token_id=None, eos_token_id=None, torch_dtype="float16")))
    return sum(int(np.prod(s)) * 2 for k, s in shapes.items() if k != "model.embed_tokens.weight")


class Peer:
    """transformers' LlamaForCausalLM on the same checkpoint (GPU when torch sees one)."""

    def __init__(self, root: Path):
        import torch
        from transformers import LlamaForCausalLM
        self.torch = torch
        self.gpu = torch.cuda.is_available()
        dev = "cuda" if self.gpu else "cpu"
        dt = torch.float16 if self.gpu else torch.float32
        try:
            m = LlamaForCausalLM.from_pretrained(root, dtype=dt)
        except TypeError:                    # transformers < 4.56 named it torch_dtype
            m = LlamaForCausalLM.from_pretrained(root, torch_dtype=dt)
        self.model, self.dev = m.to(dev).eval(), dev

    def generate(self, prompts: list, n: int, scores: bool = False):
        torch = self.torch
        ids = torch.tensor(prompts, device=self.dev)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0,
                                      output_scores=scores, return_dict_in_generate=scores)
        if self.gpu:
            torch.cuda.synchronize()
        if not scores:
            return out
        toks = out.sequences[:, ids.shape[1]:].tolist()
        return toks, [s.float().cpu().numpy() for s in out.scores]


def check_tokens(ours: list, theirs: list, scores: list) -> tuple[bool, str]:
    """Equal greedy tokens, or a first difference where transformers' top two were tied."""
    worst, notes = 0.0, []
    for b, (a, t) in enumerate(zip(ours, theirs)):
        step = next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), None)
        if step is None:
            continue
        top2 = np.sort(scores[step][b])[-2:]
        gap = float(top2[1] - top2[0])
        worst = max(worst, gap)
        notes.append(f"seq {b} parts at step {step} (transformers' top-2 gap {gap:.3g})")
    same = sum(a == t for a, t in zip(ours, theirs))
    ok = worst <= TIE
    text = f"greedy tokens: {same}/{len(ours)} sequences equal" + (f"; {'; '.join(notes[:3])}" if notes else "")
    return ok, text


def run(quick: bool) -> int:
    from tessera_rt import nn
    from tessera_rt.backend import get_backend
    be = get_backend()
    cfg = QUICK if quick else FULL
    prompt, new, batches, reps, agree = (8, 4, [1, 16], 1, 4) if quick else (128, 32, [1, 16], 3, 8)
    root = Path(tempfile.mkdtemp(prefix="ts_gpu_check_decode_"))
    try:
        weight_bytes = write_checkpoint(root, cfg)
        model = nn.Llama.from_pretrained(root, dtype="fp16")
        try:
            peer = Peer(root)
        except ImportError as exc:
            peer = None
            print(f"no transformers peer ({exc}): tessera_rt alone", flush=True)
        peak_bw = None
        if be.is_gpu and not getattr(be.xp, "__tessera_standin__", False):
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_kernels import peak_for
            props = be.xp.cuda.runtime.getDeviceProperties(be.xp.cuda.Device().id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            peak_bw = peak_for(name)[1]
        rng = np.random.default_rng(1)
        model_text = (f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads "
                      f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, fp16 ({weight_bytes / 1e9:.2f} GB)")
        for b in batches:
            prompts = rng.integers(0, cfg["vocab_size"], (b, prompt)).tolist()
            cache = nn.KVCache(model, max_tokens=b * (prompt + new + 16), block_size=16)

            def ours(n):
                t = time.perf_counter()
                out = model.generate(cache, prompts, max_new_tokens=n, max_prefill_tokens=None)
                return time.perf_counter() - t, out
            row = dict(model=model_text, batch=b, prompt=prompt)
            if peer is not None:
                got = ours(agree)[1]
                theirs, scores = peer.generate(prompts, agree, scores=True)
                ok, row["tokens"] = check_tokens(got, theirs, scores)
                print(f"TOKENS batch {b}: {row['tokens']}", flush=True)
                if not ok:
                    print(f"DECODE {json.dumps(row)}", flush=True)
                    print("FAILED: tessera_rt's greedy tokens part from transformers' where its logits are not tied",
                          flush=True)
                    return 1
            ours(2), ours(1 + new)                                   # warm-up: compiles, captures the graphs
            t1 = sorted(ours(1)[0] for _ in range(reps))[reps // 2]
            tn = sorted(ours(1 + new)[0] for _ in range(reps))[reps // 2]
            row.update(first_ms=t1 * 1e3, ms_per_token=max(tn - t1, 0.0) / new * 1e3,
                       roofline_ms=weight_bytes / (peak_bw * 1e12) * 1e3 if peak_bw else None,
                       graphs=sum(r.graph is not None for r in cache.runners.values()),
                       refused=sorted({r.refused for r in cache.runners.values() if r.refused}))
            if peer is not None:
                peer.generate(prompts, 2)
                p1 = sorted(_timed(lambda: peer.generate(prompts, 1)) for _ in range(reps))[reps // 2]
                pn = sorted(_timed(lambda: peer.generate(prompts, 1 + new)) for _ in range(reps))[reps // 2]
                row.update(peer_first_ms=p1 * 1e3, peer_ms_per_token=max(pn - p1, 0.0) / new * 1e3,
                           peer_device="GPU" if peer.gpu else "CPU")
            print("DECODE " + json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
