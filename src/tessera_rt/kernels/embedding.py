"""The embedding as a gather, and its backward as a deterministic scatter-add: the float64
references and the CPU kernel-table entries (``embedding``, ``embedding_backward``).

A tensor-parallel rank holds the vocab slice ``[lo, lo + table.shape[0])`` of the table: an id
outside it gives a zero row forward and adds nothing backward, so summing the ranks' lookups
gives the full one.  The GPU kernels are in ``embedding_cuda``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..backend import register_kernel
from ..dtypes import dtype_name
from ._common import array_module, check_float, widen
from .norms import NORM_DTYPES

__all__ = ["embedding", "embedding_backward", "embedding_cpu", "embedding_backward_cpu", "check_ids"]


def check_ids(op: str, ids: Any) -> None:
    if not hasattr(ids, "dtype") or np.dtype(ids.dtype) not in (np.int32, np.int64):
        raise TypeError(f"{op}: ids must be an int32 or int64 array, got "
                        f"{dtype_name(ids.dtype) if hasattr(ids, 'dtype') else type(ids).__name__}")


def _check_table(op: str, table: Any) -> None:
    check_float(op, "table", table, NORM_DTYPES)
    if table.ndim != 2:
        raise ValueError(f"{op}: table must be 2-D (rows, dim), got shape {tuple(table.shape)}")


def _local(ids: Any, rows: int, lo: int):
    """(ids - lo clipped into the slice, which ids fall in ``[lo, lo + rows)``), flat."""
    xp = array_module(ids)
    local = ids.reshape(-1).astype(np.int64) - lo
    valid = (local >= 0) & (local < rows)
    return xp.where(valid, local, 0), valid


def embedding(ids: Any, table: Any, *, lo: int = 0) -> Any:
    """``table[id - lo]`` for the ids in ``[lo, lo + rows)``, a zero row otherwise: shape
    ``ids.shape + (dim,)``, the table's dtype (float64 arithmetic: a gather is exact)."""
    _check_table("embedding", table)
    check_ids("embedding", ids)
    local, valid = _local(ids, table.shape[0], lo)
    out = widen(table, np.float64)[local] * valid[:, None]
    return out.reshape(tuple(ids.shape) + (table.shape[1],)).astype(table.dtype, copy=False)


def embedding_backward(g: Any, ids: Any, rows: int, *, lo: int = 0) -> Any:
    """``(rows, dim)`` table gradient, g's dtype: the sum of g's rows into their ids' rows in
    float64 (ids outside ``[lo, lo + rows)`` add nothing)."""
    _check_args("embedding_backward", g, ids, rows)
    xp = array_module(g)
    dim = g.shape[-1]
    local, valid = _local(ids, rows, lo)
    out = xp.zeros((rows + 1, dim), np.float64)          # row `rows` collects the ids outside the slice
    xp.add.at(out, xp.where(valid, local, rows), widen(g, np.float64).reshape(-1, dim))
    return out[:rows].astype(g.dtype)


@njit(cache=True, error_model="numpy")
def _scatter_rows(g, local, out):
    """out[local[i]] += g[i] in token order (local -1: skipped); f32 sums, the same bits every run."""
    for i in range(g.shape[0]):
        r = local[i]
        if r >= 0:
            for j in range(g.shape[1]):
                out[r, j] += g[i, j]


def _check_args(op: str, g: Any, ids: Any, rows: int) -> None:
    check_float(op, "g", g, NORM_DTYPES)
    check_ids(op, ids)
    if tuple(g.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"{op}: g {tuple(g.shape)} must be ids {tuple(ids.shape)} plus the embedding dim")
    if rows < 0:
        raise ValueError(f"{op}: rows must be >= 0, got {rows}")


def embedding_cpu(ids: Any, table: Any, *, lo: int = 0, out: Any = None, stream: Any = None) -> np.ndarray:
    """The CPU entry: a NumPy gather with the out-of-slice rows zeroed, the table's dtype (into
    ``out`` when given)."""
    _check_table("embedding", table)
    check_ids("embedding", ids)
    local, valid = _local(np.asarray(ids), table.shape[0], lo)
    shape = tuple(ids.shape) + (table.shape[1],)
    if out is None:
        res = table[local]
        res[~valid] = 0
        return res.reshape(shape)
    flat = out.reshape(-1, table.shape[1])
    np.take(table, local, axis=0, out=flat)
    flat[~valid] = 0
    return out


def embedding_backward_cpu(g: Any, ids: Any, rows: int, *, lo: int = 0, stream: Any = None) -> np.ndarray:
    """The CPU entry: f32 sums of g's rows into the slice's rows in token order (deterministic)."""
    _check_args("embedding_backward", g, ids, rows)
    dim = g.shape[-1]
    local, valid = _local(np.asarray(ids), rows, lo)
    acc = np.float64 if g.dtype == np.float64 else np.float32
    out = np.zeros((rows, dim), acc)
    _scatter_rows(np.ascontiguousarray(widen(g, acc)).reshape(-1, dim), np.where(valid, local, -1), out)
    return out.astype(g.dtype, copy=False)


register_kernel("embedding", "cpu", embedding_cpu)
register_kernel("embedding_backward", "cpu", embedding_backward_cpu)
