"""Measured on this rank, to check the planner's models against the runtime itself:
parameter bytes (the local pieces of a parameter pytree), activation bytes (what a
``ts.grad`` trace keeps for the backward: every buffer the tape's nodes hold, counted
once, parameters excluded) and the ops and collectives a model's step dispatches (the
profiler's counts, which ``ModelSpec``'s op and all-reduce counts price)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

__all__ = ["local_bytes", "traced_activation_bytes", "profiled_counts", "runtime_counts"]


def _arrays(x):
    from ..dist.tensor.dtensor import DTensor
    if type(x) is DTensor:
        x = x.to_local()
    if isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__"):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _arrays(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _arrays(y)


def _owner(a):
    """The array that owns the memory behind a view (a transpose or reshape costs nothing)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def local_bytes(tree) -> int:
    """Bytes of this rank's pieces of every array/DTensor in ``tree``."""
    seen = {}
    for a in _arrays(tree):
        o = _owner(a)
        seen[id(o)] = o.nbytes
    return sum(seen.values())


def traced_activation_bytes(fn: Callable, params, *args) -> int:
    """Run ``fn(params, *args)`` under a ``ts.grad`` trace and count the bytes its tape keeps
    alive for the backward (outputs, saved arguments and residuals of every recorded op),
    each buffer once, the parameters not counted.  The trace is dropped without a backward."""
    from ..autodiff.engine import trace
    tape, _, _, groups, _ = trace(fn, (params,) + tuple(args), 0, getattr(fn, "__name__", "fn"))
    leaves = {id(_owner(a)) for vs, _ in groups for v in vs for a in _arrays(v.value)}
    seen: dict[int, int] = {}
    for node in tape.nodes:
        saved = (node.kw or {}).get("_saved")
        for a in list(_arrays(node.value)) + list(_arrays(node.args)) + list(_arrays(saved)):
            o = _owner(a)
            if id(o) not in leaves:
                seen[id(o)] = o.nbytes
    tape.nodes.clear()
    return sum(seen.values())


def profiled_counts(fn: Callable, *args) -> tuple[int, Counter]:
    """The DTensor ops and the collectives ``fn(*args)`` dispatches, as the profiler counts
    them (collective at world size > 1: entering and leaving a profile is).

    Parameters
    ----------
    fn : callable
        Run once, under a profile.
    *args
        Its arguments.

    Returns
    -------
    tuple of (int, Counter)
        The ops the dispatcher ran (fused kernels on the local pieces, such as flash attention
        and the norm's and SwiGLU's passes, are profiler regions, not ops) and
        ``{(collective, mesh axis, "dtype[shape]"): calls}``.
    """
    from ..profiler import Profile
    with Profile(print_table=False, nvtx=False) as prof:
        fn(*args)
    ops = sum(1 for e in prof.events if e["cat"] == "op")
    return ops, Counter(e["key"][1:] for e in prof.events if e["cat"] == "collective")


def runtime_counts(spec, mesh) -> dict:
    """The profiler's counts of ``spec``'s model as the runtime runs it, in ``ModelSpec``'s
    terms: per block (two blocks' count less one block's) and outside the blocks (one
    block's count less that).  Collective on ``mesh``.

    Parameters
    ----------
    spec : ModelSpec
        Its vocab, width, heads, MLP width, sequence, batch and experts make an
        ``nn.Transformer``.
    mesh : Mesh
        Where it runs: axes dp and tp, and ep for experts.

    Returns
    -------
    dict
        ``ops_per_layer``, ``ops_outside``: the forward (``model.loss`` alone, as inference
        and a rematerialized block run it); ``bwd_ops_per_layer``, ``bwd_ops_outside``: what
        ``ts.value_and_grad`` adds (the training step's ops less the forward's);
        ``collectives_per_layer``, ``collectives_outside``: the training step's, keyed as
        ``profiled_counts`` keys them.
    """
    from .. import nn
    from ..autodiff import value_and_grad
    if spec.n_experts:
        from .. import moe as _moe  # noqa: F401  (nn.Transformer(moe=...)'s block plugs in when moe is imported)
    moe = (dict(num_experts=spec.n_experts, top_k=spec.top_k, capacity_factor=spec.capacity_factor)
           if spec.n_experts else None)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, spec.vocab, (spec.batch, spec.seq_len)) for _ in range(2)]
    runs = []
    for layers in (1, 2):
        model = nn.Transformer(spec.vocab, spec.d_model, spec.n_heads, layers, spec.seq_len,
                               hidden=spec.ffn_hidden, mesh=mesh, moe=moe)
        params = model.init(0)
        x, y = (model.batch(t) for t in tokens)
        fwd, _ = profiled_counts(model.loss, params, x, y)
        both, coll = profiled_counts(value_and_grad(model.loss), params, x, y)
        runs.append((fwd, both - fwd, coll))
    (f1, b1, c1), (f2, b2, c2) = runs
    return {"ops_per_layer": f2 - f1, "ops_outside": 2 * f1 - f2, "bwd_ops_per_layer": b2 - b1,
            "bwd_ops_outside": 2 * b1 - b2, "collectives_per_layer": c2 - c1, "collectives_outside": c1 - (c2 - c1)}
