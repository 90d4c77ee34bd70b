"""Compiled redistribution plans: a plan's steps turned, once, into communicator calls.

A ``RedistributionPlan`` (``redistribute``) is a pure function of (global shape, layouts, mesh, dtype)
and this rank's mesh position, so everything its collectives work out per call -- the
group, output shapes, MPI counts, pack/unpack orders, which role runs it -- is the same on
every call.  ``compile_plan`` works it out once, on the plan's first run, and returns the
one function that runs the plan from then on, doing only what must happen per call:

* an output (NumPy's ``empty`` below 2 MiB, the pool's huge-page blocks from there up), or
  the caller's ``out`` (``DTensor.redistribute(out=...)``);
* at most one pack and one unpack copy, into the order MPI/NCCL move, where the layout needs
  one (a dim other than the leading one); none where the pieces are contiguous runs;
* one communicator call in the role's stream order (``work.issue``'s), the raw
  mpi4py call where the array collective's direct path would make one (``step_caller``);
* the local steps (slices, partialize) as the plan made them.

``RedistributionPlan.run`` makes the agreement check for every collective (the signature the array
collective would pass, returned here) before the first step moves data.  While something
watches collectives (``trace_collectives``, the profiler, ``TESSERA_DEBUG``, deterministic
reductions: ``hooks.SEAM.watchers``) each communicator call goes through the array
collectives' watched path (``work.issue_watched``) with the record the array collective
would give: the watchers see the same calls, and sum/avg reductions take the deterministic
fixed order.  The groups a plan's steps need are made here when missing (collectively, on
every rank, in step order, as the array collectives make them).
"""
from __future__ import annotations

import functools
import math
from collections import namedtuple
from collections.abc import Callable

from ...backend import mapped_empty
from ...dtypes import dtype_name
from ..comm import work
from ..comm.communicators import MPI_OPS
from ..comm.cpu_async import after_role_worker
from ..comm.hooks import SEAM
from ..comm.packing import with_dim
from ..comm.plans import mpi_direct
from ..comm.process_group import world
from .shard import local_shape

__all__ = ["compile_plan", "step_caller"]

# what a watcher's record reads of a collective's input (its shape and dtype; compiled
# steps know them without the array)
_Piece = namedtuple("_Piece", "shape dtype")


def _group(mesh, axis, op: str, shape: tuple, dtype):
    """The step's group, made now if it does not exist yet, the array collectives' way
    (``work.resolve_group``: making it is collective, so ``TESSERA_DEBUG=collectives`` first
    checks that the ranks agree)."""
    g = mesh._groups.get(axis)
    return g if g is not None else work.resolve_group(mesh, axis, op, _Piece(shape, dtype))


def _record(check: tuple, shape: tuple, nbytes: int, mesh) -> tuple:
    """What the array collective hands its watchers (``work.issue_watched``'s ``info``) for a
    step with agreement-check arguments ``check`` on an input of ``shape``."""
    op, g, dtype, gshape, extra = check
    return op, g, _Piece(shape, dtype), nbytes, mesh, gshape, extra


def _parts_view(shape: tuple, dim: int, sizes) -> tuple[tuple, tuple] | None:
    """For equal parts along ``dim``: (split shape, transposition) taking an array of
    ``shape`` to the (part, ...) order of a packed buffer; None for uneven parts."""
    if min(sizes) != max(sizes):
        return None
    n, part = len(sizes), sizes[0]
    split = shape[:dim] + (n, part) + shape[dim + 1:]
    perm = (dim,) + tuple(i for i in range(len(split)) if i != dim)
    return split, perm


def _keeper(b, shape: tuple, dtype) -> Callable:
    """() -> a new uninitialized ``shape`` array from the backend's pool (a step's output).

    Outputs are not kept and handed out again: a refcount test ("nobody holds it any more")
    let a kept buffer be reused while the caller still used its data (two gathered attention
    inputs of one tp=3 forward shared one buffer, and the loss went wrong), so every call
    allocates: ``HostBufferPool.allocator`` for this one shape (``np.empty`` below the pool's
    huge-page size, ~0.4 us) is the price, or nothing when the caller passes ``out``."""
    if b._pool is not None:
        return b._pool.allocator(tuple(shape), dtype)
    return functools.partial(b.empty, shape, dtype)


# Scratch buffers (a pack buffer, a flat receive buffer) up to this size are kept by their
# step on CPU ranks: ~0.5 us a call, which matters for small messages only.  Plans are
# cached by the thousand, so the bytes kept in all are bounded too (then: the pool; the count
# is not given back when a plan is evicted, so a long run of new plans ends on the pool).
SCRATCH_MAX_BYTES = 4 << 20
SCRATCH_BUDGET_BYTES = 64 << 20
# bytes of scratch buffers compiled plans keep (bounded by SCRATCH_BUDGET_BYTES)
_SCRATCH_KEPT = [0]


def _scratch(b, shape: tuple, dtype) -> Callable:
    """() -> a buffer a step writes and is done with before it returns (never handed out).
    On CPU ranks the step's collective is blocking, so one buffer per step serves every call;
    on GPUs (stream-ordered: the next call may be enqueued while this one runs), above
    ``SCRATCH_MAX_BYTES`` and once the kept scratch reaches ``SCRATCH_BUDGET_BYTES`` it comes
    from the pool."""
    nbytes = math.prod(shape) * dtype.itemsize
    if b.is_gpu or nbytes > SCRATCH_MAX_BYTES or _SCRATCH_KEPT[0] + nbytes > SCRATCH_BUDGET_BYTES:
        return _keeper(b, shape, dtype)
    _SCRATCH_KEPT[0] += nbytes
    buf = mapped_empty(shape, dtype)     # (huge pages from 2 MiB, as the pool's blocks)
    return lambda: buf


def _pieces(shape: tuple, dim: int, sizes) -> list[tuple]:
    """Uneven parts along ``dim``: (run in the flat buffer, part shape, index in the array)."""
    pieces, pos, off = [], 0, 0
    for p in sizes:
        piece = with_dim(shape, dim, p)
        cnt = math.prod(piece)
        pieces.append((slice(pos, pos + cnt), piece, (slice(None),) * dim + (slice(off, off + p),)))
        pos, off = pos + cnt, off + p
    return pieces


def _packer(b, shape: tuple, dim: int, sizes, dtype) -> Callable | None:
    """x (of ``shape``) -> one flat buffer holding its parts along ``dim`` one after another;
    None when x itself is that buffer (dim 0, or only size-1 dims before it)."""
    if dim == 0 or math.prod(shape[:dim]) == 1:
        return None
    xp, new_buf = b.xp, _scratch(b, (math.prod(shape),), dtype)
    view = _parts_view(shape, dim, sizes)
    if view is not None:
        split, perm = view
        packed = tuple(split[i] for i in perm)

        def pack(x):
            buf = new_buf()
            xp.copyto(buf.reshape(packed), x.reshape(split).transpose(perm))
            return buf
        return pack
    pieces = _pieces(shape, dim, sizes)

    def pack_uneven(x):
        buf = new_buf()
        for flat, piece, index in pieces:
            xp.copyto(buf[flat].reshape(piece), x[index])
        return buf
    return pack_uneven


def _unpacker(xp, shape: tuple, dim: int, sizes) -> Callable | None:
    """(flat, out) -> out holding flat's parts concatenated along ``dim``; None when the
    parts land in place (dim 0, or only size-1 dims before it)."""
    if dim == 0 or math.prod(shape[:dim]) == 1:
        return None
    view = _parts_view(shape, dim, sizes)
    if view is not None:
        split, perm = view
        packed = tuple(split[i] for i in perm)
        inv = tuple(perm.index(i) for i in range(len(perm)))

        def unpack(flat, out):
            xp.copyto(out.reshape(split), flat.reshape(packed).transpose(inv))
        return unpack
    pieces = _pieces(shape, dim, sizes)

    def unpack_uneven(flat, out):
        for fl, piece, index in pieces:
            xp.copyto(out[index], flat[fl].reshape(piece))
    return unpack_uneven


def _counts(sizes, inner: int):
    """MPI counts per part, or None when the parts are equal (the fixed-size collective)."""
    return None if min(sizes) == max(sizes) else [s * inner for s in sizes]


def step_caller(comm, method: str, role: str, dtype, counts=None, op: str | None = None,
                record: tuple | None = None) -> Callable:
    """(send, recv) -> recv, after one blocking ``comm.<method>`` in ``role``'s stream order.

    On CPU ranks over MPI, with fixed-size parts and a dtype MPI moves (reduces) itself, this
    is the raw mpi4py call the method would make, after the role's worker has run what it
    was given (``work.issue``'s CPU order): ~0.8 us a call less than going through
    ``issue`` and the method.  Otherwise ``issue`` (GPU streams, staged dtypes, -v forms).
    While something watches collectives the call is the array collective's watched one
    (``_watched``, with ``record``)."""
    reducing = method in ("all_reduce", "reduce_scatter")
    extra = {"all_reduce": (op,), "reduce_scatter": (counts, op), "all_gather": (counts,),
             "all_to_all": tuple(counts or (None, None))}[method]
    sizes = {"all_reduce": (), "reduce_scatter": (counts,), "all_gather": (counts,), "all_to_all": extra}[method]
    fixed = all(c is None for c in sizes)            # equal parts: the fixed-size MPI call
    m, watchers = getattr(comm, method), SEAM.watchers
    watched = _watched(record, role, m, extra, reducing and op in ("sum", "avg"), method == "reduce_scatter")
    if not (fixed and mpi_direct(comm, False, dtype, reducing, op)):
        issue = work.issue

        def issue_call(send, recv):
            if watchers:
                return watched(send, recv)
            return issue(role, False, m, (send, recv) + extra, recv)
        return issue_call
    mpi = comm.mpi
    fn = {"all_reduce": mpi.Allreduce, "reduce_scatter": mpi.Reduce_scatter_block, "all_gather": mpi.Allgather,
          "all_to_all": mpi.Alltoall}[method]
    args = (MPI_OPS[op],) if reducing else ()
    after_worker = after_role_worker

    def raw_call(send, recv):            # (the watchdog knows this frame: it waits inside MPI)
        if watchers:
            return watched(send, recv)
        after_worker(role)
        fn(send, recv, *args)
        return recv
    return raw_call


def _watched(record, role: str, method, extra: tuple, det: bool, flat: bool) -> Callable:
    """(send, recv) -> recv through the array collectives' watched path (``work.issue_watched``:
    the watchers' before/after around the call) with ``record``, the array collective's; ``det``:
    a sum/avg reduction, which takes the fixed order while deterministic reductions are on;
    ``flat``: a reduce_scatter, whose parts go flat (as ``collectives.run_reduce_scatter``)."""
    hooked = work.issue_watched

    def watched(send, recv):
        out = recv
        if flat:
            send, recv = send.reshape(-1), recv.reshape(-1)
        args = (send, recv) + extra
        fixed = ((record[1],) + args + ((out,) if flat else ())) if det else None
        return hooked(record, role, False, method, args, out, det=fixed)
    return watched


# --------------------------------------------------------------------------- step bodies
# Each mirrors its array collective in ``collectives`` for an input of a known shape: the
# same check signature, role, communicator call and counts; only the per-call work is left.

def _nbytes(shape: tuple, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _all_reduce(b, mesh, shape, dtype, spec):
    a, op = spec
    g = _group(mesh, a, "all_reduce", shape, dtype)
    check = ("all_reduce", g, dtype, shape, op)
    call = step_caller(g.comm, "all_reduce", "tp_collective", dtype, op=op,
                   record=_record(check, shape, _nbytes(shape, dtype), mesh))
    new_out = _keeper(b, shape, dtype)

    def body(x, out=None):
        return call(x, new_out() if out is None else out)
    return body, shape, check


def _all_gather(b, mesh, shape, dtype, spec):
    a, d, sizes = spec
    g = _group(mesh, a, "all_gather", shape, dtype)
    even = min(sizes) == max(sizes)
    inner = math.prod(with_dim(shape, d, 1))
    counts = None if even else [s * inner for s in sizes]
    out_shape = with_dim(shape, d, sum(sizes))
    # what collectives.all_gather checks: with sizes given, lengths along d may differ
    check = ("all_gather", g, dtype, shape if even else with_dim(shape, d, -1), d)
    call = step_caller(g.comm, "all_gather", "tp_collective", dtype, counts,
                   record=_record(check, shape, _nbytes(out_shape, dtype), mesh))
    new_out = _keeper(b, out_shape, dtype)
    unpack = _unpacker(b.xp, out_shape, d, sizes)
    new_recv = _scratch(b, (math.prod(out_shape),), dtype)
    if unpack is None:
        def body(x, out=None):
            return call(x, new_out() if out is None else out)
        return body, out_shape, check

    def body_unpack(x, out=None):
        recv = call(x, new_recv())
        out = new_out() if out is None else out
        unpack(recv, out)
        return out
    return body_unpack, out_shape, check


def _reduce_scatter(b, mesh, shape, dtype, spec):
    a, op, d, sizes = spec
    g = _group(mesh, a, "reduce_scatter", shape, dtype)
    inner = math.prod(with_dim(shape, d, 1))
    counts = _counts(sizes, inner)
    out_shape = with_dim(shape, d, sizes[g.index])
    check = ("reduce_scatter", g, dtype, shape, (op, d))
    call = step_caller(g.comm, "reduce_scatter", "tp_collective", dtype, counts, op,
                   record=_record(check, shape, _nbytes(shape, dtype), mesh))
    new_out = _keeper(b, out_shape, dtype)
    pack = _packer(b, shape, d, sizes, dtype)

    def body(x, out=None):
        return call(x if pack is None else pack(x), new_out() if out is None else out)
    return body, out_shape, check


def _exchange(b, g, dtype, in_shape, split_dim, split, concat_dim, recv, record):
    """all_to_all of an ``in_shape`` piece: parts ``split`` along ``split_dim`` go out, parts
    of lengths ``recv`` along ``concat_dim`` come in (``record``: the watchers')."""
    base = with_dim(in_shape, split_dim, split[g.index])
    out_shape = with_dim(base, concat_dim, sum(recv))
    send_counts = [math.prod(with_dim(in_shape, split_dim, s)) for s in split]
    recv_counts = [math.prod(with_dim(base, concat_dim, r)) for r in recv]
    fixed = min(send_counts) == max(send_counts) and send_counts == recv_counts
    sc, rc = (None, None) if fixed else (send_counts, recv_counts)
    comm, issue, xp = g.comm, work.issue, b.xp
    call = step_caller(comm, "all_to_all", "a2a", dtype, (sc, rc), record=record)
    pack = _packer(b, in_shape, split_dim, split, dtype)
    unpack = _unpacker(xp, out_shape, concat_dim, recv)
    new_out, new_got = _keeper(b, out_shape, dtype), _scratch(b, (math.prod(out_shape),), dtype)
    part_type = _strided_part(comm, in_shape, split_dim, split, dtype) if pack is not None and fixed else None

    def body(x, out=None):
        send = x if pack is None else pack(x)
        if unpack is None:
            return call(send, new_out() if out is None else out)
        got = call(send, new_got())
        out = new_out() if out is None else out
        unpack(got, out)
        return out
    if part_type is None or unpack is not None:
        return body, out_shape
    watchers = SEAM.watchers

    def body_strided(x, out=None):
        # the parts are strided views of x: MPI reads them in place (no pack buffer); watched,
        # the array collective's call (pack, all_to_all), as its watchers know it
        if watchers:
            return body(x, out)
        out = new_out() if out is None else out
        return issue("a2a", False, comm.all_to_all_strided, (x, part_type, out), out)
    return body_strided, out_shape


# Below this many bytes in this rank's piece, packing with NumPy and the plain Alltoall is
# as fast or faster than MPI's datatype engine (MPICH 4, 2 ranks, loaded 2-core VM, min of
# 30 interleaved repeats: 128 KiB pieces 26 vs 38 us, 2 MiB mixed, 8 MiB 1.4-6.1 ms vs
# 1.5-8.3 ms in 4 of 4 runs: the derived type saves the pack's pass over memory).
STRIDED_MIN_BYTES = 4 << 20


def _strided_part(comm, shape: tuple, dim: int, sizes, dtype):
    """An MPI datatype for one of the equal parts of a C-contiguous ``shape`` array along
    ``dim`` (resized so part j starts j extents in), or None where it does not apply: not
    MPI, a dtype MPI has no type for, or too small to gain (``STRIDED_MIN_BYTES``)."""
    if getattr(comm, "kind", "") != "mpi" or math.prod(shape) * dtype.itemsize < STRIDED_MIN_BYTES:
        return None
    from mpi4py.util import dtlib
    try:
        base = dtlib.from_numpy_dtype(dtype)
    except (KeyError, ValueError, TypeError):
        return None
    part, inner = sizes[0], math.prod(shape[dim + 1:])
    rows, stride = math.prod(shape[:dim]), shape[dim] * inner
    vec = base.Create_vector(rows, part * inner, stride)
    t = vec.Create_resized(0, part * inner * dtype.itemsize).Commit()
    vec.Free()
    return t


def _all_to_all(b, mesh, shape, dtype, spec):
    a, d, e, split, recv = spec
    g = _group(mesh, a, "all_to_all", shape, dtype)
    check = ("all_to_all", g, dtype, tuple(-1 if i in (e, d) else s for i, s in enumerate(shape)), (e, d))
    body, out_shape = _exchange(b, g, dtype, shape, e, list(split), d, list(recv),
                                _record(check, shape, _nbytes(shape, dtype), mesh))
    return body, out_shape, check


def _direct(b, mesh, shape, dtype, spec):
    """The one-exchange step: pieces cut from boxes of x, one all_to_all(v) over the group,
    pieces written into boxes of the result (``plan_steps.direct_step``)."""
    group, send, recv, send_counts, recv_counts, out_shape = spec
    packed = (sum(send_counts),)             # what goes out: the parts, one after another
    g = _group(mesh, group, "all_to_all", packed, dtype)
    check = ("all_to_all", g, dtype, (-1,), (0, 0))
    fixed = min(send_counts) == max(send_counts) and send_counts == recv_counts
    sc, rc = (None, None) if fixed else (list(send_counts), list(recv_counts))
    call = step_caller(g.comm, "all_to_all", "a2a", dtype, (sc, rc), record=_record(check, packed, _nbytes(packed, dtype), mesh))
    xp = b.xp
    new_buf, new_got = _scratch(b, (sum(send_counts),), dtype), _scratch(b, (sum(recv_counts),), dtype)
    new_out = _keeper(b, out_shape, dtype)
    sends, at = [], 0
    for sl, cnt, shp in send:
        sends.append((slice(at, at + cnt), shp, sl))
        at += cnt
    recvs, at = [], 0
    for sl, cnt, shp in recv:
        recvs.append((slice(at, at + cnt), shp, sl))
        at += cnt

    def body(x, out=None):
        buf = new_buf()
        for flat, shp, sl in sends:
            xp.copyto(buf[flat].reshape(shp), x[sl])
        got = call(buf, new_got())
        out = new_out() if out is None else out
        for flat, shp, sl in recvs:
            xp.copyto(out[sl], got[flat].reshape(shp))
        return out
    return body, out_shape, check


_COMPILERS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
              "all_to_all": _all_to_all, "direct": _direct}


def compile_plan(plan, backend, x):
    """(the function running ``plan`` on this rank's pieces like ``x`` -- ``fn(x)``, or
    ``fn(x, out)`` writing the result into ``out`` --, its input shape, the agreement check's
    arguments for each collective).  Makes the groups the steps need that do not exist yet."""
    shape = local_shape(plan.shape, plan.src, plan.mesh)
    if not backend.is_array(x) or tuple(x.shape) != shape:
        got = f"{dtype_name(x.dtype)}{list(x.shape)}" if backend.is_array(x) else type(x).__name__
        raise ValueError(f"rank {world().rank}: redistributing {plan.dtype_name}{list(plan.shape)} {plan.src!r} -> "
                         f"{plan.dst!r} on {plan.mesh!r}: this rank's piece must be a {backend.xp.__name__} array "
                         f"of shape {list(shape)} (its part of {plan.src!r}), got {got}")
    dtype = x.dtype
    in_shape, bodies, checks, local_last = shape, [], [], False
    for s in plan.steps:
        if s.kind == "relabel":
            continue
        if s.spec is None:                       # a local step (slice, partialize): its own body
            bodies.append(s.local)
            shape = local_shape(plan.shape, s.dst, plan.mesh)
            local_last = True
            continue
        local_last = False
        kind = "direct" if s.detail.startswith("direct") else s.kind
        body, shape, check = _COMPILERS[kind](backend, plan.mesh, shape, dtype, s.spec)
        bodies.append(body)
        checks.append(check)
    assert shape == local_shape(plan.shape, plan.dst, plan.mesh), (plan, shape)
    if not bodies or local_last:
        # a local step last (or none at all): its result is a view of its input, copied into
        # the caller's ``out`` when one is given
        xp, local = backend.xp, (bodies.pop() if bodies else (lambda x: x))

        def last_into(x, out=None):
            y = local(x)
            if out is None:
                return y
            xp.copyto(out, y)
            return out
        bodies.append(last_into)
    if len(bodies) == 1:
        return bodies[0], in_shape, tuple(checks)
    first, last = bodies[:-1], bodies[-1]

    def run(x, out=None):
        for body in first:
            x = body(x)
        return last(x, out)
    return run, in_shape, tuple(checks)
