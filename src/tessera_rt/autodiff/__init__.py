"""tessera_rt.autodiff: tape-based reverse mode over tessera_rt ops (seed 002 §2.5).

    import tessera_rt as ts
    gW = ts.grad(loss_fn)(W)                         # W: an array, a DTensor or a pytree of them
    loss, grads = ts.value_and_grad(loss_fn)(params, batch)
    with ts.no_grad(): ...                           # evaluate without recording
    h = ts.remat(block)(block_params, x)             # rematerialize block's activations
    y = ts.detach(x)                                 # no gradient flows through y

Every public op entry point (``op.*``, DTensor operators, the DTensor-aware collectives,
``X.redistribute``) carries one hook (``differentiable``); VJP rules are a table keyed by
op name (``vjp_rule``): the data-movement rules are here (``dist_vjps``), the math ops'
rules are the op layer's (``tessera_rt.op.vjps``, ``vjps_nn``), which also registers the operators of
traced values (``register_ops``); autodiff never imports op.

A DTensor parameter's gradient comes back in its layout; the pending sums of finished
gradients go out in flat buckets (``finish``, ``buckets``: PyTorch DDP's scheme;
``set_grad_bucket_mb`` / ``$TESSERA_GRAD_BUCKET_MB`` set the cap).

Modules: ``tape`` (traced values, the recording hook, no_grad/detach, the registries),
``engine`` (the reverse sweep, grad/value_and_grad/vjp/remat), ``finish`` (gradients
into their parameters' layouts, reduce_grads), ``buckets``, ``pytree``, ``dist_vjps``.
"""
from ..deprecation import aliases as _aliases
from . import dist_vjps  # noqa: F401  (registers the data-movement VJP rules)
from .buckets import grad_bucket_bytes, set_grad_bucket_mb
from .engine import grad, remat, value_and_grad, vjp
from .finish import GRAD_ROLE, reduce_grads
from .pytree import tree_flatten, tree_unflatten
from .tape import VJPS, Tape, Var, current_tape, detach, differentiable, is_traced, no_grad, register_ops, vjp_rule

__all__ = [
    "grad", "value_and_grad", "vjp", "remat", "no_grad", "detach", "is_traced", "Var", "Tape",
    "differentiable", "vjp_rule", "VJPS", "current_tape", "GRAD_ROLE", "tree_flatten", "tree_unflatten",
    "reduce_grads", "set_grad_bucket_mb", "grad_bucket_bytes", "register_ops",
]

# renamed (issue 41: "checkpoint" is dist.save/dist.load's word), kept for one release
__getattr__ = _aliases(__name__, {"checkpoint": ("tessera_rt.remat", lambda: remat)})
