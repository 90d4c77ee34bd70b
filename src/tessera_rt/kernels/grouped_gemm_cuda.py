"""Grouped GEMM on the GPU: one launch for every group, offsets read on the device.

Launchers for the ops of ``kernels.grouped_gemm`` (the NumPy references): f16/bf16 run the
tensor-core kernel (the tile GEMM's ``cp.async`` + ``ldmatrix`` + ``mma.sync`` pipeline with a
device-side group scheduler in front, f32 accumulators), f32 the SIMT kernel (exact f32 FMAs),
f64 the reference (one cuBLAS call per group after copying the offsets to the host: the one
path that waits).  No launch reads a count on the host: a forward's grid has
``ceil(R / BM) + G`` row tiles (an upper bound) times the column tiles on x, and each block
finds its group on the device (``grouped_gemm_src``).  Kernel-table ops: ``grouped_matmul``,
``grouped_dual_matmul``, ``grouped_swiglu``, ``grouped_matmul_wgrad`` (also
``grouped_matmul_wgrad_dual``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name, resolve_dtype
from . import grouped_gemm as ref
from ._common import check_float, check_stream
from .compile import KernelSource, register_source
from .cuda_common import MAX_GRID_YZ, get_function, launch_stream
from .grouped_gemm_src import (
    SIMT_TILE,
    grouped_smem_bytes,
    grouped_threads,
    grouped_tiles_m,
    render_grouped_mma,
    render_grouped_simt,
)
from .norms import NORM_DTYPES
from .precision import note
from .providers import dispatching

__all__ = ["grouped_matmul_cuda", "grouped_dual_matmul_cuda", "grouped_swiglu_cuda", "grouped_matmul_wgrad_cuda",
           "grouped_launch", "grouped_tile", "grouped_vec", "grouped_configs"]

_BF16 = resolve_dtype("bf16")
_MMA = {np.dtype(np.float16): "f16", _BF16: "bf16"}
_F32 = np.dtype(np.float32)
# average rows per group below which 64-row tiles win (a model, not a measurement): a 128-row
# tile wastes half a tile a group (r / (r + 64) useful), a 64-row one a quarter as much but
# moves 1.5x the L2 bytes per FLOP (assumed ~0.85x the rate): even near 150 rows
_SMALL_GROUPS = 128
_MAX_GRID_X = 2 ** 31 - 1


def grouped_tile(rows: int, groups: int, *, dual: bool, wgrad: bool, vec: int = 8) -> tuple[int, int, int]:
    """The tile GEMM config a grouped product runs with.  A forward's row tiles end at group
    boundaries, so groups averaging under ``_SMALL_GROUPS`` rows take 64-row tiles (less of each
    partial tile wasted); the gradient's M tiles are whole (M is the weight's K).  4- and 2-element
    copies (widths not multiples of 8) take 64x64 tiles: ``ts_load_tile`` unrolls 2-4x more of
    them a thread, whose addresses would spill the larger tiles' registers."""
    if vec in (2, 4):
        return (64, 64, 32)
    small = not wgrad and rows < _SMALL_GROUPS * max(groups, 1)
    if dual:
        return (64, 64, 32) if small else (128, 128, 32)
    return (64, 128, 32) if small else (128, 128, 32)


def grouped_configs() -> list[dict]:
    """Every tensor-core config ``grouped_tile`` can pick (f16; bf16 and f32 output compile the
    same code with other conversions, one of each added): what tests/kernels/test_compile.py
    compiles for sm_80 and sm_90."""
    forms: list[dict[str, Any]] = [dict(mode=m, trans_w=t) for m in ("plain", "sum2") for t in (False, True)]
    forms += [dict(mode="dual"), dict(mode="swiglu"), dict(wgrad=True), dict(mode="dual", wgrad=True)]
    out = []
    for form in forms:
        dual, wgrad = form.get("mode") in ("dual", "swiglu"), form.get("wgrad", False)
        for vec in (8, 4, 2, 1):
            tiles = {grouped_tile(r, 1, dual=dual, wgrad=wgrad, vec=vec) for r in (1, 10 ** 6)}
            out += [dict(BM=t[0], BN=t[1], BK=t[2], vec=vec, **form) for t in sorted(tiles)]
    return out + [dict(BM=128, BN=128, BK=32, dtype="bf16"), dict(BM=128, BN=128, BK=32, wgrad=True, out_f32=True)]


register_source(KernelSource("grouped_gemm", render_grouped_mma, ("ts_grouped_mma",), configs=grouped_configs(),
                             smem_dynamic=grouped_smem_bytes))
register_source(KernelSource(
    "grouped_gemm_f32", render_grouped_simt, ("ts_grouped_simt",),
    configs=[dict(), dict(trans_w=True, mode="sum2"), dict(mode="dual"), dict(mode="swiglu"), dict(wgrad=True),
             dict(wgrad=True, mode="dual")]))


def _dense(a):
    import cupy
    return None if a is None else cupy.ascontiguousarray(a)


def _offsets64(offsets):
    import cupy
    off = offsets if isinstance(offsets, cupy.ndarray) else cupy.asarray(offsets)
    return cupy.ascontiguousarray(off if off.dtype == np.int64 else off.astype(np.int64))


def grouped_vec(widths, *arrays) -> int:
    """Elements per cp.async: 8 (16 bytes) where every row width/leading dim the copies use is a
    multiple of 8 and every operand starts 16-byte aligned, else 4, 2 or 1 (``gemm_vec``'s rule;
    a group's weight starts ``g * K * N`` elements in, a multiple of the width when K is)."""
    for vec in (8, 4, 2):
        if all(w % vec == 0 for w in widths) and all(a is None or a.data.ptr % (2 * vec) == 0 for a in arrays):
            return vec
    return 1


def grouped_launch(a, b, offsets, *, mode: str = "plain", trans_w: bool = False, wgrad: bool = False, a2=None,
                   b2=None, out_f32: bool = False, stream=None, op: str = "grouped_matmul"):
    """Launch one grouped product (the ops below check their arguments first): one kernel launch.

    Forward (``wgrad=False``): ``a (R, K)``, ``b (G, K, N)`` (``(G, N, K)`` with ``trans_w``);
    returns ``C (R, N)`` (mode "dual": ``(C, C2)`` with ``b2``; "swiglu": ``silu(a@b) * (a@b2)``;
    "sum2": ``a@b + a2@b2``).  Weight gradient: ``a (R, M)``, ``b (R, N)``; returns
    ``(G, M, N)`` (``(C, C2)`` for ``b2`` with mode "dual").  ``offsets`` is a device vector.
    """
    import cupy
    dt = np.dtype(a.dtype)
    with launch_stream(stream):
        a, b, a2, b2 = (_dense(t) for t in (a, b, a2, b2))
        off = _offsets64(offsets)
        g = off.shape[0] - 1
        if wgrad:
            rows, m, n = a.shape[0], a.shape[1], b.shape[1]
            k = rows
            shape: tuple[int, ...] = (g, m, n)
        else:
            rows, k = a.shape
            n = b.shape[1] if trans_w else b.shape[2]
            m = rows
            shape = (rows, n)
        out_dt = _F32 if (out_f32 or dt == _F32) else dt
        c = cupy.empty(shape, out_dt)
        c2 = cupy.empty(shape, out_dt) if mode == "dual" else None
        if c.size == 0:
            if wgrad:
                c.fill(0)
                if c2 is not None:
                    c2.fill(0)
            return (c, c2) if mode == "dual" else c
        smem = 0
        if dt in _MMA:
            precision = _MMA[dt]
            widths = (m, n) if wgrad else (k,) if trans_w else (k, n)
            vec = grouped_vec(widths, a, b, a2, b2)
            tile = grouped_tile(rows, g, dual=mode in ("dual", "swiglu"), wgrad=wgrad, vec=vec)
            cfg: dict[str, Any] = dict(BM=tile[0], BN=tile[1], BK=tile[2], mode=mode, wgrad=wgrad,
                                       trans_w=trans_w and not wgrad, dtype=precision, vec=vec, out_f32=out_dt == _F32)
            smem = grouped_smem_bytes(**cfg)
            fn = get_function("grouped_gemm", "ts_grouped_mma", cfg, render_grouped_mma, dynamic_smem=smem)
            bm, bn, threads = tile[0], tile[1], grouped_threads(**cfg)
        else:
            precision, bm, bn, threads = "f32", SIMT_TILE, SIMT_TILE, 256
            cfg = dict(mode=mode, wgrad=wgrad, trans_w=trans_w and not wgrad)
            fn = get_function("grouped_gemm_f32", "ts_grouped_simt", cfg, render_grouped_simt, fast_math=False)
        null = np.uint64(0)
        args = (a, b, null if a2 is None else a2, null if b2 is None else b2, c, null if c2 is None else c2, off,
                np.int32(g), np.int32(m), np.int32(n), np.int32(k))
        # x: every (row tile, column tile) (the kernel orders them); z: the gradient's group
        blocks = grouped_tiles_m(m, g, bm, wgrad) * (-(-n // bn))
        if blocks > _MAX_GRID_X or (wgrad and g > MAX_GRID_YZ):
            raise ValueError(f"{op}: {blocks} tiles of {g} groups exceed the grid's limits; split the rows or groups")
        fn((blocks, 1, g if wgrad else 1), (threads,), args, shared_mem=smem)
    note(op, precision)          # the provider dispatcher fills in "own" and the providers' reasons
    return (c, c2) if mode == "dual" else c


def _reference(fn, *args, stream=None, **kw):
    """The f64 path: the CuPy reference (copies the offsets to the host, so the host waits)."""
    note(fn.__name__, "f64")
    with launch_stream(stream):
        return fn(*args, **kw)


def _gpu_dtype(x) -> bool:
    return np.dtype(x.dtype) in _MMA or np.dtype(x.dtype) == _F32


def grouped_matmul_cuda(x: Any, w: Any, offsets: Any, *, trans_w: bool = False, x2: Any = None, w2: Any = None,
                        out: Any = None, stream: Any = None):
    """GPU ``grouped_matmul`` (see ``kernels.grouped_gemm.grouped_matmul``)."""
    op = "grouped_matmul"
    check_stream(op, stream)
    r, k, n, g = ref.check_grouped(op, x, w, offsets, trans_w)
    if (x2 is None) != (w2 is None):
        raise ValueError(f"{op}: pass x2 and w2 together (the second product x2 @ w2)")
    if x2 is not None and (tuple(x2.shape) != tuple(x.shape) or tuple(w2.shape) != tuple(w.shape)
                           or x2.dtype != x.dtype or w2.dtype != w.dtype):
        raise ValueError(f"{op}: x2 {tuple(x2.shape)} / w2 {tuple(w2.shape)} must match x {tuple(x.shape)} / w "
                         f"{tuple(w.shape)} (the kernel runs both products over the same K)")
    if not _gpu_dtype(x):
        return _reference(ref.grouped_matmul, x, w, offsets, trans_w=trans_w, x2=x2, w2=w2, out=out, stream=stream)
    y = grouped_launch(x, w, offsets, mode="plain" if x2 is None else "sum2", trans_w=trans_w, a2=x2, b2=w2,
                       stream=stream)
    return _into(op, y, out, stream)


def _into(op, y, out, stream):
    if out is None:
        return y
    if tuple(out.shape) != tuple(y.shape) or out.dtype != y.dtype:
        raise ValueError(f"{op}: out is {tuple(out.shape)} {dtype_name(out.dtype)}, the result {tuple(y.shape)} "
                         f"{dtype_name(y.dtype)}")
    with launch_stream(stream):
        out[...] = y
    return out


def _pair(op: str, mode: str, reference, x: Any, w1: Any, w3: Any, offsets: Any, stream: Any):
    """The two-weight forms: one pass over ``x`` computing ``x @ w1`` and ``x @ w3``."""
    check_stream(op, stream)
    ref.check_pair(op, x, w1, w3, offsets)
    if not _gpu_dtype(x):
        return _reference(reference, x, w1, w3, offsets, stream=stream)
    return grouped_launch(x, w1, offsets, mode=mode, b2=w3, stream=stream, op=op)


def grouped_dual_matmul_cuda(x: Any, w1: Any, w3: Any, offsets: Any, *, stream: Any = None):
    """GPU ``grouped_dual_matmul``: ``(x @ w1[g], x @ w3[g])`` in one pass over ``x``."""
    return _pair("grouped_dual_matmul", "dual", ref.grouped_dual_matmul, x, w1, w3, offsets, stream)


def grouped_swiglu_cuda(x: Any, w1: Any, w3: Any, offsets: Any, *, stream: Any = None):
    """GPU ``grouped_swiglu``: ``silu(x @ w1[g]) * (x @ w3[g])`` in one pass, f32 products."""
    return _pair("grouped_swiglu", "swiglu", ref.grouped_swiglu, x, w1, w3, offsets, stream)


def _check_wgrad(op, x, dy, offsets):
    check_float(op, "x", x, NORM_DTYPES, min_ndim=2)
    check_float(op, "dy", dy, NORM_DTYPES, min_ndim=2)
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0] or x.dtype != dy.dtype:
        raise ValueError(f"{op}: x {tuple(x.shape)} {dtype_name(x.dtype)} and dy {tuple(dy.shape)} "
                         f"{dtype_name(dy.dtype)} must be 2-D with the same rows and dtype")
    if not hasattr(offsets, "shape") or len(offsets.shape) != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{op}: offsets must be a vector of groups + 1 row offsets")
    ref.check_offsets(op, offsets, offsets.shape[0] - 1)


def grouped_matmul_wgrad_cuda(x: Any, dy: Any, offsets: Any, *, out: Any = None, stream: Any = None):
    """GPU ``grouped_matmul_wgrad``: ``dw[g] = x[rows of g].T @ dy[rows of g]``, ``(G, K, N)``."""
    op = "grouped_matmul_wgrad"
    check_stream(op, stream)
    _check_wgrad(op, x, dy, offsets)
    if not _gpu_dtype(x):
        return _reference(ref.grouped_matmul_wgrad, x, dy, offsets, out=out, stream=stream)
    return _into(op, grouped_launch(x, dy, offsets, wgrad=True, stream=stream, op=op), out, stream)


def grouped_matmul_wgrad_dual_cuda(x: Any, dy: Any, dy2: Any, offsets: Any, *, stream: Any = None):
    """``(x.T @ dy, x.T @ dy2)`` per group, one pass over ``x`` (the SwiGLU experts' gw1, gw3)."""
    op = "grouped_matmul_wgrad_dual"
    check_stream(op, stream)
    _check_wgrad(op, x, dy, offsets)
    _check_wgrad(op, x, dy2, offsets)
    if tuple(dy2.shape) != tuple(dy.shape):
        raise ValueError(f"{op}: dy2 {tuple(dy2.shape)} must match dy {tuple(dy.shape)}")
    if not _gpu_dtype(x):
        return _reference(ref.grouped_matmul_wgrad_dual, x, dy, dy2, offsets, stream=stream)
    return grouped_launch(x, dy, offsets, wgrad=True, mode="dual", b2=dy2, stream=stream, op=op)


# the table's entries try the providers first (kernels.cublas_grouped: one cuBLAS call per
# group when the offsets are on the host), then these kernels
for _name, _fn in (("grouped_matmul", grouped_matmul_cuda), ("grouped_dual_matmul", grouped_dual_matmul_cuda),
                   ("grouped_swiglu", grouped_swiglu_cuda), ("grouped_matmul_wgrad", grouped_matmul_wgrad_cuda),
                   ("grouped_matmul_wgrad_dual", grouped_matmul_wgrad_dual_cuda)):
    register_kernel(_name, "cuda", dispatching(_name, _fn))
