"""Bytes per GPU for one mesh factorization (the largest stage: pipeline stage 0 holds the
embedding and the most micro-batches in flight).

Where the bytes come from (Megatron's accounting, ZeRO paper's notation):
  params      the stage's layers: attention and dense MLP sharded over tp (kv heads
              replicated when tp > kv heads), experts sharded over ep (E/ep each) and
              their hidden dim over tp, norms and learned positions replicated, embedding
              and head vocab-parallel over tp
  grads       one per parameter, in the parameter dtype (training only)
  optimizer   AdamW as tessera_rt.optim keeps it: f32 masters (aliased to the parameters
              when those are f32) and two f32 moments; ``offload`` puts them in the host
              tier (Grace) instead
  activations what the backward keeps per micro-batch (ModelSpec.act_coeffs per token
              per layer; remat every block keeps only block inputs, every other block
              half of them), times the micro-batches in flight (1F1B: pp on stage 0,
              GPipe: all of them)
  kv_cache    decode: 2 x layers x kv heads per GPU x head dim x sequences x context
  buffers     the runtime's persistent double buffers (seed 004): tp and pp activation
              messages, ep dispatch/combine, dp gradient staging
  transient   the one block a remat backward rebuilds at a time (counted in total)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..deprecation import aliases
from .cluster import Cluster
from .specs import ModelSpec

__all__ = ["ParallelConfig", "memory_per_gpu", "param_counts", "activation_bytes", "REMATS", "SCHEDULES"]

REMATS = ("none", "every_other", "every")
SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class ParallelConfig:
    """One candidate: the mesh factorization plus the knobs that change memory and time.

    Parameters
    ----------
    tp, ep, pp, dp : int
        The mesh factorization.
    micro_batch : int
        Sequences per micro-batch per data-parallel rank.
    remat : str
        "none", "every" or "every_other" (rematerialize every block, every other one, none).
    schedule : str
        The pipeline schedule.
    offload : bool
        Optimizer state in the host tier.
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1          # sequences per micro-batch per data-parallel rank
    remat: str = "none"
    schedule: str = "1f1b"
    offload: bool = False         # optimizer state in the host tier

    @property
    def n(self) -> int:
        return self.tp * self.ep * self.pp * self.dp

    @property
    def data_ranks(self) -> int:
        """Ranks that split the batch for the dense part: dp x ep (GShard: ep ranks hold
        different tokens and exchange them at each MoE layer)."""
        return self.dp * self.ep

    def label(self) -> str:
        """``tp=.. ep=.. pp=.. dp=..``.

        Returns
        -------
        str
            The label.
        """
        return f"tp={self.tp} ep={self.ep} pp={self.pp} dp={self.dp}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def param_counts(m: ModelSpec, lay: ParallelConfig) -> dict:
    """Parameters on the busiest GPU.

    Parameters
    ----------
    m : ModelSpec
        The model.
    lay : ParallelConfig
        The factorization.

    Returns
    -------
    dict
        ``{"dense": ..., "expert": ..., "largest": largest tensor}``.
    """
    tp, d, hd = lay.tp, m.d_model, m.head_dim
    layers = _ceil_div(m.n_layers, lay.pp)
    moe_layers = _ceil_div(m.n_moe_layers, lay.pp) if m.n_experts else 0
    # columns split evenly over tp (the runtime's uneven shard math: ceil on the busiest
    # rank); kv heads replicated once tp exceeds them
    q_cols = _ceil_div(m.n_heads * hd, tp)
    kv_cols = _ceil_div(m.kv_heads * hd, tp) if tp <= m.kv_heads else hd
    attn = 2 * d * q_cols + 2 * d * kv_cols
    mlp = 3 * d * _ceil_div(m.ffn_hidden, tp)
    router = d * m.n_experts
    dense = layers * (attn + 2 * d) + (layers - moe_layers) * mlp + moe_layers * router
    v_local = _ceil_div(m.vocab, tp)
    # stage 0 holds the embedding (and positions); the last stage the head and final norm
    first = v_local * d + (m.seq_len * d if m.learned_pos else 0)
    last = (0 if m.tied_embeddings else v_local * d) + d
    dense += first + last if lay.pp == 1 else max(first, last)
    expert = moe_layers * _ceil_div(m.n_experts, lay.ep) * 3 * d * _ceil_div(m.f_expert, tp) if m.n_experts else 0
    largest = max(d * _ceil_div(m.ffn_hidden, tp), v_local * d, d * q_cols,
                  _ceil_div(m.n_experts, lay.ep) * d * _ceil_div(m.f_expert, tp) if m.n_experts else 0)
    return {"dense": dense, "expert": expert, "total": dense + expert, "largest": largest}


def _layer_act_elems(m: ModelSpec, tp: int, moe: bool) -> float:
    """Elements kept per token by one block without remat."""
    rep, sh_d, sh_f, sh_h = (tuple(m.act_coeffs) + (0.0,) * 4)[:4]
    if tp > 1 and m.n_heads % tp:
        # heads that do not split over tp: the column shards of q, k, v are not head-aligned,
        # so the runtime gathers them to full width for the attention (3 d more; the shards
        # stay on the tape too) and runs it on every head: its output and the head-merging
        # reshape (2 of the d/tp terms) and the per-head term are full width (tessera_rt's
        # nn.Attention at tp=3 with 4 heads, traced in tests/plan/mpi_plan.py)
        e = (rep + 3 + 2) * m.d_model + (sh_d - 2) * _ceil_div(m.d_model, tp) + sh_h * m.n_heads
    else:
        e = rep * m.d_model + sh_d * m.d_model / tp + sh_h * m.n_heads / tp
    if not moe:
        return e + sh_f * _ceil_div(m.ffn_hidden, tp)
    # GShard: router logits (E), the dispatched and combined token copies (top_k * CF each),
    # and each expert's kept SwiGLU tensors for the tokens it serves
    slots = m.top_k * m.capacity_factor
    if m.moe_act_coeffs:              # (x d, x f/tp per slot; x d, x E per token): a runtime's own count
        d_slot, f_slot, d_tok, e_tok = m.moe_act_coeffs
        return (e + e_tok * m.n_experts + d_tok * m.d_model
                + slots * (d_slot * m.d_model + f_slot * _ceil_div(m.f_expert, tp)))
    return e + m.n_experts + 2 * slots * m.d_model + slots * sh_f * _ceil_div(m.f_expert, tp)


def activation_bytes(m: ModelSpec, lay: ParallelConfig, seq: int, micro_batch: int | None = None) -> dict:
    """Activation bytes kept per GPU after the forward of the micro-batches in flight, and
    the transient of one rematerialized block.

    Parameters
    ----------
    m : ModelSpec
        The model.
    lay : ParallelConfig
        The factorization.
    seq : int
        The sequence length.
    micro_batch : int, optional
        Sequences per micro-batch (default ``lay.micro_batch``).

    Returns
    -------
    dict
        The kept bytes and the transient, by kind.
    """
    mb = lay.micro_batch if micro_batch is None else micro_batch
    tokens = mb * seq
    b = m.dtype_bytes
    layers = _ceil_div(m.n_layers, lay.pp)
    moe_layers = _ceil_div(m.n_moe_layers, lay.pp) if m.n_experts else 0
    full = [_layer_act_elems(m, lay.tp, i < moe_layers) for i in range(layers)]
    if lay.remat == "every":
        kept: list[float] = [m.d_model] * layers
    elif lay.remat == "every_other":
        kept = [m.d_model if i % 2 == 0 else full[i] for i in range(layers)]
    else:
        kept = full
    rep, voc, one = (tuple(m.act_outside) + (0.0,) * 3)[:3]
    outside = rep * m.d_model + voc * _ceil_div(m.vocab, lay.tp) + one
    per_mb = tokens * b * (sum(kept) + outside)
    in_flight: int | None = 1
    if lay.pp > 1:
        in_flight = lay.pp if lay.schedule != "gpipe" else None        # GPipe: all micro-batches
    transient = tokens * b * max(full) if lay.remat != "none" else 0.0
    return {"per_microbatch": per_mb, "in_flight": in_flight, "transient": transient}


def memory_per_gpu(m: ModelSpec, cluster: Cluster, lay: ParallelConfig, *, workload: str, batch: int, seq: int,
                   n_micro: int = 1) -> dict:
    """The bytes breakdown on the busiest GPU (see the module docstring).

    Parameters
    ----------
    m : ModelSpec
        The model.
    cluster : Cluster
        The cluster.
    lay : ParallelConfig
        The factorization.
    workload : str
        "train" or "decode".
    batch : int
        The global batch in sequences.
    seq : int
        The sequence length (decode: the context length).
    n_micro : int
        Micro-batches per step.

    Returns
    -------
    dict
        Bytes by kind (parameters, gradients, optimizer, activations, ...) and the total.
    """
    p = param_counts(m, lay)
    b = m.dtype_bytes
    train = workload == "train"
    params = p["total"] * b
    grads = p["total"] * b if train else 0.0
    opt_per_param = (0 if m.dtype_bytes == 4 else 4) + 8           # masters (aliased when f32) + m, v
    optimizer = p["total"] * opt_per_param if train else 0.0
    host = 0.0
    if train and lay.offload:
        host, optimizer = optimizer, 0.0
    seqs_per_rank = _ceil_div(batch, lay.data_ranks)
    kv_cache = 0.0
    if train:
        act = activation_bytes(m, lay, seq)
        in_flight = act["in_flight"] if act["in_flight"] is not None else n_micro
        activations = act["per_microbatch"] * min(in_flight, n_micro) if lay.pp > 1 else act["per_microbatch"]
        transient = act["transient"]
        tokens_mb = lay.micro_batch * seq
    else:
        # decode: one new token per sequence per step; the KV cache holds the context
        layers = _ceil_div(m.n_layers, lay.pp)
        kv_heads = _ceil_div(m.kv_heads, lay.tp) if lay.tp <= m.kv_heads else 1
        kv_cache = 2.0 * layers * kv_heads * m.head_dim * seqs_per_rank * seq * b
        # nothing is kept for a backward: one block's working set for the new tokens
        moe = m.n_experts > 0
        activations = seqs_per_rank * b * (_layer_act_elems(m, lay.tp, moe) + m.d_model
                                           + 2 * _ceil_div(m.vocab, lay.tp))
        transient = 0.0
        tokens_mb = seqs_per_rank
    buffers = 0.0
    msg = tokens_mb * m.d_model * b
    if lay.tp > 1:
        buffers += 2 * msg
    if lay.pp > 1:
        buffers += 2 * 2 * msg                                          # send and recv, double-buffered
    if lay.ep > 1 and m.n_experts:
        buffers += 2 * 2 * msg * m.top_k * m.capacity_factor            # dispatch and combine
    if train and lay.data_ranks > 1:
        buffers += 2 * p["largest"] * b
    total = params + grads + optimizer + activations + kv_cache + buffers + transient
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
            "kv_cache": kv_cache, "buffers": buffers, "transient": transient, "total": total,
            "host_tier": host, "hbm": cluster.hbm_bytes, "params_per_gpu": p["total"]}


# renamed (issue 41), kept for one release
__getattr__ = aliases(__name__, {"Layout": ("tessera_rt.plan.ParallelConfig", lambda: ParallelConfig)})
