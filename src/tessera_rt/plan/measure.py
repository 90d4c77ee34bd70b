"""Measured bytes on this rank, to check the memory model against the runtime itself:
parameter bytes (the local pieces of a parameter pytree) and activation bytes (what a
``ts.grad`` trace keeps for the backward: every buffer the tape's nodes hold, counted
once, parameters excluded)."""
from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["local_bytes", "traced_activation_bytes"]


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
    from ..autodiff.engine import _trace
    tape, _, _, groups, _ = _trace(fn, (params,) + tuple(args), 0, getattr(fn, "__name__", "fn"))
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
