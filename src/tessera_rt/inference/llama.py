"""A Llama-architecture decoder for inference, tensor-parallel over a mesh's ``tp`` axis.

Megatron layout on local arrays (seed 004's Llama3-70B decode): each tp rank owns
``num_attention_heads / tp`` query heads and the kv heads they read (kv heads are
replicated when tp exceeds them), the q/k/v and gate/up projections are column-parallel,
o_proj and down_proj are row-parallel (one all_reduce each per layer), and the embedding
and LM head are vocab-parallel (the embedding's rows, the head's output columns; uneven
splits allowed).  ``from_pretrained`` reads each rank's slices straight from the
safetensors files, so no rank ever holds the whole model.

One layer stack (``forward``) serves every use over packed token rows: a plain causal forward
(``logits``), a batched variable-length prefill that writes K/V into a paged ``KVCache``, and
a decode step that reads the cache through block tables; only the attention callable differs
(``inference.layers``).  Every activation lives in a workspace, so a decode step allocates
nothing and can be captured in a CUDA graph (``inference.decode``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import runtime as rt
from ..backend import get_backend
from ..dist.comm import collectives as C
from ..dist.comm.mesh import Mesh
from ..dist.tensor.shard import split_offsets, split_sizes
from ..dtypes import resolve_dtype
from .hf import CheckpointReader, LlamaConfig, rope_inv_freq

__all__ = ["Llama", "TPShard"]


@dataclass(frozen=True)
class TPShard:
    """What one tp rank owns: its heads, kv heads, MLP columns and vocabulary rows.

    Parameters
    ----------
    tp : int
        Ranks on the tp axis.
    index : int
        This rank's position.
    heads, kv_heads : slice
        Its query and kv heads.
    ffn : slice
        Its MLP columns.
    vocab : slice
        Its vocabulary rows.
    vocab_sizes : tuple
        Every rank's vocabulary rows.
    """

    tp: int
    index: int
    heads: slice
    kv_heads: slice
    ffn: slice
    vocab: slice
    vocab_sizes: tuple

    @classmethod
    def of(cls, cfg: LlamaConfig, tp: int, index: int, where: str = "nn.Llama") -> TPShard:
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if h % tp:
            ok = [t for t in range(1, h + 1) if h % t == 0 and (kv % t == 0 or t % kv == 0)]
            raise ValueError(f"{where}: num_attention_heads={h} is not divisible by the mesh's tp={tp}; "
                             f"use a tp size in {ok}")
        if kv % tp and tp % kv:
            raise ValueError(f"{where}: num_key_value_heads={kv} and tp={tp}: tp must divide the kv heads or be "
                             f"a multiple of them (kv heads are replicated when tp exceeds them)")
        hl = h // tp
        if tp <= kv:
            kvl = kv // tp
            kv_heads = slice(index * kvl, (index + 1) * kvl)
        else:                                   # tp / kv ranks share (replicate) one kv head
            k0 = index // (tp // kv)
            kv_heads = slice(k0, k0 + 1)
        f0, v0 = split_offsets(cfg.intermediate_size, tp)[index], split_offsets(cfg.vocab_size, tp)[index]
        fs, vs = split_sizes(cfg.intermediate_size, tp), split_sizes(cfg.vocab_size, tp)
        return cls(tp, index, slice(index * hl, (index + 1) * hl), kv_heads, slice(f0, f0 + fs[index]),
                   slice(v0, v0 + vs[index]), tuple(vs))


def _cols(sl: slice, d: int) -> slice:
    return slice(sl.start * d, sl.stop * d)


class Llama:
    """``nn.Llama``: a Llama decoder whose weights live as per-rank shards (plain arrays).

    Parameters
    ----------
    cfg : LlamaConfig
        The config.
    params : dict
        This rank's shards (``from_pretrained`` reads them).
    shard : TPShard
        What this rank owns.
    mesh : Mesh, optional
        The tp mesh; None: one rank.
    tp_axis : str
        The tp axis.
    dtype : str or dtype
        The weights' dtype.
    """

    def __init__(self, cfg: LlamaConfig, params: dict, shard: TPShard, *, mesh: Mesh | None = None,
                 tp_axis: str = "tp", dtype: Any = "float32"):
        self.config, self.params, self.shard = cfg, params, shard
        self.mesh, self.tp_axis = mesh, tp_axis
        self.dtype = resolve_dtype(dtype)
        self.xp = get_backend().xp
        self.inv_freq = self.xp.asarray(rope_inv_freq(cfg))
        self.n_heads = shard.heads.stop - shard.heads.start
        self.n_kv = shard.kv_heads.stop - shard.kv_heads.start

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh=None, tp_axis: str = "tp", dtype="float32",
                        allow_unused: bool = False) -> Llama:
        """Read a Hugging Face Llama checkpoint (config.json + safetensors), each rank only its
        slices.  The config must describe the weights: every tensor's shape is checked against
        it first, and tensors it does not use are refused unless ``allow_unused``."""
        cfg = LlamaConfig.from_dir(path)
        return cls.from_reader(cfg, CheckpointReader(path), mesh=mesh, tp_axis=tp_axis, dtype=dtype,
                               allow_unused=allow_unused)

    @classmethod
    def from_reader(cls, cfg: LlamaConfig, reader: CheckpointReader, *, mesh=None, tp_axis: str = "tp",
                    dtype="float32", allow_unused: bool = False, where: str = "nn.Llama.from_pretrained") -> Llama:
        """``from_pretrained`` from a config and a reader of Hugging Face-named tensors (a
        ``CheckpointReader``, or a ``StateDictReader`` over arrays in memory)."""
        tp, index = _tp_of(mesh, tp_axis)
        shard = TPShard.of(cfg, tp, index, where)
        reader.check(cfg, where, allow_unused)
        dt = resolve_dtype(dtype)
        xp = get_backend().xp
        hd = cfg.head_dim
        rt.stream("compute")          # the weights are uploaded where the model's kernels will read them

        def w(name, rows=None, cols=None, transpose=True):
            a = reader.read(name, rows, cols)
            a = np.ascontiguousarray(a.T if transpose else a).astype(dt, copy=False)
            return xp.asarray(a)

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q = w(p + "self_attn.q_proj.weight", _cols(shard.heads, hd))
            k = w(p + "self_attn.k_proj.weight", _cols(shard.kv_heads, hd))
            v = w(p + "self_attn.v_proj.weight", _cols(shard.kv_heads, hd))
            gate = w(p + "mlp.gate_proj.weight", shard.ffn)
            up = w(p + "mlp.up_proj.weight", shard.ffn)
            layers.append({
                "ln1": w(p + "input_layernorm.weight", transpose=False),
                "ln2": w(p + "post_attention_layernorm.weight", transpose=False),
                "qkv": xp.ascontiguousarray(xp.concatenate([q, k, v], axis=1)),
                "o": w(p + "self_attn.o_proj.weight", None, _cols(shard.heads, hd)),
                "gate_up": xp.ascontiguousarray(xp.concatenate([gate, up], axis=1)),
                "down": w(p + "mlp.down_proj.weight", None, shard.ffn),
            })
        head_name = "lm_head.weight"
        if cfg.tie_word_embeddings or not reader.has(head_name):
            head_name = "model.embed_tokens.weight"
        params = {
            "embed": w("model.embed_tokens.weight", shard.vocab, transpose=False),
            "layers": layers,
            "norm": w("model.norm.weight", transpose=False),
            "head": w(head_name, shard.vocab),            # (hidden, V_local): x @ head
        }
        return cls(cfg, params, shard, mesh=mesh, tp_axis=tp_axis, dtype=dt)

    # ---- collectives over tp ---------------------------------------------------------------
    def sum_tp(self, x: Any) -> Any:
        """``x`` summed over tp in place (the row-parallel partial sums; no new array).

        Parameters
        ----------
        x : array
            This rank's partial sums.

        Returns
        -------
        array
            ``x``, summed.
        """
        if self.shard.tp == 1:
            return x
        return C.all_reduce(x, axis=self.tp_axis, mesh=self.mesh, out=x)

    def check_ids(self, ids: Any, where: str) -> None:
        """Raise ValueError (naming ``where`` and the id) when a token id is outside the vocabulary.

        Parameters
        ----------
        ids : array-like
            Token ids.
        where : str
            Names the caller.
        """
        a = np.asarray(ids)
        if a.size and (a.min() < 0 or a.max() >= self.config.vocab_size):
            bad = int(a.max()) if a.max() >= self.config.vocab_size else int(a.min())
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {self.config.vocab_size}) "
                             f"(rank {self.shard.index} of tp={self.shard.tp}); check the tokenizer matches the model")

    # ---- the model: one definition for every use ---------------------------------------------
    def embed(self, ids: Any, out: Any) -> Any:
        """Vocab-parallel lookup of ``ids (T,)`` (int32/int64 on the model's device) into ``out
        (T, hidden)``: this rank's rows, zeros elsewhere, summed over tp.

        Parameters
        ----------
        ids : array
            Token ids.
        out : array
            Receives the rows.

        Returns
        -------
        array
            ``out``.
        """
        v = self.shard.vocab
        get_backend().kernel("embedding")(ids, self.params["embed"], lo=v.start, out=out)
        return self.sum_tp(out)

    def forward(self, ids: Any, attention: Callable, work: Any) -> Any:
        """Final-normed hidden rows ``(T, hidden)`` (``work.h``) of the token rows ``ids (T,)``: the
        one definition of the layer stack, for a packed prefill, a decode step and ``logits``
        alike.  ``attention(layer, qkv, q, out)`` ropes, keeps K/V where the use keeps them and
        attends (``inference.layers``); ``work`` holds every activation (``Workspace.view``),
        so nothing is allocated.  A residual add rides in the next norm (``add_rmsnorm``).

        Parameters
        ----------
        ids : array
            ``(T,)`` token ids on the model's device.
        attention : callable
            The use's attention.
        work : namespace
            ``x, h, qkv, q, attn, part, gu, act`` of T rows.

        Returns
        -------
        array
            ``work.h``.
        """
        rt.stream("compute")          # the compute stream is CuPy's current one: the kernels go there
        cfg, mm = self.config, get_backend().kernel("matmul")
        norm, act = get_backend().kernel("add_rmsnorm"), get_backend().kernel("silu_mul")
        eps, t = cfg.rms_norm_eps, work.x.shape[0]
        x, h = self.embed(ids, work.x), work.h
        attn = work.attn.reshape(t, -1)
        delta = None
        for i, p in enumerate(self.params["layers"]):
            norm(x, delta, p["ln1"], eps=eps, out=h)
            mm(h, p["qkv"], out=work.qkv)
            attention(i, work.qkv, work.q, work.attn)
            self.sum_tp(mm(attn, p["o"], out=work.part))
            norm(x, work.part, p["ln2"], eps=eps, out=h)
            mm(h, p["gate_up"], out=work.gu)
            act(work.gu, out=work.act)
            delta = self.sum_tp(mm(work.act, p["down"], out=work.part))
        return norm(x, delta, self.params["norm"], eps=eps, out=h)

    def local_logits(self, h: Any, out: Any = None) -> Any:
        """This rank's vocab slice of the logits ``(..., V_local)``, in the model's dtype (f32
        for an f32 model).

        Parameters
        ----------
        h : array
            Hidden states ``(..., hidden)``.
        out : array, optional
            Receives them.

        Returns
        -------
        array
            ``(..., V_local)``.
        """
        return get_backend().kernel("matmul")(h, self.params["head"], out=out)

    def logits(self, ids: Any) -> Any:
        """Full-vocabulary f32 logits ``(B, S, V)`` of a causal forward with no cache (a test and
        scoring path: it gathers the vocab, which decoding never does).  The B sequences run
        packed through ``forward`` (block-diagonal causal attention).

        Parameters
        ----------
        ids : array
            ``(B, S)`` token ids.

        Returns
        -------
        array
            ``(B, S, V)``.
        """
        from .layers import CausalAttention, Workspace
        ids = np.atleast_2d(np.asarray(ids))
        self.check_ids(ids, "Llama.logits")
        b, s = ids.shape
        xp = self.xp
        rt.stream("compute")          # the uploads below and the forward: on the compute stream
        pos = xp.asarray(np.tile(np.arange(s, dtype=np.int32), b))
        cu = xp.asarray(np.arange(0, b * s + 1, s, dtype=np.int32))
        work = Workspace(self, b * s).view(b * s)
        h = self.forward(xp.asarray(ids.reshape(-1).astype(np.int32)), CausalAttention(self, pos, cu, s), work)
        lg = self.local_logits(h).astype(np.float32, copy=False).reshape(b, s, -1)
        if self.shard.tp == 1:
            return lg
        return C.all_gather(xp.ascontiguousarray(lg), axis=self.tp_axis, mesh=self.mesh, dim=lg.ndim - 1,
                            sizes=self.shard.vocab_sizes)

    def generate(self, cache: Any, prompts: Any, **kw) -> list[list[int]]:
        """Prefill ``prompts`` into ``cache`` and decode; see ``inference.generate.generate``.

        Parameters
        ----------
        cache : KVCache
            The model's cache.
        prompts : sequence of sequence of int
            Token ids.
        **kw
            ``generate``'s keywords.

        Returns
        -------
        list of list of int
            Generated ids per prompt.
        """
        from .generate import generate
        return generate(self, cache, prompts, **kw)


def _tp_of(mesh, tp_axis: str) -> tuple[int, int]:
    if mesh is None or tp_axis not in mesh.axes:
        return 1, 0
    return mesh.size(tp_axis), mesh.coordinate(tp_axis)
