"""Generate text with a Llama-architecture model from a Hugging Face checkpoint or a train.py run.

    tessera-run -n 2 scripts/generate.py --model DIR --prompt-ids 1,2,3 --max-new-tokens 32
    .venv/bin/python scripts/generate.py --model DIR --prompt "Tessera is" --temperature 0.8 --top-p 0.9

DIR holds config.json and model.safetensors (or shards with model.safetensors.index.json), as
transformers' save_pretrained writes them, or is a `scripts/train.py --arch llama` run: its
--run-dir (DIR/checkpoint) or that checkpoint directory; the model is rebuilt from the saved
flags and the run's character vocabulary is the tokenizer.  tp is the world size unless
--tp/--dp say otherwise; from a Hugging Face directory every rank reads only its slices of the
weights (from a run: the whole parameters, then its slices).  --prompt needs a tokenizer: a
run's characters, or in a Hugging Face DIR tokenizer.json (read with the `tokenizers` package)
or the character vocabulary (tessera_chars.json) that `scripts/train.py --arch llama
--export-hf DIR` writes.  Rank 0 prints the decoded text (when a tokenizer is present) and,
last, `tokens: ` and the generated ids of the first prompt.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (config.json + *.safetensors) "
                   "or a train.py --arch llama run directory (DIR/checkpoint) or checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated (e.g. 1,2,3)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same tokens on any mesh)")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel ranks (0: world size / dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32, bf16 or fp16")
    p.add_argument("--max-tokens", type=int, default=4096, help="KV cache positions")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size (positions)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens prefilled per step (a longer prompt is prefilled in chunks)")
    return p.parse_args(argv)


class CharTokenizer:
    """The character vocabulary train.py exports (tessera_chars.json: a list of characters)."""

    def __init__(self, chars: list):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise SystemExit(f"generate.py: the prompt has characters outside the model's vocabulary: {bad!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(model_dir: Path):
    if (model_dir / "tessera_chars.json").is_file():
        return CharTokenizer(json.loads((model_dir / "tessera_chars.json").read_text()))
    if (model_dir / "tokenizer.json").is_file():
        try:
            return HFTokenizer(model_dir / "tokenizer.json")
        except ImportError:
            return None
    return None


def what_model(model_dir: Path) -> str:
    """"hf" (config.json), "run" (a train.py checkpoint), or SystemExit saying what was looked for."""
    from tessera_rt.inference.runs import run_checkpoint
    if (model_dir / "config.json").is_file():
        return "hf"
    if run_checkpoint(model_dir) is not None:
        return "run"
    exists = model_dir.is_dir()
    looked = (f"a Hugging Face checkpoint ({model_dir / 'config.json'} + *.safetensors) {'nor' if exists else 'or'} "
              f"a train.py run ({model_dir / 'checkpoint' / 'index.json'}, or {model_dir / 'index.json'})")
    raise SystemExit(f"generate.py: --model {model_dir} "
                     + (f"holds neither {looked}" if exists else f"is not a directory; looked for {looked}")
                     + ". Pass a local directory: one that save_pretrained or train.py --export-hf wrote, or the "
                     "--run-dir of a train.py --arch llama run (hub ids are not downloaded: save the model locally "
                     "first)")


def main(argv=None) -> int:
    args = parse_args(argv)
    from tessera_rt import dist, nn

    world = dist.init()
    n = world.size
    tp = args.tp or max(n // max(args.dp, 1), 1)
    if tp * args.dp != n:
        raise SystemExit(f"generate.py: --tp {tp} x --dp {args.dp} = {tp * args.dp} ranks but the job has {n}; "
                         f"launch with tessera-run -n {tp * args.dp} or change --tp/--dp")
    model_dir = Path(args.model)
    kind = what_model(model_dir)
    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": args.dp, "tp": tp})
    try:
        if kind == "run":
            from tessera_rt.inference.runs import load_run
            model, chars = load_run(model_dir, mesh=mesh, dtype=args.dtype)
            tok = CharTokenizer(chars)
        else:
            model, tok = nn.Llama.from_pretrained(model_dir, mesh=mesh, dtype=args.dtype), load_tokenizer(model_dir)
    except ValueError as e:
        raise SystemExit(f"generate.py: --model {model_dir}: {e}") from None
    if args.prompt is not None:
        if tok is None:
            raise SystemExit(f"generate.py: --prompt needs a tokenizer (tokenizer.json or tessera_chars.json) in "
                             f"{model_dir}; pass --prompt-ids instead")
        prompt = tok.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise SystemExit(f"generate.py: --prompt-ids {args.prompt_ids!r} must be comma-separated ints") from None
    if args.max_new_tokens < 0:
        raise SystemExit(f"generate.py: --max-new-tokens {args.max_new_tokens}: pass 0 or more")
    need = len(prompt) + args.max_new_tokens
    if need > args.max_tokens:         # said in flags here: the API's own error names nn.KVCache's arguments
        raise SystemExit(f"generate.py: the prompt's {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} "
                         f"= {need} positions, more than --max-tokens {args.max_tokens} (the KV cache); raise "
                         f"--max-tokens to {need} or more, or lower --max-new-tokens")
    try:
        cache = nn.KVCache(model, max_tokens=args.max_tokens, block_size=args.block_size)
        t0 = time.perf_counter()
        out = model.generate(cache, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             max_prefill_tokens=args.max_prefill_tokens)
        dt = time.perf_counter() - t0
    except ValueError as e:
        raise SystemExit(f"generate.py: {e}") from None
    if world.rank == 0:
        print(f"generated {len(out[0])} tokens in {dt:.2f} s on {n} ranks (tp={tp}, dp={args.dp})", flush=True)
        if tok is not None:
            print(tok.decode(prompt) + tok.decode(out[0]), flush=True)
        print("tokens: " + " ".join(str(t) for t in out[0]), flush=True)
    return 0


if __name__ == "__main__":
    from tessera_rt.dist.comm.script import exit_once
    sys.exit(exit_once(main))
