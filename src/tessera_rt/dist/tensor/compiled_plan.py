"""Compiled redistribution plans: a plan's steps turned, once, into communicator calls.

A ``Plan`` (``redistribute``) is a pure function of (global shape, layouts, mesh, dtype)
and this rank's mesh position, so everything its collectives work out per call -- the
group, output shapes, MPI counts, pack/unpack orders, which role runs it -- is the same on
every call.  ``compile_plan`` works it out once and returns one function per plan that does
only what must happen per call:

* the cross-rank agreement check (``consistency.check``: a set lookup in steady state) for
  each collective, with the signature the array collective would pass, so it fires as it
  does there; ``Plan.run`` makes them all before the first step moves data;
* an output (NumPy's ``empty`` below 2 MiB, the pool's huge-page blocks from there up), or
  the caller's ``out`` (``DTensor.redistribute(out=...)``);
* at most one pack and one unpack copy, into the order MPI/NCCL move, where the layout needs
  one (a dim other than the leading one); none where the pieces are contiguous runs;
* one communicator call in the role's stream order (``collectives._issue``'s), the raw
  mpi4py call where the array collective's direct path would make one (``_caller``).

A compiled plan runs only when nothing watches collectives (``trace_collectives``, the
profiler, ``TESSERA_DEBUG``, deterministic reductions: ``hooks.SEAM.watchers``) and the input
is this rank's piece (shape, dtype, array type); otherwise ``Plan.run`` takes its steps
through the array collectives, which record, check and raise as always.  Groups are never
made here (that is collective): a plan whose groups do not exist yet runs its steps once.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

from ..comm import collectives as C
from ...backend import mapped_empty
from ..comm.communicators import _MPI_OPS
from ..comm.plans import _direct as _mpi_direct
from ..comm.packing import with_dim
from .shard import local_shape

__all__ = ["compile_plan"]


def _group(mesh, axis):
    return mesh._groups.get(axis)


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


def _on_gpu() -> bool:
    """GPU buffers are left to CuPy's pool, which orders reuse against the streams."""
    return C.backend().is_gpu


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


def _caller(comm, method: str, role: str, dtype, counts=None, op: str | None = None) -> Callable:
    """(send, recv) -> recv, after one blocking ``comm.<method>`` in ``role``'s stream order.

    On CPU ranks over MPI, with fixed-size parts and a dtype MPI moves (reduces) itself, this
    is the raw mpi4py call the method would make, after the role's worker has run what it
    was given (collectives._issue's CPU order): ~0.8 us a call less than going through
    ``_issue`` and the method.  Otherwise ``_issue`` (GPU streams, staged dtypes, -v forms)."""
    reducing = method in ("all_reduce", "reduce_scatter")
    extra = {"all_reduce": (op,), "reduce_scatter": (counts, op), "all_gather": (counts,),
             "all_to_all": tuple(counts or (None, None))}[method]
    sizes = {"all_reduce": (), "reduce_scatter": (counts,), "all_gather": (counts,), "all_to_all": extra}[method]
    fixed = all(c is None for c in sizes)            # equal parts: the fixed-size MPI call
    if not (fixed and _mpi_direct(comm, False, dtype, reducing, op)):
        m, issue = getattr(comm, method), C._issue
        return lambda send, recv: issue(role, False, m, (send, recv) + extra, recv)
    mpi = comm.mpi
    fn = {"all_reduce": mpi.Allreduce, "reduce_scatter": mpi.Reduce_scatter_block, "all_gather": mpi.Allgather,
          "all_to_all": mpi.Alltoall}[method]
    args = (_MPI_OPS[op],) if reducing else ()
    after_worker = C.after_role_worker

    def raw_call(send, recv):            # (the watchdog knows this frame: it waits inside MPI)
        after_worker(role)
        fn(send, recv, *args)
        return recv
    return raw_call


# --------------------------------------------------------------------------- step bodies
# Each mirrors its array collective in ``collectives`` for an input of a known shape: the
# same check signature, role, communicator call and counts; only the per-call work is left.

def _all_reduce(b, mesh, shape, dtype, spec):
    a, op = spec
    g = _group(mesh, a)
    if g is None:
        return None
    call, new_out = _caller(g.comm, "all_reduce", "tp_collective", dtype, op=op), _keeper(b, shape, dtype)

    def body(x, out=None):
        return call(x, new_out() if out is None else out)
    return body, shape, ("all_reduce", g, dtype, shape, op)


def _all_gather(b, mesh, shape, dtype, spec):
    a, d, sizes = spec
    g = _group(mesh, a)
    if g is None:
        return None
    even = min(sizes) == max(sizes)
    inner = math.prod(with_dim(shape, d, 1))
    counts = None if even else [s * inner for s in sizes]
    out_shape = with_dim(shape, d, sum(sizes))
    check_shape = shape if even else with_dim(shape, d, -1)   # what collectives.all_gather checks
    call, new_out = _caller(g.comm, "all_gather", "tp_collective", dtype, counts), _keeper(b, out_shape, dtype)
    unpack = _unpacker(b.xp, out_shape, d, sizes)
    new_recv = _scratch(b, (math.prod(out_shape),), dtype)
    if unpack is None:
        def body(x, out=None):
            return call(x, new_out() if out is None else out)
        return body, out_shape, ("all_gather", g, dtype, check_shape, d)

    def body_unpack(x, out=None):
        recv = call(x, new_recv())
        out = new_out() if out is None else out
        unpack(recv, out)
        return out
    return body_unpack, out_shape, ("all_gather", g, dtype, check_shape, d)


def _reduce_scatter(b, mesh, shape, dtype, spec):
    a, op, d, sizes = spec
    g = _group(mesh, a)
    if g is None:
        return None
    inner = math.prod(with_dim(shape, d, 1))
    counts = _counts(sizes, inner)
    out_shape = with_dim(shape, d, sizes[g.index])
    call = _caller(g.comm, "reduce_scatter", "tp_collective", dtype, counts, op)
    new_out = _keeper(b, out_shape, dtype)
    pack = _packer(b, shape, d, sizes, dtype)

    def body(x, out=None):
        return call(x if pack is None else pack(x), new_out() if out is None else out)
    return body, out_shape, ("reduce_scatter", g, dtype, shape, (op, d))


def _exchange(b, g, dtype, in_shape, split_dim, split, concat_dim, recv):
    """all_to_all of an ``in_shape`` piece: parts ``split`` along ``split_dim`` go out, parts
    of lengths ``recv`` along ``concat_dim`` come in."""
    base = with_dim(in_shape, split_dim, split[g.index])
    out_shape = with_dim(base, concat_dim, sum(recv))
    send_counts = [math.prod(with_dim(in_shape, split_dim, s)) for s in split]
    recv_counts = [math.prod(with_dim(base, concat_dim, r)) for r in recv]
    fixed = min(send_counts) == max(send_counts) and send_counts == recv_counts
    sc, rc = (None, None) if fixed else (send_counts, recv_counts)
    comm, issue, xp = g.comm, C._issue, b.xp
    call = _caller(comm, "all_to_all", "a2a", dtype, (sc, rc))
    pack = _packer(b, in_shape, split_dim, split, dtype)
    unpack = _unpacker(xp, out_shape, concat_dim, recv)
    new_out, new_got = _keeper(b, out_shape, dtype), _scratch(b, (math.prod(out_shape),), dtype)
    part_type = _strided_part(comm, in_shape, split_dim, split, dtype) if pack is not None and fixed else None
    if part_type is not None and unpack is None:
        # the parts are strided views of x: MPI reads them in place (no pack buffer)
        def body_strided(x, out=None):
            out = new_out() if out is None else out
            return issue("a2a", False, comm.all_to_all_strided, (x, part_type, out), out)
        return body_strided, out_shape

    def body(x, out=None):
        send = x if pack is None else pack(x)
        if unpack is None:
            return call(send, new_out() if out is None else out)
        got = call(send, new_got())
        out = new_out() if out is None else out
        unpack(got, out)
        return out
    return body, out_shape


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
    g = _group(mesh, a)
    if g is None:
        return None
    masked = tuple(-1 if i in (e, d) else s for i, s in enumerate(shape))
    body, out_shape = _exchange(b, g, dtype, shape, e, list(split), d, list(recv))
    return body, out_shape, ("all_to_all", g, dtype, masked, (e, d))


def _direct(b, mesh, shape, dtype, spec):
    """The one-exchange step: pieces cut from boxes of x, one all_to_all(v) over the group,
    pieces written into boxes of the result (``redistribute._direct_step``)."""
    group, send, recv, send_counts, recv_counts, out_shape = spec
    g = _group(mesh, group)
    if g is None:
        return None
    fixed = min(send_counts) == max(send_counts) and send_counts == recv_counts
    sc, rc = (None, None) if fixed else (list(send_counts), list(recv_counts))
    call, xp = _caller(g.comm, "all_to_all", "a2a", dtype, (sc, rc)), b.xp
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
    return body, out_shape, ("all_to_all", g, dtype, (-1,), (0, 0))


_COMPILERS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
              "all_to_all": _all_to_all, "direct": _direct}


def compile_plan(plan, backend, dtype):
    """(the function running ``plan`` on this rank's piece -- ``fn(x)``, or ``fn(x, out)``
    writing the result into ``out`` --, its input shape, the agreement check's arguments for
    each collective), or None when a step's group does not exist yet (the steps make it,
    collectively, on their first run)."""
    shape = local_shape(plan.shape, plan.src, plan.mesh)
    in_shape, bodies, checks, local_last = shape, [], [], False
    for s in plan.steps:
        if s.kind == "relabel":
            continue
        if s.spec is None:                       # a local step (slice, partialize): its own body
            bodies.append(s._run)
            shape = local_shape(plan.shape, s.dst, plan.mesh)
            local_last = True
            continue
        local_last = False
        kind = "direct" if s.detail.startswith("direct") else s.kind
        made = _COMPILERS[kind](backend, plan.mesh, shape, dtype, s.spec)
        if made is None:
            return None
        body, shape, check = made
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
