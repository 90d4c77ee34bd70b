"""The network ops with kernels of their own: the embedding (a gather, its backward a
scatter-add) and the fused softmax cross-entropy.  Each takes plain arrays (the kernel
table, so NumPy or CuPy) or, for the embedding, DTensors (``dist.tensor.reduction_rules``)."""
from __future__ import annotations

from typing import Any

from ..autodiff.tape import differentiable
from ..backend import get_backend
from ..dist.tensor import dispatch as _d
from .ops import _is_dt

__all__ = ["embedding", "embedding_backward", "softmax_cross_entropy"]


@differentiable("embedding", ("table",))
def embedding(ids: Any, table: Any) -> Any:
    """Rows of ``table`` at integer ``ids``: ``table[ids]``, a gather (no one-hot GEMM).

    Parameters
    ----------
    ids : array or DTensor
        Integer ids ``(...)``.
    table : array or DTensor
        ``(vocab, dim)``.  As a DTensor its rows may be sharded (vocab-parallel): each rank
        gathers the ids it holds rows for and the result is a pending sum over those axes.

    Returns
    -------
    array or DTensor
        ``ids.shape + (dim,)`` in the table's dtype.
    """
    if _is_dt(ids, table):
        return _d.dispatch("embedding", (), (ids, table))
    return get_backend().kernel("embedding", like=table)(ids, table)


def embedding_backward(g: Any, ids: Any, table: Any) -> Any:
    """The cotangent of ``embedding``'s table: ``g``'s rows summed into the ids' rows (f32
    accumulation, the same bits on every run).

    Parameters
    ----------
    g : array or DTensor
        The output's cotangent ``ids.shape + (dim,)``.
    ids : array or DTensor
        The forward's ids.
    table : array or DTensor
        The forward's table (its shape and layout).

    Returns
    -------
    array or DTensor
        ``(vocab, dim)``; for DTensors in the table's layout, pending a sum over the axes the
        ids are sharded on.
    """
    if _is_dt(g, ids, table):
        return _d.dispatch("embedding_backward", (), (g, ids, table))
    return get_backend().kernel("embedding_backward", like=g)(g, ids, table.shape[0])


@differentiable("softmax_cross_entropy", ("logits",))
def softmax_cross_entropy(logits: Any, targets: Any, *, return_lse: bool = False) -> Any:
    """Mean over rows of ``logsumexp(logits) - logits[target]``: one fused kernel on plain
    arrays (f32 statistics for 16-bit logits, no one-hot; on a GPU the loss stays on the
    device).  For DTensors (vocab-parallel logits) use ``nn.cross_entropy``.

    Parameters
    ----------
    logits : array
        ``(..., V)``.
    targets : array
        Integer ids ``(...)``.
    return_lse : bool
        Also return the rows' log-sum-exp (f32).

    Returns
    -------
    array or (array, array)
        The scalar loss (a 0-d array on a GPU), and ``lse`` when ``return_lse``.
    """
    if _is_dt(logits, targets):
        raise TypeError("op.softmax_cross_entropy takes plain arrays; for DTensors (vocab-parallel logits) "
                        "use nn.cross_entropy(logits, targets, iota)")
    return get_backend().kernel("softmax_cross_entropy", like=logits)(logits, targets, return_lse=return_lse)
