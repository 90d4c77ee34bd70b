"""Grouped GEMM: one product per group over a ragged, group-sorted batch of rows (MoE experts).

``x (R, K)`` holds the rows of every group back to back: group ``g`` owns rows
``offsets[g] ... offsets[g+1] - 1`` (``offsets (G+1,)`` int32/int64, ``offsets[0] == 0``,
``offsets[G] == R``; a group may be empty).  ``w (G, K, N)`` holds a matrix per group.

* ``grouped_matmul(x, w, offsets)``: ``y[r] = x[r] @ w[g]`` for the rows of group ``g``
  (``trans_w=True`` takes ``w (G, N, K)`` and multiplies by ``w[g].T``: the input gradient
  ``dy @ w[g].T`` reads the forward's weights as they are); ``x2=, w2=`` add a second product
  ``x2[r] @ w2[g]`` into the same accumulator (``dh1 @ w1.T + dh3 @ w3.T`` in one pass);
* ``grouped_dual_matmul(x, w1, w3, offsets)``: ``(x @ w1[g], x @ w3[g])`` reading ``x`` once;
* ``grouped_swiglu(x, w1, w3, offsets)``: ``silu(x @ w1[g]) * (x @ w3[g])``;
* ``grouped_matmul_wgrad(x, dy, offsets)``: ``dw[g] = x[rows of g].T @ dy[rows of g]``
  ``(G, K, N)``, zeros for an empty group.

Sums accumulate in f32 (f64 for f64) and round once to the inputs' dtype.  These NumPy/CuPy
functions are the references and the CPU kernels (one BLAS call per group); the GPU kernels
(``grouped_gemm_cuda``) read the offsets on the device, so the host never waits for them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from ._common import array_module, check_float, check_stream, widen
from .norms import NORM_DTYPES
from .numerics import accum_dtype

__all__ = ["grouped_matmul", "grouped_dual_matmul", "grouped_swiglu", "grouped_matmul_wgrad", "grouped_matmul_wgrad_dual",
           "check_grouped", "check_pair", "check_offsets", "host_offsets"]


def check_offsets(op: str, offsets: Any, groups: int) -> None:
    """TypeError/ValueError unless ``offsets`` is an int32/int64 vector of ``groups + 1`` entries."""
    if not hasattr(offsets, "dtype") or np.dtype(offsets.dtype) not in (np.int32, np.int64):
        got = dtype_name(offsets.dtype) if hasattr(offsets, "dtype") else type(offsets).__name__
        raise TypeError(f"{op}: offsets must be an int32 or int64 array (group g owns rows offsets[g] .. "
                        f"offsets[g+1]-1), got {got}")
    if tuple(offsets.shape) != (groups + 1,):
        raise ValueError(f"{op}: offsets has shape {tuple(offsets.shape)}; w holds {groups} groups, so it needs "
                         f"{groups + 1} entries (0, the end of group 0, ..., the number of rows)")


def host_offsets(op: str, offsets: Any, rows: int) -> np.ndarray:
    """The offsets on the host, checked (a device array is copied: the host waits for it)."""
    off = np.asarray(offsets.get() if hasattr(offsets, "get") else offsets, dtype=np.int64)
    if off.size and (off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0)):
        raise ValueError(f"{op}: offsets {off.tolist()[:8]}{'...' if off.size > 8 else ''} must start at 0, "
                         f"never decrease and end at the number of rows ({rows})")
    return off


def check_grouped(op: str, x: Any, w: Any, offsets: Any, trans_w: bool = False) -> tuple[int, int, int, int]:
    """Validate one grouped product; returns ``(R, K, N, G)``."""
    check_float(op, "x", x, NORM_DTYPES, min_ndim=2)
    check_float(op, "w", w, NORM_DTYPES, min_ndim=3)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"{op}: x must be 2-D (rows, K) and w 3-D (groups, K, N), got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if np.dtype(x.dtype) != np.dtype(w.dtype):
        raise TypeError(f"{op}: x is {dtype_name(x.dtype)} and w {dtype_name(w.dtype)}; cast one so they match")
    g, k, n = (w.shape[0], w.shape[2], w.shape[1]) if trans_w else w.shape
    if x.shape[1] != k:
        layout = "(groups, N, K) with trans_w=True" if trans_w else "(groups, K, N)"
        raise ValueError(f"{op}: x {tuple(x.shape)} has K={x.shape[1]} but w {tuple(w.shape)} read as {layout} "
                         f"has K={k}")
    check_offsets(op, offsets, g)
    return x.shape[0], k, n, g


def check_pair(op: str, x: Any, w1: Any, w3: Any, offsets: Any) -> int:
    """Validate a product by two weights of one shape (``x @ w1``, ``x @ w3``); returns N."""
    n = check_grouped(op, x, w1, offsets)[2]
    if tuple(w3.shape) != tuple(w1.shape) or w3.dtype != w1.dtype:
        raise ValueError(f"{op}: w3 {tuple(w3.shape)} {dtype_name(w3.dtype)} must match w1 {tuple(w1.shape)} "
                         f"{dtype_name(w1.dtype)}")
    return n


def _finish(op: str, y: Any, out: Any, dtype) -> Any:
    y = y.astype(dtype, copy=False)
    if out is None:
        return y
    if tuple(out.shape) != tuple(y.shape) or np.dtype(out.dtype) != np.dtype(dtype):
        raise ValueError(f"{op}: out is {tuple(out.shape)} {dtype_name(out.dtype)}, the result "
                         f"{tuple(y.shape)} {dtype_name(dtype)}")
    out[...] = y
    return out


def _products(x, pairs, offsets, n, trans):
    """sum over (x_i, w_i) of x_i[rows of g] @ w_i[g] per group, in the accumulation dtype."""
    xp = array_module(x, *(w for _, w in pairs))
    acc = accum_dtype(x.dtype)
    off = host_offsets("grouped_matmul", offsets, x.shape[0])
    y = xp.zeros((x.shape[0], n), acc)
    for g in range(off.size - 1):
        lo, hi = int(off[g]), int(off[g + 1])
        if hi == lo:
            continue
        for xi, wi in pairs:
            wg = widen(wi[g], acc)
            y[lo:hi] += widen(xi[lo:hi], acc) @ (wg.T if trans else wg)
    return y


def grouped_matmul(x: Any, w: Any, offsets: Any, *, trans_w: bool = False, x2: Any = None, w2: Any = None,
                   out: Any = None, stream: Any = None) -> Any:
    """``y[r] = x[r] @ w[g]`` for each row ``r`` of each group ``g`` (plus ``x2[r] @ w2[g]``).

    Parameters
    ----------
    x : array
        ``(R, K)``, the rows of group 0, then group 1, ...
    w : array
        ``(G, K, N)`` (``(G, N, K)`` with ``trans_w``).
    offsets : array
        ``(G + 1,)`` int32/int64: group ``g`` owns rows ``offsets[g] .. offsets[g+1] - 1``.
    trans_w : bool
        Multiply by ``w[g].T`` (``w`` stored ``(G, N, K)``).
    x2, w2 : array, optional
        A second product added into the same sum (same layout as ``x``, ``w``).
    out : array, optional
        Receives ``y``.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    array
        ``(R, N)`` in x's dtype.
    """
    op = "grouped_matmul"
    check_stream(op, stream)
    r, k, n, g = check_grouped(op, x, w, offsets, trans_w)
    pairs = [(x, w)]
    if (x2 is None) != (w2 is None):
        raise ValueError(f"{op}: pass x2 and w2 together (the second product x2 @ w2)")
    if x2 is not None:
        if check_grouped(op, x2, w2, offsets, trans_w)[0::2] != (r, n) or x2.dtype != x.dtype:
            raise ValueError(f"{op}: x2 {tuple(x2.shape)} / w2 {tuple(w2.shape)} must give the same (rows, N) "
                             f"and dtype as x {tuple(x.shape)} / w {tuple(w.shape)}")
        pairs.append((x2, w2))
    return _finish(op, _products(x, pairs, offsets, n, trans_w), out, x.dtype)


def grouped_dual_matmul(x: Any, w1: Any, w3: Any, offsets: Any, *, stream: Any = None) -> tuple[Any, Any]:
    """``(x @ w1[g], x @ w3[g])`` per group: the SwiGLU experts' two input projections.

    Parameters
    ----------
    x : array
        ``(R, K)`` group-sorted rows.
    w1, w3 : array
        ``(G, K, N)`` each.
    offsets : array
        ``(G + 1,)`` group row offsets.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    tuple of array
        ``(h1, h3)``, each ``(R, N)``.
    """
    op = "grouped_dual_matmul"
    check_stream(op, stream)
    n = check_pair(op, x, w1, w3, offsets)
    return (_finish(op, _products(x, [(x, w1)], offsets, n, False), None, x.dtype),
            _finish(op, _products(x, [(x, w3)], offsets, n, False), None, x.dtype))


def grouped_swiglu(x: Any, w1: Any, w3: Any, offsets: Any, *, stream: Any = None) -> Any:
    """``silu(x @ w1[g]) * (x @ w3[g])`` per group, from the f32 (f64) products.

    Parameters
    ----------
    x : array
        ``(R, K)`` group-sorted rows.
    w1, w3 : array
        ``(G, K, N)`` each.
    offsets : array
        ``(G + 1,)`` group row offsets.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    array
        ``(R, N)`` in x's dtype.
    """
    op = "grouped_swiglu"
    check_stream(op, stream)
    n = check_pair(op, x, w1, w3, offsets)
    h1 = _products(x, [(x, w1)], offsets, n, False)
    h3 = _products(x, [(x, w3)], offsets, n, False)
    return _finish(op, h1 / (1 + array_module(h1).exp(-h1)) * h3, None, x.dtype)


def grouped_matmul_wgrad(x: Any, dy: Any, offsets: Any, *, out: Any = None, stream: Any = None) -> Any:
    """``dw[g] = x[rows of g].T @ dy[rows of g]``: the weight gradient of ``grouped_matmul``.

    Parameters
    ----------
    x : array
        ``(R, K)`` the forward's rows.
    dy : array
        ``(R, N)`` their output cotangents.
    offsets : array
        ``(G + 1,)`` group row offsets.
    out : array, optional
        Receives ``dw``.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    array
        ``(G, K, N)`` in x's dtype; zeros for an empty group.
    """
    op = "grouped_matmul_wgrad"
    check_stream(op, stream)
    check_float(op, "x", x, NORM_DTYPES, min_ndim=2)
    check_float(op, "dy", dy, NORM_DTYPES, min_ndim=2)
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0] or x.dtype != dy.dtype:
        raise ValueError(f"{op}: x {shape_of(x)} and dy {shape_of(dy)} must be 2-D with the same rows and dtype")
    if not hasattr(offsets, "shape") or len(offsets.shape) != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{op}: offsets must be a vector of groups + 1 row offsets")
    g = offsets.shape[0] - 1
    check_offsets(op, offsets, g)
    xp = array_module(x, dy)
    acc = accum_dtype(x.dtype)
    off = host_offsets(op, offsets, x.shape[0])
    dw = xp.zeros((g, x.shape[1], dy.shape[1]), acc)
    for i in range(g):
        lo, hi = int(off[i]), int(off[i + 1])
        if hi > lo:
            dw[i] = widen(x[lo:hi], acc).T @ widen(dy[lo:hi], acc)
    return _finish(op, dw, out, x.dtype)


def grouped_matmul_wgrad_dual(x: Any, dy: Any, dy2: Any, offsets: Any, *, stream: Any = None) -> tuple[Any, Any]:
    """``(x.T @ dy, x.T @ dy2)`` per group (the SwiGLU experts' ``gw1``, ``gw3``; the GPU kernel
    reads ``x`` once).

    Parameters
    ----------
    x : array
        ``(R, K)`` the forward's rows.
    dy, dy2 : array
        ``(R, N)`` two cotangents.
    offsets : array
        ``(G + 1,)`` group row offsets.
    stream : stream, optional
        The stream the kernel runs on.

    Returns
    -------
    tuple of array
        Two ``(G, K, N)`` gradients.
    """
    return (grouped_matmul_wgrad(x, dy, offsets, stream=stream), grouped_matmul_wgrad(x, dy2, offsets, stream=stream))


def shape_of(a: Any) -> str:
    return f"{tuple(a.shape)} {dtype_name(a.dtype)}"


for _name, _fn in (("grouped_matmul", grouped_matmul), ("grouped_dual_matmul", grouped_dual_matmul),
                   ("grouped_swiglu", grouped_swiglu), ("grouped_matmul_wgrad", grouped_matmul_wgrad),
                   ("grouped_matmul_wgrad_dual", grouped_matmul_wgrad_dual)):
    register_kernel(_name, "cpu", _fn)
