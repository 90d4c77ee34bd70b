"""Collective debugging: flight recorder, desync detection and the watchdog (seed 000 §8).

    TESSERA_DEBUG=collectives tessera-run -n 4 train.py     # or dist.init(debug="collectives")
    TESSERA_TIMEOUT=120 tessera-run -n 4 train.py           # or dist.init(timeout=120)

* **Flight recorder** (``debug="flight"`` or ``"collectives"``): the last ``TESSERA_FLIGHT_N``
  (default 32) collectives of this rank: sequence number, op, mesh axis, dtype, shape, the
  user's call site (file:line), start time and duration; ``flight_records()`` returns them.
* **Desync detection** (``debug="collectives"``): before each collective the ranks of the
  mesh (the world when there is no mesh) exchange a fingerprint (sequence number, op, axis,
  dtype, call site; plus the shape, compared within the group) over a communicator of
  their own; any difference raises ``CollectiveMismatchError`` on every rank, naming which
  ranks disagree, on what and where.  In an SPMD program every rank of a mesh issues the
  same collectives in the same order, each on its own group, so the check runs over the
  whole mesh and cannot deadlock when ranks call collectives of different groups.
  ``send``/``recv`` (pipeline stages) are not checked and do not count in the sequence.
* **Watchdog** (on by default at world size > 1; ``TESSERA_TIMEOUT`` seconds, default 600,
  0 turns it off): a daemon thread per rank samples the main thread's stack; when the main
  thread has been inside one MPI/NCCL call (a collective, its fingerprint check, a wait on
  one, a stream synchronize) for longer than the timeout it asks every rank, over a
  duplicated world communicator served by the watchdog threads, what it is doing (pending
  collective, or the main thread's stack if it is not in one, and its flight recorder),
  prints one combined report, aborts the NCCL communicators (``ncclCommAbort``) and calls
  ``MPI.COMM_WORLD.Abort(WATCHDOG_EXIT_CODE)``.  Sampling costs the collectives nothing.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref
import zlib
from collections import deque

import numpy as np
from mpi4py import MPI

from ..dtypes import dtype_name

__all__ = [
    "Call", "CollectiveMismatchError", "configure", "flight_records", "format_call", "desync_enabled",
    "recorder_enabled", "watchdog_timeout", "WATCHDOG_EXIT_CODE", "register_nccl", "status",
]

WATCHDOG_EXIT_CODE = 14
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # .../tessera_rt
_REQ, _REP = 7701, 7702


class CollectiveMismatchError(RuntimeError):
    """Ranks of a mesh issued different collectives (or shapes) at the same point."""


# --------------------------------------------------------------------------- the record of one call

class Call:
    """One collective as issued on this rank (what hooks, the recorder and profiler see)."""

    __slots__ = ("seq", "op", "group", "shape", "_dt", "site", "t0", "t1", "async_op", "role", "nbytes", "mesh",
                 "gshape", "extra", "waiting", "prof", "nvtx")

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
        self.prof = self.nvtx = None

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


def format_call(c: Call, now: float | None = None) -> str:
    now = time.monotonic() if now is None else now
    if c.t1:
        state = f"done in {(c.t1 - c.t0) * 1e3:.3f} ms"
    elif c.async_op and not c.waiting:
        state = f"issued {now - c.t0:.1f} s ago (async, not waited yet)"
    else:
        state = f"PENDING for {now - c.t0:.1f} s"
    return f"#{c.seq} {c.describe()}: {state}"


# --------------------------------------------------------------------------- configuration

class _Cfg:
    recorder = False
    desync = False
    timeout = 600.0
    ring: deque = deque(maxlen=32)
    seq = 0
    pending: Call | None = None       # the call the main thread is blocked in (recorder on)


_cfg = _Cfg()
_DT_NAMES: dict = {}
_SITES: dict = {}                     # (code, line) -> "file.py:line"
_CHECK_COMMS: dict = {}               # mesh (or None: world) -> [dup communicator, sequence]
_SITE_INTERNAL: dict = {}             # code object -> True if it belongs to tessera_rt


def desync_enabled() -> bool:
    return _cfg.desync


def recorder_enabled() -> bool:
    return _cfg.recorder


def watchdog_timeout() -> float:
    return _cfg.timeout


def _parse_debug(spec) -> set[str]:
    if spec is None:
        spec = os.environ.get("TESSERA_DEBUG", "")
    if spec is True:
        return {"collectives"}
    if spec is False or spec == "":
        return set()
    words = {w.strip().lower() for w in str(spec).replace(";", ",").split(",") if w.strip()}
    bad = words - {"collectives", "flight", "desync", "off", "none", "0"}
    if bad:
        raise ValueError(f"debug={spec!r}: unknown mode(s) {sorted(bad)}; use 'collectives' (desync checks and "
                         "the flight recorder) or 'flight' (flight recorder only)")
    return words - {"off", "none", "0"}


def configure(debug=None, timeout=None, world=None) -> None:
    """Set the debug modes (``dist.init`` calls this).  ``debug``: "collectives", "flight",
    True/False or None (read ``TESSERA_DEBUG``); ``timeout``: watchdog seconds, 0 = off,
    None (read ``TESSERA_TIMEOUT``, default 600)."""
    from . import collectives as C
    modes = _parse_debug(debug)
    _cfg.desync = bool(modes & {"collectives", "desync"})
    _cfg.recorder = _cfg.desync or "flight" in modes
    n = int(os.environ.get("TESSERA_FLIGHT_N", "32"))
    if _cfg.ring.maxlen != n:
        _cfg.ring = deque(_cfg.ring, maxlen=max(1, n))
    if timeout is None:
        env = os.environ.get("TESSERA_TIMEOUT", "").strip()
        try:
            timeout = float(env) if env else 600.0
        except ValueError:
            raise ValueError(f"TESSERA_TIMEOUT={env!r} is not a number of seconds (0 turns the watchdog off)") from None
    _cfg.timeout = float(timeout)
    if _cfg.recorder:
        if _RECORDER not in C._HOOKS:
            C._HOOKS.append(_RECORDER)
    elif _RECORDER in C._HOOKS:
        C._HOOKS.remove(_RECORDER)
    if world is not None and _cfg.timeout > 0 and world.size > 1:
        _Watchdog.start(world)
    elif _cfg.timeout <= 0:
        _Watchdog.stop()


def flight_records() -> list[Call]:
    """This rank's last collectives, oldest first (empty unless the recorder is on)."""
    return list(_cfg.ring)


# --------------------------------------------------------------------------- call sites

def _is_internal(code) -> bool:
    v = _SITE_INTERNAL.get(code)
    if v is None:
        f = code.co_filename
        v = _SITE_INTERNAL[code] = f.startswith(_PKG_DIR) or f.startswith("<frozen") or "/mpi4py/" in f
    return v


def user_site(depth: int = 2) -> str:
    """file:line of the first caller frame outside tessera_rt (the user's call site)."""
    f = sys._getframe(depth)
    internal = _SITE_INTERNAL
    while f is not None:
        code = f.f_code
        v = internal.get(code)
        if v is None:
            v = _is_internal(code)
        if not v:
            break
        f = f.f_back
    if f is None:
        return "?"
    key = (f.f_code, f.f_lineno)
    site = _SITES.get(key)
    if site is None:
        site = _SITES[key] = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
    return site


# --------------------------------------------------------------------------- the recorder hook

def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


_FP_CACHE: dict = {}


class _Recorder:
    """The hook collectives call around every collective while the recorder is on."""

    def before(self, call: Call) -> None:
        call.site = user_site(3)
        _cfg.seq += 1
        call.seq = _cfg.seq
        call.t0 = time.monotonic()
        _cfg.ring.append(call)
        if not call.async_op:
            call.waiting = True
            _cfg.pending = call
        if _cfg.desync and call.op not in ("send", "recv"):
            _check(call)

    def wait(self, call: Call) -> None:
        call.waiting = True
        _cfg.pending = call

    def after(self, call: Call) -> None:
        call.t1 = time.monotonic()
        if _cfg.pending is call:
            _cfg.pending = None


_RECORDER = _Recorder()


def _check_comm(mesh):
    st = _CHECK_COMMS.get(mesh)
    if st is None:
        from .process_group import world
        base = world().mpi if mesh is None else mesh._mpi
        st = _CHECK_COMMS[mesh] = [base.Dup(), 0]
    return st


class _NewGroup:
    def __init__(self, mesh, axis):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        self.name, self.ranks = ",".join(axes), mesh.group_ranks(axis)
        self.size = len(self.ranks)


def precheck(op: str, mesh, axis, x) -> None:
    """The check before a mesh group's communicator is made (that is collective too)."""
    if not _cfg.desync or op in ("send", "recv"):
        return
    call = Call(op, _NewGroup(mesh, axis), x if hasattr(x, "dtype") else None, 0, mesh, None, "<new group>",
                "", False)
    call.site = user_site(3)
    _check(call)


def _check(call: Call) -> None:
    """Exchange fingerprints over the mesh; raise the same error on every rank on a mismatch."""
    st = _check_comm(call.mesh)
    comm = st[0]
    st[1] += 1
    mseq = st[1]
    key = (call.op, call.axis, call.dtype, call.site, call.extra)
    h = _FP_CACHE.get(key)
    if h is None:
        h = _FP_CACHE[key] = _crc("|".join(map(str, key)))
    pre = call.gshape is None              # group-shape check waits for the real call
    mine = np.array([mseq, h, 0 if pre else _crc(repr(call.ranks)), 0 if pre else _crc(repr(call.gshape))],
                    dtype=np.int64)
    every = np.empty((comm.Get_size(), 4), dtype=np.int64)
    comm.Allgather(mine, every)
    seq_ok = (every[:, 0] == mseq).all() and (every[:, 1] == h).all()
    grp_ok = True
    if seq_ok:
        for gid in np.unique(every[:, 2]):
            rows = every[every[:, 2] == gid]
            if not (rows[:, 3] == rows[0, 3]).all():
                grp_ok = False
    if seq_ok and grp_ok:
        return
    desc = (mseq, call.op, call.axis, call.dtype, call.shape, call.site, call.ranks, call.gshape, call.extra)
    everyone = comm.allgather(desc)
    raise CollectiveMismatchError(_mismatch_message(everyone, call, comm.Get_rank(), seq_ok))


def _short(d) -> str:
    seq, op, axis, dtype, shape, site, ranks, gshape, extra = d
    dt = f" {dtype}[{','.join(map(str, shape))}]" if dtype else ""
    return f"{op}({axis}){dt} at {site}"


def _ranks_str(rs) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks [" + ",".join(map(str, rs)) + "]"


def _mismatch_message(everyone, call: Call, me: int, seq_ok: bool) -> str:
    from .process_group import world
    where = "the world" if call.mesh is None else repr(call.mesh)
    # mesh position -> world rank
    wranks = list(range(len(everyone))) if call.mesh is None else list(call.mesh.devices)
    if not seq_ok:
        groups: dict = {}
        for pos, d in enumerate(everyone):
            k = (d[0],) + d[1:6]
            groups.setdefault(k, []).append(pos)
        parts, fields = [], set()
        ref = everyone[0]
        names = {0: "sequence number", 1: "op", 2: "mesh axis", 3: "dtype", 4: "shape", 5: "call site",
                 8: "arguments"}
        for pos, d in enumerate(everyone):
            for i, n in names.items():
                if d[i] != ref[i]:
                    fields.add(n)
        for k, poss in groups.items():
            d = everyone[poss[0]]
            parts.append(f"{_ranks_str([wranks[p] for p in poss])} {_short(d)} (collective #{d[0]})")
        order = ["sequence number", "op", "mesh axis", "dtype", "shape", "arguments", "call site"]
        return (f"rank {world().rank}: collective mismatch on {where}: " + "; ".join(parts)
                + f" -- they disagree on {', '.join(f for f in order if f in fields)}. Every rank of a mesh "
                "must issue the same collectives in the same order (check rank-dependent branches).")
    parts = []
    for gid in dict.fromkeys(d[6] for d in everyone):
        members = [(pos, d) for pos, d in enumerate(everyone) if d[6] == gid]
        shapes = {}
        for pos, d in members:
            shapes.setdefault(d[7], []).append(pos)
        if len(shapes) > 1:
            d0 = members[0][1]
            desc = "; ".join(f"{_ranks_str([wranks[p] for p in ps])} {everyone[ps[0]][3]}"
                             f"[{','.join(map(str, everyone[ps[0]][4]))}]"
                             for ps in shapes.values())
            parts.append(f"group {list(gid)} in {d0[1]}({d0[2]}) at {d0[5]}: {desc}")
    return (f"rank {world().rank}: collective mismatch on {where} (collective #{everyone[0][0]}): the ranks of a "
            f"group pass shapes that do not fit together: " + " | ".join(parts)
            + ". Every rank of the group must pass the same shape (uneven parts: pass sizes=).")


# --------------------------------------------------------------------------- status and the watchdog

_NCCL_COMMS: "weakref.WeakSet" = weakref.WeakSet()
_WAIT_FILES = {os.path.join(_PKG_DIR, "dist", "comm.py"), os.path.join(_PKG_DIR, "dist", "mesh.py")}
_WAIT_FUNCS = {("debug.py", "_check"), ("backend.py", "synchronize"), ("backend.py", "wait_done"),
               ("collectives.py", "_issue"), ("collectives.py", "wait")}


def register_nccl(comm) -> None:
    """Remember an NCCL communicator so the watchdog can ncclCommAbort it."""
    _NCCL_COMMS.add(comm)


def _main_frame():
    return sys._current_frames().get(threading.main_thread().ident)


def _in_collective(frame) -> bool:
    """True if the main thread's innermost Python frame is one that waits inside MPI/NCCL."""
    if frame is None:
        return False
    fn = frame.f_code.co_filename
    return fn in _WAIT_FILES or (os.path.basename(fn), frame.f_code.co_name) in _WAIT_FUNCS


def _frame_summary(frame, limit: int = 4) -> str:
    if frame is None:
        return "(no main thread frame)"
    stack = traceback.extract_stack(frame)
    user = [s for s in stack if not s.filename.startswith((_PKG_DIR, "<frozen"))] or stack
    lines = [f"{os.path.basename(s.filename)}:{s.lineno} in {s.name}: {(s.line or '').strip()}" for s in user[-limit:]]
    return " <- ".join(reversed(lines))


def _pending_from_stack(frame) -> str:
    """Describe the collective the main thread waits in, from the frames' locals (no recorder)."""
    f = frame
    while f is not None:
        name = f.f_code.co_name
        if os.path.basename(f.f_code.co_filename) == "collectives.py" and name in (
                "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
                "barrier"):
            loc = f.f_locals
            g, x = loc.get("g"), loc.get("x")
            shape = f" {dtype_name(x.dtype)}[{','.join(map(str, x.shape))}]" if hasattr(x, "shape") else ""
            return f"{name}({getattr(g, 'name', '?')}){shape} at {_site_of(f)}"
        if name == "_check" and os.path.basename(f.f_code.co_filename) == "debug.py":
            c = f.f_locals.get("call")
            return f"fingerprint check before {c.describe() if c else '?'}"
        f = f.f_back
    return f"an MPI/NCCL call at {_site_of(frame)}"


def _site_of(frame) -> str:
    f = frame
    while f is not None and _is_internal(f.f_code):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def status(blocked_for: float | None = None) -> dict:
    """What this rank is doing now: pending collective (or main-thread stack) and its flight recorder."""
    from .process_group import world
    frame = _main_frame()
    now = time.monotonic()
    busy = _in_collective(frame)
    if _cfg.pending is not None and busy:
        pend, what = format_call(_cfg.pending, now), _cfg.pending.describe()
    elif busy:
        what = _pending_from_stack(frame)
        pend = "PENDING " + what + (f" for {blocked_for:.1f} s" if blocked_for else "")
    else:
        pend = what = None
    return {"rank": world().rank, "host": world().host, "pending": pend, "what": what,
            "stack": _frame_summary(frame),
            "flight": [format_call(c, now) for c in _cfg.ring]}


class _Watchdog:
    _thread: threading.Thread | None = None
    _stop = threading.Event()
    _comm = None

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
    def _serve(cls) -> None:
        comm = cls._comm
        st = MPI.Status()
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REQ, status=st):
            src = st.Get_source()
            comm.recv(source=src, tag=_REQ)
            comm.send(status(), dest=src, tag=_REP)

    @classmethod
    def _loop(cls, rank: int, size: int) -> None:
        frame, since = None, 0.0
        threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        while not cls._stop.is_set():
            timeout = _cfg.timeout
            cls._stop.wait(min(0.2, max(0.02, timeout / 20)))
            if timeout <= 0 or cls._stop.is_set():
                continue
            try:
                if threaded:
                    cls._serve()
                f = _main_frame()
                if not _in_collective(f):
                    frame = None
                    continue
                now = time.monotonic()
                if f is not frame:
                    frame, since = f, now
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
        if threaded and size > 1:
            for r in range(size):
                if r != rank:
                    comm.isend(("status", rank), dest=r, tag=_REQ)
            deadline = time.monotonic() + 3.0
            st = MPI.Status()
            while len(reports) < size and time.monotonic() < deadline:
                cls._serve()                                   # another rank may be asking too
                if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REP, status=st):
                    reports[st.Get_source()] = comm.recv(source=st.Get_source(), tag=_REP)
                else:
                    time.sleep(0.01)
        lines = [f"[tessera watchdog] rank {rank}: {mine['what'] or 'a collective'} has not completed "
                 f"after {waited:.1f} s (TESSERA_TIMEOUT={_cfg.timeout:g}); ending the job "
                 f"(exit code {WATCHDOG_EXIT_CODE}).", "  what every rank is doing:"]
        for r in range(size):
            rep = reports.get(r)
            if rep is None:
                lines.append(f"    rank {r}: no answer within 3 s (dead, or its main thread holds the GIL)")
            elif rep["pending"]:
                lines.append(f"    rank {r} ({rep['host']}): {rep['pending']}")
            else:
                lines.append(f"    rank {r} ({rep['host']}): not in a collective; main thread at {rep['stack']}")
        if any(rep["flight"] for rep in reports.values()):
            lines.append(f"  flight recorder (last {_cfg.ring.maxlen} collectives per rank, oldest first):")
            for r in sorted(reports):
                lines.append(f"    rank {r}:")
                lines += [f"      {c}" for c in reports[r]["flight"]] or ["      (none)"]
        else:
            lines.append("  (flight recorder off: TESSERA_DEBUG=flight or =collectives records the last collectives)")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        for c in list(_NCCL_COMMS):
            try:
                c.abort()
            except Exception:
                pass
        time.sleep(0.3)          # let mpiexec forward the report before the abort kills the pipes
        MPI.COMM_WORLD.Abort(WATCHDOG_EXIT_CODE)


atexit.register(_Watchdog.stop)
