"""Optimizers with f32 master weights, global-norm clipping and dynamic loss scaling
(seed 000 §3.4: numerics; §10.3: the mixed-precision training policy).

    opt = optim.AdamW(params, lr=3e-3, weight_decay=0.1)     # f32 masters for bf16/fp16 params
    scaler = optim.DynamicLossScaler()                        # for fp16 (bf16 rarely needs it)
    loss, grads = ts.value_and_grad(lambda p: scaler.scale(loss_fn(p)))(params)
    grads, finite = scaler.unscale(grads)
    grads, norm = optim.clip_grad_norm(grads, 1.0)
    params = opt.step(params, grads) if finite else params
    scaler.update(finite)

A step whose loss or gradients went non-finite (inf/nan, without loss scaling) should stop
the run rather than train on and save NaN weights; ``check_finite`` does it on scalars every
rank already agrees on (Megatron's ``check_for_nan_in_loss_and_grad``):

    grads, norm = optim.clip_grad_norm(grads, 1.0)
    optim.check_finite(loss=float(loss), norm=norm, grads=grads, step=step)   # NonFiniteError
    guard.check(float(loss), step=step)     # guard = optim.LossSpikeGuard(): LossSpikeError on a spike

Parameters, gradients and optimizer state are pytrees of arrays or DTensors; the state
of a DTensor parameter has the parameter's layout, so every update is local (no
communication).  ``step`` returns the new parameters (in the parameters' dtype) and keeps
the f32 masters, so low-precision rounding never accumulates into the weights.
"""
from __future__ import annotations

from .clip import clip_grad_norm, global_norm
from .finite import DynamicLossScaler, LossSpikeError, LossSpikeGuard, NonFiniteError, check_finite, non_finite_leaves
from .optimizers import SGD, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "AdamW", "clip_grad_norm", "global_norm", "DynamicLossScaler", "NonFiniteError",
           "LossSpikeError", "LossSpikeGuard", "check_finite", "non_finite_leaves"]
