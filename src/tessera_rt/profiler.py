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
  ``enable_nvtx()``) emits the ranges without profiling; without a profiler attached NVTX
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
from collections import defaultdict

from ._format import human_bytes
from .dist.tensor.dispatch import compute_region
from .dist.comm.hooks import SEAM, bytes_copied, count_copy  # noqa: F401  (re-exported: the profile's figure)

__all__ = ["Profile", "profile", "enable_nvtx", "overlap_ratio", "active_profiles", "compute_region",
           "count_copy", "bytes_copied"]

def active_profiles() -> list:
    """The profiles recording now (innermost last)."""
    return [p for p in SEAM.op_watchers if isinstance(p, Profile)]


_COLL_BUS = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}


# --------------------------------------------------------------------------- NVTX

class _Nvtx:
    def __init__(self):
        import nvtx
        self._nvtx = nvtx
        self._dom = nvtx.get_domain("tessera")
        self._attrs: dict = {}

    def _attr(self, name: str, role: str):
        a = self._attrs.get((name, role))
        if a is None:
            a = self._attrs[(name, role)] = self._dom.get_event_attributes(
                message=name, color="green" if role == "compute" else "orange", category=role)
        return a

    def push(self, name: str, role: str) -> None:
        self._dom.push_range(self._attr(name, role))

    def pop(self) -> None:
        self._dom.pop_range()

    def start(self, name: str, role: str):
        return self._dom.start_range(self._attr(name, role))

    def end(self, rid) -> None:
        self._dom.end_range(rid)


_NVTX: list = []


def _nvtx_listening() -> bool:
    """True when a tool collects NVTX ranges: Nsight Systems/Compute load their injection
    library through ``NVTX_INJECTION64_PATH``; ``TESSERA_NVTX=1`` says so for any other.
    Without one the ranges go nowhere, and their Python calls cost ~2.5 us per op."""
    env = os.environ
    return (env.get("TESSERA_NVTX", "") not in ("", "0") or "NVTX_INJECTION64_PATH" in env
            or "NVTX_INJECTION32_PATH" in env)


def _nvtx():
    if not _NVTX:
        try:
            _NVTX.append(_Nvtx())
        except Exception:           # nvtx not installed: ranges are skipped
            _NVTX.append(None)
    return _NVTX[0]


def _coll_name(call) -> str:
    dt = f" {call.dtype}[{','.join(map(str, call.shape))}]" if call.dtype else ""
    return f"{call.op}({call.axis}){dt}"


def _op_name(dec) -> str:
    return f"{dec.op} {dec.layout!r} [{','.join(map(str, dec.shape))}]"


class _NvtxOnly:
    """Hooks that only emit NVTX ranges (TESSERA_NVTX=1)."""

    def before(self, call) -> None:
        nv = _nvtx()
        if nv is None:
            return
        if call.async_op:
            call.nvtx = ("start", nv.start(_coll_name(call), call.role))
        else:
            nv.push(_coll_name(call), call.role)
            call.nvtx = ("push", None)

    def after(self, call) -> None:
        nv, p = _nvtx(), call.nvtx
        if nv is None or p is None:
            return
        call.nvtx = None
        if p[0] == "start":
            nv.end(p[1])
        else:
            nv.pop()

    def op_begin(self, dec, args) -> None:
        nv = _nvtx()
        if nv is not None:
            nv.push(_op_name(dec), "compute")

    def op_end(self, dec, args, out) -> None:
        nv = _nvtx()
        if nv is not None:
            nv.pop()


_NVTX_HOOK = _NvtxOnly()


def enable_nvtx(on: bool = True) -> None:
    """Emit an NVTX range for every op and collective (no table, no trace)."""
    for lst in (SEAM.watchers, SEAM.op_watchers):
        if on and _NVTX_HOOK not in lst:
            lst.append(_NVTX_HOOK)
        elif not on and _NVTX_HOOK in lst:
            lst.remove(_NVTX_HOOK)


class _Region:
    """``Profile.region``: the span is compute (an interval and a table row of its own)."""

    def __init__(self, prof, name: str):
        self.prof, self.name = prof, name

    def __enter__(self):
        prof = self.prof
        self.t0 = time.perf_counter() - prof._epoch
        if prof.nvtx and _nvtx() is not None:
            _nvtx().push(self.name, "compute")
        return self

    def __exit__(self, *exc):
        prof, name = self.prof, self.name
        t = time.perf_counter() - prof._epoch
        if prof.nvtx and _nvtx() is not None:
            _nvtx().pop()
        prof.compute.append((self.t0, t))
        prof._events.append({"name": name, "cat": "region", "role": "compute", "t0": self.t0, "t1": t,
                            "bytes": 0, "busbytes": 0, "flops": 0, "key": ("region", name, "", ""),
                            "async": False})


# --------------------------------------------------------------------------- intervals

def _union(iv: list) -> list:
    out: list = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap_ratio(collective: list, compute: list) -> float | None:
    """|union(collective) ∩ union(compute)| / |union(collective)| (None with no collectives)."""
    cu, pu = _union(collective), _union(compute)
    total = sum(b - a for a, b in cu)
    if total <= 0:
        return None
    hidden, j = 0.0, 0
    for a, b in cu:
        while j < len(pu) and pu[j][1] <= a:
            j += 1
        k = j
        while k < len(pu) and pu[k][0] < b:
            hidden += max(0.0, min(b, pu[k][1]) - max(a, pu[k][0]))
            k += 1
    return hidden / total


_clock = time.perf_counter
_DT: list = []                  # [DTensor], imported on the first profile (dist imports this module's users)


def _op_info(dec, args, out) -> tuple:
    """(row name, table key, flops, bytes) of a dispatcher decision's run on this rank: the
    decision is cached on its arguments' global shapes and layouts, which fix the local
    pieces' sizes.  Bytes: the output's and every DTensor argument's local piece."""
    k = 0
    if dec.op == "matmul":
        from .dist.tensor.shard import local_shape
        a = args[0]
        tgt = dec.strategy.inputs[0] if dec.strategy.inputs[0] is not None else a.layout
        k = 2 * local_shape(a.shape, tgt, a.mesh)[-1]
    nbytes = out._local.nbytes + sum(a._local.nbytes for a in args if a.__class__ is _DT[0])
    return (_op_name(dec), ("op", dec.op, repr(dec.layout), "[" + ",".join(map(str, dec.shape)) + "]"),
            k * out._local.size, nbytes)


# --------------------------------------------------------------------------- the profile

class Profile:
    """Records ops and collectives while active; see the module doc."""

    def __init__(self, *, trace: str | None = None, nvtx: bool = True, print_table: bool = True, name: str = "",
                 table: str | None = "short"):
        if table not in ("short", "full", None):
            raise ValueError(f"profile(table={table!r}): use 'short' (top ops, a line per mesh axis), 'full' "
                             "(a row per op, layout and shape) or None (print nothing)")
        if table == "short" and os.environ.get("TESSERA_PROFILE_TABLE", "") == "full":
            table = "full"
        self.trace_path, self.nvtx, self.name = trace, nvtx and _nvtx_listening(), name
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
    def __enter__(self) -> "Profile":
        from .dist.comm.process_group import world
        if not _DT:
            from .dist.tensor.dtensor import DTensor
            _DT.append(DTensor)
        w = world()
        if w.size > 1:
            w.mpi.Barrier()
        self._epoch = time.perf_counter()
        self._copied0 = bytes_copied()
        SEAM.watchers.append(self)
        SEAM.op_watchers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        from .dist.comm.process_group import world
        if self in SEAM.watchers:
            SEAM.watchers.remove(self)
        if self in SEAM.op_watchers:
            SEAM.op_watchers.remove(self)
        self.bytes_copied = bytes_copied() - self._copied0
        w = world()
        mine = (self.events, self.overlap_ratio)
        every = w.mpi.gather(mine, root=0) if w.size > 1 else [mine]
        if w.rank == 0:
            self.all_events = [e for e, _ in every]
            self.rank_overlaps = [o for _, o in every]
            if self.trace_path and exc[0] is None:
                self.write_chrome_trace(self.trace_path)
            if self.print_table and exc[0] is None:
                print(self.table(full=self.table_kind == "full"), flush=True)

    # hooks: collectives ------------------------------------------------------
    def before(self, call) -> None:
        t = time.perf_counter() - self._epoch
        if self._stack and not call.async_op:
            cur = self._stack[-1]
            self.compute.append((cur[0], t))              # the op's compute so far
        call.prof = [t, None]
        if self.nvtx:
            nv = _nvtx()
            if nv is not None:
                if call.async_op:
                    call.prof[1] = nv.start(_coll_name(call), call.role)
                else:
                    nv.push(_coll_name(call), call.role)

    def after(self, call) -> None:
        p = call.prof
        if not isinstance(p, list):
            return
        t = time.perf_counter() - self._epoch
        if self.nvtx:
            nv = _nvtx()
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
        self._events.append({"name": _coll_name(call), "cat": "collective", "role": call.role, "t0": t0, "t1": t,
                            "bytes": call.nbytes, "busbytes": busbw, "flops": 0,
                            "key": ("collective", call.op, call.axis, f"{call.dtype}[{','.join(map(str, call.shape))}]"),
                            "async": call.async_op})

    # hooks: ops ---------------------------------------------------------------
    def op_begin(self, dec, args) -> None:
        t = _clock() - self._epoch
        self._stack.append([t, t])
        if self.nvtx:
            nv = _nvtx()
            if nv is not None:
                nv.push(_op_name(dec), "compute")

    def op_end(self, dec, args, out) -> None:
        t = _clock() - self._epoch
        cursor, start = self._stack.pop()
        self.compute.append((cursor, t))
        if self.nvtx:
            nv = _nvtx()
            if nv is not None:
                nv.pop()
        if out is None:                       # the op raised
            return
        info = self._ops.get(dec)
        if info is None:                      # what the (cached) decision fixes, worked out once:
            info = self._ops[dec] = _op_info(dec, args, out)     # its local shapes fix bytes and flops
        self._events.append((info, start, t))

    def region(self, name: str) -> "_Region":
        """Mark plain-array work as compute: ``with prof.region("mlp"): ...``."""
        return _Region(self, name)

    def span(self, name: str, role: str, t0: float, t1: float) -> None:
        """Add a finished span (``time.perf_counter()`` times) on its own trace row ``role``
        (the pipeline's per-micro-batch stage timeline); in the trace only, not in the tables."""
        self._events.append({"name": name, "cat": "pipeline", "role": role, "t0": t0 - self._epoch,
                            "t1": t1 - self._epoch, "bytes": 0, "busbytes": 0, "flops": 0,
                            "key": ("pipeline", name, role, ""), "async": False})

    # results ------------------------------------------------------------------
    @property
    def overlap_ratio(self) -> float | None:
        """This rank's collective time hidden under compute, over all its collective time."""
        return overlap_ratio(self.collective, self.compute)

    def rows(self, events: list | None = None) -> list[dict]:
        """One row per (kind, op, layout/axis, shape): calls, total/mean seconds, bytes, rates."""
        events = self.events if events is None else events
        agg: dict = defaultdict(lambda: {"calls": 0, "time": 0.0, "bytes": 0, "busbytes": 0, "flops": 0})
        for e in events:
            if e["cat"] == "pipeline":     # stage timeline spans enclose the ops: trace rows only
                continue
            dur = e["t1"] - e["t0"]
            if e["cat"] == "op":           # own time: minus the blocking collectives it issued
                dur -= sum(c["t1"] - c["t0"] for c in events if c["cat"] == "collective" and not c["async"]
                           and e["t0"] <= c["t0"] and c["t1"] <= e["t1"])
            r = agg[e["key"]]
            r["calls"] += 1
            r["time"] += max(dur, 0.0)
            r["bytes"] += e["bytes"]
            r["busbytes"] += e["busbytes"]
            r["flops"] += e["flops"]
        out = []
        for key, r in agg.items():
            kind, op, where, shape = key
            t = r["time"]
            rate = (f"{r['flops'] / t / 1e12:.3f} TFLOP/s" if r["flops"] and t > 0 else
                    f"{r['busbytes'] / t / 1e9:.2f} GB/s" if r["busbytes"] and t > 0 else "-")
            out.append({"kind": kind, "op": op, "layout": where, "shape": shape, "calls": r["calls"],
                        "total_s": t, "mean_s": t / r["calls"], "bytes": r["bytes"], "achieved": rate})
        out.sort(key=lambda r: -r["total_s"])
        return out

    def table(self, full: bool = False, top: int = 8) -> str:
        """The summary (``full=False``: the ``top`` ops, a line per mesh axis, the spread over
        ranks) or the full per-(op, layout, shape) table; rank 0 sees every rank after exit."""
        if not full:
            return self._short_table(top)
        head = f"{'op':<16} {'layout/axis':<24} {'shape':<16} {'calls':>6} {'total ms':>10} {'mean us':>10} " \
               f"{'bytes':>12} {'achieved':>16}"
        lines = [f"tessera profile{' ' + self.name if self.name else ''} -- rank 0", head, "-" * len(head)]
        for r in self.rows(self.all_events[0] if self.all_events else None):
            lines.append(f"{r['op']:<16} {r['layout'][:24]:<24} {r['shape'][:16]:<16} {r['calls']:>6} "
                         f"{r['total_s'] * 1e3:>10.3f} {r['mean_s'] * 1e6:>10.1f} {r['bytes']:>12} {r['achieved']:>16}")
        if self.all_events and len(self.all_events) > 1:
            per = [{(r["kind"], r["op"], r["layout"], r["shape"]): r for r in self.rows(ev)} for ev in self.all_events]
            keys = list(dict.fromkeys(k for p in per for k in p))
            lines += ["", f"across {len(per)} ranks (total ms: min / mean / max; calls on the busiest rank)",
                      f"{'op':<16} {'layout/axis':<24} {'shape':<16} {'calls':>6} {'min':>9} {'mean':>9} {'max':>9}"]
            for k in keys:
                ts = [p[k]["total_s"] * 1e3 if k in p else 0.0 for p in per]
                calls = max(p[k]["calls"] if k in p else 0 for p in per)
                lines.append(f"{k[1]:<16} {k[2][:24]:<24} {k[3][:16]:<16} {calls:>6} {min(ts):>9.3f} "
                             f"{sum(ts) / len(ts):>9.3f} {max(ts):>9.3f}")
        lines += self._overlap_lines("\n")
        return "\n".join(lines)

    def _short_table(self, top: int) -> str:
        rows = self.rows(self.all_events[0] if self.all_events else None)
        ops: dict = defaultdict(lambda: [0, 0.0])                            # op -> calls, seconds
        axes: dict = defaultdict(lambda: [0, 0.0, 0, defaultdict(int)])     # axis -> calls, s, bytes, {op: calls}
        for r in rows:
            if r["kind"] == "collective":
                a = axes[r["layout"]]
                a[0] += r["calls"]
                a[1] += r["total_s"]
                a[2] += r["bytes"]
                a[3][r["op"]] += r["calls"]
            else:
                o = ops[r["op"]]
                o[0] += r["calls"]
                o[1] += r["total_s"]
        total = sum(o[1] for o in ops.values()) + sum(a[1] for a in axes.values())
        name = f" {self.name}" if self.name else ""
        lines = [f"tessera profile{name} -- rank 0: {total * 1e3:.1f} ms in {len(ops)} ops and "
                 f"{sum(a[0] for a in axes.values())} collectives (full table: profile(..., table='full') "
                 "or TESSERA_PROFILE_TABLE=full)"]
        ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])
        if ranked:
            lines.append(f"  {'top ops':<22} {'calls':>6} {'total ms':>10} {'share':>6}")
            for op, (calls, t) in ranked[:top]:
                lines.append(f"  {op[:22]:<22} {calls:>6} {t * 1e3:>10.3f} {t / total if total else 0:>6.0%}")
            if len(ranked) > top:
                rest = sum(v[1] for _, v in ranked[top:])
                lines.append(f"  {f'({len(ranked) - top} more ops)':<22} {'':>6} {rest * 1e3:>10.3f} "
                             f"{rest / total if total else 0:>6.0%}")
        for axis, (calls, t, nbytes, kinds) in sorted(axes.items(), key=lambda kv: -kv[1][1]):
            what = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
            lines.append(f"  axis {axis:<17} {calls:>6} {t * 1e3:>10.3f} {t / total if total else 0:>6.0%}  "
                         f"{human_bytes(nbytes)}: {what}")
        if self.all_events and len(self.all_events) > 1:
            per = [sum(r["total_s"] for r in self.rows(ev)) * 1e3 for ev in self.all_events]
            lines.append(f"  measured time over {len(per)} ranks: min {min(per):.1f} / mean "
                         f"{sum(per) / len(per):.1f} / max {max(per):.1f} ms")
        if self.bytes_copied:
            lines.append(f"  layout copies for kernels (rank 0): {human_bytes(self.bytes_copied)}")
        lines += self._overlap_lines("  ")
        return "\n".join(lines)

    def _overlap_lines(self, prefix: str) -> list[str]:
        ov = [o for o in (self.rank_overlaps or [self.overlap_ratio]) if o is not None]
        if not ov:
            return []
        return [f"{prefix}overlap ratio (collective time hidden under compute): min {min(ov):.2f}, "
                f"mean {sum(ov) / len(ov):.2f} over {len(ov)} rank(s) (goal >= 0.6)"]

    def chrome_trace(self) -> dict:
        """The Chrome/Perfetto trace of every rank (rank 0, after exit) or of this rank."""
        per_rank = self.all_events if self.all_events is not None else [self.events]
        roles = ["compute", "tp_collective", "a2a", "io"]
        ev = []
        for rank, events in enumerate(per_rank):
            ev.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            used = list(dict.fromkeys(roles + [e["role"] for e in events]))
            for tid, role in enumerate(used):
                ev.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": role}})
            for e in events:
                ev.append({"ph": "X", "name": e["name"], "cat": e["cat"], "pid": rank, "tid": used.index(e["role"]),
                           "ts": e["t0"] * 1e6, "dur": max(0.0, (e["t1"] - e["t0"]) * 1e6),
                           "args": {"bytes": e["bytes"], "flops": e["flops"], "async": e["async"]}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"producer": "tessera_rt.profiler", "overlap_ratio": self.rank_overlaps}}

    def write_chrome_trace(self, path: str) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.chrome_trace(), f)
        os.replace(tmp, path)


def profile(step_fn=None, *args, trace: str | None = None, nvtx: bool = True, print_table: bool = True,
            name: str = "", table: str | None = "short", **kwargs):
    """``profile(step_fn, *args)`` runs ``step_fn(*args)`` under a :class:`Profile` and returns
    it (``.result`` holds what step_fn returned); ``with profile(): ...`` profiles a block.
    ``table``: "short" (default), "full" or None (see the module doc)."""
    p = Profile(trace=trace, nvtx=nvtx, print_table=print_table, name=name or getattr(step_fn, "__name__", ""),
                table=table)
    if step_fn is None:
        return p
    with p:
        p.result = step_fn(*args, **kwargs)
    return p


if os.environ.get("TESSERA_NVTX", "") not in ("", "0"):
    enable_nvtx(True)
