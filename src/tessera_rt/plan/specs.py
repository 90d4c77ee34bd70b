"""What the planner plans for: a model (:class:`ModelSpec`), with its presets and JSON
loading; the cluster it runs on is in ``cluster`` (:class:`Cluster`).

Counts follow Megatron-LM's accounting (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters"; Korthikanti et al. 2022, "Reducing Activation
Recomputation"): parameters per layer from the weight shapes, activations per token per
layer from the tensors the backward pass keeps.  MoE layers follow GShard/Switch: ``top_k``
experts per token, ``capacity_factor`` padding, experts sharded over ``ep``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "MODELS", "get_model", "DTYPE_BYTES"]

DTYPE_BYTES = {"f32": 4, "float32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "float16": 2, "bfloat16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfp8": 1, "fp4": 0.5}


def _bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense or MoE.

    ``act_coeffs``: the activation elements the backward keeps per token per layer, as
    multiples of (d_model replicated, d_model / tp, ffn_hidden / tp, heads / tp); the
    default is Megatron's count for a pre-norm SwiGLU block with flash attention and no
    sequence parallelism (norm and residual inputs replicated; q, k, v and the attention
    output sharded; w1, w3 outputs and the w2 input sharded).  ``act_outside``: the same
    outside the blocks, as multiples of (d_model, vocab / tp, 1).  The op counts price the
    fixed cost per op (``Cluster.op_overhead_s``); for the runtime's models (the ``char``
    presets) they are the profiler's counts (``plan.measure.runtime_counts``), which
    calibration's per-op cost is measured over, and tests/plan check them against it.

    Parameters
    ----------
    name : str
        The preset's name.
    vocab : int
        Vocabulary size.
    d_model : int
        Model width.
    n_layers : int
        Blocks.
    n_heads : int
        Attention heads.
    ffn_hidden : int
        The dense MLP's hidden width.
    n_kv_heads : int, optional
        Key/value heads (grouped-query); None: ``n_heads``.
    seq_len : int
        Default sequence length.
    dtype : str
        Parameters, gradients and compute.
    n_experts : int
        Experts per MoE layer; 0: dense.
    top_k : int
        Experts per token.
    capacity_factor : float
        Expert slots as a multiple of the even share.
    expert_hidden : int, optional
        An expert's hidden width (None: ``ffn_hidden``).
    moe_every : int
        Every k-th layer is MoE.
    learned_pos : bool
        A ``(seq_len, d_model)`` position table.
    tied_embeddings : bool
        The head shares the embedding table.
    act_coeffs : tuple
        The activation elements the backward keeps per token per layer, as multiples of (d_model
        replicated, d_model / tp, ffn_hidden / tp, heads / tp); the default is Megatron's count for
        a pre-norm SwiGLU block with flash attention and no sequence parallelism.
    act_outside : tuple
        The same outside the blocks, as multiples of (d_model, vocab / tp, 1): embedding, head,
        loss.
    moe_act_coeffs : tuple
        An MoE block's: (x d, x f/tp per slot; x d, x E per token); (): GShard's count.
    uneven_gathers : tuple
        Batch all_gathers when batch % dp != 0: (x d, x f per block, x vocab).
    ops_per_layer, ops_outside : int
        Forward ops per block and outside the blocks, as inference and a rematerialized
        block run them (the fixed cost per op).
    bwd_ops_per_layer, bwd_ops_outside : int
        What a training step adds to them (its ops less the forward's): the backward.
    tp_ar_per_layer : int
        tp all-reduces per block, forward + backward (Megatron: 2 + 2).
    tp_ar_outside : int
        The d-wide ones outside the blocks (embedding, head input).
    batch : int
        Default global batch (sequences).
    notes : str
        Free text.
    """

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: int | None = None
    seq_len: int = 4096
    dtype: str = "bf16"                    # parameters, gradients and compute
    n_experts: int = 0                     # 0: dense
    top_k: int = 1
    capacity_factor: float = 1.0
    expert_hidden: int | None = None
    moe_every: int = 1                     # every k-th layer is MoE
    learned_pos: bool = False              # a (seq_len, d_model) position table
    tied_embeddings: bool = False
    act_coeffs: tuple = (4.0, 4.0, 3.0, 0.0)   # (x d, x d/tp, x f/tp, x heads/tp) per token per layer
    act_outside: tuple = (2.0, 2.0, 0.0)       # (x d, x vocab/tp, x 1) per token: embedding, head, loss
    moe_act_coeffs: tuple = ()             # MoE block: (x d, x f/tp per slot; x d, x E per token); () GShard's
    uneven_gathers: tuple = ()             # batch all_gathers when batch % dp != 0: (x d, x f per block, x vocab)
    # a fused GPU framework's kernels (Megatron-LM: 12 per block forward, dgrad + wgrad per
    # GEMM backward), for the GPU presets; the char presets carry the runtime's own counts
    ops_per_layer: int = 12                # forward ops per block
    ops_outside: int = 8                   # forward ops outside the blocks
    bwd_ops_per_layer: int = 24            # what the backward adds per block
    bwd_ops_outside: int = 16
    tp_ar_per_layer: int = 4               # tp all-reduces per block, forward + backward (Megatron: 2 + 2)
    tp_ar_outside: int = 2                 # d-wide ones outside the blocks (embedding, head input)
    batch: int = 8                         # default global batch (sequences)
    notes: str = ""

    def __post_init__(self):
        for f in ("vocab", "d_model", "n_layers", "n_heads", "ffn_hidden", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelSpec({self.name!r}): {f}={v!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelSpec({self.name!r}): d_model={self.d_model} is not a multiple of "
                             f"n_heads={self.n_heads}")
        if self.kv_heads > self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"ModelSpec({self.name!r}): n_kv_heads={self.kv_heads} must divide "
                             f"n_heads={self.n_heads}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelSpec({self.name!r}): top_k={self.top_k} must be in 1..n_experts="
                             f"{self.n_experts}")
        _bytes(self.dtype)

    # shapes ---------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.n_experts else 0

    @property
    def f_expert(self) -> int:
        return self.expert_hidden or self.ffn_hidden

    @property
    def dtype_bytes(self) -> float:
        return _bytes(self.dtype)

    # parameters -----------------------------------------------------------------
    def attn_params(self) -> int:
        """Attention parameters of one block (q, o and k, v).

        Returns
        -------
        int
            The count.
        """
        d, kv = self.d_model, self.kv_heads * self.head_dim
        return d * d * 2 + 2 * d * kv                     # q, o and k, v

    def mlp_params(self) -> int:
        """Dense SwiGLU MLP parameters of one block (w1, w3, w2).

        Returns
        -------
        int
            The count.
        """
        return 3 * self.d_model * self.ffn_hidden          # SwiGLU: w1, w3, w2

    def expert_params_per_layer(self) -> int:
        """Expert parameters of one MoE block (every expert's w1, w3, w2).

        Returns
        -------
        int
            The count.
        """
        return self.n_experts * 3 * self.d_model * self.f_expert

    def router_params(self) -> int:
        """Router parameters of one MoE block.

        Returns
        -------
        int
            The count.
        """
        return self.d_model * self.n_experts

    def embed_params(self) -> int:
        """Embedding, head (unless tied), learned positions and the final norm.

        Returns
        -------
        int
            The count.
        """
        pos = self.seq_len * self.d_model if self.learned_pos else 0
        head = 0 if self.tied_embeddings else self.vocab * self.d_model
        return self.vocab * self.d_model + head + pos + self.d_model     # + final norm

    def dense_layer_params(self, moe: bool) -> int:
        """Parameters of one block that are not experts (sharded over tp, replicated over ep).

        Parameters
        ----------
        moe : bool
            The block is an MoE block (router instead of the dense MLP).

        Returns
        -------
        int
            The count.
        """
        return self.attn_params() + 2 * self.d_model + (self.router_params() if moe else self.mlp_params())

    def total_params(self) -> int:
        """Every parameter of the model.

        Returns
        -------
        int
            The count.
        """
        n_moe = self.n_moe_layers
        return (self.embed_params() + self.n_layers * self.attn_params() + 2 * self.n_layers * self.d_model
                + (self.n_layers - n_moe) * self.mlp_params()
                + n_moe * (self.router_params() + self.expert_params_per_layer()))

    def active_params_per_token(self) -> int:
        """Parameters one token touches (the N of training's 6N FLOPs): top_k of the experts.

        Returns
        -------
        int
            The count.
        """
        idle = self.n_experts - self.top_k if self.n_experts else 0
        return self.total_params() - self.n_moe_layers * idle * 3 * self.d_model * self.f_expert

    def to_dict(self) -> dict:
        """The fields as a dict (JSON values).

        Returns
        -------
        dict
            The fields.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; ModelSpec fields are {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing} (required: name, vocab, d_model, n_layers, "
                             "n_heads, ffn_hidden)")
        d = dict(d)
        for k in ("act_coeffs", "act_outside", "moe_act_coeffs", "uneven_gathers"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)


# ------------------------------------------------------------------------------ presets

MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_hidden=14336, seq_len=8192, batch=64),
    "llama3-70b": ModelSpec("llama3-70b", vocab=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            ffn_hidden=28672, seq_len=8192, batch=32),
    # Seed 000 §9: E=4096, heads=128, d_model=8192, CF=1.25 (top_k=2 from §4.1).  The seed
    # gives neither depth nor expert width: 24 layers of fine-grained experts (hidden 256)
    # are our assumption, about 0.63T parameters, sized so a 72-GPU rack can train it.
    "sr-moe": ModelSpec("sr-moe", vocab=128256, d_model=8192, n_layers=24, n_heads=128, ffn_hidden=28672,
                        n_experts=4096, top_k=2, capacity_factor=1.25, expert_hidden=256, seq_len=4096,
                        batch=72, notes="seed 000 §9 SR-MoE; depth 24 and expert hidden 256 assumed"),
    # scripts/train.py's defaults, as the runtime runs them: f32, learned positions, and the
    # activation count of tessera_rt's tape, read off nn/blocks.py: every op output is kept, so a
    # block keeps norm1, o, add, norm2, w2, add (d each, replicated), q, k, v, attention out
    # and its reshape (d/tp), swiglu's output and the x@W1, x@W3 its backward keeps (3 f/tp)
    # and the logsumexp (heads/tp); outside: embedding, +pos, final norm (d), the loss's
    # one-hot, logits, shifted, exp, picked (vocab/tp; train.py's loss on DTensors: the fused
    # cross-entropy, which keeps only its logsumexp, serves plain arrays).  The op and tp
    # all-reduce counts are the profiler's (plan.measure.runtime_counts; tests/plan check
    # them): the norms', SwiGLU's and attention's backward are each one fused kernel on the
    # local pieces, which the profiler shows as regions, not ops.
    "char": ModelSpec("char", vocab=111, d_model=64, n_layers=2, n_heads=4, ffn_hidden=256, seq_len=64,
                      dtype="f32", learned_pos=True, batch=8, act_coeffs=(6.0, 5.0, 3.0, 1.0),
                      act_outside=(3.0, 5.0, 3.0), ops_per_layer=22, ops_outside=16,
                      bwd_ops_per_layer=49, bwd_ops_outside=21, tp_ar_per_layer=4, tp_ar_outside=2,
                      uneven_gathers=(11, 3, 2), notes="scripts/train.py defaults"),
    # train.py --experts 4 --capacity-factor 1.25 (top-2), counted as "char" is; the experts
    # are not split over tp, so only attention's 2 + 2 tp all-reduces per block (timing.py
    # prices the all_to_alls and the routing statistics' all-reduce).  Kept per block, read off
    # tessera_rt.moe.dispatch's saved tensors: per slot (top_k x CF, padded parts) the
    # dispatched rows (d) and the grouped GEMMs' h1, h3 and silu(h1) * h3 (3 f: moe.experts);
    # per token the combine gather (top_k d), the gate's logits and probabilities (2 E)
    "char-moe": ModelSpec("char-moe", vocab=111, d_model=64, n_layers=2, n_heads=4, ffn_hidden=256, seq_len=64,
                          dtype="f32", learned_pos=True, batch=8, act_coeffs=(6.0, 5.0, 3.0, 1.0),
                          act_outside=(3.0, 5.0, 3.0), ops_per_layer=28, ops_outside=16, bwd_ops_per_layer=55,
                          bwd_ops_outside=21, tp_ar_per_layer=2, tp_ar_outside=2, n_experts=4, top_k=2,
                          capacity_factor=1.25, moe_act_coeffs=(1.0, 3.0, 2.0, 2.0),
                          notes="scripts/train.py --experts 4 --capacity-factor 1.25"),
}


def get_model(model: Any) -> ModelSpec:
    """A model spec from a preset name, a JSON file path, a dict, or a ModelSpec.

    Parameters
    ----------
    model : str, dict or ModelSpec
        What names the model (``MODELS`` lists the presets).

    Returns
    -------
    ModelSpec
        The spec.
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return ModelSpec.from_dict(model)
    if isinstance(model, str):
        if model in MODELS:
            return MODELS[model]
        if model.endswith(".json") or os.path.exists(model):
            return ModelSpec.from_dict(_read_json(model), where=model)
        raise ValueError(f"unknown model {model!r}; use a preset ({', '.join(MODELS)}) or a JSON file of "
                         "ModelSpec fields")
    raise TypeError(f"model must be a preset name, a JSON path, a dict or a plan.ModelSpec, not {type(model).__name__}")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object of fields, got {type(d).__name__}")
    return d
