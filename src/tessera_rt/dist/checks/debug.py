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
* **Default checks** (``dist.checks.consistency``): without any debug mode, each collective's signature
  is verified within its group when it is new and every 1024th call (< 1 us per call).
* **Watchdog** (on by default at world size > 1; ``TESSERA_TIMEOUT`` seconds, default 300,
  0 turns it off): a daemon thread per rank samples the main thread's stack; when the main
  thread has been inside one MPI/NCCL call (a collective, its fingerprint check, a wait on
  one, a stream synchronize) for longer than the timeout it asks every rank, over a
  duplicated world communicator served by the watchdog threads, what it is doing (pending
  collective, or the main thread's stack if it is not in one, and its flight recorder),
  prints one combined report (once per job: when several ranks time out, the lowest prints),
  with where the ranks' call histories first diverge (a skipped collective, another axis),
  which ranks finished normally and which are dead, aborts the NCCL communicators
  (``ncclCommAbort``) and calls ``MPI.COMM_WORLD.Abort(WATCHDOG_EXIT_CODE)``.  Sampling costs
  the collectives nothing.
"""
from __future__ import annotations

import os
import time
import zlib
from collections import deque

import numpy as np

from ..comm.calls import Call
from ..comm.hooks import SEAM
from ..comm.process_group import on_init
from . import consistency
from .consistency import CollectiveMismatchError, mismatch_message, site_of, user_frame

__all__ = [
    "Call", "CollectiveMismatchError", "configure", "flight_records", "format_call", "desync_enabled",
    "recorder_enabled", "watchdog_timeout", "WATCHDOG_EXIT_CODE", "register_nccl", "status", "parse_debug",
]

DEFAULT_TIMEOUT = 300.0      # ends a hung job in minutes; raise it for long first collectives


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
    timeout = DEFAULT_TIMEOUT
    ring: deque = deque(maxlen=32)
    seq = 0
    pending: Call | None = None       # the call the main thread is blocked in (recorder on)


_cfg = _Cfg()
_CHECK_COMMS: dict = {}               # mesh (or None: world) -> [dup communicator, sequence]


def desync_enabled() -> bool:
    return _cfg.desync


def recorder_enabled() -> bool:
    return _cfg.recorder


def watchdog_timeout() -> float:
    return _cfg.timeout


def parse_debug(spec) -> set[str]:
    """The ``TESSERA_DEBUG`` modes of ``spec`` (None: the environment's) this layer acts on, as a
    set ("kernels" belongs to the kernel layer and is left out); an unknown mode raises."""
    if spec is None:
        spec = os.environ.get("TESSERA_DEBUG", "")
    if spec is True:
        return {"collectives"}
    if spec is False or spec == "":
        return set()
    words = {w.strip().lower() for w in str(spec).replace(";", ",").split(",") if w.strip()}
    # "kernels" (one line per kernel call naming its provider) belongs to tessera_rt.kernels.providers
    bad = words - {"collectives", "flight", "desync", "off", "none", "0", "kernels", "providers"}
    if bad:
        raise ValueError(f"debug={spec!r}: unknown mode(s) {sorted(bad)}; use 'collectives' (desync checks and "
                         "the flight recorder), 'flight' (flight recorder only) or 'kernels' (each kernel call's provider)")
    return words - {"off", "none", "0", "kernels", "providers"}


def configure(debug=None, timeout=None, world=None) -> None:
    """Set the debug modes (``dist.init`` calls this).  ``debug``: "collectives", "flight",
    True/False or None (read ``TESSERA_DEBUG``); ``timeout``: watchdog seconds, 0 = off,
    None (read ``TESSERA_TIMEOUT``, default 300)."""
    modes = parse_debug(debug)
    _cfg.desync = bool(modes & {"collectives", "desync"})
    _cfg.recorder = _cfg.desync or "flight" in modes
    n = int(os.environ.get("TESSERA_FLIGHT_N", "32"))
    if _cfg.ring.maxlen != n:
        _cfg.ring = deque(_cfg.ring, maxlen=max(1, n))
    if timeout is None:
        env = os.environ.get("TESSERA_TIMEOUT", "").strip()
        try:
            timeout = float(env) if env else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"TESSERA_TIMEOUT={env!r} is not a number of seconds (0 turns the watchdog off)") from None
    _cfg.timeout = float(timeout)
    consistency.configure(not _cfg.desync)        # the full check replaces the default one
    SEAM.precheck = precheck if _cfg.desync else None
    if world is not None and world.size > 1:
        consistency.open_p2p_headers(world)        # send/recv headers in debug mode (init: collective)
    watchers = SEAM.watchers
    if _cfg.recorder:
        if _RECORDER not in watchers:
            watchers.append(_RECORDER)
    elif _RECORDER in watchers:
        watchers.remove(_RECORDER)
    if world is not None and _cfg.timeout > 0 and world.size > 1:
        Watchdog.start(world)
    elif _cfg.timeout <= 0:
        Watchdog.stop()


def flight_records() -> list[Call]:
    """This rank's last collectives, oldest first (empty unless the recorder is on:
    ``dist.init(debug="flight")`` or ``"collectives"``; ``TESSERA_FLIGHT_N`` of them).

    Returns
    -------
    list of Call
        Op, group, shapes, dtype and call site of each.
    """
    return list(_cfg.ring)


# --------------------------------------------------------------------------- call sites

def user_site(depth: int = 2) -> str:
    """file:line of the first caller frame outside tessera_rt (the user's call site)."""
    code, line, _ = user_frame(depth)
    return site_of(code, line)


# --------------------------------------------------------------------------- the recorder hook

def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


# cache: a call's description -> its fingerprint (crc32)
_FP_CACHE: dict = {}


class _Recorder:
    """The hook collectives call around every collective while the recorder is on."""

    def before(self, call: Call) -> None:
        code, line, meta = user_frame(2)
        call.meta = None if meta is None else (meta, None)
        call.site = site_of(code, line)
        _cfg.seq += 1
        call.seq = _cfg.seq
        call.t0 = time.monotonic()
        _cfg.ring.append(call)
        if not call.async_op:
            call.waiting = True
            _cfg.pending = call
        if _cfg.desync:
            if call.op == "send":
                consistency.p2p_send_header(call.group, call.shape, call._dt, call.extra, call.site)
            elif call.op == "recv":
                call.hdr = consistency.p2p_post_header(call.group, call.extra)
                if not call.async_op:             # async: checked in wait(), so an exchange cannot deadlock
                    hdr, call.hdr = call.hdr, None
                    consistency.p2p_check_header(hdr, call.group, call.shape, call._dt, call.extra, call.site)
            else:
                _check(call)

    def wait(self, call: Call) -> None:
        call.waiting = True
        _cfg.pending = call

    def after(self, call: Call) -> None:
        call.t1 = time.monotonic()
        if _cfg.pending is call:
            _cfg.pending = None
        if call.hdr is not None:
            hdr, call.hdr = call.hdr, None
            consistency.p2p_check_header(hdr, call.group, call.shape, call._dt, call.extra, call.site)


_RECORDER = _Recorder()


def _check_comm(mesh):
    st = _CHECK_COMMS.get(mesh)
    if st is None:
        from ..comm.process_group import world
        base = world().mpi if mesh is None else mesh._mpi
        st = _CHECK_COMMS[mesh] = [base.Dup(), 0]
    return st


class _NewGroup:
    def __init__(self, mesh, axis):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        self.name, self.ranks = ",".join(axes), mesh.group_ranks(axis)
        self.size = len(self.ranks)


def precheck(op: str, mesh, axis, x) -> None:
    """The check before a mesh group's communicator is made (that is collective too): the
    collectives call it through ``SEAM.precheck`` while the desync check is on."""
    if op in ("send", "recv"):
        return
    call = Call(op, _NewGroup(mesh, axis), x if hasattr(x, "dtype") else None, 0, mesh, None, "<new group>",
                "", False)
    code, line, meta = user_frame(2)
    call.meta = None if meta is None else (meta, None)
    call.site = site_of(code, line)
    _check(call)


def _check(call: Call) -> None:
    """Exchange fingerprints over the mesh; raise the same error on every rank on a mismatch."""
    st = _check_comm(call.mesh)
    comm = st[0]
    st[1] += 1
    mseq = st[1]
    key = (call.op, call.axis, call.dtype, call.site, call.extra, call.meta)
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
    desc = (mseq, call.op, call.axis, call.dtype, tuple(call.shape), call.site, call.extra, call.meta, call.ranks,
            call.gshape)
    everyone = comm.allgather(desc)
    raise CollectiveMismatchError(_mismatch_message(everyone, call, comm.Get_rank(), seq_ok))


def ranks_str(rs) -> str:
    return consistency.ranks_str(rs)


def _mismatch_message(everyone, call: Call, me: int, seq_ok: bool) -> str:
    from ..comm.process_group import world
    where = "the world" if call.mesh is None else repr(call.mesh)
    # mesh position -> world rank
    wranks = list(range(len(everyone))) if call.mesh is None else list(call.mesh.devices)
    if not seq_ok:
        return mismatch_message(world().rank, f"on {where} (collective #{call_seq(everyone)})",
                                [d[:8] for d in everyone], wranks,
                                "Every rank of a mesh must issue the same collectives in the same order "
                                "(check rank-dependent branches).")
    parts = []
    for gid in dict.fromkeys(d[8] for d in everyone):
        members = [(pos, d) for pos, d in enumerate(everyone) if d[8] == gid]
        shapes: dict = {}
        for pos, d in members:
            shapes.setdefault(d[9], []).append(pos)
        if len(shapes) > 1:
            d0 = members[0][1]
            ordered = sorted(shapes.values(), key=len)
            desc = "; ".join(f"{ranks_str([wranks[p] for p in ps])} {everyone[ps[0]][3]}"
                             f"[{','.join(map(str, everyone[ps[0]][4]))}] at {everyone[ps[0]][5]}"
                             for ps in ordered)
            parts.append(f"group {list(gid)} in {d0[1]}({d0[2]}): {desc}")
    return (f"rank {world().rank}: collective mismatch on {where} (collective #{everyone[0][0]}): the ranks of a "
            f"group pass shapes that do not fit together: " + " | ".join(parts)
            + ". Every rank of the group must pass the same shape (uneven parts: pass sizes=).")


def call_seq(everyone) -> str:
    seqs = sorted({d[0] for d in everyone})
    return str(seqs[0]) if len(seqs) == 1 else "/".join(map(str, seqs))


# --------------------------------------------------------------------------- the watchdog (own module)

from .watchdog import WATCHDOG_EXIT_CODE, attach_recorder, register_nccl, status
from .watchdog_thread import Watchdog

attach_recorder(_cfg, format_call)
on_init(configure)              # dist.init sets the modes (process_group does not import debug)
