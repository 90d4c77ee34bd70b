"""The watchdog's thread (see ``watchdog``): it samples the main thread, probes the other
ranks' watchdogs once a wait grows old (a disagreement, a rank that no longer answers, one
that finished while this wait needs it: each ends the job at once, naming the rank),
collects every rank's ``status`` into one report at the timeout and ends the job
(``Watchdog.start`` / ``stop``, called by ``debug.configure``).  Ranks talk over a duplicate
of the world communicator that the watchdog threads alone serve."""
from __future__ import annotations

import atexit
import sys
import threading
import time

from ..comm.calls import group_seqs
from ..comm.mpi import MPI
from ..comm.nccl import NCCL_COMMS
from ..comm.process_group import abort
from . import consistency
from .watchdog import (
    PROBE_AFTER_S,
    PROBE_EVERY_S,
    PROBE_MIN_WAIT_S,
    UNANSWERED_PROBES,
    WATCHDOG_EXIT_CODE,
    disagreement,
    divergence,
    hot_pending,
    in_collective,
    main_frame,
    recorder_config,
    status,
    wait_members,
    wait_state,
)

__all__ = ["Watchdog"]

_REQ, _REP, _BYE, _PROBE, _PROBE_REP = 7701, 7702, 7703, 7705, 7706


def _mismatch_report(rank: int, gkey, members: dict, waited: float) -> str:
    """The agreement check's error for ranks found blocked in different calls of a group."""
    ranks, axis = gkey
    n = min(w[1] for w in members.values())
    phases: dict = {}
    for r, w in sorted(members.items()):
        phases.setdefault(w[2], []).append(r)
    how = "; ".join(f"{consistency.ranks_str(rs)} {_PHASES[p]}" for p, rs in phases.items())
    where = f"in group {list(ranks)} (mesh axis {axis!r}, call #{n} on it)"
    msg = consistency.mismatch_message(
        rank, where, [w[3] for w in members.values()], list(members),
        "Every rank of a group must pass the same op, dtype, shape and layout at the same point "
        "(look for rank-dependent branches, dtypes or shapes at those lines). "
        f"Found after {waited:.0f} s of waiting: {how}, and none of them can go on.")
    return f"[rank {rank}] CollectiveMismatchError; ending the job:\nCollectiveMismatchError: {msg}\n"


def _gone_lead(what: str, gone: list) -> str:
    who = f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))}"
    return (f"{what} waits for {who}, which finished the program (exited normally) without making this call, so it "
            "can never complete")


def _silent_lead(what: str, waited: float, silent: list) -> str:
    who = f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
    return (f"{what} has waited {waited:.1f} s; {who} answered none of the last {UNANSWERED_PROBES} probes "
            f"({(UNANSWERED_PROBES - 1) * PROBE_EVERY_S:.0f} s): unresponsive (stopped by SIGSTOP or a debugger, "
            "wedged in a call that holds the GIL, or its host is gone)")


_SAME_CALLS = ("  Every rank of a group makes the same collectives: look for one made on some ranks only (under "
               "`if rank == 0:`, a full_tensor() or print of a DTensor on one rank) or a rank that returns early.")


_PHASES = {"check": "in its agreement check (a call new to it, or the check's every-1024th sample)",
           "call": "in the collective", "new group": "making its group's communicator (a first call on that group)"}


class Watchdog:
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
    _finished_seqs: dict = {}             # rank -> its calls on each group, from its goodbye
    _silent: dict = {}                    # rank -> probes in a row it did not answer (this wait)

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
            note = ("finished", consistency.recent_calls(), group_seqs())
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
        assert comm is not None                  # start() made it
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
            src = st.Get_source()
            _, cls._finished[src], cls._finished_seqs[src] = comm.recv(source=src, tag=_BYE)
        return lower

    @staticmethod
    def _wait_ident(f):
        hot = hot_pending()
        return id(f), None if hot is None else hot[0]

    @classmethod
    def _answer(cls) -> dict:
        """This rank's side of a probe: whether its main thread waits in a collective ("busy"),
        in what (None where not known) and for how long."""
        since, f = cls._since, main_frame()
        busy = since is not None and in_collective(f) and cls._wait_ident(f) == cls._ident
        w = wait_state(f) if busy else None
        return {"wait": w, "waited": 0.0 if w is None or since is None else time.monotonic() - since, "seqs": group_seqs(),
                "busy": busy}

    @classmethod
    def _loop(cls, rank: int, size: int) -> None:
        frame, since, probe_at = None, 0.0, 0.0
        threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        while not cls._stop.is_set():
            timeout = recorder_config().timeout
            cls._stop.wait(min(0.2, max(0.02, timeout / 20)))
            if timeout <= 0 or cls._stop.is_set():
                frame = None                 # (a held frame keeps its locals, buffers included)
                continue
            try:
                if threaded:
                    cls._serve(rank)
                f = main_frame()
                if not in_collective(f):
                    frame = cls._since = None
                    continue
                now = time.monotonic()
                # the C path runs in the caller's frame: a loop of quick collectives keeps
                # that frame, so its call count tells one long wait from many short ones
                hot = hot_pending()
                f = (f, None if hot is None else hot[0])
                if frame is None or f[0] is not frame[0] or f[1] != frame[1]:
                    frame, since = f, now
                    cls._since, cls._ident, cls._found, probe_at = now, (id(f[0]), f[1]), None, now + PROBE_AFTER_S
                    cls._silent = {}
                    continue
                # another rank is already reporting: leave it the report (unless it went quiet)
                if cls._asked_by is not None and now - cls._asked_at < 10.0:
                    continue
                if now - since >= timeout:
                    cls._fire(rank, size, now - since, threaded)
                elif threaded and size > 1:
                    if cls._finished and probe_at == since + PROBE_AFTER_S:
                        probe_at = since + PROBE_MIN_WAIT_S     # a rank has finished: the first probe comes sooner
                    if now >= probe_at:
                        probe_at = now + PROBE_EVERY_S
                        cls._probe(rank, size, f[0], now - since)
            except Exception as e:          # the watchdog must never take the job down by itself
                sys.stderr.write(f"[tessera watchdog rank {rank}] internal error: {e!r}\n")
            finally:
                f = None

    @classmethod
    def _fire(cls, rank: int, size: int, waited: float, threaded: bool, lead=None, skip=(), hint: str = "") -> None:
        """Collect every rank's status into the job's one report and end it: at the timeout, or
        (``lead``: the report's first words) when a probe found a rank that can never come
        (``skip``: ranks not to wait 3 s for, known silent)."""
        comm = cls._comm
        mine = status(waited)
        reports = {rank: mine}
        finished = cls._finished
        if threaded and size > 1:
            assert comm is not None              # start() made it
            for r in range(size):
                if r != rank:
                    comm.isend(("status", rank), dest=r, tag=_REQ)
            deadline = time.monotonic() + 3.0
            st = MPI.Status()
            while len(reports) + len(finished) + len(skip) < size and time.monotonic() < deadline:
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
        lead = lead(mine["what"] or "a collective") if lead else None
        cls._end(cls._report(rank, size, waited, mine, reports, finished, lead, hint), WATCHDOG_EXIT_CODE)

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
        abort(code)

    @classmethod
    def _probe(cls, rank: int, size: int, frame, waited: float) -> None:
        """Ask every rank what it waits in.  Ends the job when two probes in a row find the
        same disagreement (the early comparison, module docstring of ``watchdog``), or when a
        rank has answered none of the last ``UNANSWERED_PROBES``."""
        mine = wait_state(frame) if consistency.STATE.on else None
        comm = cls._comm
        assert comm is not None                  # start() made it
        cls._round += 1
        for r in range(size):
            if r != rank and r not in cls._finished:
                comm.isend(cls._round, dest=r, tag=_PROBE)
        states = {rank: {"wait": mine, "waited": waited, "seqs": group_seqs(), "busy": True}}
        deadline = time.monotonic() + 1.5
        st = MPI.Status()
        while len(states) + len(cls._finished) < size and time.monotonic() < deadline:
            if cls._serve(rank):
                return                                   # a lower rank collects the watchdog's report
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_PROBE_REP, status=st):
                n, answer = comm.recv(source=st.Get_source(), tag=_PROBE_REP)
                cls._silent[st.Get_source()] = 0         # (a late answer to an earlier probe says it lives too)
                if n == cls._round:
                    states[st.Get_source()] = answer
            else:
                time.sleep(0.01)
        for r in range(size):
            if r not in states and r not in cls._finished:
                cls._silent[r] = cls._silent.get(r, 0) + 1
        found = disagreement(states, cls._finished) if mine is not None else None
        gone = cls._gone(rank, frame, mine)
        # ranks blocked in different calls: the agreement check's error names the cause (two
        # probes in a row agree on it; one is enough when a finished rank can never come)
        if found is not None and (found == cls._found or gone):
            gkey, members, blocked = found
            what = _mismatch_report(rank, gkey, members, waited)
            return cls._report_from(rank, min(blocked), lambda: cls._end(what, 1))
        cls._found = found
        silent = sorted(r for r, k in cls._silent.items() if k >= UNANSWERED_PROBES and r not in cls._finished)
        if gone:
            cls._fire(rank, size, waited, True, lambda what: _gone_lead(what, gone), hint=_SAME_CALLS)
        elif silent:
            cls._fire(rank, size, waited, True, lambda what: _silent_lead(what, waited, silent), skip=silent)

    @classmethod
    def _gone(cls, rank: int, frame, mine) -> list:
        """The ranks this wait needs (``wait_members``) that finished the program without
        making the call: their goodbye's call count on the group is below this call's number,
        or (the call not known by number) they finished while this rank waited."""
        gone = [r for r in wait_members(frame) or () if r in cls._finished and r != rank] if cls._finished else []
        if gone and mine is not None:
            gone = [r for r in gone if cls._finished_seqs.get(r, {}).get(mine[0], 0) < mine[1]]
        return gone

    @classmethod
    def _report_from(cls, rank: int, reporter: int, end) -> None:
        """One report per job: the rank ``reporter`` ends it; the others give it a moment
        (answering probes), then end it themselves if their own wait still goes on."""
        if rank != reporter:
            deadline = time.monotonic() + 2 * PROBE_EVERY_S + 2.0
            while time.monotonic() < deadline:
                cls._serve(rank)
                time.sleep(0.05)
        if cls._wait_ident(main_frame()) == cls._ident:      # (else this rank's call completed after all)
            end()

    @classmethod
    def _yield(cls) -> None:
        """Another rank prints the report and aborts; keep answering it, abort late if it does not."""
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            cls._serve(10 ** 9)
            time.sleep(0.05)
        abort(WATCHDOG_EXIT_CODE)

    @staticmethod
    def _report(rank, size, waited, mine, reports, finished, lead=None, hint="") -> str:
        cfg = recorder_config()
        lead = lead or (f"{mine['what'] or 'a collective'} has not completed after {waited:.1f} s "
                        f"(TESSERA_TIMEOUT={cfg.timeout:g})")
        lines = [f"[tessera watchdog] rank {rank}: {lead}; ending the job (exit code {WATCHDOG_EXIT_CODE}).",
                 "  what every rank is doing:"]
        for r in range(size):
            rep = reports.get(r)
            if rep is None and r in finished:
                lines.append(f"    rank {r}: finished normally (exited the program; it no longer takes part)")
            elif rep is None:
                lines.append(f"    rank {r}: DEAD or unresponsive: no answer (the process died or is stopped, or "
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
                f"{consistency.ranks_str(sorted(rs))} {w}" for w, rs in sorted(waits.items(), key=lambda kv: len(kv[1]))))
        if any(rep["flight"] for rep in reports.values()):
            lines.append(f"  flight recorder (last {cfg.ring.maxlen} collectives per rank, oldest first):")
            for r in sorted(reports):
                lines.append(f"    rank {r}:")
                lines += [f"      {c}" for c in reports[r]["flight"]] or ["      (none)"]
        if hint:
            lines.append(hint)
        lines.append("  To find the first call where the ranks disagree as it happens, rerun with "
                     "TESSERA_DEBUG=collectives (checks every collective mesh-wide, ~+20 us each).")
        return "\n".join(lines) + "\n"


atexit.register(Watchdog.goodbye)
