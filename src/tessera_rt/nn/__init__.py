"""Tensor-parallel modules on DTensors (seed 002 §2.8's transformer block, seed 000 §2.2's
layouts), written with ``op.*`` so ``ts.grad`` differentiates them.

Modules are configurations; parameters are a pytree (a dict) that the caller owns and
passes in, as ``ts.grad(loss_fn)(params, ...)`` needs::

    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": 2, "tp": 2})
    model = nn.Transformer(vocab=96, d_model=64, n_heads=4, n_layers=2, seq_len=64, mesh=mesh)
    params = model.init(seed=0)                       # the same global values on any mesh
    loss = model.loss(params, tokens, targets)        # tokens: (B, S) ints, batch over dp

Layouts (Megatron's): ``Linear(parallel="column")`` shards the weight's output dim over
``tp`` (its output comes out sharded, no communication); ``parallel="row"`` shards the
input dim (its output is a pending sum over ``tp``, reduced when the residual add needs
it).  Attention shards heads over ``tp`` (q/k/v column-parallel, the output projection
row-parallel); the SwiGLU MLP is column- then row-parallel; the embedding and the LM
head shard the vocabulary.  Data parallelism shards the batch over ``dp``: replicated
parameters' gradients arrive as pending sums over ``dp`` and ``ts.grad`` all-reduces
each one, asynchronously, as soon as it is complete.  With ``mesh=None`` every module
runs on plain arrays (the single-process reference).
"""
from __future__ import annotations

from ..upper import UpperNames
from .blocks import Attention, SwiGLUMLP, TransformerBlock
from .layers import Embedding, Linear, RMSNorm, cross_entropy, one_hot, vocab_iota
from .module import Module
from .parts import register_moe_mlp, register_part, register_stage_plan  # noqa: F401  (how moe and pipeline plug in)
from .transformer import Transformer

__all__ = [
    "Module", "Linear", "Embedding", "RMSNorm", "Attention", "SwiGLUMLP", "TransformerBlock", "Transformer",
    "cross_entropy", "one_hot", "vocab_iota",
]

# names that live above nn: tessera_rt.inference provides them when imported
UPPER = UpperNames(__name__, {"Llama": "tessera_rt.inference", "KVCache": "tessera_rt.inference"})


def __getattr__(name: str):
    err = UPPER.missing(name)
    if err is None:
        err = AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise err
