"""Hugging Face Llama checkpoints: ``config.json`` parsed and checked, safetensors read by slice.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> file).  Tensors are
opened lazily (``safe_open(...).get_slice``) so a tensor-parallel rank reads only the rows or
columns it owns and never the whole model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LlamaConfig", "CheckpointReader", "rope_inv_freq"]

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` this runtime uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: Any = None
    eos_token_id: Any = None

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "LlamaConfig":
        """Check that ``d`` describes a Llama-shaped model; the error names the field to fix."""
        mt = d.get("model_type", "llama")
        if mt not in ("llama",):
            raise ValueError(f"{where}: model_type={mt!r} is not Llama-shaped; nn.Llama reads model_type 'llama'")
        for k in _REQUIRED:
            if not isinstance(d.get(k), int) or d[k] <= 0:
                raise ValueError(f"{where}: field {k!r} must be a positive int, got {d.get(k)!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act={act!r}; a Llama MLP is SwiGLU ('silu')")
        for k in ("attention_bias", "mlp_bias"):
            if d.get(k):
                raise ValueError(f"{where}: {k}=true is not Llama-shaped (Llama projections have no bias)")
        h, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
        if h % kv:
            raise ValueError(f"{where}: num_attention_heads={h} is not a multiple of num_key_value_heads={kv}")
        hd = d.get("head_dim") or d["hidden_size"] // h
        if hd % 2:
            raise ValueError(f"{where}: head_dim={hd} must be even for rotary embeddings")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"{where}: rope type {kind!r} is not supported; use 'default', 'linear' or 'llama3'")
        return cls(d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], h, kv, hd,
                   float(d.get("rms_norm_eps", 1e-6)), theta, dict(rope, rope_type=kind) if kind != "default" else None,
                   bool(d.get("tie_word_embeddings", False)), int(d.get("max_position_embeddings", 2048)),
                   d.get("bos_token_id"), d.get("eos_token_id"))

    @classmethod
    def from_dir(cls, path: str | Path) -> "LlamaConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"nn.Llama.from_pretrained: {path} has no config.json; pass a Hugging Face "
                             "checkpoint directory (config.json + *.safetensors)")
        return cls.from_dict(json.loads(p.read_text()), str(p))


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Rotary inverse frequencies (f32, as transformers computes them), Llama 3 scaling applied."""
    d = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)))
    inv = inv.astype(np.float32)
    r = cfg.rope_scaling
    if r is None:
        return inv
    factor = float(r["factor"])
    if r["rope_type"] == "linear":
        return (inv / factor).astype(np.float32)
    lo, hi = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old = float(r.get("original_max_position_embeddings", 8192))
    lo_wav, hi_wav = old / lo, old / hi
    wav = 2 * math.pi / inv
    scaled = np.where(wav > lo_wav, inv / factor, inv)
    smooth = (old / wav - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wav < hi_wav) & ~(wav > lo_wav)
    return np.where(medium, smoothed, scaled).astype(np.float32)


class CheckpointReader:
    """Lazy reads of named tensors, or row/column slices of them, from a safetensors checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text()).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise ValueError(f"nn.Llama.from_pretrained: {index} has no weight_map")
            self.files = {k: self.path / v for k, v in wm.items()}
        else:
            single = sorted(self.path.glob("*.safetensors"))
            if not single:
                raise ValueError(f"nn.Llama.from_pretrained: {self.path} has no weights (model.safetensors or "
                                 "model.safetensors.index.json); save the model with save_pretrained")
            self.files = {}
            for f in single:
                for k in self._open(f).keys():
                    self.files[k] = f
        missing = sorted({str(f) for f in self.files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"nn.Llama.from_pretrained: the index names missing weight files {missing}")
        self._handles: dict = {}

    def _open(self, f: Path):
        from safetensors import safe_open
        return safe_open(str(f), framework="numpy")

    def has(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """``tensor[rows, cols]`` as an f32 array, reading only that slice from disk."""
        if name not in self.files:
            raise ValueError(f"nn.Llama.from_pretrained: tensor {name!r} is not in the checkpoint at {self.path}")
        f = self.files[name]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(f)
        sl = h.get_slice(name)
        idx = (slice(None) if rows is None else rows,) + (() if cols is None else (cols,))
        if sl.get_dtype() == "BF16":        # NumPy has no bf16: read the raw bits and widen
            return _bf16_slice(f, name, sl.get_shape(), idx)
        return np.ascontiguousarray(sl[idx], dtype=np.float32)


def _bf16_slice(f: Path, name: str, shape: list, idx: tuple) -> np.ndarray:
    """Rows (and columns) of a bf16 tensor through a memory map of just its bytes."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))[name]
    start, end = meta["data_offsets"]
    u16 = np.memmap(f, dtype=np.uint16, mode="r", offset=8 + n + start, shape=tuple(shape))
    part = np.asarray(u16[idx]).astype(np.uint32) << 16
    return part.view(np.float32)
