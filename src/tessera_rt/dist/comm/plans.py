"""Per-call plans for the array collectives (and the ``dist.ccl`` ops over them).

A collective called again with the same group, shape, dtype, dim, sizes, reduction/root,
tag, role and mode recomputes nothing: everything its arguments determine (the checks,
the output shape, counts and pack/unpack layout, the communicator, the raw MPI call and
the agreement check's signature) is worked out once, by a builder here, and kept in one
table keyed by those arguments.  A plan is made only after every check passed, so bad
input still gets its error on the first call with that key, before any communication;
the per-call checks that depend on the array itself (its type, contiguity, ``out=``) stay
on the call.  ``dist.ccl`` keeps its ring/line programs in the same table (``plan``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import runtime as rt
from ...deprecation import aliases
from ...dtypes import dtype_name
from .calls import ALONE, group_state, sig
from .communicators import _MPI_NATIVE, _MPI_REDUCIBLE, MPI_OPS, MpiCommunicator
from .interface import REDUCE_OPS
from .mesh import AxisGroup
from .packing import _even, _pack, with_dim
from .process_group import world
from .trace import TAGS

__all__ = ["CallPlan", "plan", "lookup", "keep", "planned", "clear_plans", "plans_made", "check_dtype", "mpi_direct"]

# the plan table (a cache: key -> CallPlan), read live by dist/comm/_hot.c; owned here (clear_plans)
_PLANS: dict = {}
_MAX_PLANS = 4096          # a bound: plans keep their group (and its mesh) alive
# plans built in this process (plans_made: the tests check caching)
_MADE = [0]
_CLEARS = [0]              # times the table was emptied: dist/comm/_hot.c's memo of its last plan checks it


def plan(key: tuple, build: Callable[[], Any]):
    """The plan cached under ``key`` (made by ``build()`` on first use; ``build`` raises on
    bad input, and then nothing is cached)."""
    p = _PLANS.get(key)
    return keep(key, build()) if p is None else p


# the table's lookup, bound once: the plan under a key, or None (dist.ccl's ops call it on
# every call, where a call of ``plan`` with a closure to build would cost each call)
lookup = _PLANS.get


def keep(key, p):
    """Cache the new plan ``p`` under ``key`` (None: an argument was unhashable, and ``p``
    serves this call only)."""
    _MADE[0] += 1
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
            _CLEARS[0] += 1
        _PLANS[key] = p
    return p


def clear_plans() -> None:
    """Forget every cached plan (the algorithm table, TESSERA_COMM_ALGO or the backend changed)."""
    _PLANS.clear()
    _CLEARS[0] += 1


def plans_made() -> int:
    """How many plans this process has built (a repeated call builds none)."""
    return _MADE[0]


# --------------------------------------------------------------------------- shared checks

# [the world's backend], looked up once
_BACKEND: list = []


def backend():
    """The backend, looked up once (it is fixed for the life of the process)."""
    if not _BACKEND:
        _BACKEND.append(world().backend)
    return _BACKEND[0]


def where(op: str, g: AxisGroup, x) -> str:
    return (f"rank {world().rank}: {op} over mesh axis {g.name!r} (group of {g.size}) "
            f"on {dtype_name(x.dtype)}{list(x.shape)}")


def check_dtype(op: str, x) -> None:
    """Refuse an array MPI/NCCL cannot move as numbers (objects, strings, bytes, dates, records)
    before any communication: MPI would fail inside the call, on one rank, with a conversion
    error naming neither the call nor the dtype.  Numbers are NumPy's bool, integer, float
    and complex kinds and ml_dtypes' types (bf16, fp8: kind "V", their own scalar type)."""
    dt = getattr(x, "dtype", None)
    if dt is None or dt.kind in "biufc" or (dt.kind == "V" and dt.type is not np.void):
        return
    what = {"O": "Python objects", "U": "strings", "S": "bytes", "M": "dates", "m": "time deltas"}.get(dt.kind, "records")
    raise TypeError(f"rank {world().rank}: dist.{op}: the array has dtype {dt} ({what}), which collectives cannot "
                    "move: they take numbers (bool, int, float, complex, bf16, fp8). Convert it first (e.g. "
                    "x.astype(np.float32)), or exchange Python objects with mpi4py's lowercase calls "
                    "(dist.init().mpi.allgather(obj))")


def check_array(op: str, g: AxisGroup, x):
    b = backend()
    if not isinstance(x, b.xp.ndarray):
        raise TypeError(f"rank {world().rank}: {op} over {g.name!r} takes a {b.xp.__name__} array "
                        f"on the {b.name} backend, got {type(x).__name__}")
    check_dtype(op, x)
    return x if x.flags.c_contiguous else b.xp.ascontiguousarray(x)


def norm_dim(op: str, g: AxisGroup, x, dim: int) -> int:
    if not -x.ndim <= dim < max(x.ndim, 1):
        raise ValueError(f"{where(op, g, x)}: dim={dim} is out of range for {x.ndim} dims")
    return dim % x.ndim


def check_sizes(op, g, x, sizes, length, name) -> list[int]:
    if sizes is None:
        if length % g.size:
            raise ValueError(
                f"{where(op, g, x)}: dim of length {length} does not split evenly over {g.size} ranks; "
                f"pass {name}= with {g.size} part sizes adding up to {length} (uneven and zero parts are fine)")
        return [length // g.size] * g.size
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or any(s < 0 for s in sizes) or sum(sizes) != length:
        raise ValueError(f"{where(op, g, x)}: {name}={sizes} must be {g.size} sizes >= 0 adding up to {length}")
    return sizes


def _out(op, g, x, out, shape, dtype):
    if out is None:
        return backend().empty(shape, dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{where(op, g, x)}: out= must be a contiguous {dtype_name(dtype)}{list(shape)}, "
                         f"got {dtype_name(out.dtype)}{list(out.shape)}")
    return out


def _tagged(op: str, g: AxisGroup, x, tag: str, extra):
    """(the communicator that serves ``tag``, ``extra`` with the tag in it for the agreement check)."""
    if tag not in TAGS:
        raise ValueError(f"{where(op, g, x) if x is not None else f'rank {world().rank}: {op}'}: "
                         f"tag={tag!r}; use one of {TAGS} (or leave it out)")
    return g.comm.tagged(op, tag), (extra, ("tag", tag))


def _tup(sizes):
    """``sizes`` as a hashable key part (None stays None)."""
    return sizes if sizes is None or sizes.__class__ is tuple else tuple(sizes)


# --------------------------------------------------------------------------- the plan

class CallPlan:
    """What one collective signature needs per call.  ``fn`` is the raw MPI call for the
    blocking CPU path (None where the communicator method must run: GPU, async, staged
    dtypes, uneven parts); ``empty(shape, dtype)`` allocates the output."""

    __slots__ = ("op", "g", "comm", "st", "sig", "shape", "dtype", "empty", "fn", "mop", "rop", "extra", "gshape",
                 "dim", "sizes", "even", "counts", "pack", "flat", "root", "exchange", "mine", "site", "hot")

    def __init__(self, op: str, g: AxisGroup, comm, x, shape, extra, gshape, role: str, async_op: bool, **kw):
        self.op, self.g, self.comm, self.shape, self.dtype = op, g, comm, tuple(shape), x.dtype
        self.extra, self.gshape = extra, gshape
        self.st = group_state(g)
        rt.stream(role)                  # an unknown role is an error now, not at the MPI call
        # what every rank of the group must agree on (an async call's role is part of it: on
        # CPU ranks each role's worker has its own communicator)
        self.sig = sig(op, x.dtype, gshape, (extra, role) if async_op else extra)
        nbytes = math.prod(self.shape) * x.dtype.itemsize
        b = backend()
        self.empty = b.xp.empty if not b.is_gpu and nbytes < b._pool.MIN_BYTES else b.empty
        self.fn = self.mop = self.rop = self.dim = self.sizes = self.counts = self.pack = self.root = None
        self.exchange, self.mine, self.even, self.flat = False, None, True, True
        # the agreement check's last verified call site (a group of one has nothing to agree on)
        self.site = ALONE if g.size == 1 else None
        for k, v in kw.items():
            setattr(self, k, v)
        # what dist/comm/_hot.c reads for a direct call (one attribute instead of seven), or None:
        # the raw MPI call takes this rank's input (packed first if ``pack``) and the output
        direct = self.fn is not None and not self.exchange and self.flat
        self.hot = (self.fn, self.mop, self.st, self.empty, self.shape, self.dtype, self.pack) if direct else None


def mpi_direct(comm, async_op: bool, dtype, reducing: bool, op: str | None = None) -> bool:
    """True when the blocking CPU call may go straight to mpi4py (what the communicator
    method would do anyway, minus its dispatch): an MPI communicator, blocking, and a dtype
    MPI moves (``reducing``: and reduces with ``op``) itself.  The plans and compiled
    redistribution steps ask this before taking the raw call."""
    if async_op or comm.__class__ is not MpiCommunicator:
        return False
    if reducing:
        return op != "avg" and dtype in _MPI_REDUCIBLE
    return dtype in _MPI_NATIVE


def _reduce_checks(name: str, g, x, op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{where(name, g, x)}: op={op!r}; use one of {list(REDUCE_OPS)}")
    if op == "avg" and x.dtype.kind not in "fc" and x.dtype.kind != "V":
        raise TypeError(f"{where(name, g, x)}: op='avg' needs a floating dtype; use op='sum'")


def _comm(name: str, g, x, tag, extra):
    if tag is None:
        return g.comm, extra
    return _tagged(name, g, x, tag, extra)


def all_reduce_plan(g, x, op, tag, role, async_op) -> CallPlan:
    x = check_array("all_reduce", g, x)
    _reduce_checks("all_reduce", g, x, op)
    comm, extra = _comm("all_reduce", g, x, tag, op)
    direct = mpi_direct(comm, async_op, x.dtype, True, op)
    return CallPlan("all_reduce", g, comm, x, x.shape, extra, x.shape, role, async_op,
                fn=comm.mpi.Allreduce if direct else None, mop=MPI_OPS[op], rop=op)


def _even_pack(shape: tuple, dim: int, n: int, part: int):
    """A pack of equal parts along ``dim`` with every reshape worked out: one strided copy."""
    split = shape[:dim] + (n, part) + shape[dim + 1:]
    axes = (dim,) + tuple(i for i in range(len(split)) if i != dim)
    into = (n,) + with_dim(shape, dim, part)
    size = math.prod(shape)
    b = backend()

    def pack(x):
        buf = b.empty((size,), x.dtype)
        buf.reshape(into)[...] = x.reshape(split).transpose(axes)
        return buf
    return pack


def reduce_scatter_plan(g, x, op, dim, sizes, tag, role, async_op) -> CallPlan:
    name = "reduce_scatter"
    x = check_array(name, g, x)
    _reduce_checks(name, g, x, op)
    if not 0 <= dim < x.ndim:
        dim = norm_dim(name, g, x, dim)
    sizes = check_sizes(name, g, x, sizes, x.shape[dim], "sizes")
    even, mine = _even(sizes), sizes[g.index]
    inner = math.prod(with_dim(x.shape, dim, 1))
    counts = None if even else [s * inner for s in sizes]      # None: the fixed-size collective
    shape = with_dim(x.shape, dim, mine)
    comm, extra = _comm(name, g, x, tag, (op, dim))
    if dim == 0 or math.prod(x.shape[:dim]) == 1:
        pack = None                      # x is already the parts one after another
    elif even:
        pack = _even_pack(x.shape, dim, g.size, mine)
    else:
        pack = lambda x: _pack(x, dim, sizes, False)
    direct = counts is None and mpi_direct(comm, async_op, x.dtype, True, op)
    return CallPlan(name, g, comm, x, shape, extra, x.shape, role, async_op, dim=dim, counts=counts, pack=pack,
                fn=comm.mpi.Reduce_scatter_block if direct else None, mop=MPI_OPS[op], rop=op)


def all_gather_plan(g, x, dim, sizes, tag, role, async_op) -> CallPlan:
    name = "all_gather"
    x = check_array(name, g, x)
    if dim is None:
        dim = 0
    if not 0 <= dim < x.ndim:
        dim = norm_dim(name, g, x, dim)
    given = sizes is not None            # then lengths along dim may differ: not compared
    if sizes is None:
        sizes = [x.shape[dim]] * g.size
    else:
        sizes = [int(s) for s in sizes]
        if len(sizes) != g.size or any(s < 0 for s in sizes) or sizes[g.index] != x.shape[dim]:
            raise ValueError(f"{where(name, g, x)}: sizes={sizes} must list {g.size} lengths "
                             f"along dim {dim}, this rank's ({g.index}) being {x.shape[dim]}")
    even = _even(sizes)
    inner = math.prod(with_dim(x.shape, dim, 1))
    counts = None if even else [s * inner for s in sizes]
    shape = with_dim(x.shape, dim, sum(sizes))
    comm, extra = _comm(name, g, x, tag, dim)
    flat = dim == 0 or math.prod(x.shape[:dim]) == 1          # communicators see flat buffers
    direct = flat and counts is None and mpi_direct(comm, async_op, x.dtype, False)
    return CallPlan(name, g, comm, x, shape, extra, x.shape if not given else with_dim(x.shape, dim, -1), role,
                async_op, dim=dim, sizes=sizes, even=even, counts=counts, flat=flat,
                fn=comm.mpi.Allgather if direct else None)



def _pack_plan(shape: tuple, dim: int, sizes: list):
    """None when x's parts along ``dim`` already lie one after another, else the pack."""
    if dim == 0 or math.prod(shape[:dim]) == 1:
        return None
    if _even(sizes):
        return _even_pack(shape, dim, len(sizes), sizes[0])
    return lambda x: _pack(x, dim, sizes, False)


def all_to_all_plan(g, x, split_dim, concat_dim, split_sizes, recv_sizes, has_out, tag, role, async_op) -> CallPlan:
    """With ``split_sizes`` and no ``recv_sizes`` the receive sizes come from the peers: that
    plan says so (``exchange``, with ``mine`` to send them), and the call then takes the plan
    for the sizes that arrived (``recv_sizes`` given: a second key)."""
    name, n = "all_to_all", g.size
    x = check_array(name, g, x)
    if not 0 <= split_dim < x.ndim:
        split_dim = norm_dim(name, g, x, split_dim)
    concat_dim = split_dim if concat_dim is None else norm_dim(name, g, x, concat_dim)
    if has_out and (split_dim != 0 or concat_dim != 0):
        raise ValueError(f"{where(name, g, x)}: out= needs split_dim=concat_dim=0")
    gshape = tuple(-1 if i in (split_dim, concat_dim) else s for i, s in enumerate(x.shape))
    comm, extra = _comm(name, g, x, tag, (split_dim, concat_dim))
    exchange = split_sizes is not None and recv_sizes is None
    split_sizes = check_sizes(name, g, x, split_sizes, x.shape[split_dim], "split_sizes")
    if recv_sizes is None:
        recv_sizes = split_sizes if concat_dim == split_dim else [x.shape[concat_dim]] * n
        if exchange:
            return CallPlan(name, g, comm, x, x.shape, extra, gshape, role, async_op, exchange=True, mine=recv_sizes)
    else:
        recv_sizes = [int(s) for s in recv_sizes]
        if len(recv_sizes) != n or any(s < 0 for s in recv_sizes):
            raise ValueError(f"{where(name, g, x)}: recv_sizes={recv_sizes} must be {n} sizes >= 0")
    # every piece that arrives has x's shape with this rank's split length and the sender's
    # length along concat_dim
    base = with_dim(x.shape, split_dim, split_sizes[g.index])
    shape = with_dim(base, concat_dim, sum(recv_sizes))
    send_counts = [math.prod(with_dim(x.shape, split_dim, s)) for s in split_sizes]
    recv_counts = [math.prod(with_dim(base, concat_dim, r)) for r in recv_sizes]
    fixed = _even(send_counts) and send_counts == recv_counts
    flat = concat_dim == 0 or math.prod(shape[:concat_dim]) == 1
    even_recv = _even(recv_sizes)
    direct = fixed and flat and mpi_direct(comm, async_op, x.dtype, False)
    return CallPlan(name, g, comm, x, shape, extra, gshape, role, async_op, dim=concat_dim, sizes=recv_sizes,
                even=even_recv, counts=(None, None) if fixed else (send_counts, recv_counts), flat=flat,
                pack=_pack_plan(x.shape, split_dim, split_sizes), fn=comm.mpi.Alltoall if direct else None)


def broadcast_plan(g, x, root, tag, role, async_op) -> CallPlan:
    name = "broadcast"
    b = backend()
    if not b.is_array(x) or not x.flags.c_contiguous:
        raise TypeError(f"rank {world().rank}: broadcast over {g.name!r} fills x in place: pass a contiguous "
                        f"{b.xp.__name__} array, got {type(x).__name__}")
    check_dtype(name, x)
    if not 0 <= root < g.size:
        raise ValueError(f"{where(name, g, x)}: root={root} is not a position in the group (0..{g.size - 1})")
    comm, extra = _comm(name, g, x, tag, root)
    direct = mpi_direct(comm, async_op, x.dtype, False)
    return CallPlan(name, g, comm, x, x.shape, extra, x.shape, role, async_op, root=root,
                fn=comm.mpi.Bcast if direct else None)


def planned(name: str, g: AxisGroup, x, role: str, tag, async_op: bool = False, **args) -> CallPlan:
    """The plan (the same table entry) the plain collective ``name`` uses for these arguments:
    ``dist.ccl``'s library path runs it with ``collectives.run_<op>``.  The keys are the ones
    the collectives build inline (kept in step by tests/collectives/mpi_ccl.py)."""
    cls, shape, dt = x.__class__, x.shape, x.dtype
    if name == "all_reduce":
        return plan(("all_reduce", id(g), cls, shape, dt, args["op"], tag, role, async_op),
                    lambda: all_reduce_plan(g, x, args["op"], tag, role, async_op))
    sizes = args.get("sizes")
    sizes = sizes if sizes is None else tuple(sizes)
    if name == "reduce_scatter":
        return plan(("reduce_scatter", id(g), cls, shape, dt, args["op"], args["dim"], sizes, tag, role, async_op),
                    lambda: reduce_scatter_plan(g, x, args["op"], args["dim"], sizes, tag, role, async_op))
    return plan(("all_gather", id(g), cls, shape, dt, args["dim"], sizes, tag, role, async_op),
                lambda: all_gather_plan(g, x, args["dim"], sizes, tag, role, async_op))


# --------------------------------------------------------------------------- what the collectives share

_plan_get = _PLANS.get


def plan_for(name: str, g: AxisGroup, x, build, args: tuple) -> CallPlan:
    """The plan of collective ``name`` on ``x`` over ``g``: the table's entry for (name, group,
    array type, shape, dtype) + ``args``, else ``build(g, x, *args)`` (which checks them all)."""
    try:
        key = (name, id(g), x.__class__, x.shape, x.dtype) + args
        p = _plan_get(key)
    except (AttributeError, TypeError):          # not an array / unhashable: the builder says what
        key = p = None
    if p is None:
        p = keep(key, build(g, x, *args))
    return p


def bad_out(p: CallPlan, x, out):
    _out(p.op, p.g, x, out, p.shape, p.dtype)      # raises, naming what out= must be


def untaggable(op: str, x, tag) -> None:
    if tag is not None:
        raise ValueError(f"rank {world().rank}: dist.{op}(tag={tag!r}) on a {type(x).__name__}: the tag applies to "
                         "arrays (a DTensor's collectives come from its redistribution plan); pass x.to_local() "
                         "or leave tag out")


def check_peer(op, g, x, peer, name):
    if not 0 <= peer < g.size or peer == g.index:
        raise ValueError(f"{where(op, g, x)}: {name}={peer} must be another position in the group "
                         f"(0..{g.size - 1}, this rank is {g.index})")


# renamed (issue 41: one name per thing; ``Plan`` is the redistribution plan's too)
__getattr__ = aliases(__name__, {"Plan": ("tessera_rt.dist.comm.plans.CallPlan", lambda: CallPlan)})
