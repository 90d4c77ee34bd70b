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
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref

from mpi4py import MPI

from ..dtypes import dtype_name
from . import consistency

__all__ = ["WATCHDOG_EXIT_CODE", "register_nccl", "status"]

WATCHDOG_EXIT_CODE = 14
_REQ, _REP, _BYE = 7701, 7702, 7703
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NCCL_COMMS: "weakref.WeakSet" = weakref.WeakSet()
_WAIT_FILES = {os.path.join(_PKG_DIR, "dist", "comm.py"), os.path.join(_PKG_DIR, "dist", "mesh.py")}
_WAIT_FUNCS = {("debug.py", "_check"), ("backend.py", "synchronize"), ("backend.py", "wait_done"),
               ("cpu_streams.py", "synchronize"), ("cpu_streams.py", "wait_done"), ("cpu_streams.py", "_wait"),
               ("collectives.py", "_issue"), ("collectives.py", "wait"), ("consistency.py", "_verify"),
               ("consistency.py", "p2p_check_header"), ("consistency.py", "p2p_send_header")}
_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv", "barrier")
# a planned blocking CPU collective calls mpi4py from its own frame (dist/plans.py), or from
# its runner (run_all_reduce, ...: dist.ccl's library path too)
_WAIT_FUNCS |= {("collectives.py", f) for op in _COLLECTIVES for f in (op, f"run_{op}")}
# ... or from a compiled redistribution plan's step, or dist.ccl's library reduce-scatter
_WAIT_FUNCS |= {("compiled_plan.py", "raw_call"), ("line.py", "line_reduce_scatter")}


def register_nccl(comm) -> None:
    """Remember an NCCL communicator so the watchdog can ncclCommAbort it."""
    _NCCL_COMMS.add(comm)


def _cfg():
    from . import debug
    return debug._cfg


_THREADING = threading.__file__


def _main_frame():
    frame = sys._current_frames().get(threading.main_thread().ident)
    # a wait on a CPU worker stream blocks in threading's Condition.wait: report its caller
    while frame is not None and frame.f_code.co_filename == _THREADING:
        frame = frame.f_back
    return frame


def _hot_pending():
    """(call number, plan, x) of the collective the main thread is in through the C path
    (dist/_hot.c: from its check to the end of its MPI call), which leaves no Python frame
    of its own, or None."""
    from . import collectives
    h = collectives._hot
    got = h.pending() if h is not None else None
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
    user = [s for s in stack if not s.filename.startswith((_PKG_DIR, "<frozen"))] or stack
    lines = [f"{os.path.basename(s.filename)}:{s.lineno} in {s.name}: {(s.line or '').strip()}" for s in user[-limit:]]
    return " <- ".join(reversed(lines))


def _site_of(frame) -> str:
    f = frame
    while f is not None and consistency._is_internal(f.f_code):
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


def _note_of(frame) -> str:
    """What a waiting frame says it waits for: a layer above dist (the pipeline: its stage and
    micro-batch) leaves a string in a local named ``watchdog_note`` before it waits."""
    f = frame
    while f is not None:
        note = f.f_locals.get("watchdog_note") if f.f_code.co_name != "<module>" else None
        if isinstance(note, str):
            return note
        f = f.f_back
    return ""


def status(blocked_for: float | None = None) -> dict:
    """What this rank is doing now: pending collective (or main-thread stack), its recent calls
    and its flight recorder."""
    from .debug import format_call
    from .process_group import world
    cfg = _cfg()
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
    note = _note_of(frame) if busy else ""
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


class _Watchdog:
    _thread: threading.Thread | None = None
    _stop = threading.Event()
    _comm = None
    _asked_by: int | None = None          # a rank that is collecting the report
    _asked_at = 0.0

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
            from .process_group import world
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
        return lower

    @classmethod
    def _loop(cls, rank: int, size: int) -> None:
        frame, since = None, 0.0
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
                    frame = None
                    continue
                now = time.monotonic()
                # the C path runs in the caller's frame: a loop of quick collectives keeps
                # that frame, so its call count tells one long wait from many short ones
                hot = _hot_pending()
                f = (f, None if hot is None else hot[0])
                if frame is None or f[0] is not frame[0] or f[1] != frame[1]:
                    frame, since = f, now
                    continue
                # another rank is already reporting: leave it the report (unless it went quiet)
                if cls._asked_by is not None and now - cls._asked_at < 10.0:
                    continue
                if now - since >= timeout:
                    cls._fire(rank, size, now - since, threaded)
            except Exception as e:          # the watchdog must never take the job down by itself
                sys.stderr.write(f"[tessera watchdog rank {rank}] internal error: {e!r}\n")
            finally:
                f = None

    @classmethod
    def _fire(cls, rank: int, size: int, waited: float, threaded: bool) -> None:
        comm = cls._comm
        mine = status(waited)
        reports = {rank: mine}
        finished: dict = {}
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
                elif comm.Iprobe(source=MPI.ANY_SOURCE, tag=_BYE, status=st):
                    finished[st.Get_source()] = comm.recv(source=st.Get_source(), tag=_BYE)[1]
                else:
                    time.sleep(0.01)
            while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_BYE, status=st):
                finished[st.Get_source()] = comm.recv(source=st.Get_source(), tag=_BYE)[1]
            time.sleep(0.2)                                      # a lower rank firing at the same time wins
            if cls._serve(rank):
                return cls._yield()
        sys.stderr.write(cls._report(rank, size, waited, mine, reports, finished))
        sys.stderr.flush()
        for c in list(_NCCL_COMMS):
            try:
                c.abort()
            except Exception:
                pass
        time.sleep(0.3)          # let mpiexec forward the report before the abort kills the pipes
        MPI.COMM_WORLD.Abort(WATCHDOG_EXIT_CODE)

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
