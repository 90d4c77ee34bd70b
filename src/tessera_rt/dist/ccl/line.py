"""Line and ring reduce-scatter / all-gather / all-reduce over send/recv (seed 004).

Each algorithm is a *schedule*: n-1 steps, each a list of transfers (src, dst, chunk, piece)
between neighbours of the cluster axis.  Chunk c is the part rank c ends up owning.

* ``ring``: the classic ring, bidirectional: every chunk is cut in two pieces; piece 0 goes
  clockwise (r -> r+1), piece 1 counter-clockwise (r -> r-1), so both directions of every
  link carry half the data each step (NCCL's ring, on a torus-like Galaxy row).
* ``line``: no wrap-around link (the ends of a Galaxy line are not neighbours): the part of
  chunk d that ranks < d contribute flows rightward through 0..d-1, the part of ranks > d
  flows leftward; in a reduce-scatter rank r sends n-1 chunks, the same bytes as the ring
  (an all-gather forwards every chunk both ways, so a line moves more than a ring there).

Every rank walks the same transfer list in the same order, so messages between a pair
match in issue order (NCCL has no tags).  Reduce-scatter receives into a slot and reduces
into the working buffer; all-gather receives straight into place.  All buffers come from
``buffers.take``: with a ``buffer_key`` nothing is allocated after the first call.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Sequence

from ... import runtime as rt
from ...dtypes import dtype_name
from .. import collectives as C
from ..comm import REDUCE_OPS, _displs as _offsets
from ..shard import split_sizes
from . import buffers
from ._common import check_array, choose_algo, resolve, where

__all__ = ["line_reduce_scatter", "line_all_gather", "line_all_reduce", "schedule", "Transfer"]

Transfer = tuple  # (src, dst, chunk, piece): piece 0/1 = half of the chunk, None = all of it


@lru_cache(maxsize=256)
def schedule(kind: str, n: int, algo: str) -> tuple[tuple[Transfer, ...], ...]:
    """The steps of ``kind`` ("reduce_scatter" or "all_gather") over ``n`` ranks by ``algo``."""
    steps = []
    for t in range(n - 1):
        step = []
        for r in range(n):
            if algo == "ring":
                if kind == "reduce_scatter":
                    step += [(r, (r + 1) % n, (r - 1 - t) % n, 0), (r, (r - 1) % n, (r + 1 + t) % n, 1)]
                else:
                    step += [(r, (r + 1) % n, (r - t) % n, 0), (r, (r - 1) % n, (r + t) % n, 1)]
            elif kind == "reduce_scatter":
                if r < n - 1 and t >= r:
                    step.append((r, r + 1, r + n - 1 - t, None))
                if r > 0 and t >= n - 1 - r:
                    step.append((r, r - 1, r - n + 1 + t, None))
            else:
                if r < n - 1 and r - t >= 0:
                    step.append((r, r + 1, r - t, None))
                if r > 0 and r + t <= n - 1:
                    step.append((r, r - 1, r + t, None))
        steps.append(tuple(step))
    return tuple(steps)


def _bounds(offs: Sequence[int], counts: Sequence[int], c: int, piece) -> tuple[int, int]:
    lo, cnt = offs[c], counts[c]
    if piece is None:
        return lo, lo + cnt
    h = (cnt + 1) // 2
    return (lo, lo + h) if piece == 0 else (lo + h, lo + cnt)


def _max_piece(counts: Sequence[int], algo: str) -> int:
    return max((c + 1) // 2 if algo == "ring" else c for c in counts) if counts else 0


_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum"}


def _links(n: int, links: int):
    """(start, stop) of the ``links`` sub-messages a message of ``n`` elements is cut into."""
    if links == 1:
        return ((0, n),)
    out, acc = [], 0
    for size in split_sizes(n, links):
        if size:
            out.append((acc, acc + size))
            acc += size
    return out


def run_steps(g, steps, work, offs, counts, slots, op: str | None, stream, between: Callable | None = None,
              links: int = 1) -> None:
    """Execute ``steps`` on this rank: post this step's recvs then sends (non-blocking), wait,
    and reduce what arrived (``op``) or leave it in place (``op=None``: a gather).  Each
    message goes as ``links`` sub-messages, all in flight together (seed 004's num_links).
    ``between`` runs once, after the first step is posted and before it is waited for."""
    me, comm = g.index, g.comm
    ufunc = getattr(C._backend().xp, _UFUNC[op]) if op is not None else None
    for step in steps:
        reqs, reduce_into = [], []
        for src, dst, c, p in step:
            if dst != me:
                continue
            lo, hi = _bounds(offs, counts, c, p)
            if hi == lo:
                continue
            if ufunc is None:
                into = work[lo:hi]
            else:
                into = slots[len(reduce_into)][:hi - lo]
                reduce_into.append((lo, hi, into))
            for a, b in _links(hi - lo, links):
                reqs.append(comm.recv(into[a:b], src, 0, blocking=False, stream=stream))
        for src, dst, c, p in step:
            if src != me:
                continue
            lo, hi = _bounds(offs, counts, c, p)
            for a, b in (_links(hi - lo, links) if hi > lo else ()):
                reqs.append(comm.send(work[lo + a:lo + b], dst, 0, blocking=False, stream=stream))
        if between is not None:
            between()
            between = None
        for req in reqs:
            if req is not None:
                req.wait_done()
        for lo, hi, slot in reduce_into:
            ufunc(work[lo:hi], slot, out=work[lo:hi])
    if between is not None:
        between()


class _OnRole:
    """Run the ring on the role's stream, ordered after compute's work and before its next."""

    def __init__(self, role: str):
        self.gpu = C._backend().is_gpu
        self.stream = rt.stream(role)

    def __enter__(self):
        if self.gpu:
            compute = rt.stream("compute")
            if self.stream is not compute:
                self.stream.wait_event(compute.record())
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.gpu:
            self.stream.__exit__(*exc)
            rt.stream("compute").wait_event(self.stream.record())


def _pack_into(work, x, dim: int, sizes) -> None:
    """x's parts along ``dim`` one after another in the flat ``work`` (no allocation)."""
    if dim == 0 or math.prod(x.shape[:dim]) == 1:
        work[...] = x.reshape(-1)
        return
    pos = off = 0
    for p in sizes:
        piece = C._with_dim(x.shape, dim, p)
        cnt = math.prod(piece)
        work[pos:pos + cnt].reshape(piece)[...] = x[(slice(None),) * dim + (slice(off, off + p),)]
        pos, off = pos + cnt, off + p


def _unpack_into(out, work, dim: int, sizes) -> None:
    pos = off = 0
    for p in sizes:
        piece = C._with_dim(out.shape, dim, p)
        cnt = math.prod(piece)
        out[(slice(None),) * dim + (slice(off, off + p),)] = work[pos:pos + cnt].reshape(piece)
        pos, off = pos + cnt, off + p


def _reducing_buffers(name, g, x, key, sig, counts, algo: str, kind: str, tag: str | None):
    """(work, (slot0, slot1), chunk offsets) of a reducing ring/line call, the call recorded."""
    piece = _max_piece(counts, algo)
    bufs = buffers.take(key, sig, lambda: {"work": (x.size,), "slot0": (piece,), "slot1": (piece,)}, x.dtype)
    _record(name, g, x, int(x.nbytes * C.bus_factor(kind, g.size)), algo, tag)
    return bufs["work"], (bufs["slot0"], bufs["slot1"]), _offsets(counts)


# dtypes CuPy has elementwise kernels for: others (bf16, fp8) cannot be reduced by the ring on
# a GPU, while NCCL reduces bf16 natively, so "auto" picks the library for them there
_CUPY_KINDS = "biufc"


def _reducing_algo(opname: str, g, x, requested: str, algo: str) -> str:
    if algo == "library" or not C._backend().is_gpu or x.dtype.kind in _CUPY_KINDS:   # bf16/fp8: kind "V"
        return algo
    if requested == "auto":
        return "library"
    raise TypeError(f"{where(opname, g, x)}: algo={algo!r} reduces with CuPy kernels, which have none for "
                    f"{dtype_name(x.dtype)} on the GPU; use algo='library' (NCCL reduces bf16) or cast to float32")


def _common_checks(opname: str, g, x, op: str | None, num_links: int) -> None:
    if op is not None and op not in REDUCE_OPS:
        raise ValueError(f"{where(opname, g, x)}: op={op!r}; use one of {list(REDUCE_OPS)}")
    if op == "avg" and x.dtype.kind not in "fcV":
        raise TypeError(f"{where(opname, g, x)}: op='avg' needs a floating dtype; use op='sum'")
    if isinstance(num_links, bool) or not isinstance(num_links, int) or num_links < 1:
        raise ValueError(f"{where(opname, g, x)}: num_links={num_links!r} must be an int >= 1")


def _record(opname: str, g, x, nbytes: int, algo: str, tag: str | None = None) -> None:
    """Show the op (not its steps) to dist.trace_collectives, with its algorithm."""
    if not C._HOOKS:
        return
    for h in C._HOOKS:
        if isinstance(h, C.trace_collectives):
            h.records.append(C.CollectiveRecord(opname, g.name, g.size, tuple(x.shape), dtype_name(x.dtype),
                                                nbytes, algo=algo, tag=tag or ""))


def line_reduce_scatter(x: Any, dim: int = -1, cluster_axis: int | str = 0, *, mesh=None, op: str = "sum",
                        sizes: Sequence[int] | None = None, buffer_key: str | None = None, num_links: int = 1,
                        algo: str = "auto", tag: str | None = None, role: str = "tp_collective",
                        between: Callable | None = None):
    """``dist.reduce_scatter(x, axis, op, dim=dim, sizes=sizes)`` along the cluster axis by a
    line or ring of sends/recvs.  ``dim`` must split evenly over the axis unless ``sizes``
    lists the parts (the plain collective's rule).  With ``buffer_key`` the result is a view
    into the key's persistent buffer: valid until the call after next with that key."""
    name = "line_reduce_scatter"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    x = check_array(name, g, x)
    dim = C._norm_dim(f"ccl.{name}", g, x, dim)
    _common_checks(name, g, x, op, num_links)
    given = sizes
    if sizes is None and not x.shape[dim] % g.size:
        sizes = (x.shape[dim] // g.size,) * g.size            # the common case, kept cheap
    else:
        sizes = tuple(C._check_sizes(f"ccl.{name}", g, x, sizes, x.shape[dim], "sizes"))
    algo = _reducing_algo(name, g, x, algo, choose_algo("reduce_scatter", algo, x.nbytes, lambda: where(name, g, x), tag))
    n, me = g.size, g.index
    out_shape = C._with_dim(x.shape, dim, sizes[me])
    sig = (name, axis, x.shape, x.dtype, (("op", op), ("dim", dim), ("sizes", sizes), ("algo", algo)))
    if algo == "library":
        bufs = buffers.take(buffer_key, sig, lambda: {"out": out_shape}, x.dtype)
        _record(name, g, x, int(x.nbytes * C.bus_factor("reduce_scatter", n)), algo, tag)
        work = C.reduce_scatter(x, axis, op, dim=dim, sizes=given, mesh=mesh, out=bufs["out"], role=role,
                                async_op=between is not None, tag=tag)
        if between is None:
            return work
        between()
        return work.wait()
    if C._check is not None:       # (the library collective runs its own)
        C._check(f"ccl.{name}", g, x.dtype, x.shape, (op, dim, algo))
    inner = math.prod(C._with_dim(x.shape, dim, 1))
    counts = [s * inner for s in sizes]
    work, slots, offs = _reducing_buffers(name, g, x, buffer_key, sig, counts, algo, "reduce_scatter", tag)
    with _OnRole(role) as stream:
        _pack_into(work, x, dim, sizes)
        run_steps(g, schedule("reduce_scatter", n, algo), work, offs, counts, slots,
                  op, stream, between, num_links)
        mine = work[offs[me]:offs[me] + counts[me]]
        if op == "avg":
            C._backend().xp.true_divide(mine, n, out=mine)
    return mine.reshape(out_shape)


def line_all_gather(x: Any, dim: int = -1, cluster_axis: int | str = 0, *, mesh=None,
                    sizes: Sequence[int] | None = None, buffer_key: str | None = None, num_links: int = 1,
                    algo: str = "auto", tag: str | None = None, role: str = "tp_collective"):
    """``dist.all_gather(x, axis, dim=dim, sizes=sizes)`` along the cluster axis by a line or
    ring.  Ranks may hold different lengths along ``dim`` if ``sizes`` lists all of them."""
    name = "line_all_gather"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    x = check_array(name, g, x)
    dim = C._norm_dim(f"ccl.{name}", g, x, dim)
    _common_checks(name, g, x, None, num_links)
    n, me = g.size, g.index
    if sizes is None:
        sizes = [x.shape[dim]] * n
    else:
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or any(s < 0 for s in sizes) or sizes[me] != x.shape[dim]:
            raise ValueError(f"{where(name, g, x)}: sizes={sizes} must list {n} lengths along dim {dim}, "
                             f"this rank's ({me}) being {x.shape[dim]}")
    algo = choose_algo("all_gather", algo, x.nbytes * n, lambda: where(name, g, x), tag)
    shape = C._with_dim(x.shape, dim, sum(sizes))
    if C._check is not None and algo != "library":
        C._check(f"ccl.{name}", g, x.dtype, C._with_dim(x.shape, dim, -1), (dim, tuple(sizes), algo))
    sig = (name, axis, x.shape, x.dtype, (("dim", dim), ("sizes", tuple(sizes)), ("algo", algo)))
    if algo == "library":
        bufs = buffers.take(buffer_key, sig, lambda: {"out": shape}, x.dtype)
        _record(name, g, x, int(math.prod(shape) * x.dtype.itemsize * C.bus_factor("all_gather", n)), algo, tag)
        even = min(sizes) == max(sizes)
        return C.all_gather(x, axis, dim=dim, sizes=None if even else sizes, mesh=mesh, out=bufs["out"],
                            role=role, tag=tag)
    flat = dim == 0 or math.prod(x.shape[:dim]) == 1
    total = math.prod(shape)
    bufs = buffers.take(buffer_key, sig, lambda: {"work": (total,)} if flat else {"work": (total,), "out": shape},
                        x.dtype)
    _record(name, g, x, int(math.prod(shape) * x.dtype.itemsize * C.bus_factor("all_gather", n)), algo, tag)
    inner = math.prod(C._with_dim(x.shape, dim, 1))
    counts = [s * inner for s in sizes]
    work, offs = bufs["work"], _offsets(counts)
    with _OnRole(role) as stream:
        work[offs[me]:offs[me] + counts[me]] = x.reshape(-1)
        run_steps(g, schedule("all_gather", n, algo), work, offs, counts, (), None, stream, links=num_links)
        if flat:
            return work.reshape(shape)
        _unpack_into(bufs["out"], work, dim, sizes)
    return bufs["out"]


def line_all_reduce(x: Any, cluster_axis: int | str = 0, *, mesh=None, op: str = "sum",
                    buffer_key: str | None = None, num_links: int = 1, algo: str = "auto",
                    tag: str | None = None, role: str = "tp_collective"):
    """``dist.all_reduce(x, axis, op)`` along the cluster axis: a line/ring reduce-scatter of
    the flattened array (uneven parts when n does not divide its size) then an all-gather,
    in one buffer."""
    name = "line_all_reduce"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    x = check_array(name, g, x)
    _common_checks(name, g, x, op, num_links)
    algo = _reducing_algo(name, g, x, algo, choose_algo("all_reduce", algo, x.nbytes, lambda: where(name, g, x), tag))
    n, me = g.size, g.index
    if C._check is not None and algo != "library":
        C._check(f"ccl.{name}", g, x.dtype, x.shape, (op, algo))
    sig = (name, axis, x.shape, x.dtype, (("op", op), ("algo", algo)))
    if algo == "library":
        bufs = buffers.take(buffer_key, sig, lambda: {"out": tuple(x.shape)}, x.dtype)
        _record(name, g, x, int(x.nbytes * C.bus_factor("all_reduce", n)), algo, tag)
        return C.all_reduce(x, axis, op, mesh=mesh, out=bufs["out"], role=role, tag=tag)
    counts = list(split_sizes(x.size, n))
    work, slots, offs = _reducing_buffers(name, g, x, buffer_key, sig, counts, algo, "all_reduce", tag)
    with _OnRole(role) as stream:
        work[...] = x.reshape(-1)
        run_steps(g, schedule("reduce_scatter", n, algo), work, offs, counts, slots, op, stream, links=num_links)
        if op == "avg":
            mine = work[offs[me]:offs[me] + counts[me]]
            C._backend().xp.true_divide(mine, n, out=mine)
        run_steps(g, schedule("all_gather", n, algo), work, offs, counts, (), None, stream, links=num_links)
    return work.reshape(x.shape)
