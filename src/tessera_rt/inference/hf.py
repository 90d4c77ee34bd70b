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
    """The fields of a Hugging Face ``LlamaConfig`` this runtime uses.

    Parameters
    ----------
    vocab_size, hidden_size, intermediate_size : int
        Vocabulary, model and MLP widths.
    num_hidden_layers : int
        Blocks.
    num_attention_heads, num_key_value_heads : int
        Query and key/value heads.
    head_dim : int
        Per head.
    rms_norm_eps : float
        The RMSNorms' eps.
    rope_theta : float
        RoPE's base.
    rope_scaling : dict, optional
        Llama 3's RoPE scaling, as config.json gives it.
    tie_word_embeddings : bool
        The head shares the embedding.
    max_position_embeddings : int
        The longest position.
    bos_token_id, eos_token_id : int or list of int, optional
        As config.json gives them.
    """

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
    def from_dict(cls, d: dict, where: str = "config.json") -> LlamaConfig:
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
    def from_dir(cls, path: str | Path) -> LlamaConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"nn.Llama.from_pretrained: {path} has no config.json; pass a Hugging Face "
                             "checkpoint directory (config.json + *.safetensors)")
        return cls.from_dict(json.loads(p.read_text()), str(p))


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Rotary inverse frequencies (f32, as transformers computes them), Llama 3 scaling applied.

    Parameters
    ----------
    cfg : LlamaConfig
        The model's config.

    Returns
    -------
    numpy.ndarray
        ``(head_dim // 2,)`` f32.
    """
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
    """Lazy reads of named tensors, or row/column slices of them, from a safetensors checkpoint.

    Parameters
    ----------
    path : str or Path
        The checkpoint directory (``model.safetensors.index.json`` or ``*.safetensors``).
    """

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
        try:
            return safe_open(str(f), framework="numpy")
        except Exception as e:              # safetensors' own errors name no file
            raise ValueError(f"nn.Llama.from_pretrained: {f} cannot be read as safetensors ({e}): it is truncated or "
                             "corrupt; save or download it again") from None

    def _handle(self, name: str):
        f = self.files[name]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(f)
        return h

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name``.

        Parameters
        ----------
        name : str
            The tensor's name.

        Returns
        -------
        bool
            True when present.
        """
        return name in self.files

    def shape(self, name: str) -> tuple:
        """A tensor's shape, from its file's header (no data read).

        Parameters
        ----------
        name : str
            The tensor's name.

        Returns
        -------
        tuple
            The shape.
        """
        return tuple(self._handle(name).get_slice(name).get_shape())

    def check(self, cfg: LlamaConfig, where: str, allow_unused: bool = False) -> None:
        """Every tensor ``cfg`` needs is there with the shape it implies, and (unless
        ``allow_unused``) nothing else is: a config that disagrees with its weights is refused
        before any read, naming the file, the tensor and the config field.

        Parameters
        ----------
        cfg : LlamaConfig
            The config.
        where : str
            Names the caller in errors.
        allow_unused : bool
            Accept tensors the config does not use.
        """
        expected = _expected_shapes(cfg, tied=cfg.tie_word_embeddings or "lm_head.weight" not in self.files)
        cfg_file = self.path / "config.json"
        for name, dims in expected.items():
            if name not in self.files:
                layer = _layer_of(name)
                why = (f" (layer {layer}: num_hidden_layers={cfg.num_hidden_layers} in {cfg_file}, but the weights "
                       f"hold {_n_layers(self.files)} layers)" if layer is not None else "")
                raise ValueError(f"{where}: tensor {name!r} is not in the checkpoint at {self.path}{why}")
            got = self.shape(name)
            want = tuple(n for n, _ in dims)
            if got != want:
                bad = [f"dim {d}: {field} = {n}, the tensor has {g}"
                       for d, ((n, field), g) in enumerate(zip(dims, got)) if n != g] or [
                       f"{len(got)} dims, expected {len(want)}"]
                raise ValueError(f"{where}: {self.files[name]}: tensor {name!r} has shape {got} but {cfg_file} "
                                 f"implies {want} ({'; '.join(bad)}): the config does not describe these weights; "
                                 "fix the field in config.json")
        unused = sorted(k for k in self.files if k not in expected and not k.endswith("rotary_emb.inv_freq"))
        if unused and not allow_unused:
            layers = _n_layers(self.files)
            hint = (f"num_hidden_layers={cfg.num_hidden_layers} in {cfg_file} but the weights hold {layers} layers; "
                    if layers > cfg.num_hidden_layers else "")
            files = sorted({str(self.files[k]) for k in unused})
            raise ValueError(f"{where}: the checkpoint at {self.path} holds {len(unused)} tensor(s) the config does "
                             f"not use ({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}, in {files}): "
                             f"{hint}fix config.json, or pass allow_unused=True to load without them")

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """``tensor[rows, cols]`` as an f32 array, reading only that slice from disk.

        Parameters
        ----------
        name : str
            The tensor's name.
        rows, cols : slice, optional
            The slice read (None: all).

        Returns
        -------
        numpy.ndarray
            f32.
        """
        if name not in self.files:
            raise ValueError(f"nn.Llama.from_pretrained: tensor {name!r} is not in the checkpoint at {self.path}")
        f = self.files[name]
        sl = self._handle(name).get_slice(name)
        idx = (slice(None) if rows is None else rows,) + (() if cols is None else (cols,))
        if sl.get_dtype() == "BF16":        # NumPy has no bf16: read the raw bits and widen
            return _bf16_slice(f, name, sl.get_shape(), idx)
        return np.ascontiguousarray(sl[idx], dtype=np.float32)


class StateDictReader(CheckpointReader):
    """``CheckpointReader``'s reads from tensors already in memory (a Hugging Face state dict of
    full arrays, e.g. a train.py run's parameters): the same checks and slices."""

    def __init__(self, tensors: dict, path: str | Path):
        self.path, self.tensors = Path(path), tensors
        self.files = {k: self.path for k in tensors}

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        a = self.tensors[name]
        idx = (slice(None) if rows is None else rows,) + (() if cols is None else (cols,))
        return np.ascontiguousarray(a[idx], dtype=np.float32)


def _expected_shapes(cfg: LlamaConfig, tied: bool) -> dict:
    """Each tensor a Llama of ``cfg`` reads: its Hugging Face (out, in) shape, each dim with
    the config field(s) it comes from."""
    h = (cfg.hidden_size, "hidden_size")
    v = (cfg.vocab_size, "vocab_size")
    f = (cfg.intermediate_size, "intermediate_size")
    q = (cfg.num_attention_heads * cfg.head_dim,
         f"num_attention_heads x head_dim = {cfg.num_attention_heads} x {cfg.head_dim}")
    kv = (cfg.num_key_value_heads * cfg.head_dim,
          f"num_key_value_heads x head_dim = {cfg.num_key_value_heads} x {cfg.head_dim}")
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
    return out


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def _n_layers(names) -> int:
    return 1 + max((_layer_of(n) for n in names if _layer_of(n) is not None), default=-1)


def _bf16_slice(f: Path, name: str, shape: list, idx: tuple) -> np.ndarray:
    """Rows (and columns) of a bf16 tensor through a memory map of just its bytes."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))[name]
    start, end = meta["data_offsets"]
    u16 = np.memmap(f, dtype=np.uint16, mode="r", offset=8 + n + start, shape=tuple(shape))
    part = np.asarray(u16[idx]).astype(np.uint32) << 16
    return part.view(np.float32)
