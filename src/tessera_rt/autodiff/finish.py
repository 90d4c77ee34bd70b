"""Finished gradients into their parameters' layouts and dtypes.

When a parameter's gradient is complete (every op that read it has been swept) and only
pending sums stand between it and the parameter's layout (data-parallel replicas,
tensor-parallel partial products), it goes into a gradient bucket (``buckets``: DDP's flat
buckets, one async all-reduce per full bucket on the ``grad_reduce`` stream role), so the
reduction overlaps the rest of the backward pass; ``Finisher.wait`` collects them all.
``reduce_grads`` does the same for raw gradients a caller accumulated itself.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import runtime as rt
from ..backend import get_backend
from ..dist.tensor import dtensor_collectives as dc
from ..dist.tensor.dtensor import DTensor, meta_of
from .buckets import GradBuckets, grad_bucket_bytes, largest_shard
from .pytree import tree_flatten, tree_unflatten

__all__ = ["GRAD_ROLE", "Finisher", "reduce_grads", "Reduction"]

GRAD_ROLE = "grad_reduce"


def _issue_reduce(local, mesh, axis, out=None):
    """The async all-reduce of a gradient's (or a bucket's) pending sum on ``GRAD_ROLE``."""
    if GRAD_ROLE not in rt.stream_map():
        rt.set_stream_map({GRAD_ROLE: rt.stream_map()["tp_collective"]})
    return dc.all_reduce(local, axis=axis, mesh=mesh, out=out, async_op=True, role=GRAD_ROLE)


class Finisher:
    """Brings each leaf's gradient into the leaf's layout and dtype; pending sums over mesh
    axes go into a gradient bucket the moment the gradient is complete, and a full bucket
    becomes one async all-reduce (``buckets``; cap 0: one all-reduce per gradient).

    Parameters
    ----------
    bucket_mb : float or None
        The bucket cap in MiB (None: ``set_grad_bucket_mb``'s, ``$TESSERA_GRAD_BUCKET_MB`` or
        the default; 0: no buckets).
    """

    def __init__(self, bucket_mb: float | None = None):
        self.pending: list = []
        self.bucket_mb = bucket_mb
        self.buckets: GradBuckets | None = None

    def plan(self, params: list) -> None:
        """Size the buckets for ``params``: the default cap depends on their DTensors' global
        bytes, the same number on every rank.

        Parameters
        ----------
        params : list
            The differentiated values (arrays and DTensors).
        """
        total = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params if type(p) is DTensor)
        cap = grad_bucket_bytes(self.bucket_mb, total)
        self.buckets = GradBuckets(cap, _issue_reduce) if cap > 0 else None

    def __call__(self, leaf: Any) -> None:
        g, p = leaf.grad, leaf.value
        if g is None:
            return
        if type(p) is not DTensor:
            if type(g) is DTensor:
                g = g.full_tensor()
            if getattr(g, "dtype", None) != p.dtype or getattr(g, "shape", None) != p.shape:
                g = get_backend().xp.asarray(g, dtype=p.dtype).reshape(p.shape)
            if not getattr(g.flags, "writeable", True):   # CuPy flags have no writeable
                g = g.copy()                     # a broadcast view (the gradient of a sum)
            leaf.grad = g
            return
        if type(g) is not DTensor:
            raise TypeError(f"ts.grad: the gradient of DTensor argument {leaf.name} came back as a "
                            f"{type(g).__name__}; a VJP rule lost the layout")
        if g.dtype != p.dtype:
            g = g.astype(p.dtype)
        want = p.layout
        lay = g.layout
        if lay == want:
            leaf.grad = g
            return
        sums = [a for a, o in lay.partial if o == "sum"]
        if lay.dims == want.dims and not want.partial and len(sums) == len(lay.partial) and sums:
            axis = sums[0] if len(sums) == 1 else tuple(sums)
            if g.mesh.size(axis) == 1:           # a sum over one rank: the piece is the sum already
                leaf.grad = DTensor._wrap(g.to_local(), meta_of(want, p.shape, g.dtype, p.mesh))
                return
            if self.buckets is not None:
                self.buckets.add(leaf, g.to_local(), g.mesh, axis, largest_shard(g.shape, lay, g.mesh))
            else:
                self.pending.append((leaf, _issue_reduce(g.to_local(), g.mesh, axis)))
            leaf.grad = None
            return
        leaf.grad = g.redistribute(want)

    def flush(self) -> None:
        """Issue the buckets still open (their gradients are all in)."""
        if self.buckets is not None:
            self.buckets.flush()

    def wait(self) -> None:
        """Wait for every all-reduce issued and put each result in its leaf's ``grad``."""
        done = [(leaf, work.wait()) for leaf, work in self.pending]
        if self.buckets is not None:
            done += self.buckets.results()
        for leaf, local in done:
            p = leaf.value
            leaf.grad = DTensor._wrap(local, meta_of(p.layout, p.shape, local.dtype, p.mesh))
        self.pending.clear()


class _Leaf:
    __slots__ = ("value", "grad", "name")

    def __init__(self, value, grad, name):
        self.value, self.grad, self.name = value, grad, name


class Reduction:
    """The handle ``reduce_grads`` returns: ``wait()`` gives the gradients in their
    parameters' layouts.

    Parameters
    ----------
    leaves : list
        The parameters with their raw gradients (``value``, ``grad``, ``name`` each).
    finisher : Finisher
        The finisher that issued their reductions.
    struct : Any
        The parameters' pytree structure (``tree_flatten``'s).
    """

    def __init__(self, leaves: list, finisher: Finisher, struct: Any):
        self._leaves, self._finisher, self._struct = leaves, finisher, struct

    def wait(self) -> Any:
        """Wait for the reductions.

        Returns
        -------
        Any
            The gradients as a pytree shaped like the parameters, each in its parameter's layout.
        """
        self._finisher.wait()
        return tree_unflatten(self._struct, [leaf.grad for leaf in self._leaves])


def reduce_grads(params: Any, grads: Any) -> Reduction:
    """Start bringing raw gradients (from ``vjp(..., reduce=False)``, possibly summed over
    micro-batches) into their parameters' layouts: the pending sums go out in gradient
    buckets (async all-reduces on the ``grad_reduce`` role), issued now (the same mechanism
    ``ts.grad`` uses).

    Parameters
    ----------
    params : pytree
        The parameters (arrays / DTensors).
    grads : pytree
        Their raw gradients, in the same structure.

    Returns
    -------
    Reduction
        ``wait()`` on it returns the finished gradients.
    """
    ps, paths, struct = tree_flatten(params)
    gs = tree_flatten(grads)[0]
    if len(gs) != len(ps):
        raise ValueError(f"reduce_grads: {len(gs)} gradients for {len(ps)} parameters")
    finisher = Finisher()
    finisher.plan(ps)
    leaves = [_Leaf(p, g, path) for p, g, path in zip(ps, gs, paths)]
    for leaf in leaves:
        finisher(leaf)
    finisher.flush()
    return Reduction(leaves, finisher, struct)
