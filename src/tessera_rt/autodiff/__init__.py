"""tessera_rt.autodiff: tape-based reverse mode over tessera_rt ops (seed 002 §2.5).

    import tessera_rt as ts
    gW = ts.grad(loss_fn)(W)                         # W: an array, a DTensor or a pytree of them
    loss, grads = ts.value_and_grad(loss_fn)(params, batch)
    with ts.no_grad(): ...                           # evaluate without recording
    h = ts.checkpoint(block)(block_params, x)        # rematerialize block's activations
    y = ts.detach(x)                                 # no gradient flows through y

Every public op entry point (``op.*``, DTensor operators, the DTensor-aware collectives,
``X.redistribute``) carries one hook (``differentiable``); VJP rules are a table keyed by
op name (``vjp_rule``).  A DTensor parameter's gradient comes back in its layout; the
pending sums of finished gradients go out in flat buckets (``buckets``, PyTorch DDP's
scheme; ``set_grad_bucket_mb`` / ``$TESSERA_GRAD_BUCKET_MB`` set the cap).
"""
from . import dist_vjps  # noqa: F401  (registers the data-movement VJP rules)
from .buckets import grad_bucket_bytes, set_grad_bucket_mb
from .engine import GRAD_ROLE, checkpoint, grad, reduce_grads, tree_flatten, tree_unflatten, value_and_grad, vjp
from .tape import VJPS, Tape, Var, current_tape, detach, differentiable, is_traced, no_grad, register_ops, vjp_rule

__all__ = [
    "grad", "value_and_grad", "vjp", "checkpoint", "no_grad", "detach", "is_traced", "Var", "Tape",
    "differentiable", "vjp_rule", "VJPS", "current_tape", "GRAD_ROLE", "tree_flatten", "tree_unflatten",
    "reduce_grads", "set_grad_bucket_mb", "grad_bucket_bytes", "register_ops",
]
