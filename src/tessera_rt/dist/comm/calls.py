"""A collective call as the layers above see it: the record each watcher gets (``Call``),
a call's interned signature (``sig``) and a group's call count and verified keys
(``group_state``).

They sit here, below the checkers, because a collective's plan (``plans.CallPlan``) and the C
path keep them per call: a plan carries its group's state and its signature, so the
agreement check (``checks.consistency``) looks nothing up on a repeat call, and the
collectives build the ``Call`` a watcher (``checks.debug``'s recorder, the profiler,
``trace_collectives``) reads.
"""
from __future__ import annotations

import weakref

from ...dtypes import dtype_name

__all__ = ["Call", "ALONE", "GroupState", "GroupStates", "GROUPS", "Sig", "group_key", "group_seqs", "group_state", "sig"]

# cache: dtype -> its short name (dtype_name is slow on the hot path)
_DT_NAMES: dict = {}


class Call:
    """One collective as issued on this rank (what hooks, the recorder and profiler see)."""

    __slots__ = ("seq", "op", "group", "shape", "_dt", "site", "t0", "t1", "async_op", "role", "nbytes", "mesh",
                 "gshape", "extra", "waiting", "prof", "nvtx", "meta", "hdr", "ran", "tag")

    def __init__(self, op, g, x, nbytes, mesh, gshape, extra, role, async_op):
        self.op, self.group, self.nbytes, self.mesh, self.gshape, self.extra = op, g, nbytes, mesh, gshape, extra
        if x is not None:
            self.shape, self._dt = x.shape, x.dtype
        else:
            self.shape, self._dt = (), None
        self.role, self.async_op = role, async_op
        self.seq = -1
        self.site = ""
        self.t0 = self.t1 = 0.0
        self.waiting = False
        self.prof = self.nvtx = self.meta = self.hdr = self.ran = None
        self.tag = ""                  # the tree/ring hint, when the call carried one

    axis = property(lambda self: self.group.name)
    group_size = property(lambda self: self.group.size)
    ranks = property(lambda self: self.group.ranks)

    @property
    def dtype(self) -> str:
        dt = self._dt
        if dt is None:
            return ""
        name = _DT_NAMES.get(dt)
        if name is None:
            name = _DT_NAMES[dt] = dtype_name(dt)
        return name

    def describe(self) -> str:
        dt = f" {self.dtype}[{','.join(map(str, self.shape))}]" if self.dtype else ""
        return f"{self.op}({self.axis}){dt}" + (f" at {self.site}" if self.site else "")

    def __repr__(self) -> str:
        state = ("pending" if not self.t1 else f"done in {(self.t1 - self.t0) * 1e3:.3f} ms")
        return f"#{self.seq} {self.describe()} [{state}]"


# --------------------------------------------------------------------------- what ranks agree on

ALONE = ()      # a plan's ``site`` over a group of one: check_plan (and dist/comm/_hot.c) skip it


class GroupState:
    """Per-group: the calls this group has verified and how many calls it has issued."""
    __slots__ = ("seq", "seen", "comm", "g", "__weakref__")

    def __init__(self, g):
        self.seq, self.seen, self.comm, self.g = 0, set(), None, g


class GroupStates:
    """Every live group's ``GroupState`` (weakly: a state goes with its group), the per-group
    call state of this layer.  ``seqs()`` is what the watchdog reports; ``reset()`` sets every
    count back to 0, which a test harness calls between tests whose ranks issued different
    collectives on purpose (apart, the sampled check would verify on one rank alone: a hang)."""

    def __init__(self) -> None:
        self._states: weakref.WeakSet[GroupState] = weakref.WeakSet()

    def add(self, st: GroupState) -> None:
        self._states.add(st)

    def __iter__(self):
        return iter(list(self._states))

    def seqs(self) -> dict:
        """How many calls this rank has issued on each of its groups: {group_key: count} (read
        by the watchdog's thread while the main thread waits)."""
        for _ in range(3):
            try:
                return {group_key(st.g): st.seq for st in list(self._states)}
            except RuntimeError:                # the set changed while it was copied: again
                continue
        return {}

    def reset(self) -> None:
        """Every group's call count back to 0 (all ranks must call it at one point)."""
        for st in list(self._states):
            st.seq = 0


GROUPS = GroupStates()      # the one per process


def group_state(g) -> GroupState:
    """The group's check state (call count, verified keys), made on first use."""
    st = g.__dict__.get("_consistency")
    if st is None:
        st = GroupState(g)
        object.__setattr__(g, "_consistency", st)      # AxisGroup is frozen; this is bookkeeping
        GROUPS.add(st)
    return st


def group_key(g) -> tuple:
    """A group as the ranks name it to each other: (world ranks, mesh axis)."""
    return tuple(g.ranks), g.name


def group_seqs() -> dict:
    """``GROUPS.seqs()``: this rank's call count on each of its groups, {group_key: count}."""
    return GROUPS.seqs()


class Sig:
    """One collective signature (op, dtype, shape compared within the group, arguments),
    interned by ``sig``: equal signatures are one object, so the verified-call key
    (code, line, sig, meta) hashes by identity, cheaply, while still meaning the content (a
    plan rebuilt after eviction, or a call that reached the same signature another way,
    finds its key verified exactly when its peers do)."""
    __slots__ = ("op", "dtype", "shape", "extra")

    def __init__(self, op, dtype, shape, extra):
        self.op, self.dtype, self.shape, self.extra = op, dtype, shape, extra


# the interned signatures: content -> its one Sig object (see Sig)
_SIGS: dict = {}


def sig(op: str, dtype, shape, extra) -> Sig:
    """The interned signature of a collective (see ``Sig``)."""
    k = (op, dtype, tuple(shape), extra)
    s = _SIGS.get(k)
    if s is None:
        s = _SIGS[k] = Sig(*k)
    return s
