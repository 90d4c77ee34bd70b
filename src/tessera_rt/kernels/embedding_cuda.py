"""The embedding on the GPU: a gather (one launch) and a deterministic scatter-add backward
(one launch, no sort, no atomics).

The backward gives each block a tile of ``EMB_ROWS`` table rows by ``EMB_COLS`` columns, held
in f32 in shared memory.  The block reads the ids a chunk at a time, compacts the tokens whose
id falls in its rows (in token order, by a prefix count), and each thread adds its column of
those tokens' gradient rows into the tile.  Every table row is thus the sum of its tokens'
rows in token order: the same bits on every run, every row written once (zero where no token
hit it).  No host sync: a sort (``cupy.argsort``: Thrust's blocking policy) would wait on the
host.  References: ``kernels.embedding``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from . import embedding as ref
from ._common import check_stream
from .compile import KernelSource, register_source
from .cuda_common import ELEM_IO, MAX_GRID_YZ, all_aligned, get_function, io_defines, io_name, launch_stream
from .fused_cuda import dense, elementwise_grid, on_gpu

__all__ = ["embedding_cuda", "embedding_backward_cuda", "render_embedding", "EMB_ROWS", "EMB_COLS"]

NT = 256
EMB_ROWS, EMB_COLS = 64, 128       # a backward block's tile: 32 KiB of f32 sums

EMBEDDING_SOURCE = r"""
#define NT 256
#define EMB_ROWS 64
#define EMB_COLS 128

// out[tok, :] = table[id - lo, :] for ids in [lo, lo + rows), zeros otherwise; item = (token, W-wide chunk).
template <int W> __device__ __forceinline__ void ts_gather(const void* ids, const io_t* table, io_t* out,
                                                           long long tokens, int dim, long long lo, long long rows,
                                                           int ids64) {
  typedef ts_access<W, io_t> A;
  const long long chunks = dim / W, total = tokens * chunks, stride = (long long)gridDim.x * blockDim.x;
  for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < total; item += stride) {
    const long long tok = item / chunks, c = (item % chunks) * W, r = ts_id(ids, tok, ids64) - lo;
    typename A::word* dst = reinterpret_cast<typename A::word*>(out + tok * dim + c);
    const bool hit = r >= 0 && r < rows;
    #pragma unroll
    for (int j = 0; j < W / A::elems; ++j) {
      typename A::word v{};             // zero bits: a zero row
      if (hit) v = reinterpret_cast<const typename A::word*>(table + r * dim + c)[j];
      dst[j] = v;
    }
  }
}

extern "C" __global__ void ts_embed_fwd(const void* __restrict__ ids, const io_t* __restrict__ table,
                                        io_t* __restrict__ out, long long tokens, int dim, long long lo,
                                        long long rows, int ids64, int vec) {
  if (vec) ts_gather<VEC>(ids, table, out, tokens, dim, lo, rows, ids64);
  else ts_gather<1>(ids, table, out, tokens, dim, lo, rows, ids64);
}

// Block (bx, by): table rows [bx * EMB_ROWS, +EMB_ROWS) x columns [by * EMB_COLS, +EMB_COLS).
extern "C" __global__ void __launch_bounds__(EMB_COLS) ts_embed_bwd(
    const io_t* __restrict__ g, const void* __restrict__ ids, io_t* __restrict__ dtable, long long tokens, int dim,
    long long lo, long long rows, int ids64) {
  __shared__ float acc[EMB_ROWS][EMB_COLS];
  __shared__ long long hit_tok[EMB_COLS];
  __shared__ int hit_row[EMB_COLS];
  __shared__ int warp_hits[EMB_COLS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long r0 = (long long)blockIdx.x * EMB_ROWS;
  const int c = blockIdx.y * EMB_COLS + threadIdx.x;
  for (int r = 0; r < EMB_ROWS; ++r) acc[r][threadIdx.x] = 0.f;      // each thread owns its column
  for (long long base = 0; base < tokens; base += EMB_COLS) {
    const long long tok = base + threadIdx.x;
    int row = -1;
    if (tok < tokens) {
      const long long rel = ts_id(ids, tok, ids64) - lo - r0;
      if (rel >= 0 && rel < EMB_ROWS && r0 + rel < rows) row = (int)rel;
    }
    int incl = row >= 0;                // hits among lanes 0..lane (an inclusive warp scan)
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    if (lane == 31) warp_hits[warp] = incl;
    __syncthreads();
    int before = 0, hits = 0;
    #pragma unroll
    for (int w = 0; w < EMB_COLS / 32; ++w) {
      before += w < warp ? warp_hits[w] : 0;
      hits += warp_hits[w];
    }
    if (row >= 0) {                     // the hits in token order
      hit_tok[before + incl - 1] = tok;
      hit_row[before + incl - 1] = row;
    }
    __syncthreads();
    if (c < dim)                        // (the next chunk rewrites the lists after its first barrier)
      for (int k = 0; k < hits; ++k) acc[hit_row[k]][threadIdx.x] += ts_f(g[hit_tok[k] * dim + c]);
  }
  if (c < dim)
    for (int r = 0; r < EMB_ROWS && r0 + r < rows; ++r) dtable[(r0 + r) * dim + c] = ts_to<io_t>(acc[r][threadIdx.x]);
}
"""

def render_embedding(io: str = "f32") -> str:
    return io_defines(io) + ELEM_IO + EMBEDDING_SOURCE


register_source(KernelSource("embedding", render_embedding, ("ts_embed_fwd", "ts_embed_bwd"),
                             configs=[dict(io=d) for d in ("f32", "f16", "bf16")]))


def _fn(entry: str, dtype):
    return get_function("embedding", entry, dict(io=io_name(dtype)), render_embedding)


def _ids(op: str, ids: Any) -> int:
    ref.check_ids(op, ids)
    return int(ids.dtype == np.int64)


def embedding_cuda(ids: Any, table: Any, *, lo: int = 0, out: Any = None, stream: Any = None):
    """``table[id - lo]`` for ids in ``[lo, lo + rows)``, a zero row otherwise, shape
    ``ids.shape + (dim,)`` (into ``out`` when given: contiguous, the table's dtype): one
    launch, 16-byte copies where the rows allow."""
    import cupy
    op = "embedding"
    ref._check_table(op, table)
    ids64 = _ids(op, ids)
    check_stream(op, stream)
    if not on_gpu(table):
        with launch_stream(stream):
            r = ref.embedding(ids, table, lo=lo)
            if out is None:
                return r
            out[...] = r
            return out
    rows, dim = table.shape
    shape = tuple(ids.shape) + (dim,)
    if out is not None and (tuple(out.shape) != shape or out.dtype != table.dtype or not out.flags.c_contiguous):
        raise ValueError(f"{op}: out must be contiguous {shape} {table.dtype}, got {tuple(out.shape)} {out.dtype}")
    with launch_stream(stream):
        ids, table = dense(ids, table)
        out = cupy.empty(shape, table.dtype) if out is None else out
        if out.size:
            vec = dim % (16 // table.itemsize) == 0 and all_aligned(16, table, out)
            items = ids.size * (dim // (16 // table.itemsize) if vec else dim)
            _fn("ts_embed_fwd", table.dtype)(elementwise_grid(items), (NT,),
                                             (ids, table, out, np.int64(ids.size), np.int32(dim), np.int64(lo),
                                              np.int64(rows), np.int32(ids64), np.int32(vec)))
    return out


def embedding_backward_cuda(g: Any, ids: Any, rows: int, *, lo: int = 0, stream: Any = None):
    """``(rows, dim)`` gradient of the vocab slice ``[lo, lo + rows)``, g's dtype: the sum of
    g's rows into their ids' rows, f32 sums in token order (one launch, no atomics: the same
    bits on every run); ids outside the slice add nothing."""
    import cupy
    op = "embedding_backward"
    ref._check_args(op, g, ids, rows)
    ids64 = _ids(op, ids)
    check_stream(op, stream)
    if not on_gpu(g):
        with launch_stream(stream):
            return ref.embedding_backward(g, ids, rows, lo=lo)
    dim = g.shape[-1]
    with launch_stream(stream):
        g, ids = dense(g, ids)
        out = cupy.empty((rows, dim), g.dtype)
        if out.size:
            col_tiles = -(-dim // EMB_COLS)
            if col_tiles > MAX_GRID_YZ:
                raise ValueError(f"{op}: dim {dim} is over the {MAX_GRID_YZ * EMB_COLS} columns a launch covers")
            _fn("ts_embed_bwd", g.dtype)((-(-rows // EMB_ROWS), col_tiles), (EMB_COLS,),
                                         (g, ids, out, np.int64(ids.size), np.int32(dim), np.int64(lo),
                                          np.int64(rows), np.int32(ids64)))
    return out


register_kernel("embedding", "cuda", embedding_cuda)
register_kernel("embedding_backward", "cuda", embedding_backward_cuda)
