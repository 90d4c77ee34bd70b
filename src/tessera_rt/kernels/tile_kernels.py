"""The seeds' tile kernels written with the tile API: saxpy (seed 002 §2.1), the staged axpy
(§2.3's double-buffered ``tp_axpy``) and a shared-memory tiled matmul (§2.6, f32 accumulate).

Each has a launcher that checks arguments before launch and takes ``out=``/``stream=``; the
NumPy reference is the CPU path and the oracle.  They run on a GPU through Numba and on a
CPU-only machine under the CUDA simulator (small sizes).
"""
from __future__ import annotations

import contextlib
from typing import Any

import numba
import numpy as np

from ..backend import register_kernel
from ..dtypes import dtype_name
from . import tile
from ._common import array_module, check_float, check_stream, is_cupy

__all__ = ["saxpy", "saxpy_tile", "staged_axpy_tile", "tiled_matmul_tile", "saxpy_reference",
           "make_tiled_matmul", "AXPY_TILE"]

cuda: Any             # numba.cuda, once make_tiled_matmul has loaded it (tile.cuda_target)
AXPY_TILE = 32          # elements staged per buffer by staged_axpy (one per lane)


@tile.kernel(group_size=128)
def saxpy_kernel(x, y, alpha):
    i = tile.linear_id()
    if i < x.size:
        y[i] = alpha * x[i] + y[i]


@tile.kernel(group_size=AXPY_TILE)
def staged_axpy_kernel(x, y, alpha):
    # Two shared buffers: the group stages tile t+1 of x while it consumes tile t.
    s0 = tile.shared_alloc(32, numba.float32)
    s1 = tile.shared_alloc(32, numba.float32)
    lane = tile.lane_id()
    step = tile.group_size() * tile.num_groups()
    t = tile.group_id() * tile.group_size()
    if t + lane < x.size:
        s0[lane] = tile.load(x, t + lane)
    tile.barrier()
    use0 = True
    while t < x.size:
        nxt = t + step
        if nxt + lane < x.size:                     # prefetch the next tile into the other buffer
            if use0:
                s1[lane] = tile.load(x, nxt + lane)
            else:
                s0[lane] = tile.load(x, nxt + lane)
        if t + lane < x.size:
            xv = s0[lane] if use0 else s1[lane]
            tile.store(y, t + lane, alpha * xv + tile.load(y, t + lane))
        tile.barrier()
        use0 = not use0
        t = nxt


# cache: tile size -> its tiled-matmul kernel
_MATMULS: dict[int, tile.TileKernel] = {}


def make_tiled_matmul(ts: int = 16) -> tile.TileKernel:
    """A ts×ts shared-memory tiled matmul (one lane per C element), compiled once per tile size."""
    if ts in _MATMULS:
        return _MATMULS[ts]
    global cuda              # the kernel reads cuda.threadIdx (2-D): numba.cuda, loaded now
    cuda = tile.cuda_target()

    def tiled_matmul(a, b, c):
        sa = tile.shared_alloc((ts, ts), numba.float32)
        sb = tile.shared_alloc((ts, ts), numba.float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * ts + ty
        col = cuda.blockIdx.x * ts + tx
        acc = numba.float32(0.0)
        for k0 in range(0, a.shape[1], ts):
            sa[ty, tx] = a[row, k0 + tx] if row < a.shape[0] and k0 + tx < a.shape[1] else 0.0
            sb[ty, tx] = b[k0 + ty, col] if k0 + ty < b.shape[0] and col < b.shape[1] else 0.0
            tile.barrier()
            for kk in range(ts):
                acc += sa[ty, kk] * sb[kk, tx]
            tile.barrier()
        if row < c.shape[0] and col < c.shape[1]:
            c[row, col] = acc

    kern = tile.kernel(tiled_matmul)
    _MATMULS[ts] = kern
    return kern


def saxpy_reference(x: Any, y: Any, alpha: float, *, out: Any | None = None, stream: Any | None = None) -> Any:
    """``alpha * x + y`` (into ``out``, which may be ``y`` itself, as the seed's ``mut y``).

    Parameters
    ----------
    x, y : array
        Vectors of one shape (f32).
    alpha : float
        The scale of x.
    out : array, optional
        Receives the result (may be ``y``).
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        ``alpha * x + y``.
    """
    _check_axpy("saxpy", x, y, out)
    xp = array_module(x, y)
    r = xp.asarray(alpha, dtype=y.dtype) * x + y
    if out is None:
        return r
    out[...] = r
    return out


def _check_axpy(op: str, x: Any, y: Any, out: Any | None) -> None:
    check_float(op, "x", x, (np.float32,))
    check_float(op, "y", y, (np.float32,))
    if x.ndim != 1 or tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"{op}: x {tuple(x.shape)} and y {tuple(y.shape)} must be 1-D of the same length")
    if out is not None and (tuple(out.shape) != tuple(y.shape) or out.dtype != y.dtype):
        raise ValueError(f"{op}: out must be {tuple(y.shape)} {dtype_name(y.dtype)}, got "
                         f"{tuple(out.shape)} {dtype_name(out.dtype)}")


def saxpy_tile(x: Any, y: Any, alpha: float, *, out: Any | None = None, stream: Any | None = None,
               staged: bool = False, groups: int | None = None):
    """Run the tile saxpy (or the staged one, on ``groups`` groups) into ``out`` (default: a copy of ``y``)."""
    op = "saxpy"
    _check_axpy(op, x, y, out)
    check_stream(op, stream)
    with _on_stream(stream, x):      # the copy into res is ordered before the kernel reads it
        res = out if out is not None else y.copy()
        if res is not y and out is not None:
            res[...] = y
        if staged:
            groups = groups or min(max(1, (x.size + AXPY_TILE - 1) // AXPY_TILE), 1024)
            staged_axpy_kernel.configure(groups, AXPY_TILE, stream)(x, res, np.float32(alpha))
        else:
            saxpy_kernel.launch(x.size, x, res, np.float32(alpha), stream=stream)
    return res


def _on_stream(stream: Any, x: Any):
    """CuPy work (allocations, copies) on the launch's stream; nothing to do for host arrays."""
    if stream is None or not is_cupy(x):
        return contextlib.nullcontext()
    from .cuda_common import launch_stream
    return launch_stream(stream)


def staged_axpy_tile(x: Any, y: Any, alpha: float, *, out: Any | None = None, stream: Any | None = None,
                     groups: int | None = None):
    return saxpy_tile(x, y, alpha, out=out, stream=stream, staged=True, groups=groups)


def tiled_matmul_tile(a: Any, b: Any, *, ts: int = 16, out: Any | None = None, stream: Any | None = None):
    """f32 ``a @ b`` by the tile-API tiled matmul (2-D operands)."""
    op = "tiled_matmul"
    check_float(op, "a", a, (np.float32,))
    check_float(op, "b", b, (np.float32,))
    check_stream(op, stream)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: need 2-D a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if ts * ts > 1024:
        raise ValueError(f"{op}: a {ts}x{ts} tile needs {ts * ts} lanes per group; the limit is 1024 (ts <= 32)")
    xp = array_module(a, b)
    if out is not None and (tuple(out.shape) != (a.shape[0], b.shape[1]) or out.dtype != np.float32):
        raise ValueError(f"{op}: out must be {(a.shape[0], b.shape[1])} float32, got {tuple(out.shape)} {out.dtype}")
    grid = ((b.shape[1] + ts - 1) // ts, (a.shape[0] + ts - 1) // ts)
    with _on_stream(stream, a):
        c = out if out is not None else xp.empty((a.shape[0], b.shape[1]), np.float32)
        make_tiled_matmul(ts).configure(grid, (ts, ts), stream)(a, b, c)
    return c


saxpy = saxpy_reference
register_kernel("saxpy", "cpu", saxpy_reference)
register_kernel("saxpy", "cuda", saxpy_tile)
