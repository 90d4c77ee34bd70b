"""The watchdog: one report per job when a collective does not complete (see ``dist.debug``).

A daemon thread per rank samples the main thread's stack.  When the main thread has been
inside one MPI/NCCL call (a collective, a signature check, a wait on one, a stream
synchronize) for longer than ``TESSERA_TIMEOUT`` it asks every rank, over a duplicated
world communicator that the watchdog threads serve, what it is doing, prints one report
and aborts the job.  The report:

* comes from one rank only: a rank that is asked by a lower rank while it collects its own
  report leaves the printing to that rank, and ranks asked by a reporting rank do not fire;
* says where the ranks' call histories first diverge (``consistency``'s ring of the last
  calls per rank: a skipped collective or another axis shows as two different lines at the
  same call number of a group), not only the later line where they hang;
* tells ranks that finished normally (they send a goodbye with their last calls at exit)
  from ranks that are dead or do not answer.

Long before the timeout, a collective that has waited ``PROBE_AFTER_S`` asks the other
ranks' watchdogs, on the same channel, what they wait in (``wait_state``: the group, the
call number on it, whether in the agreement check or the call, and the call as the check
describes it).  Ranks blocked in different calls of one group, none of which can move (each
waits for a rank that is blocked too, or finished), disagree: seen by two probes in a row,
the job ends at once with the agreement check's ``CollectiveMismatchError`` text, naming
the odd rank, the call sites and what differs (``disagreement``).  This is how a rank that
changes a call after its site was verified (the check then samples every 1024th call), or
makes another axis's group on a first call, is caught in seconds.  A rank that is busy
elsewhere, or waits in the same call, may still come: the others keep waiting.  Only the
waiting path does this work.

The same probes end the job, naming the rank, when a rank the wait needs can never come:
one that does not answer ``UNANSWERED_PROBES`` probes in a row (about 15 s: stopped by
SIGSTOP or a debugger, wedged in a C call that holds the GIL, its host gone), and one that
finished the program (its goodbye says how many calls it made on each group) before making
the call this rank waits in (at once; ``wait_members`` says which ranks the wait needs).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from ...dtypes import dtype_name
from ..comm.c_path import pending as _c_pending  # the collectives' C path: its call in progress
from ..comm.calls import group_key
from ..comm.hooks import PKG_DIR, SEAM, is_internal
from ..comm.mesh import AxisGroup
from ..comm.mpi import MPI
from ..comm.nccl import NCCL_COMMS
from . import consistency

__all__ = ["WATCHDOG_EXIT_CODE", "register_nccl", "status", "attach_recorder", "wait_state", "wait_members",
           "divergence", "disagreement", "UNANSWERED_PROBES", "note_of_main"]

WATCHDOG_EXIT_CODE = 14
# the early comparison: first after this long in one call, then this often; a peer's wait
# counts once it is this old (a rank passing through a call is not blocked in it)
PROBE_AFTER_S, PROBE_EVERY_S, PROBE_MIN_WAIT_S = 3.0, 2.0, 1.5
# a rank that answers none of this many probes in a row (the first after PROBE_AFTER_S, then
# every PROBE_EVERY_S, each waited for 1.5 s: about 15 s) is taken for stopped or wedged
UNANSWERED_PROBES = 6
_WAIT_FILES = {os.path.join(PKG_DIR, "dist", "comm", f) for f in ("communicators.py", "nccl.py", "mesh.py")}
_WAIT_FUNCS = {("debug.py", "_check"), ("backend.py", "synchronize"), ("backend.py", "wait_done"),
               ("cpu_streams.py", "synchronize"), ("cpu_streams.py", "wait_done"), ("cpu_streams.py", "_wait"),
               ("work.py", "issue"), ("work.py", "wait"), ("consistency.py", "_verify"),
               ("consistency.py", "p2p_check_header"), ("consistency.py", "p2p_send_header")}
_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv", "barrier")
# the files that define them: dist/comm/collectives.py the five, dist/comm/p2p.py send, recv, barrier
_COLLECTIVE_FILES = ("collectives.py", "p2p.py")
# a planned blocking CPU collective calls mpi4py from its own frame (dist/comm/plans.py), or from
# its runner (run_all_reduce, ...: dist.ccl's library path too)
_WAIT_FUNCS |= {(file, f) for file in _COLLECTIVE_FILES for op in _COLLECTIVES for f in (op, f"run_{op}")}
# ... or from a compiled redistribution plan's step, or dist.ccl's library reduce-scatter
_WAIT_FUNCS |= {("compiled_plan.py", "raw_call"), ("line.py", "line_reduce_scatter")}


def register_nccl(comm) -> None:
    """Remember an NCCL communicator so the watchdog can ncclCommAbort it."""
    NCCL_COMMS.add(comm)


_RECORDER: list = []      # [(debug's config, its format_call)]: the flight recorder, attached by debug


def attach_recorder(cfg, format_call) -> None:
    """``dist.debug`` hands over its config (timeout, flight recorder ring, pending call) and
    how it formats a call: the watchdog reads them, never imports debug (which starts it)."""
    _RECORDER[:] = [(cfg, format_call)]


def recorder_config():
    """debug's config (timeout, flight recorder ring, pending call), as ``attach_recorder`` got it."""
    return _RECORDER[0][0]


_THREADING = threading.__file__
_ENTRY = os.path.join(os.path.dirname(PKG_DIR), "tessera_run.py")     # tessera-run's entry (beside the package)


def main_frame():
    frame = sys._current_frames().get(threading.main_thread().ident)
    # a wait on a CPU worker stream blocks in threading's Condition.wait: report its caller
    while frame is not None and frame.f_code.co_filename == _THREADING:
        frame = frame.f_back
    return frame


def hot_pending():
    """(call number, plan, x) of the collective the main thread is in through the C path
    (dist/comm/_hot.c: from its check to the end of its MPI call), which leaves no Python frame
    of its own, or None."""
    got = _c_pending()
    if got is None or got[3] != threading.main_thread().ident:
        return None
    return got[:3]


def in_collective(frame) -> bool:
    """True if the main thread's innermost Python frame is one that waits inside MPI/NCCL,
    or the main thread is in a collective's C path."""
    if frame is None:
        return False
    fn = frame.f_code.co_filename
    return fn in _WAIT_FILES or (os.path.basename(fn), frame.f_code.co_name) in _WAIT_FUNCS or \
        hot_pending() is not None


def _frame_summary(frame, limit: int = 4) -> str:
    if frame is None:
        return "(no main thread frame)"
    stack = traceback.extract_stack(frame)
    user = [s for s in stack if not s.filename.startswith((PKG_DIR, "<frozen", _ENTRY))] or stack
    lines = [f"{os.path.basename(s.filename)}:{s.lineno} in {s.name}: {(s.line or '').strip()}" for s in user[-limit:]]
    return " <- ".join(reversed(lines))


def _site_of(frame) -> str:
    f = frame
    while f is not None and is_internal(f.f_code):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _pending_from_stack(frame) -> str:
    """Describe the collective the main thread waits in, from the frames' locals (no recorder)
    or the C path's plan."""
    checking = frame is not None and frame.f_code.co_name == "_verify"
    hot = hot_pending()
    if hot is not None:
        _, p, x = hot
        axis = ",".join(p.g.name) if isinstance(p.g.name, (tuple, list)) else p.g.name
        what = f"{p.op}({axis}) {dtype_name(x.dtype)}[{','.join(map(str, x.shape))}] at {_site_of(frame)}"
        return ("the signature check of " + what) if checking else what
    f, making = frame, None
    while f is not None:
        name = f.f_code.co_name
        if os.path.basename(f.f_code.co_filename) in _COLLECTIVE_FILES and name in _COLLECTIVES:
            loc = f.f_locals
            g, x = loc.get("g"), loc.get("x")
            axis = g.name if g is not None else loc.get("axis") or "world"
            if isinstance(axis, (tuple, list)):
                axis = ",".join(axis)
            shape = f" {dtype_name(x.dtype)}[{','.join(map(str, x.shape))}]" if hasattr(x, "shape") else ""
            what = f"{name}({axis}){shape} at {_site_of(f)}"
            if g is None:
                what += " (making the axis group's communicator)"
            return ("the signature check of " + what) if checking else what
        if name == "_check" and os.path.basename(f.f_code.co_filename) == "debug.py":
            c = f.f_locals.get("call")
            return f"fingerprint check before {c.describe() if c else '?'}"
        if name == "group" and os.path.basename(f.f_code.co_filename) == "mesh.py" and "ranks" in f.f_locals:
            making = making or (f"making the communicator of group {list(f.f_locals['ranks'])} (axis "
                                f"{f.f_locals.get('axis')!r}) at {_site_of(f)}")    # (for a DTensor plan's step)
        f = f.f_back
    return making or f"an MPI/NCCL call at {_site_of(frame)}"


def note_of_main() -> str:
    """What the main thread says it waits for: a layer above dist (the pipeline: its stage and
    micro-batch) wraps its wait in ``hooks.note(...)``; the innermost note counts."""
    main = threading.main_thread().ident
    for ident, text in reversed(list(SEAM.notes)):
        if ident == main:
            return text
    return ""


def status(blocked_for: float | None = None) -> dict:
    """What this rank is doing now: pending collective (or main-thread stack), its recent calls
    and its flight recorder."""
    from ..comm.process_group import world
    cfg, format_call = _RECORDER[0]
    frame = main_frame()
    now = time.monotonic()
    busy = in_collective(frame)
    if cfg.pending is not None and busy:
        pend, what = format_call(cfg.pending, now), cfg.pending.describe()
    elif busy:
        what = _pending_from_stack(frame)
        pend = "PENDING " + what + (f" for {blocked_for:.1f} s" if blocked_for else "")
    else:
        pend = what = None
    note = note_of_main() if busy else ""
    if note:
        what, pend = f"{what} ({note})", f"{pend} ({note})"
    return {"rank": world().rank, "host": world().host, "pending": pend, "what": what,
            "stack": _frame_summary(frame), "calls": consistency.recent_calls(),
            "flight": [format_call(c, now) for c in cfg.ring]}


def divergence(histories: dict) -> list[str]:
    """Where the ranks' call histories first differ, per group: {rank: [(ranks, axis, n, desc)]}."""
    groups: dict = {}
    for r, calls in histories.items():
        for ranks, axis, n, desc in calls:
            groups.setdefault((ranks, axis), {}).setdefault(r, {})[n] = desc
    out = []
    for (ranks, axis), per in groups.items():
        members = [r for r in ranks if r in per]
        if len(members) < 2:
            continue
        common = set.intersection(*(set(per[r]) for r in members))
        for n in sorted(common):
            descs = {r: per[r][n] for r in members}
            if len(set(descs.values())) > 1:
                by: dict = {}
                for r, d in descs.items():
                    by.setdefault(d, []).append(r)
                parts = [f"{consistency.ranks_str(rs)} {d}" for d, rs in sorted(by.items(), key=lambda kv: len(kv[1]))]
                out.append(f"call #{n} on group {list(ranks)} (axis {axis!r}): " + "; ".join(parts))
                break
    return out


def _ring_state(st, phase: str):
    """(group key, call #, phase, description) of the call the group state ``st`` is in: the
    check appended it to the ring just before the call (None if the ring no longer has it)."""
    if st is None:
        return None
    for s, seq, key in reversed(list(consistency.STATE.ring)):
        if s is st:
            return (group_key(st.g), seq, phase, consistency._desc(st, seq, key)) if seq == st.seq else None
    return None


def wait_state(frame):
    """What the main thread waits in, in the terms the ranks compare: (group key, call number
    on the group, "check" | "call" | "new group", the call as ``consistency`` describes it),
    or None where that is not known (send/recv, an async wait, a DTensor plan's step, the
    agreement check off): those never count as a disagreement."""
    making = None
    f = frame
    while f is not None and is_internal(f.f_code):
        base, name, loc = os.path.basename(f.f_code.co_filename), f.f_code.co_name, f.f_locals
        if base == "consistency.py" and name == "_verify":
            st, seq = loc["st"], loc["seq"]
            return group_key(st.g), seq, "check", consistency._desc(st, seq, loc["key"])
        if base == "mesh.py" and name == "group" and "ranks" in loc:
            making = (tuple(loc["ranks"]), ",".join(loc["self"]._axes_of(loc["axis"])))
        elif base in _COLLECTIVE_FILES and name.removeprefix("run_") in _COLLECTIVES:
            if name in ("send", "recv"):
                return None
            if making is not None:          # the group's first call: its communicator is being made
                x = loc.get("x")
                shape = tuple(x.shape) if hasattr(x, "shape") else ()
                dt = dtype_name(x.dtype) if hasattr(x, "dtype") else ""
                return making, 1, "new group", (1, name, making[1], dt, shape, _site_of(f), None, None)
            g = loc.get("g") or getattr(loc.get("p"), "g", None)
            return _ring_state(None if g is None else g.__dict__.get("_consistency"), "call")
        f = f.f_back
    hot = hot_pending()
    return None if hot is None else _ring_state(hot[1].st, "call")


_WORLD_RANKS: dict = {}            # id(an MPI communicator) -> its members' world ranks


def _comm_ranks(mpi_comm) -> tuple:
    got = _WORLD_RANKS.get(id(mpi_comm))
    if got is None:
        group = mpi_comm.Get_group()
        got = _WORLD_RANKS[id(mpi_comm)] = tuple(group.Translate_ranks(list(range(group.Get_size())),
                                                                       MPI.COMM_WORLD.Get_group()))
    return got


def wait_members(frame) -> tuple | None:
    """The world ranks of the group the main thread waits in (the group being made, or the
    collective's or its plan step's group), or None where that is not known."""
    f = frame
    while f is not None and is_internal(f.f_code):
        loc = f.f_locals
        if os.path.basename(f.f_code.co_filename) == "mesh.py" and f.f_code.co_name == "group" and "ranks" in loc:
            return tuple(loc["ranks"])
        for g in (loc.get("g"), getattr(loc.get("p"), "g", None), getattr(loc.get("st"), "g", None)):
            if isinstance(g, AxisGroup):
                return tuple(g.ranks)
        comm = getattr(loc.get("comm"), "mpi", None)           # a compiled plan's step: its communicator
        if comm is not None:
            try:
                return _comm_ranks(comm)
            except Exception:                                   # (not an MPI communicator after all)
                return None
        f = f.f_back
    hot = hot_pending()
    return None if hot is None else tuple(hot[1].g.ranks)


def _past(answer, ws, gkey, n: int) -> bool:
    """Whether a rank waiting in ``ws`` has already issued call #n of the group ``gkey``."""
    return ws[1] > n if ws[0] == gkey else answer["seqs"].get(gkey, 0) >= n


def disagreement(states: dict, finished=()):
    """From every rank's answer ({rank: {"wait": wait_state or None, "waited": s, "seqs":
    group_seqs()}} or None) and the ranks that finished: (group key, the waiting members'
    {rank: wait}, the blocked ranks) when ranks of a group are blocked in different calls
    that none of them can leave, else None.

    A rank waiting in call #n of group G needs each other member of G to reach that call: a
    member in the same call (same description and phase) or past it (more than n calls on G)
    is no obstacle, nor is one that is running or unknown (it may come).  A member blocked in
    another call, or finished, is; the ranks whose obstacles are all blocked themselves can
    never move."""
    waits = {r: a["wait"] for r, a in states.items()
             if a is not None and a["wait"] is not None and a["waited"] >= PROBE_MIN_WAIT_S}
    finished = set(finished) - set(waits)
    needs = {}
    for r, w in waits.items():
        gkey, n = w[0], w[1]
        needs[r] = set()
        for s in gkey[0]:
            ws = waits.get(s)
            if s == r or s not in finished and (ws is None or ws == w or _past(states[s], ws, gkey, n)):
                continue
            needs[r].add(s)
    blocked = finished | {r for r in waits if needs[r]}
    while True:
        free = {r for r in blocked - finished if not needs[r] & blocked}
        if not free:
            break
        blocked -= free
    for r in sorted(blocked - finished):
        gkey = waits[r][0]
        members = {s: waits[s] for s in gkey[0] if s in waits and s in blocked}
        if len(set(members.values())) > 1:
            return gkey, members, blocked - finished
    return None
