"""Cross-rank agreement checks that are on by default (``TESSERA_CHECK=0`` turns them off).

Every rank of a group must pass the same collective: op, reduction, dtype, shape, mesh axis,
group and, for a DTensor, its global shape and layout.  MPI and NCCL do not check this: an
int32 buffer reduced with float32 ones, a ``max`` paired with a ``sum`` or a (4, 8) array
gathered with (8, 4) ones all "work" and give wrong numbers.  ``TESSERA_DEBUG=collectives``
compares a fingerprint before every call (one extra collective, ~+20 us); this module is
the default, and costs well under 1 us per call in steady state:

* Each call's **signature** (op, reduction/dim/root, dtype, shape compared within the group,
  DTensor global shape and layouts, and the user's call site) is a key looked up in a
  per-group set; the call site is part of the key but not of what must agree (ranks may
  reach one collective from different lines), and is named in the error.  The signature
  part is interned (``sig``: one object per content, hashed by identity) and a collective
  with a cached plan remembers its last verified site (``check_plan``), so a repeated call
  builds no key at all.  A signature this group has not verified yet, and every 1024th
  call on the group (``TESSERA_CHECK_EVERY``), is **verified before the data moves**: the members exchange a
  64-bit hash of it over a duplicate of the group's communicator and all raise the same
  ``CollectiveMismatchError`` on a difference, naming the odd rank(s), both call sites and
  what differs.  Nothing has been sent, so no wrong result exists and the ranks stay in step.
* The trigger is **symmetric** in a correct program: the members of a group issue the same
  calls in the same order, so a signature is new on all of them at once, and the sampling
  counter is the group's own call count.  Only a rank that deviates after a call site has
  been verified checks alone; it then waits in the check while its peers wait in the
  collective, and the watchdog reports both sides (rank, op, shape, line).
* A **ring of the last calls** per rank (group, call number on that group, site, signature)
  is kept for the watchdog, which finds where the ranks' histories first diverge (a skipped
  collective, a different axis) instead of pointing at the later line where they hang.

Why not piggyback the hash on the data or run a tiny extra collective each call: on the
CPU path a 16-byte MPI_Allreduce costs 2-10 us, so any extra message per call, or a copy
into a larger buffer, is several times the 1 us budget; a set lookup is ~0.2 us.
"""
from __future__ import annotations

import os
import zlib
from collections import deque

import numpy as np

from ...dtypes import dtype_name
from ..comm.calls import ALONE, GroupState, Sig, group_state, sig
from ..comm.hooks import (
    SEAM,
    Agreement,
    caller as _getframe,
    is_internal as _is_internal,
    known_internal,
    user_frame as _user_frame,
)

__all__ = ["CollectiveMismatchError", "CheckState", "STATE", "ranks_str", "configure", "check", "check_sig", "check_plan", "check_run", "sig", "Sig", "group_state",
           "user_frame", "site_of", "site_at", "recent_calls", "describe", "mismatch_message", "p2p_send_header",
           "p2p_check_header", "enabled"]

class CollectiveMismatchError(RuntimeError):
    """Ranks of a group issued different collectives (op, dtype, shape, layout) at the same point."""


# --------------------------------------------------------------------------- call sites

def user_frame(depth: int, lasti: bool = False):
    """(code, line, DTensor meta) of the first caller outside tessera_rt (``hooks.user_frame``);
    meta is (dtype, global shape, source layout, target layout) while a redistribution plan
    runs its steps (``SEAM.moving``).  ``lasti``: the instruction offset in place of the line."""
    code, at = _user_frame(depth + 1, lasti)
    return code, at, SEAM.moving


# cache: (code, line or -1-offset) -> its "file.py:line" text
_SITES: dict = {}


def site_of(code, line) -> str:
    if code is None:
        return "?"
    key = (code, line)
    s = _SITES.get(key)
    if s is None:
        s = _SITES[key] = f"{os.path.basename(code.co_filename)}:{line}"
    return s


def site_at(code, lasti: int) -> str:
    """``file.py:line`` of the instruction at byte offset ``lasti`` of ``code``."""
    if code is None:
        return "?"
    key = (code, -1 - lasti)              # (negative: apart from site_of's (code, line) keys)
    s = _SITES.get(key)
    if s is None:
        line = next((ln for a, b, ln in code.co_lines() if a <= lasti < b and ln is not None), 0)
        s = _SITES[key] = site_of(code, line)
    return s


# --------------------------------------------------------------------------- describing calls

_ARG_NAMES = {"all_reduce": ("op",), "reduce_scatter": ("op", "dim"), "all_gather": ("dim",),
              "all_to_all": ("split_dim", "concat_dim"), "broadcast": ("root",), "send": ("dst",),
              "recv": ("src",)}


def _args(op: str, extra) -> str:
    if extra is None or extra == "<new group>":
        return ""
    names = _ARG_NAMES.get(op, ("args",))
    vals = extra if isinstance(extra, tuple) and len(names) > 1 else (extra,)
    return ", ".join(f"{n}={v!r}" for n, v in zip(names, vals))


def describe(op, axis, dtype, shape, site, extra=None, meta=None, with_args=False, with_meta=False) -> str:
    """``all_reduce(dp) float32[64,32] at train.py:41`` (+ ``with op='max'``, ``on DTensor ...``)."""
    dt = f" {dtype}[{','.join(map(str, shape))}]" if dtype else ""
    s = f"{op}({axis}){dt}"
    if with_meta and meta:
        plan, ops = meta
        if plan:
            s += f" moving DTensor {plan[0]}{list(plan[1])} {plan[2]}" + (f" -> {plan[3]}" if plan[3] != plan[2] else "")
        if ops:
            s += f" after DTensor ops on {', '.join(ops)}"
    s += f" at {site}"
    if with_args and _args(op, extra):
        s += f" with {_args(op, extra)}"
    return s


def ranks_str(rs) -> str:
    """``rank 3`` or ``ranks [0,2]``: how messages name ranks."""
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks [" + ",".join(map(str, rs)) + "]"


# A description exchanged on a mismatch: (seq, op, axis, dtype, shape, site, extra, meta)
_FIELDS = ((0, "call count"), (1, "op"), (2, "mesh axis"), (3, "dtype"), (4, "shape"), (6, "arguments"),
           (7, "DTensor global shape/layout"), (5, "call site"))


def mismatch_message(me: int, where: str, descs: list, ranks: list, fix: str) -> str:
    """One message for every rank: the odd rank(s) first, then the rest, and what differs."""
    clusters: dict = {}
    for r, d in zip(ranks, descs):
        clusters.setdefault(tuple(d[1:]), []).append(r)
    ordered = sorted(clusters.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    ref = descs[0]
    fields = [name if i != 6 else f"arguments ({'/'.join(_ARG_NAMES.get(ref[1], ('args',)))})"
              for i, name in _FIELDS if any(d[i] != ref[i] for d in descs)]
    show_args = any(f.startswith("arguments") for f in fields)
    show_meta = "DTensor global shape/layout" in fields

    def one(key, rs):
        op, axis, dtype, shape, site, extra, meta = key
        return f"{ranks_str(rs)} {describe(op, axis, dtype, shape, site, extra, meta, show_args, show_meta)}"

    if len(ordered) > 1 and len(ordered[0][1]) > len(ordered[1][1]):
        odd = [r for _, rs in ordered[1:] for r in rs]
        lead = f"{ranks_str(sorted(odd))} differ{'s' if len(odd) == 1 else ''} from the others: "
    else:
        lead = ""
    parts = [one(k, rs) for k, rs in reversed(ordered)] if lead else [one(k, rs) for k, rs in ordered]
    return (f"rank {me}: collective mismatch {where}: {lead}" + "; ".join(parts)
            + f" -- they disagree on {', '.join(fields) or 'nothing visible (hash collision?)'}. {fix}")


# --------------------------------------------------------------------------- the default check

class CheckState:
    """The default check's state, one per process (``STATE``): whether it is on, how often it
    verifies (``mask``), the DTensor metadata noted since the last collective (``metas``) and
    this rank's last calls (``ring``).  dist/comm/_hot.c reads ``mask`` and ``metas`` through
    ``SEAM.agreement``; ``configure`` sets ``on`` and ``mask``; ``reset()`` drops what the ops
    noted (a test harness calls it between tests)."""

    def __init__(self) -> None:
        self.on = True
        # DTensor (global shape, layout) seen by ops since the last collective, per mesh (by id),
        # at most 16 each: a cap shared by all meshes would let a stage's own ops (a pipeline
        # stage's sub-mesh, different on each rank) crowd out what the ranks must agree on
        self.metas: dict = {}
        self.mask = 1023                     # verify when (call count on the group) & mask == 0
        self.ring = deque(maxlen=64)         # the last calls of this rank, for the watchdog

    def reset(self) -> None:
        """Forget the DTensor metadata noted since the last collective."""
        self.metas = {}


STATE = CheckState()
_RING = STATE.ring.append


def enabled() -> bool:
    return STATE.on


def configure(on: bool) -> None:
    """Turn the default check on or off (``debug.configure`` calls this; the full debug mode
    replaces it).  ``TESSERA_CHECK=0`` turns it off; ``TESSERA_CHECK_EVERY=N`` (a power of two)
    sets the sampling period."""
    env = os.environ.get("TESSERA_CHECK", "1").strip().lower()
    STATE.on = on and env not in ("0", "off", "false", "no")
    every = int(os.environ.get("TESSERA_CHECK_EVERY", "1024"))
    if every < 1 or every & (every - 1):
        raise ValueError(f"TESSERA_CHECK_EVERY={every} must be a power of two (1 verifies every call)")
    STATE.mask = every - 1
    on = STATE.on
    SEAM.check = check if on else None
    SEAM.check_plan = check_plan if on else None
    SEAM.check_run = check_run if on else None
    SEAM.agreement = _AGREEMENT if on else None
    # Every DTensor op notes the global shapes/layouts it ran on since the last collective
    # (dispatch.Decision.run, into STATE.metas), so the next collective's signature carries
    # them.  A DTensor whose global shape differs across ranks may issue identical
    # collectives (X.sum() all-reduces a scalar); its ops' metadata is where that shows.
    SEAM.metas = STATE if on else None


def check(op: str, g, dtype, shape, extra, plan_meta=None) -> None:
    """Called by a collective before it moves data, from the frame of the function the user
    called (its caller is the call site); collectives with a cached plan call ``check_sig``.
    ``plan_meta``: a compiled redistribution plan's ``check_meta``, passed by ``RedistributionPlan.run``
    (which calls this for each of its collectives, so no ``RedistributionPlan.run`` frame lies between
    here and the user to read it from)."""
    check_sig(g.__dict__.get("_consistency") or group_state(g), sig(op, dtype, shape, extra), 3, plan_meta)


def check_sig(st: GroupState, s: Sig, depth: int = 2, plan_meta=None, _internal=known_internal, _c=STATE):
    """The check for a planned call (the hot path: keep it lean).  ``depth``: frames from here
    up to the collective's caller (2: called by the collective itself).  A call site is its
    code object and instruction offset (``f_lasti``: cheaper than ``f_lineno``, which
    CPython computes from the line table; the line is looked up when a site is described)."""
    if st.g.size == 1:
        # nothing to agree on, and the DTensor metas gathered since the last collective stay
        # for the next one over a real group: ranks may issue different numbers of
        # collectives over groups of their own, which must not change what they compare
        return None
    st.seq = seq = st.seq + 1
    f = _getframe(depth)                  # the collective's caller: the user, for a plain array
    code = f.f_code
    if _internal(code) is False and not _c.metas:
        key = (code, f.f_lasti, s, None if plan_meta is None else (plan_meta, None))
        _RING((st, seq, key))
        if seq & _c.mask and key in st.seen:
            return key
        _verify(st, seq, key)
        return key                        # a plan may remember it (check_plan)
    else:                                 # called from tessera_rt (a DTensor op): walk out
        code, at, meta = user_frame(depth, lasti=True)
        if meta is None:
            meta = plan_meta
        if _c.metas:
            ms, _c.metas = _spanning(_c.metas, st.g), {}
            meta = (meta, ms) if ms else (None if meta is None else (meta, None))
        elif meta is not None:
            meta = (meta, None)
        key = (code, at, s, meta)
    _RING((st, seq, key))
    if seq & _c.mask and key in st.seen:
        return None
    _verify(st, seq, key)
    return None


def check_plan(p, depth: int = 2, _c=STATE) -> None:
    """``check_sig`` for a call with a plan ``p`` (``p.st``, ``p.sig`` and ``p.site``, the last
    verified key of a plain call site): a repeat from that site skips the key and the lookup,
    since a verified key stays verified; the group's count and sampling still run."""
    site = p.site
    if site is ALONE:
        return                            # a group of one: nothing to agree on (check_sig's rule)
    if site is not None and not _c.metas:
        f = _getframe(depth)
        if f.f_code is site[0] and f.f_lasti == site[1]:
            st = p.st
            st.seq = seq = st.seq + 1
            _RING((st, seq, site))
            if seq & _c.mask:
                return
            _verify(st, seq, site)
            return
    key = check_sig(p.st, p.sig, depth + 1)
    if key is not None:
        p.site = key




def check_run(plan, checks, _c=STATE) -> None:
    """The checks of a compiled redistribution plan's collectives, made by ``RedistributionPlan.run``
    before the first one moves data (``checks``: (op, group, dtype, shape, extra) each).

    A run from the call site that last verified them all takes ``plan._verified`` (the depth
    of the user's frame, its code and offset, and each group's state and verified key), so
    it skips the walk out to the user's frame, the signature interning and the key lookups:
    a verified key stays verified (``check_plan``'s rule).  DTensor ops since the last
    collective (``_c.metas``) are part of the keys, so their presence takes the full path."""
    v = plan._verified
    if v is not None and not _c.metas:
        try:
            f = _getframe(v[0])
        except ValueError:                   # a shallower stack than the remembered site's
            f = None
        if f is not None and f.f_code is v[1] and f.f_lasti == v[2]:
            mask = _c.mask
            for st, key in v[3]:
                st.seq = seq = st.seq + 1
                _RING((st, seq, key))
                if not seq & mask:
                    _verify(st, seq, key)
            return
    fresh = not _c.metas
    meta = plan.check_meta
    for op, g, dtype, shape, extra in checks:
        check_sig(g.__dict__.get("_consistency") or group_state(g), sig(op, dtype, shape, extra), 3, meta)
    plan._verified = _remember(plan, checks) if fresh else None


def _remember(plan, checks):
    """``check_run``'s fast-path record for the run that just verified (None when the user's
    frame cannot be found): the keys ``check_sig`` made, rebuilt from the same parts."""
    depth, f = 2, _getframe(2)             # 2: RedistributionPlan.run's caller, seen from check_run
    while f is not None and _is_internal(f.f_code):
        depth, f = depth + 1, f.f_back
    if f is None:
        return None
    meta = None if plan.check_meta is None else (plan.check_meta, None)
    keys = tuple((st, (f.f_code, f.f_lasti, sig(op, dtype, shape, extra), meta))
                 for op, g, dtype, shape, extra in checks
                 if (st := g.__dict__.get("_consistency") or group_state(g)).g.size > 1)
    return depth - 1, f.f_code, f.f_lasti, keys      # (depth from check_run's own frame)


def _spanning(metas, g) -> frozenset:
    """The DTensor metas on meshes that hold every rank of ``g``: ops on a mesh without some
    of the group's ranks (a pipeline stage's sub-mesh, seen from the pp group) say nothing
    about what those ranks must agree on."""
    ranks, out = g.ranks, []
    for on in metas.values():               # keyed by mesh: one answer per mesh (~30 us less a
        mesh = next(iter(on)).mesh          # gradient bucket's issue inside the backward)
        if mesh is None or _covers(mesh, ranks):
            out.extend(on)
    return frozenset(out)


_COVERS: dict = {}                           # (mesh, group ranks) -> the mesh holds every rank


def _covers(mesh, ranks) -> bool:
    key = (mesh, ranks)
    v = _COVERS.get(key)
    if v is None:
        if len(_COVERS) >= 4096:            # a bound: the keys hold their meshes
            _COVERS.clear()
        v = _COVERS[key] = all(r in mesh.devices for r in ranks)
    return v


def _desc(st, seq, key) -> tuple:
    code, at, s, meta = key
    op, dtype, shape, extra = s.op, s.dtype, s.shape, s.extra
    if meta is not None:
        meta = (meta[0], tuple(sorted(map(repr, meta[1]))) if meta[1] else None)
    return (seq, op, st.g.name, dtype_name(dtype) if dtype is not None else "", tuple(shape),
            site_at(code, at), extra, meta)


def _verify(st: GroupState, seq: int, key) -> None:
    """Exchange the signature's hash within the group; raise on every member if they differ."""
    g = st.g
    if g.size == 1:
        st.seen.add(key)
        return
    if st.comm is None:
        st.comm = g.comm.mpi.Dup()       # collective: the group's first call is new on every member
    d = _desc(st, seq, key)
    # the call site is not compared (ranks may reach one collective from different lines);
    # it is reported, and the watchdog uses it to find where histories diverged
    what = d[1:5] + d[6:]
    h = zlib.crc32(repr(what).encode()) | (zlib.crc32(repr(what[::-1]).encode()) << 32)
    mine = np.array([seq, h], dtype=np.int64) if h < 2 ** 63 else np.array([seq, h - 2 ** 64], dtype=np.int64)
    every = np.empty((g.size, 2), dtype=np.int64)
    st.comm.Allgather(mine, every)
    if (every == mine).all():
        st.seen.add(key)
        return
    descs = st.comm.allgather(d)
    from ..comm.process_group import world
    where = f"in group {list(g.ranks)} (mesh axis {g.name!r}, call #{seq} on it)"
    raise CollectiveMismatchError(mismatch_message(
        world().rank, where, descs, list(g.ranks),
        "Every rank of a group must pass the same op, dtype, shape and layout at the same point "
        "(look for rank-dependent branches, dtypes or shapes at those lines)."))


# what the C path (dist/comm/_hot.c) runs of this check, through SEAM.agreement
_AGREEMENT = Agreement(_RING, _verify, STATE, check_plan)


def recent_calls() -> list[tuple]:
    """This rank's last calls, oldest first: (group ranks, axis, call # on the group, description)."""
    out = []
    for st, seq, key in list(STATE.ring):
        d = _desc(st, seq, key)
        out.append((tuple(st.g.ranks), st.g.name, seq,
                    describe(d[1], d[2], d[3], d[4], d[5], d[6], d[7], with_args=d[1] in ("all_reduce",
                                                                                           "reduce_scatter"))))
    return out


# --------------------------------------------------------------------------- send/recv headers
# Debug mode: each send is preceded by a header (dtype, shape, line, rank) on a duplicate of
# the world communicator (made by dist.init), with the user's tag, so MPI matches header
# and data in the same order; the receiver checks it before its data can be used.

# [the duplicate of COMM_WORLD the headers travel on], made on the first checked send/recv
_P2P: list = [None]


def open_p2p_headers(world) -> None:
    """Make the headers' communicator (a duplicate of the world's; collective, once)."""
    if _P2P[0] is None:
        _P2P[0] = world.mpi.Dup()


def p2p_send_header(g, shape, dt, extra, site: str) -> None:
    from ..comm.process_group import world
    comm = _P2P[0]
    if comm is None:
        return
    dst, tag = extra
    comm.send((dtype_name(dt), tuple(shape), site, world().rank), dest=g.ranks[dst], tag=tag)


def p2p_post_header(g, extra):
    """The receive of the sender's header (a request; its wait() returns the header)."""
    comm = _P2P[0]
    if comm is None:
        return None
    src, tag = extra
    return comm.irecv(source=g.ranks[src], tag=tag)


def p2p_check_header(req, g, shape, dt, extra, site: str) -> None:
    """The sender's header must match the receive buffer, else raise naming both sides."""
    from ..comm.process_group import world
    if req is None:
        return
    sdt, sshape, ssite, srank = req.wait()
    mine = (dtype_name(dt), tuple(shape))
    if (sdt, sshape) != mine:
        raise CollectiveMismatchError(
            f"rank {world().rank}: recv from rank {srank} (mesh axis {g.name!r}, tag {extra[1]}) at {site} into "
            f"{mine[0]}[{','.join(map(str, mine[1]))}], but rank {srank} sent {sdt}[{','.join(map(str, sshape))}] "
            f"at {ssite}: the bytes would be reinterpreted. Receive into a {sdt} array of shape {list(sshape)} "
            "(or send what the receiver expects).")
