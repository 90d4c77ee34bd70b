"""What a profile says from its recorded events: the per-(op, layout, shape) rows, the short
and full tables, the Chrome/Perfetto trace, and the overlap ratio of two sets of intervals.

``Profile`` (``tessera_rt.profiler``) records; this module only reads what it recorded.
"""
from __future__ import annotations

from collections import defaultdict

from ..formatting import human_bytes

__all__ = ["ProfileReport", "overlap_ratio"]


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
    """|union(collective) ∩ union(compute)| / |union(collective)|.

    Parameters
    ----------
    collective : list of (float, float)
        The collectives' intervals (start, end).
    compute : list of (float, float)
        The compute intervals.

    Returns
    -------
    float or None
        The share of collective time hidden under compute; None with no collective time.
    """
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


# --------------------------------------------------------------------------- the report

class ProfileReport:
    """The tables and the trace of a profile (``Profile`` inherits them): reads ``events``,
    ``all_events`` (every rank's, on rank 0 after exit), ``rank_overlaps``, ``overlap_ratio``,
    ``name`` and ``bytes_copied``.  Takes no parameters."""

    all_events: list | None
    rank_overlaps: list | None
    name: str
    bytes_copied: int

    # read-only: a profile works them out from what it recorded
    @property
    def events(self) -> list:
        raise NotImplementedError

    @property
    def overlap_ratio(self) -> float | None:
        raise NotImplementedError

    def rows(self, events: list | None = None) -> list[dict]:
        """One row per (kind, op, layout/axis, shape): calls, total/mean seconds, bytes, rates.

        Parameters
        ----------
        events : list of dict or None
            The events to sum (None: this rank's).

        Returns
        -------
        list of dict
            The rows, the most total time first.
        """
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
        """The summary or the full table; rank 0 sees every rank after exit.

        Parameters
        ----------
        full : bool
            False: the ``top`` ops, a line per mesh axis, the spread over ranks; True: a row per
            (op, layout, shape) and the min/mean/max over ranks.
        top : int
            How many ops the summary lists.

        Returns
        -------
        str
            The table's lines.
        """
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
        lines += self._overlap_lines("\n") + self._precision_lines("\n")
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
        lines += self._overlap_lines("  ") + self._precision_lines("  ")
        return "\n".join(lines)

    def _precision_lines(self, prefix: str) -> list[str]:
        """What the kernels computed in and who ran them (``kernels.precision.note``: every GPU
        GEMM and attention call, array or DTensor), on this rank: ``op precision/provider xN``
        (cudnn, cublaslt, cublas or own), then why the vendor providers declined where the
        project's own kernel ran instead."""
        counts = getattr(self, "precisions", None)
        if not counts:
            return []
        ops: dict = defaultdict(list)
        for key, n in sorted(counts.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
            op, prec = key[0], key[1]
            provider = key[2] if len(key) > 2 else None
            ops[op].append(f"{prec}/{provider} x{n}" if provider else f"{prec} x{n}")
        lines = [f"{prefix}kernels ran in (rank 0): " + "; ".join(f"{op} {', '.join(v)}" for op, v in ops.items())]
        for (op, why), n in sorted(getattr(self, "fallbacks", {}).items()):
            lines.append(f"{prefix}  {op}: own kernel x{n} because {why}")
        return lines

    def _overlap_lines(self, prefix: str) -> list[str]:
        ov = [o for o in (self.rank_overlaps or [self.overlap_ratio]) if o is not None]
        if not ov:
            return []
        return [f"{prefix}overlap ratio (collective time hidden under compute): min {min(ov):.2f}, "
                f"mean {sum(ov) / len(ov):.2f} over {len(ov)} rank(s) (goal >= 0.6)"]

    def chrome_trace(self) -> dict:
        """The Chrome/Perfetto trace of every rank (rank 0, after exit) or of this rank.

        Returns
        -------
        dict
            ``traceEvents`` (one pid per rank, one tid per stream role) and metadata.
        """
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
