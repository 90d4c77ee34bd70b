"""Line and ring reduce-scatter / all-gather / all-reduce over send/recv (seed 004).

Each op works its arguments out once into a cached plan (``_plan_*``, kept by
``dist.comm.plans``): the group, the algorithm (``algo``, ``"auto"``: by size), and either
the library collective's own plan (``algo="library"``) or this rank's program of the ring
or line schedule (``schedules``).  A call then looks its plan up, takes its buffers and
runs it.  All buffers come from ``buffers.take``: with a ``buffer_key`` nothing is
allocated after the first call.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ...dtypes import dtype_name
from ..comm import collectives as C
from ..comm.hooks import SEAM
from ..comm.interface import REDUCE_OPS
from ..comm.mesh import Mesh, current_mesh
from ..comm.plans import keep, lookup, planned
from ..tensor.shard import split_sizes
from . import buffers
from ._common import check_array, choose_algo, resolve, where
from .schedules import OnRole, compile_steps, max_piece, offsets, pack_into, run_steps, schedule, unpack_into

__all__ = ["line_reduce_scatter", "line_all_gather", "line_all_reduce"]


# dtypes CuPy has elementwise kernels for: others (bf16, fp8) cannot be reduced by the ring on
# a GPU, while NCCL reduces bf16 natively, so "auto" picks the library for them there
_CUPY_KINDS = "biufc"


def _reducing_algo(opname: str, g, x, requested: str, algo: str) -> str:
    if algo == "library" or not C.backend().is_gpu or x.dtype.kind in _CUPY_KINDS:   # bf16/fp8: kind "V"
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
    for h in SEAM.watchers:
        if isinstance(h, C.trace_collectives):
            h.records.append(C.CollectiveRecord(opname, g.name, g.size, tuple(x.shape), dtype_name(x.dtype),
                                                nbytes, algo=algo, tag=tag or ""))


class _Plan:
    """What a ccl call works out from its arguments (see ``_common.plan``)."""

    __slots__ = ("mesh", "axis", "g", "dim", "sizes", "given", "algo", "shape", "sig", "shapes", "counts", "offs",
                 "progs", "nbytes", "flat", "check", "coll", "coll_async", "entry")
    mesh: Mesh
    axis: Any
    g: Any
    dim: Any
    sizes: Any
    given: Any
    algo: Any
    shape: Any
    sig: Any
    shapes: Any
    counts: Any
    offs: Any
    progs: Any
    nbytes: Any
    flat: Any
    check: Any
    coll: Any
    coll_async: Any
    entry: Any

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


def _miss(key: tuple, build: Callable, buffer_key: str | None, dtype, args: tuple) -> _Plan:
    """Build, check and cache the plan for ``key`` (``build(*args)``), holding ``buffer_key``'s
    persistent sets (made now, or checked against the plan's signature).  A function of its
    own, not a lambda in the op: a lambda would turn the op's arguments into closure cells,
    which costs every call ~0.3 us (measured), not only the first."""
    p = build(*args)
    p.entry = None if buffer_key is None else buffers.entry(buffer_key, p.sig, p.shapes, dtype)
    return keep(key, p)


_cycle = buffers.cycle
_ND: list = [None]           # the backend's array type, once known


def _array(name: str, mesh, cluster_axis, x):
    """x itself when it is a contiguous array of the backend (the cheap test every call
    makes); otherwise the full checks (errors, a contiguous copy)."""
    if x.__class__ is _ND[0] and x.flags.c_contiguous:
        return x
    _ND[0] = C.backend().xp.ndarray
    if x.__class__ is _ND[0] and x.flags.c_contiguous:
        return x
    return check_array(name, resolve(name, mesh, cluster_axis)[2], x)


def _plan_reduce_scatter(name, mesh, cluster_axis, x, dim, op, sizes, num_links, algo, tag, role) -> _Plan:
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    dim = C.norm_dim(f"ccl.{name}", g, x, dim)
    _common_checks(name, g, x, op, num_links)
    given = sizes
    if sizes is None and not x.shape[dim] % g.size:
        sizes = (x.shape[dim] // g.size,) * g.size
    else:
        sizes = tuple(C.check_sizes(f"ccl.{name}", g, x, sizes, x.shape[dim], "sizes"))
    algo = _reducing_algo(name, g, x, algo, choose_algo("reduce_scatter", algo, x.nbytes, lambda: where(name, g, x), tag))
    n, me = g.size, g.index
    out_shape = C.with_dim(x.shape, dim, sizes[me])
    sig = (name, axis, x.shape, x.dtype, (("op", op), ("dim", dim), ("sizes", sizes), ("algo", algo)))
    nbytes = int(x.nbytes * C.bus_factor("reduce_scatter", n))
    if algo == "library":
        return _Plan(mesh=mesh, axis=axis, g=g, dim=dim, given=given, algo=algo, shape=out_shape, sig=sig,
                     shapes=lambda: {"out": out_shape}, nbytes=nbytes,
                     coll=planned("reduce_scatter", g, x, role, tag, op=op, dim=dim, sizes=given),
                     coll_async=planned("reduce_scatter", g, x, role, tag, True, op=op, dim=dim, sizes=given))
    inner = math.prod(C.with_dim(x.shape, dim, 1))
    counts = [s * inner for s in sizes]
    offs = offsets(counts)
    piece, size = max_piece(counts, algo), x.size      # (the plan keeps no reference to x)
    prog = compile_steps(schedule("reduce_scatter", n, algo), me, offs, counts, True, num_links)
    return _Plan(mesh=mesh, axis=axis, g=g, dim=dim, sizes=sizes, algo=algo, shape=out_shape, sig=sig,
                 shapes=lambda: {"work": (size,), "slot0": (piece,), "slot1": (piece,)}, counts=counts, offs=offs,
                 progs=(prog,), nbytes=nbytes, check=(op, dim, algo))


def line_reduce_scatter(x: Any, dim: int = -1, cluster_axis: int | str = 0, *, mesh: Mesh | None = None,
                        op: str = "sum", sizes: Sequence[int] | None = None, buffer_key: str | None = None,
                        num_links: int = 1, algo: str = "auto", tag: str | None = None, role: str = "tp_collective",
                        between: Callable | None = None) -> Any:
    """``dist.reduce_scatter(x, axis, op, dim=dim, sizes=sizes)`` along the cluster axis by a
    line or ring of sends/recvs.

    Parameters
    ----------
    x : array
        This rank's full-size contribution.
    dim : int
        The dim scattered: it must split evenly over the axis unless ``sizes`` lists the parts.
    cluster_axis : int or str
        The mesh axis (index or name).
    mesh : Mesh, optional
        Default: the current mesh.
    op : {"sum", "max", "min", "avg"}
        The reduction.
    sizes : sequence of int, optional
        Uneven part lengths along ``dim``.
    buffer_key : str, optional
        Reuse the key's persistent buffers: the result is a view into them, valid until the
        call after next with that key.
    num_links : int
        Sub-messages each transfer is cut into, all in flight together.
    algo : {"auto", "library", "ring", "line"}
        ``auto``: by size (``algo_table``); ``library``: ``dist.reduce_scatter``.
    tag : {None, "tree", "ring"}
        An algorithm hint, recorded and checked; with ``algo="auto"`` it picks: ``ring`` the
        ring, ``tree`` the library collective.
    role : str
        The stream role it runs on.
    between : callable, optional
        Run once while the first step's messages travel (overlapped compute).

    Returns
    -------
    array
        This rank's reduced part.
    """
    name = "line_reduce_scatter"
    if mesh is None:
        mesh = current_mesh()
    if x.__class__ is not _ND[0] or not x.flags.c_contiguous:
        x = _array(name, mesh, cluster_axis, x)
    key = (name, id(mesh), cluster_axis, x.shape, x.dtype, dim, op, sizes if sizes is None else tuple(sizes),
           num_links, algo, tag, role, buffer_key)
    p = lookup(key) or _miss(key, _plan_reduce_scatter, buffer_key, x.dtype,
                           (name, mesh, cluster_axis, x, dim, op, sizes, num_links, algo, tag, role))
    g = p.g
    e = p.entry                  # (inline: a helper call costs ~0.05 us of the library path's budget)
    bufs = _cycle(e) if e is not None else buffers.take(None, p.sig, p.shapes, x.dtype)
    if SEAM.watchers:
        _record(name, g, x, p.nbytes, p.algo, tag)
    if p.algo == "library":      # the plain collective's plan, run from here (the caller: the user's site)
        cp = p.coll if between is None else p.coll_async
        check = SEAM.check_plan
        if check is not None:
            check(cp)
        if between is None:
            if cp.fn is not None and cp.pack is None and not SEAM.watchers:      # run_reduce_scatter's direct path
                C.after_role_worker(role)
                out = bufs["out"]
                cp.fn(x, out, cp.mop)
                return out
            return C.run_reduce_scatter(cp, x, bufs["out"], role, False, p.mesh, tag)
        work = C.run_reduce_scatter(cp, x, bufs["out"], role, True, p.mesh, tag)
        between()
        return work.wait()
    check = SEAM.check
    if check is not None:       # (the library collective runs its own)
        check(f"ccl.{name}", g, x.dtype, x.shape, p.check)
    work, me = bufs["work"], g.index
    with OnRole(role) as stream:
        pack_into(work, x, p.dim, p.sizes)
        run_steps(g, p.progs[0], work, (bufs["slot0"], bufs["slot1"]), op, stream, between)
        lo = p.offs[me]
        mine = work[lo:lo + p.counts[me]]
        if op == "avg":
            C.backend().xp.true_divide(mine, g.size, out=mine)
    return mine.reshape(p.shape)


def _plan_all_gather(name, mesh, cluster_axis, x, dim, sizes, num_links, algo, tag, role) -> _Plan:
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    dim = C.norm_dim(f"ccl.{name}", g, x, dim)
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
    shape = C.with_dim(x.shape, dim, sum(sizes))
    sig = (name, axis, x.shape, x.dtype, (("dim", dim), ("sizes", tuple(sizes)), ("algo", algo)))
    nbytes = int(math.prod(shape) * x.dtype.itemsize * C.bus_factor("all_gather", n))
    if algo == "library":
        even = min(sizes) == max(sizes)
        return _Plan(mesh=mesh, axis=axis, g=g, dim=dim, given=None if even else sizes, algo=algo, shape=shape,
                     sig=sig, shapes=lambda: {"out": shape}, nbytes=nbytes,
                     coll=planned("all_gather", g, x, role, tag, dim=dim, sizes=None if even else sizes))
    flat = dim == 0 or math.prod(x.shape[:dim]) == 1
    total = math.prod(shape)
    inner = math.prod(C.with_dim(x.shape, dim, 1))
    counts = [s * inner for s in sizes]
    offs = offsets(counts)
    prog = compile_steps(schedule("all_gather", n, algo), me, offs, counts, False, num_links)
    return _Plan(mesh=mesh, axis=axis, g=g, dim=dim, sizes=sizes, algo=algo, shape=shape, sig=sig,
                 shapes=lambda: {"work": (total,)} if flat else {"work": (total,), "out": shape}, counts=counts,
                 offs=offs, progs=(prog,), nbytes=nbytes, flat=flat,
                 check=(C.with_dim(x.shape, dim, -1), (dim, tuple(sizes), algo)))


def line_all_gather(x: Any, dim: int = -1, cluster_axis: int | str = 0, *, mesh: Mesh | None = None,
                    sizes: Sequence[int] | None = None, buffer_key: str | None = None, num_links: int = 1,
                    algo: str = "auto", tag: str | None = None, role: str = "tp_collective") -> Any:
    """``dist.all_gather(x, axis, dim=dim, sizes=sizes)`` along the cluster axis by a line or
    ring of sends/recvs.

    Parameters
    ----------
    x : array
        This rank's part.
    dim : int
        The dim concatenated along.
    cluster_axis : int or str
        The mesh axis (index or name).
    mesh : Mesh, optional
        Default: the current mesh.
    sizes : sequence of int, optional
        Every rank's length along ``dim`` when they differ.
    buffer_key : str, optional
        Reuse the key's persistent buffers (the result is a view into them).
    num_links : int
        Sub-messages each transfer is cut into, all in flight together.
    algo : {"auto", "library", "ring", "line"}
        ``auto``: by size (``algo_table``); ``library``: ``dist.all_gather``.
    tag : {None, "tree", "ring"}
        An algorithm hint, recorded and checked; with ``algo="auto"`` it picks: ``ring`` the
        ring, ``tree`` the library collective.
    role : str
        The stream role it runs on.

    Returns
    -------
    array
        The concatenation in rank order.
    """
    name = "line_all_gather"
    if mesh is None:
        mesh = current_mesh()
    if x.__class__ is not _ND[0] or not x.flags.c_contiguous:
        x = _array(name, mesh, cluster_axis, x)
    key = (name, id(mesh), cluster_axis, x.shape, x.dtype, dim, sizes if sizes is None else tuple(sizes),
           num_links, algo, tag, role, buffer_key)
    p = lookup(key) or _miss(key, _plan_all_gather, buffer_key, x.dtype,
                           (name, mesh, cluster_axis, x, dim, sizes, num_links, algo, tag, role))
    g = p.g
    e = p.entry                  # (inline: a helper call costs ~0.05 us of the library path's budget)
    bufs = _cycle(e) if e is not None else buffers.take(None, p.sig, p.shapes, x.dtype)
    if SEAM.watchers:
        _record(name, g, x, p.nbytes, p.algo, tag)
    if p.algo == "library":
        check = SEAM.check_plan
        if check is not None:
            check(p.coll)
        return C.run_all_gather(p.coll, x, bufs["out"], role, False, p.mesh, tag)
    check = SEAM.check
    if check is not None:
        check(f"ccl.{name}", g, x.dtype, *p.check)
    work, me, offs = bufs["work"], g.index, p.offs
    with OnRole(role) as stream:
        work[offs[me]:offs[me] + p.counts[me]] = x.reshape(-1)
        run_steps(g, p.progs[0], work, (), None, stream)
        if p.flat:
            return work.reshape(p.shape)
        unpack_into(bufs["out"], work, p.dim, p.sizes)
    return bufs["out"]


def _plan_all_reduce(name, mesh, cluster_axis, x, op, num_links, algo, tag, role) -> _Plan:
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    _common_checks(name, g, x, op, num_links)
    algo = _reducing_algo(name, g, x, algo, choose_algo("all_reduce", algo, x.nbytes, lambda: where(name, g, x), tag))
    n, me = g.size, g.index
    sig = (name, axis, x.shape, x.dtype, (("op", op), ("algo", algo)))
    nbytes = int(x.nbytes * C.bus_factor("all_reduce", n))
    shape, size = tuple(x.shape), x.size                  # (the plan keeps no reference to x)
    if algo == "library":
        return _Plan(mesh=mesh, axis=axis, g=g, algo=algo, sig=sig, shapes=lambda: {"out": shape}, nbytes=nbytes,
                     coll=planned("all_reduce", g, x, role, tag, op=op))
    counts = list(split_sizes(size, n))
    offs = offsets(counts)
    piece = max_piece(counts, algo)
    progs = (compile_steps(schedule("reduce_scatter", n, algo), me, offs, counts, True, num_links),
             compile_steps(schedule("all_gather", n, algo), me, offs, counts, False, num_links))
    return _Plan(mesh=mesh, axis=axis, g=g, algo=algo, shape=shape, sig=sig,
                 shapes=lambda: {"work": (size,), "slot0": (piece,), "slot1": (piece,)}, counts=counts, offs=offs,
                 progs=progs, nbytes=nbytes, check=(op, algo))


def line_all_reduce(x: Any, cluster_axis: int | str = 0, *, mesh: Mesh | None = None, op: str = "sum",
                    buffer_key: str | None = None, num_links: int = 1, algo: str = "auto",
                    tag: str | None = None, role: str = "tp_collective") -> Any:
    """``dist.all_reduce(x, axis, op)`` along the cluster axis: a line/ring reduce-scatter of
    the flattened array (uneven parts when n does not divide its size) then an all-gather,
    in one buffer.

    Parameters
    ----------
    x : array
        This rank's contribution.
    cluster_axis : int or str
        The mesh axis (index or name).
    mesh : Mesh, optional
        Default: the current mesh.
    op : {"sum", "max", "min", "avg"}
        The reduction.
    buffer_key : str, optional
        Reuse the key's persistent buffers (the result is a view into them).
    num_links : int
        Sub-messages each transfer is cut into, all in flight together.
    algo : {"auto", "library", "ring", "line"}
        ``auto``: by size (``algo_table``); ``library``: ``dist.all_reduce``.
    tag : {None, "tree", "ring"}
        An algorithm hint, recorded and checked; with ``algo="auto"`` it picks: ``ring`` the
        ring, ``tree`` the library collective.
    role : str
        The stream role it runs on.

    Returns
    -------
    array
        The reduced array, on every rank.
    """
    name = "line_all_reduce"
    if mesh is None:
        mesh = current_mesh()
    if x.__class__ is not _ND[0] or not x.flags.c_contiguous:
        x = _array(name, mesh, cluster_axis, x)
    key = (name, id(mesh), cluster_axis, x.shape, x.dtype, op, num_links, algo, tag, role, buffer_key)
    p = lookup(key) or _miss(key, _plan_all_reduce, buffer_key, x.dtype,
                           (name, mesh, cluster_axis, x, op, num_links, algo, tag, role))
    g = p.g
    e = p.entry                  # (inline: a helper call costs ~0.05 us of the library path's budget)
    bufs = _cycle(e) if e is not None else buffers.take(None, p.sig, p.shapes, x.dtype)
    if SEAM.watchers:
        _record(name, g, x, p.nbytes, p.algo, tag)
    if p.algo == "library":
        check = SEAM.check_plan
        if check is not None:
            check(p.coll)
        return C.run_all_reduce(p.coll, x, bufs["out"], role, False, p.mesh, tag)
    check = SEAM.check
    if check is not None:
        check(f"ccl.{name}", g, x.dtype, x.shape, p.check)
    work, me = bufs["work"], g.index
    with OnRole(role) as stream:
        work[...] = x.reshape(-1)
        run_steps(g, p.progs[0], work, (bufs["slot0"], bufs["slot1"]), op, stream)
        if op == "avg":
            lo = p.offs[me]
            mine = work[lo:lo + p.counts[me]]
            C.backend().xp.true_divide(mine, g.size, out=mine)
        run_steps(g, p.progs[1], work, (), None, stream)
    return work.reshape(p.shape)
