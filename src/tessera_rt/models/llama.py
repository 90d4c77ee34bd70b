"""A Llama-shaped language model to train with ``ts.value_and_grad`` (``scripts/train.py --arch
llama``) and its export as a Hugging Face Llama checkpoint that ``nn.Llama.from_pretrained`` and
transformers' ``LlamaForCausalLM`` both load.

``LlamaLM`` is ``nn.Transformer``'s decoder with Llama's parts: rotary positions (RoPE, the
``rotate_half`` convention transformers uses, so the exported q/k weights need no permutation)
instead of learned positions, grouped-query attention (``n_kv_heads`` may divide ``n_heads``),
RMSNorm, a SwiGLU MLP, no biases and an untied head.  It is written with ``op.*`` on the same
modules (``nn.Linear``, ``nn.RMSNorm``, ``nn.SwiGLUMLP``, ``nn.Embedding``), so it trains on any
mesh ``nn.Transformer`` does (tp shards heads and kv heads, dp the batch).  No pipeline or MoE.

``export_hf(model, params, out_dir, chars)`` writes config.json, model.safetensors, the character
vocabulary (``tessera_chars.json``, read by scripts/generate.py) and a ``tokenizers``
tokenizer.json for it.  It is collective (each parameter is gathered); rank 0 writes.
Serving a run (``inference.runs.load_run``) reads it back into an ``nn.Llama``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import op
from ..dist.comm.mesh import Mesh
from ..dist.tensor.dtensor import DTensor, distribute
from ..dist.tensor.layout import ShardSpec
from ..nn import Embedding, Linear, Module, RMSNorm, SwiGLUMLP, TransformerBlock, cross_entropy

__all__ = ["LlamaLM", "RopeAttention", "LlamaBlock", "export_hf", "hf_state_dict", "rotate_half_matrix",
           "char_tokenizer_json"]


def rotate_half_matrix(d: int) -> np.ndarray:
    """``R`` with ``x @ R == concat(-x[d/2:], x[:d/2])`` (transformers' ``rotate_half``)."""
    h = d // 2
    r = np.zeros((d, d), np.float32)
    r[np.arange(h) + h, np.arange(h)] = -1.0
    r[np.arange(h), np.arange(h) + h] = 1.0
    return r


class RopeAttention(Module):
    """Causal attention with rotary positions and grouped-query heads, heads over tp."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, seq_len: int, *, theta: float = 10000.0,
                 mesh=None, tp_axis: str = "tp", dtype="float32"):
        super().__init__(mesh, tp_axis, dtype)
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"RopeAttention: d_model={d_model} must be a multiple of n_heads={n_heads}, and "
                             f"n_heads a multiple of n_kv_heads={n_kv_heads}")
        self.h, self.kv, self.hd, self.seq_len, self.theta = n_heads, n_kv_heads, d_model // n_heads, seq_len, theta
        if self.hd % 2:
            raise ValueError(f"RopeAttention: head_dim={self.hd} must be even for rotary positions")
        tp = mesh.size(self.tp) if self.tp is not None else 1
        if n_heads % tp or n_kv_heads % tp:
            raise ValueError(f"RopeAttention: n_heads={n_heads} and n_kv_heads={n_kv_heads} must both be multiples "
                             f"of the mesh's {tp_axis}={tp} (each rank holds whole heads); change --heads/--kv-heads "
                             f"or --tp")
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.q = Linear(d_model, n_heads * self.hd, parallel="column", **kw)
        self.k, self.v = (Linear(d_model, n_kv_heads * self.hd, parallel="column", **kw) for _ in range(2))
        self.o = Linear(n_heads * self.hd, d_model, parallel="row", std=1.0 / math.sqrt(2 * d_model), **kw)
        # constants: cos/sin of every position (f32 angles, as transformers) and rotate_half's matrix
        inv = (1.0 / (np.float32(theta) ** (np.arange(0, self.hd, 2, dtype=np.int64).astype(np.float32) / self.hd)))
        f = np.arange(seq_len, dtype=np.float32)[:, None] * inv.astype(np.float32)
        emb = np.concatenate([f, f], axis=-1)
        self.cos, self.sin = self._place(np.cos(emb), None), self._place(np.sin(emb), None)
        self.rot = self._place(rotate_half_matrix(self.hd), None)

    def init(self, seed: int, name: str = "attn") -> dict:
        return {n: getattr(self, n).init(seed, f"{name}.{n}") for n in ("q", "k", "v", "o")}

    def _heads(self, t, b: int, s: int, n: int):
        return op.transpose(op.reshape(t, (b, s, n, self.hd)), (0, 2, 1, 3))

    def _rope(self, t):
        return op.add(op.mul(t, self.cos), op.mul(op.matmul(t, self.rot), self.sin))

    def __call__(self, p: dict, x):
        b, s = x.shape[0], x.shape[1]
        if s != self.seq_len:
            raise ValueError(f"RopeAttention: sequence length {s} != seq_len {self.seq_len}")
        q = self._rope(self._heads(self.q(p["q"], x), b, s, self.h))
        k = self._rope(self._heads(self.k(p["k"], x), b, s, self.kv))
        v = self._heads(self.v(p["v"], x), b, s, self.kv)
        y = op.flash_attention(q, k, v, causal=True)
        y = op.reshape(op.transpose(y, (0, 2, 1, 3)), (b, s, self.h * self.hd))
        return self.o(p["o"], y)


class LlamaBlock(TransformerBlock):
    """``nn.TransformerBlock`` (pre-norm, residual adds; its ``init`` and ``__call__``) with
    rotary grouped-query attention."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, hidden: int, seq_len: int, *, mesh=None,
                 tp_axis: str = "tp", dtype="float32", eps: float = 1e-6):
        Module.__init__(self, mesh, tp_axis, dtype)
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.norm1, self.norm2 = RMSNorm(d_model, eps=eps, **kw), RMSNorm(d_model, eps=eps, **kw)
        self.attn = RopeAttention(d_model, n_heads, n_kv_heads, seq_len, **kw)
        self.mlp = SwiGLUMLP(d_model, hidden, **kw)


class LlamaLM(Module):
    """A decoder-only LM of Llama's shape (see the module docstring); ``loss``/``batch``/``init``
    as ``nn.Transformer``'s, so train.py drives either.

    Parameters
    ----------
    vocab : int
        Vocabulary size.
    d_model : int
        Model width.
    n_heads : int
        Query heads.
    n_layers : int
        Blocks.
    seq_len : int
        The longest sequence.
    n_kv_heads : int, optional
        Key/value heads (grouped-query); None: ``n_heads``.
    hidden : int, optional
        The MLP's hidden width.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis, dp_axis : str
        The tensor- and data-parallel axes.
    dtype : str or dtype
        The parameters' dtype.
    eps : float
        The RMSNorms' eps.
    """

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, *,
                 n_kv_heads: int | None = None, hidden: int | None = None, mesh: Mesh | None = None,
                 tp_axis: str = "tp", dp_axis: str = "dp", dtype: object = "float32", eps: float = 1e-6):
        super().__init__(mesh, tp_axis, dtype)
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.vocab, self.d, self.seq_len, self.eps = vocab, d_model, seq_len, eps
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.hidden, self.n_layers = hidden or 4 * d_model, n_layers
        self.dp = dp_axis if mesh is not None and dp_axis in mesh.axes else None
        self.embed = Embedding(vocab, d_model, **kw)
        self.blocks = [LlamaBlock(d_model, n_heads, self.n_kv_heads, self.hidden, seq_len, eps=eps, **kw)
                       for _ in range(n_layers)]
        self.norm = RMSNorm(d_model, eps=eps, **kw)
        self.head = Linear(d_model, vocab, parallel="column", **kw)

    def init(self, seed: int = 0) -> dict:
        """The parameters (the same global values on any mesh).

        Parameters
        ----------
        seed : int
            Values depend only on (seed, name).

        Returns
        -------
        dict
            The parameter tree.
        """
        return {"embed": self.embed.init(seed, "embed"),
                "blocks": [b.init(seed, f"blocks.{i}") for i, b in enumerate(self.blocks)],
                "norm": self.norm.init(seed, "norm"), "head": self.head.init(seed, "head")}

    def batch(self, tokens: np.ndarray) -> object:
        """A global (B, S) int batch (the same on every rank), its batch dim over dp.

        Parameters
        ----------
        tokens : numpy.ndarray
            ``(B, S)`` ints.

        Returns
        -------
        DTensor or array
            The placed batch.
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.mesh is None:
            return tokens
        spec = ShardSpec(partition=(0,), mesh_axes=(self.dp,)) if self.dp else None
        return distribute(tokens, layout=spec, mesh=self.mesh)

    def logits(self, p: dict, tokens: object) -> object:
        """The LM head's logits.

        Parameters
        ----------
        p : dict
            The parameters.
        tokens : DTensor or array
            ``(B, S)`` ints.

        Returns
        -------
        DTensor or array
            ``(B, S, vocab)``, vocab sharded over tp.
        """
        x = self.embed(p["embed"], tokens)
        for blk, bp in zip(self.blocks, p["blocks"]):
            x = blk(bp, x)
        return self.head(p["head"], self.norm(p["norm"], x))

    def loss(self, p: dict, tokens: object, targets: object) -> object:
        """The mean token cross-entropy.

        Parameters
        ----------
        p : dict
            The parameters.
        tokens : DTensor or array
            ``(B, S)`` ints.
        targets : DTensor or array
            ``(B, S)`` ints.

        Returns
        -------
        DTensor or array
            The scalar loss.
        """
        logits = self.logits(p, tokens)
        if np.dtype(logits.dtype).itemsize < 4:
            logits = op.astype(logits, "float32")
        return cross_entropy(logits, targets, self.embed.iota(len(targets.shape)))

    def moe_stats(self) -> None:
        """None: no MoE blocks (``nn.Transformer``'s interface).
        """
        return None

    def hf_config(self) -> dict:
        """The Hugging Face ``config.json`` of this model.

        Returns
        -------
        dict
            The config.
        """
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab,
                "hidden_size": self.d, "intermediate_size": self.hidden, "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
                "head_dim": self.d // self.n_heads, "hidden_act": "silu", "rms_norm_eps": self.eps,
                "rope_theta": self.blocks[0].attn.theta if self.blocks else 10000.0,
                "max_position_embeddings": max(self.seq_len, 2048), "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
                "bos_token_id": None, "eos_token_id": None}


def _full(a) -> np.ndarray:
    """The global value of a parameter (collective for a DTensor: call on every rank)."""
    v = a.full_tensor() if isinstance(a, DTensor) else a
    return np.ascontiguousarray(np.asarray(getattr(v, "get", lambda: v)(), dtype=np.float32))


def hf_state_dict(model: LlamaLM, params: dict) -> dict[str, np.ndarray]:
    """transformers' tensor names and (out, in) weight layout for ``params`` (collective)."""
    sd = {"model.embed_tokens.weight": _full(params["embed"]["w"]),
          "model.norm.weight": _full(params["norm"]["w"]), "lm_head.weight": _full(params["head"]["w"]).T}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
    for i, bp in enumerate(params["blocks"]):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = _full(bp["norm1"]["w"])
        sd[pre + "post_attention_layernorm.weight"] = _full(bp["norm2"]["w"])
        for n, hf in names.items():
            sd[pre + hf + ".weight"] = _full(bp["attn"][n]["w"]).T
        for n, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            sd[pre + "mlp." + hf + ".weight"] = _full(bp["mlp"][n]["w"]).T
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def char_tokenizer_json(chars: Sequence[str]) -> str:
    """A ``tokenizers`` tokenizer for a character vocabulary: every character one token, decoded
    by concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def export_hf(model: LlamaLM, params: dict, out_dir: str | Path, chars: Sequence[str] | None = None,
              rank: int = 0) -> Path:
    """Write ``out_dir`` as a Hugging Face Llama checkpoint (collective; ``rank`` 0 writes).

    Parameters
    ----------
    model : LlamaLM
        The model.
    params : dict
        Its parameters (DTensors or arrays).
    out_dir : str or Path
        The directory written.
    chars : sequence of str, optional
        A character vocabulary: also writes ``tessera_chars.json`` and a tokenizer.
    rank : int
        The rank that writes.

    Returns
    -------
    Path
        ``out_dir``.
    """
    if not isinstance(model, LlamaLM):
        raise TypeError(f"export_hf: the model is a {type(model).__name__}; only a LlamaLM (train.py --arch "
                        "llama) has the Llama shape")
    sd = hf_state_dict(model, params)
    out = Path(out_dir)
    if rank == 0:
        from safetensors.numpy import save_file
        out.mkdir(parents=True, exist_ok=True)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(model.hf_config(), indent=2))
        if chars is not None:
            (out / "tessera_chars.json").write_text(json.dumps(list(chars)))
            try:
                (out / "tokenizer.json").write_text(char_tokenizer_json(chars))
            except ImportError:        # the character vocabulary file alone serves generate.py
                pass
    return out
