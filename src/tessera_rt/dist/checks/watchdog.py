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
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback

from ..comm.mpi import MPI

from ...dtypes import dtype_name
from . import consistency
from ..comm.communicators import NCCL_COMMS
try:
    from ..comm import _hot                  # the collectives' C path: its call in progress (pending)
except ImportError:
    _hot = None
from ..comm.hooks import PKG_DIR, SEAM, is_internal

__all__ = ["WATCHDOG_EXIT_CODE", "register_nccl", "status"]

WATCHDOG_EXIT_CODE = 14
_REQ, _REP, _BYE, _PROBE, _PROBE_REP = 7701, 7702, 7703, 7705, 7706
# the early comparison: first after this long in one call, then this often; a peer's wait
# counts once it is this old (a rank passing through a call is not blocked in it)
PROBE_AFTER_S, PROBE_EVERY_S, PROBE_MIN_WAIT_S = 3.0, 2.0, 1.5
_WAIT_FILES = {os.path.join(PKG_DIR, "dist", "comm", "communicators.py"), os.path.join(PKG_DIR, "dist", "comm", "mesh.py")}
_WAIT_FUNCS = {("debug.py", "_check"), ("backend.py", "synchronize"), ("backend.py", "wait_done"),
               ("cpu_streams.py", "synchronize"), ("cpu_streams.py", "wait_done"), ("cpu_streams.py", "_wait"),
               ("collectives.py", "_issue"), ("collectives.py", "wait"), ("consistency.py", "_verify"),
               ("consistency.py", "p2p_check_header"), ("consistency.py", "p2p_send_header")}
_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv", "barrier")
# a planned blocking CPU collective calls mpi4py from its own frame (dist/comm/plans.py), or from
# its runner (run_all_reduce, ...: dist.ccl's library path too)
_WAIT_FUNCS |= {("collectives.py", f) for op in _COLLECTIVES for f in (op, f"run_{op}")}
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


def _cfg():
    return _RECORDER[0][0]


_THREADING = threading.__file__


def _main_frame():
    frame = sys._current_frames().get(threading.main_thread().ident)
    # a wait on a CPU worker stream blocks in threading's Condition.wait: report its caller
    while frame is not None and frame.f_code.co_filename == _THREADING:
        frame = frame.f_back
    return frame


def _hot_pending():
    """(call number, plan, x) of the collective the main thread is in through the C path
    (dist/comm/_hot.c: from its check to the end of its MPI call), which leaves no Python frame
    of its own, or None."""
    got = _hot.pending() if _hot is not None else None
    if got is None or got[3] != threading.main_thread().ident:
        return None
    return got[:3]


def _in_collective(frame) -> bool:
    """True if the main thread's innermost Python frame is one that waits inside MPI/NCCL,
    or the main thread is in a collective's C path."""
    if frame is None:
        return False
    fn = frame.f_code.co_filename
    return fn in _WAIT_FILES or (os.path.basename(fn), frame.f_code.co_name) in _WAIT_FUNCS or \
        _hot_pending() is not None


def _frame_summary(frame, limit: int = 4) -> str:
    if frame is None:
        return "(no main thread frame)"
    stack = traceback.extract_stack(frame)
    user = [s for s in stack if not s.filename.startswith((PKG_DIR, "<frozen"))] or stack
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
    hot = _hot_pending()
    if hot is not None:
        _, p, x = hot
        axis = ",".join(p.g.name) if isinstance(p.g.name, (tuple, list)) else p.g.name
        what = f"{p.op}({axis}) {dtype_name(x.dtype)}[{','.join(map(str, x.shape))}] at {_site_of(frame)}"
        return ("the signature check of " + what) if checking else what
    f = frame
    while f is not None:
        name = f.f_code.co_name
        if os.path.basename(f.f_code.co_filename) == "collectives.py" and name in _COLLECTIVES:
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
        f = f.f_back
    return f"an MPI/NCCL call at {_site_of(frame)}"


def _note_of_main() -> str:
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
    frame = _main_frame()
    now = time.monotonic()
    busy = _in_collective(frame)
    if cfg.pending is not None and busy:
        pend, what = format_call(cfg.pending, now), cfg.pending.describe()
    elif busy:
        what = _pending_from_stack(frame)
        pend = "PENDING " + what + (f" for {blocked_for:.1f} s" if blocked_for else "")
    else:
        pend = what = None
    note = _note_of_main() if busy else ""
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
                parts = [f"{consistency._ranks_str(rs)} {d}" for d, rs in sorted(by.items(), key=lambda kv: len(kv[1]))]
                out.append(f"call #{n} on group {list(ranks)} (axis {axis!r}): " + "; ".join(parts))
                break
    return out


def _ring_state(st, phase: str):
    """(group key, call #, phase, description) of the call the group state ``st`` is in: the
    check appended it to the ring just before the call (None if the ring no longer has it)."""
    if st is None:
        return None
    for s, seq, key in reversed(list(consistency._cfg.ring)):
        if s is st:
            return (consistency.group_key(st.g), seq, phase, consistency._desc(st, seq, key)) if seq == st.seq else None
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
            return consistency.group_key(st.g), seq, "check", consistency._desc(st, seq, loc["key"])
        if base == "mesh.py" and name == "group" and "ranks" in loc:
            making = (tuple(loc["ranks"]), ",".join(loc["self"]._axes_of(loc["axis"])))
        elif base == "collectives.py" and name.removeprefix("run_") in _COLLECTIVES:
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
    hot = _hot_pending()
    return None if hot is None else _ring_state(hot[1].st, "call")


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


def _mismatch_report(rank: int, gkey, members: dict, waited: float) -> str:
    """The agreement check's error for ranks found blocked in different calls of a group."""
    ranks, axis = gkey
    n = min(w[1] for w in members.values())
    phases = {}
    for r, w in sorted(members.items()):
        phases.setdefault(w[2], []).append(r)
    how = "; ".join(f"{consistency._ranks_str(rs)} {_PHASES[p]}" for p, rs in phases.items())
    where = f"in group {list(ranks)} (mesh axis {axis!r}, call #{n} on it)"
    msg = consistency.mismatch_message(
        rank, where, [w[3] for w in members.values()], list(members),
        "Every rank of a group must pass the same op, dtype, shape and layout at the same point "
        "(look for rank-dependent branches, dtypes or shapes at those lines). "
        f"Found after {waited:.0f} s of waiting: {how}, and none of them can go on.")
    return f"[rank {rank}] CollectiveMismatchError; ending the job:\nCollectiveMismatchError: {msg}\n"


_PHASES = {"check": "in its agreement check (a call new to it, or the check's every-1024th sample)",
           "call": "in the collective", "new group": "making its group's communicator (a first call on that group)"}


class _Watchdog:
    _thread: threading.Thread | None = None
    _stop = threading.Event()
    _comm = None
    _asked_by: int | None = None          # a rank that is collecting the report
    _asked_at = 0.0
    _since: float | None = None           # when the main thread's current wait began (None: not waiting)
    _ident = None                         # which wait that is (frame id, C path call number)
    _round = 0                            # this rank's probes, to drop late answers to old ones
    _found = None                         # what the last probe found (reported when the next agrees)
    _finished: dict = {}                  # rank -> its last calls, from its goodbye

    @classmethod
    def start(cls, world) -> None:
        if cls._thread is not None:
            return
        if cls._comm is None:
            cls._comm = world.mpi.Dup()          # collective: init runs on every rank
        cls._stop.clear()
        cls._thread = threading.Thread(target=cls._loop, args=(world.rank, world.size), name="tessera-watchdog",
                                       daemon=True)
        cls._thread.start()

    @classmethod
    def stop(cls) -> None:
        t = cls._thread
        if t is not None:
            cls._stop.set()
            t.join(timeout=5)
            cls._thread = None

    @classmethod
    def goodbye(cls) -> None:
        """At a normal exit: tell the other ranks' watchdogs this rank finished (and its last calls)."""
        comm = cls._comm
        if cls._thread is None or comm is None:
            return
        cls.stop()
        try:
            from ..comm.process_group import world
            me, n = world().rank, world().size
            note = ("finished", consistency.recent_calls())
            reqs = [comm.isend(note, dest=r, tag=_BYE) for r in range(n) if r != me]
            deadline = time.monotonic() + 1.0          # small messages go eagerly; never hang at exit
            while reqs and time.monotonic() < deadline:
                reqs = [q for q in reqs if not q.Test()]
                if reqs:
                    time.sleep(0.001)
            for q in reqs:
                q.Cancel()
        except Exception:
            pass

    @classmethod
    def _serve(cls, rank: int) -> bool:
        """Answer status requests; True if a lower rank is collecting a report (it prints)."""
        comm = cls._comm
        st = MPI.Status()
        lower = False
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REQ, status=st):
            src = st.Get_source()
            comm.recv(source=src, tag=_REQ)
            cls._asked_by, cls._asked_at = src, time.monotonic()
            lower |= src < rank
            comm.send(status(), dest=src, tag=_REP)
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_PROBE, status=st):
            src = st.Get_source()
            n = comm.recv(source=src, tag=_PROBE)
            comm.send((n, cls._answer()), dest=src, tag=_PROBE_REP)
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_BYE, status=st):
            cls._finished[st.Get_source()] = comm.recv(source=st.Get_source(), tag=_BYE)[1]
        return lower

    @staticmethod
    def _wait_ident(f):
        hot = _hot_pending()
        return id(f), None if hot is None else hot[0]

    @classmethod
    def _answer(cls) -> dict:
        """This rank's side of a probe: what its main thread waits in, and for how long."""
        since, f = cls._since, _main_frame()
        w = None
        if since is not None and _in_collective(f) and cls._wait_ident(f) == cls._ident:
            w = wait_state(f)
        return {"wait": w, "waited": 0.0 if w is None else time.monotonic() - since, "seqs": consistency.group_seqs()}

    @classmethod
    def _loop(cls, rank: int, size: int) -> None:
        frame, since, probe_at = None, 0.0, 0.0
        threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        while not cls._stop.is_set():
            timeout = _cfg().timeout
            cls._stop.wait(min(0.2, max(0.02, timeout / 20)))
            if timeout <= 0 or cls._stop.is_set():
                frame = None                 # (a held frame keeps its locals, buffers included)
                continue
            try:
                if threaded:
                    cls._serve(rank)
                f = _main_frame()
                if not _in_collective(f):
                    frame = cls._since = None
                    continue
                now = time.monotonic()
                # the C path runs in the caller's frame: a loop of quick collectives keeps
                # that frame, so its call count tells one long wait from many short ones
                hot = _hot_pending()
                f = (f, None if hot is None else hot[0])
                if frame is None or f[0] is not frame[0] or f[1] != frame[1]:
                    frame, since = f, now
                    cls._since, cls._ident, cls._found, probe_at = now, (id(f[0]), f[1]), None, now + PROBE_AFTER_S
                    continue
                # another rank is already reporting: leave it the report (unless it went quiet)
                if cls._asked_by is not None and now - cls._asked_at < 10.0:
                    continue
                if now - since >= timeout:
                    cls._fire(rank, size, now - since, threaded)
                elif threaded and now >= probe_at and consistency._cfg.on:
                    probe_at = now + PROBE_EVERY_S
                    cls._probe(rank, size, f[0], now - since)
            except Exception as e:          # the watchdog must never take the job down by itself
                sys.stderr.write(f"[tessera watchdog rank {rank}] internal error: {e!r}\n")
            finally:
                f = None

    @classmethod
    def _fire(cls, rank: int, size: int, waited: float, threaded: bool) -> None:
        comm = cls._comm
        mine = status(waited)
        reports = {rank: mine}
        finished = cls._finished
        if threaded and size > 1:
            for r in range(size):
                if r != rank:
                    comm.isend(("status", rank), dest=r, tag=_REQ)
            deadline = time.monotonic() + 3.0
            st = MPI.Status()
            while len(reports) + len(finished) < size and time.monotonic() < deadline:
                if cls._serve(rank):
                    return cls._yield()                          # a lower rank reports
                if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REP, status=st):
                    reports[st.Get_source()] = comm.recv(source=st.Get_source(), tag=_REP)
                else:
                    time.sleep(0.01)
            cls._serve(rank)                                     # (the goodbyes that came meanwhile)
            time.sleep(0.2)                                      # a lower rank firing at the same time wins
            if cls._serve(rank):
                return cls._yield()
        cls._end(cls._report(rank, size, waited, mine, reports, finished), WATCHDOG_EXIT_CODE)

    @staticmethod
    def _end(report: str, code: int) -> None:
        """Print the one report of the job and end every rank."""
        sys.stderr.write(report)
        sys.stderr.flush()
        for c in list(NCCL_COMMS):
            try:
                c.abort()
            except Exception:
                pass
        time.sleep(0.3)          # let mpiexec forward the report before the abort kills the pipes
        MPI.COMM_WORLD.Abort(code)

    @classmethod
    def _probe(cls, rank: int, size: int, frame, waited: float) -> None:
        """The early comparison (module docstring): ask every rank what it waits in; end the
        job when two probes in a row find the same disagreement."""
        mine = wait_state(frame)
        if mine is None or size < 2:
            return
        comm = cls._comm
        cls._round += 1
        for r in range(size):
            if r != rank:
                comm.isend(cls._round, dest=r, tag=_PROBE)
        states = {rank: {"wait": mine, "waited": waited, "seqs": consistency.group_seqs()}}
        deadline = time.monotonic() + 1.5
        st = MPI.Status()
        while len(states) + len(cls._finished) < size and time.monotonic() < deadline:
            if cls._serve(rank):
                return                                   # a lower rank collects the watchdog's report
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_PROBE_REP, status=st):
                n, answer = comm.recv(source=st.Get_source(), tag=_PROBE_REP)
                if n == cls._round:
                    states[st.Get_source()] = answer
            else:
                time.sleep(0.01)
        found = disagreement(states, cls._finished)
        if found is None or found != cls._found:
            cls._found = found
            return
        gkey, members, blocked = found
        if rank != min(blocked):
            # the lowest blocked rank reports; if it has not ended the job in a while, report here
            end = time.monotonic() + 2 * PROBE_EVERY_S + 2.0
            while time.monotonic() < end:
                cls._serve(rank)
                time.sleep(0.05)
        if cls._wait_ident(_main_frame()) != cls._ident:
            return                                       # this rank's call completed after all
        cls._end(_mismatch_report(rank, gkey, members, waited), 1)

    @classmethod
    def _yield(cls) -> None:
        """Another rank prints the report and aborts; keep answering it, abort late if it does not."""
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            cls._serve(10 ** 9)
            time.sleep(0.05)
        MPI.COMM_WORLD.Abort(WATCHDOG_EXIT_CODE)

    @staticmethod
    def _report(rank, size, waited, mine, reports, finished) -> str:
        cfg = _cfg()
        lines = [f"[tessera watchdog] rank {rank}: {mine['what'] or 'a collective'} has not completed "
                 f"after {waited:.1f} s (TESSERA_TIMEOUT={cfg.timeout:g}); ending the job "
                 f"(exit code {WATCHDOG_EXIT_CODE}).", "  what every rank is doing:"]
        for r in range(size):
            rep = reports.get(r)
            if rep is None and r in finished:
                lines.append(f"    rank {r}: finished normally (exited the program; it no longer takes part)")
            elif rep is None:
                lines.append(f"    rank {r}: DEAD or unresponsive: no answer within 3 s (the process died, or "
                             "its main thread holds the GIL)")
            elif rep["pending"]:
                lines.append(f"    rank {r} ({rep['host']}): {rep['pending']}")
            else:
                lines.append(f"    rank {r} ({rep['host']}): not in a collective; main thread at {rep['stack']}")
        histories = {r: rep["calls"] for r, rep in reports.items()}
        histories.update(finished)
        div = divergence(histories)
        if div:
            lines.append("  the ranks' collective calls diverged first at:")
            lines += [f"    {d}" for d in div]
        waits: dict = {}
        for r, rep in reports.items():
            if rep["what"]:
                waits.setdefault(rep["what"], []).append(r)
        if len(waits) > 1:
            lines.append("  they wait in different calls: " + "; ".join(
                f"{consistency._ranks_str(sorted(rs))} {w}" for w, rs in sorted(waits.items(), key=lambda kv: len(kv[1]))))
        if any(rep["flight"] for rep in reports.values()):
            lines.append(f"  flight recorder (last {cfg.ring.maxlen} collectives per rank, oldest first):")
            for r in sorted(reports):
                lines.append(f"    rank {r}:")
                lines += [f"      {c}" for c in reports[r]["flight"]] or ["      (none)"]
        lines.append("  To find the first call where the ranks disagree as it happens, rerun with "
                     "TESSERA_DEBUG=collectives (checks every collective mesh-wide, ~+20 us each).")
        return "\n".join(lines) + "\n"


atexit.register(_Watchdog.goodbye)
