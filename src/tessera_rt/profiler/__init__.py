"""The profiler (seed 001 §7.7, seed 000 §7): per-op tables, NVTX ranges, a merged Chrome
trace and the overlap ratio.

    from tessera_rt import graph
    prof = graph.profile(step_fn, x)                 # runs step_fn(x) once, prints the table
    with graph.profile(trace="trace.json") as prof:  # or around any code
        step_fn(x)
    prof.overlap_ratio                               # collective time hidden under compute / all

What is measured: every DTensor op (through the dispatcher) and every collective (through
``collectives``), each with its op, layout, mesh axis and shape.  An op's time is its own
time (the collectives it issues are rows of their own); a blocking collective's time is the
call; an async one's runs from issue to the ``wait()`` that completes it.  Plain-array work
is invisible unless marked with ``prof.region(name)`` (counted as compute).

* NVTX (when a tool collects them: Nsight sets ``NVTX_INJECTION64_PATH``, or set
  ``TESSERA_NVTX=1``): each op/collective/region is an NVTX range in the ``tessera`` domain, named
  ``op layout [shape]`` / ``all_reduce(dp) float32[64,32]``, with the stream role as its
  category (compute, tp_collective, a2a, io), so Nsight Systems shows the timeline per role.
  Async collectives use start/end ranges (they do not nest).  ``TESSERA_NVTX=1`` (or
  ``enablenvtx()``) emits the ranges without profiling; without a profiler attached NVTX
  calls are no-ops.  Ranges are CPU-side (issue) ranges: on a GPU the kernels they launch
  appear under them on the CUDA rows.
* The table (printed by rank 0) is short by default: the top ops by total time (summed
  over layouts and shapes), one line per mesh axis for its collectives, the spread of the
  measured time over ranks and the overlap ratio.  ``table="full"`` (or
  ``TESSERA_PROFILE_TABLE=full``, or ``prof.table(full=True)``) gives a row per (op,
  layout/axis, shape): calls, total and mean time, bytes, achieved GB/s (collectives: bus
  bandwidth, nccl-tests style; ops: bytes read and written) or TFLOP/s (matmul), and min/
  mean/max over ranks.  ``table=None`` (or ``print_table=False``) prints nothing.
* ``trace=path``: a Chrome/Perfetto trace (``traceEvents``) of all ranks merged on rank 0, one
  pid per rank, one tid per stream role.
* ``overlap_ratio``: |collective intervals ∩ compute intervals| / |collective intervals|, from
  the recorded events (the seeds ask for >= 0.6).  On the CPU an async collective runs on its
  role's worker thread and its interval is the time the worker really spent in it, so the
  ratio measures real overlap (given a core for the worker; see the README).  On a GPU the
  interval is issue to ``wait()`` (host-side; Nsight shows the device timeline).

Entering and leaving a profile is collective (a barrier, then a gather) at world size > 1.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from ..dist.comm.hooks import SEAM, bytes_copied, count_copy
from ..dist.comm.process_group import world
from ..dist.tensor.dispatch import compute_region
from ..dist.tensor.dtensor import DTensor
from ..dist.tensor.shard import local_shape
from ..kernels import precision
from .nvtx import coll_name, enable_nvtx, nvtx_domain, nvtx_listening, op_name
from .report import ProfileReport, overlap_ratio

__all__ = ["Profile", "profile", "enable_nvtx", "overlap_ratio", "active_profiles", "compute_region",
           "count_copy", "bytes_copied"]

def active_profiles() -> list:
    """The profiles recording now.

    Returns
    -------
    list of Profile
        Innermost last.
    """
    return [p for p in SEAM.op_watchers if isinstance(p, Profile)]


_COLL_BUS = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}


class _Region:
    """``Profile.region``: the span is compute (an interval and a table row of its own)."""

    def __init__(self, prof, name: str):
        self.prof, self.name = prof, name

    def __enter__(self):
        prof = self.prof
        self.t0 = time.perf_counter() - prof._epoch
        if prof.nvtx and nvtx_domain() is not None:
            nvtx_domain().push(self.name, "compute")
        return self

    def __exit__(self, *exc):
        prof, name = self.prof, self.name
        t = time.perf_counter() - prof._epoch
        if prof.nvtx and nvtx_domain() is not None:
            nvtx_domain().pop()
        prof.compute.append((self.t0, t))
        prof._events.append({"name": name, "cat": "region", "role": "compute", "t0": self.t0, "t1": t,
                            "bytes": 0, "busbytes": 0, "flops": 0, "key": ("region", name, "", ""),
                            "async": False})


_clock = time.perf_counter


def _op_info(dec, args, out) -> tuple:
    """(row name, table key, flops, bytes) of a dispatcher decision's run on this rank: the
    decision is cached on its arguments' global shapes and layouts, which fix the local
    pieces' sizes.  Bytes: the output's and every DTensor argument's local piece."""
    k = 0
    if dec.op == "matmul":
        a = args[0]
        tgt = dec.strategy.inputs[0] if dec.strategy.inputs[0] is not None else a.layout
        k = 2 * local_shape(a.shape, tgt, a.mesh)[-1]
    nbytes = out._local.nbytes + sum(a._local.nbytes for a in args if a.__class__ is DTensor)
    return (op_name(dec), ("op", dec.op, repr(dec.layout), "[" + ",".join(map(str, dec.shape)) + "]"),
            k * out._local.size, nbytes)


# --------------------------------------------------------------------------- the profile

class Profile(ProfileReport):
    """Records ops and collectives while active (``with Profile(): ...``); see the module doc.

    Parameters
    ----------
    trace : str or None
        Write the Chrome/Perfetto trace of every rank here (rank 0, at exit).
    nvtx : bool
        Emit NVTX ranges too, when a tool collects them.
    print_table : bool
        Print the table at exit (rank 0); False is ``table=None``.
    name : str
        Shown in the table's title.
    table : str or None
        "short" (the top ops, a line per mesh axis), "full" (a row per op, layout and shape)
        or None (print nothing).
    """

    def __init__(self, *, trace: str | None = None, nvtx: bool = True, print_table: bool = True, name: str = "",
                 table: str | None = "short"):
        if table not in ("short", "full", None):
            raise ValueError(f"profile(table={table!r}): use 'short' (top ops, a line per mesh axis), 'full' "
                             "(a row per op, layout and shape) or None (print nothing)")
        if table == "short" and os.environ.get("TESSERA_PROFILE_TABLE", "") == "full":
            table = "full"
        self.trace_path, self.nvtx, self.name = trace, nvtx and nvtx_listening(), name
        self.table_kind = table if print_table else None
        self.print_table = self.table_kind is not None
        # this rank's events (name, cat, role, t0, t1, bytes, flops, key): ops are kept as
        # (info, t0, t1) while the profile runs and become dicts when ``events`` is read
        self._events: list = []
        self._done = 0                          # _events[:_done] are dicts
        self.compute: list = []                 # compute intervals (s, relative to the epoch)
        self.collective: list = []
        self.result = None
        self.all_events: list | None = None     # rank 0 after exit: every rank's events
        self.rank_overlaps: list | None = None
        self._stack: list = []                  # open ops: [t_cursor]
        self._ops: dict = {}                    # decision -> _op_info(decision)
        self._epoch = 0.0
        self._copied0 = 0
        self.bytes_copied = 0                   # layout copies while active (this rank; see count_copy)
        self.precisions: dict = {}              # (op, precision, provider) -> kernel calls (kernels.precision.note)
        self.fallbacks: dict = {}               # (op, why the providers declined) -> own-kernel calls

    @property
    def events(self) -> list[dict]:
        """This rank's events, one dict each (name, cat, role, t0, t1, bytes, busbytes, flops,
        key, async)."""
        ev = self._events
        for i in range(self._done, len(ev)):
            e = ev[i]
            if type(e) is tuple:
                info, t0, t1 = e
                ev[i] = {"name": info[0], "cat": "op", "role": "compute", "t0": t0, "t1": t1, "bytes": info[3],
                         "busbytes": info[3], "flops": info[2], "key": info[1], "async": False}
        self._done = len(ev)
        return ev

    # lifecycle ---------------------------------------------------------------
    def __enter__(self) -> Profile:
        w = world()
        if w.size > 1:
            w.mpi.Barrier()
        self._epoch = time.perf_counter()
        self._copied0 = bytes_copied()
        SEAM.watchers.append(self)
        SEAM.op_watchers.append(self)
        precision.add_listener(self._noted)
        return self

    def _noted(self, op: str, prec: str, provider: str | None = None, why: str | None = None) -> None:
        key = (op, prec, provider)
        self.precisions[key] = self.precisions.get(key, 0) + 1
        if why:
            k = (op, why)
            self.fallbacks[k] = self.fallbacks.get(k, 0) + 1

    def __exit__(self, *exc) -> None:
        if self in SEAM.watchers:
            SEAM.watchers.remove(self)
        if self in SEAM.op_watchers:
            SEAM.op_watchers.remove(self)
        precision.remove_listener(self._noted)
        self.bytes_copied = bytes_copied() - self._copied0
        w = world()
        mine = (self.events, self.overlap_ratio)
        every = w.mpi.gather(mine, root=0) if w.size > 1 else [mine]
        if every is not None:                   # (rank 0's)
            self.all_events = [e for e, _ in every]
            self.rank_overlaps = [o for _, o in every]
            if self.trace_path and exc[0] is None:
                self.write_chrome_trace(self.trace_path)
            if self.print_table and exc[0] is None:
                print(self.table(full=self.table_kind == "full"), flush=True)

    # hooks: collectives ------------------------------------------------------
    def before(self, call: Any) -> None:
        """Watcher hook: a collective is about to be issued (``hooks.SEAM.watchers``).

        Parameters
        ----------
        call : dist's Call record
            The collective's record (op, role, bytes, group); this hook may set attributes on it.
        """
        t = time.perf_counter() - self._epoch
        if self._stack and not call.async_op:
            cur = self._stack[-1]
            self.compute.append((cur[0], t))              # the op's compute so far
        call.prof = [t, None]
        if self.nvtx:
            nv = nvtx_domain()
            if nv is not None:
                if call.async_op:
                    call.prof[1] = nv.start(coll_name(call), call.role)
                else:
                    nv.push(coll_name(call), call.role)

    def after(self, call: Any) -> None:
        """Watcher hook: the collective of :meth:`before` has been issued (or completed).

        Parameters
        ----------
        call : dist's Call record
            The same record :meth:`before` saw.
        """
        p = call.prof
        if not isinstance(p, list):
            return
        t = time.perf_counter() - self._epoch
        if self.nvtx:
            nv = nvtx_domain()
            if nv is not None:
                nv.end(p[1]) if p[1] is not None else nv.pop()
        if self._stack and not call.async_op:
            self._stack[-1][0] = t
        n = call.group_size
        busbw = call.nbytes * (2 * (n - 1) / n if call.op == "all_reduce" else (n - 1) / n) \
            if call.op in _COLL_BUS and n > 1 else call.nbytes
        t0, ran = p[0], call.ran
        if ran is not None and ran.t1 is not None:
            # a CPU worker ran it: count the time it really ran, not issue-to-wait
            t0, t = ran.t0 - self._epoch, ran.t1 - self._epoch
        self.collective.append((t0, t))
        self._events.append({"name": coll_name(call), "cat": "collective", "role": call.role, "t0": t0, "t1": t,
                            "bytes": call.nbytes, "busbytes": busbw, "flops": 0,
                            "key": ("collective", call.op, call.axis, f"{call.dtype}[{','.join(map(str, call.shape))}]"),
                            "async": call.async_op})

    # hooks: ops ---------------------------------------------------------------
    def op_begin(self, dec: Any, args: tuple) -> None:
        """Op-watcher hook: a DTensor op's dispatch begins (``hooks.SEAM.op_watchers``).

        Parameters
        ----------
        dec : Decision
            The dispatcher's decision for the op (its name and layouts).
        args : tuple
            The op's arguments.
        """
        t = _clock() - self._epoch
        self._stack.append([t, t])
        if self.nvtx:
            nv = nvtx_domain()
            if nv is not None:
                nv.push(op_name(dec), "compute")

    def op_end(self, dec: Any, args: tuple, out: Any) -> None:
        """Op-watcher hook: the op of :meth:`op_begin` has returned.

        Parameters
        ----------
        dec : Decision
            The dispatcher's decision for the op.
        args : tuple
            The op's arguments.
        out : object
            The op's result.
        """
        t = _clock() - self._epoch
        cursor, start = self._stack.pop()
        self.compute.append((cursor, t))
        if self.nvtx:
            nv = nvtx_domain()
            if nv is not None:
                nv.pop()
        if out is None:                       # the op raised
            return
        info = self._ops.get(dec)
        if info is None:                      # what the (cached) decision fixes, worked out once:
            info = self._ops[dec] = _op_info(dec, args, out)     # its local shapes fix bytes and flops
        self._events.append((info, start, t))

    def region(self, name: str) -> _Region:
        """Mark plain-array work as compute: ``with prof.region("mlp"): ...``.

        Parameters
        ----------
        name : str
            The region's row in the table and the trace.

        Returns
        -------
        context manager
            Times its block as compute.
        """
        return _Region(self, name)

    def span(self, name: str, role: str, t0: float, t1: float) -> None:
        """Add a finished span on a trace row of its own (the pipeline's per-micro-batch stage
        timeline); in the trace only, not in the tables.

        Parameters
        ----------
        name : str
            The span's name.
        role : str
            Its trace row.
        t0, t1 : float
            Its start and end, ``time.perf_counter()`` times.
        """
        self._events.append({"name": name, "cat": "pipeline", "role": role, "t0": t0 - self._epoch,
                            "t1": t1 - self._epoch, "bytes": 0, "busbytes": 0, "flops": 0,
                            "key": ("pipeline", name, role, ""), "async": False})

    # results ------------------------------------------------------------------
    @property
    def overlap_ratio(self) -> float | None:
        """This rank's collective time hidden under compute, over all its collective time."""
        return overlap_ratio(self.collective, self.compute)

    def write_chrome_trace(self, path: str) -> None:
        """Write ``chrome_trace()`` as JSON (atomically: a reader never sees half a file).

        Parameters
        ----------
        path : str
            The file.
        """
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.chrome_trace(), f)
        os.replace(tmp, path)


def profile(step_fn: Callable | None = None, *args: Any, trace: str | None = None, nvtx: bool = True,
            print_table: bool = True, name: str = "", table: str | None = "short", **kwargs: Any) -> Profile:
    """``profile(step_fn, *args)`` runs ``step_fn(*args)`` under a :class:`Profile` and returns
    it (``.result`` holds what step_fn returned); ``with profile(): ...`` profiles a block.

    Parameters
    ----------
    step_fn : callable or None
        What to run (None: return the Profile, for a ``with`` block).
    *args, **kwargs
        Its arguments.
    trace : str or None
        Write the merged Chrome/Perfetto trace here.
    nvtx : bool
        Emit NVTX ranges too, when a tool collects them.
    print_table : bool
        Print the table at the end (rank 0).
    name : str
        The table's title (default: ``step_fn``'s name).
    table : str or None
        "short" (default), "full" or None (see the module doc).

    Returns
    -------
    Profile
        The profile (its tables, trace and ``result``).
    """
    p = Profile(trace=trace, nvtx=nvtx, print_table=print_table, name=name or getattr(step_fn, "__name__", ""),
                table=table)
    if step_fn is None:
        return p
    with p:
        p.result = step_fn(*args, **kwargs)
    return p


if os.environ.get("TESSERA_NVTX", "") not in ("", "0"):
    enable_nvtx(True)
