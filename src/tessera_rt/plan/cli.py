"""``tessera-plan``: which mesh factorization to launch, with numbers.

    tessera-plan --model llama3-70b --cluster nvl72 --workload train --json
    tessera-plan --model sr-moe --cluster nvl72 --recipes --plot moe.png
    tessera-plan --model llama3-70b --cluster galaxy --workload decode --dtype fp8_e4m3 --recipes
    tessera-plan --model char --cluster local --mesh tp=2,dp=2 --remat none --batch 8
    tessera-plan --calibrate            # measure this machine, save the `local` cluster
"""
from __future__ import annotations

import argparse
import json
import sys

from .cluster import CLUSTERS, get_cluster
from .search import GB, evaluate, recipes, search
from .specs import MODELS, get_model
from .timing import duration

__all__ = ["main", "parse_mesh"]


def parse_mesh(text: str) -> dict:
    """"tp=8,ep=9" -> {"tp": 8, "ep": 9, "pp": 1, "dp": 1}."""
    out = {"tp": 1, "ep": 1, "pp": 1, "dp": 1}
    for part in filter(None, text.replace(" ", "").split(",")):
        k, _, v = part.partition("=")
        if k not in out or not v.isdigit() or int(v) < 1:
            raise ValueError(f"--mesh {text!r}: write axis=N pairs over tp, ep, pp, dp (e.g. tp=8,ep=9), "
                             f"got {part!r}")
        out[k] = int(v)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line (not argparse's usage block), exit status 2 as argparse gives."""
        self.exit(2, f"{self.prog}: error: {message} (tessera-plan --help lists the flags)\n")


def _count(low: int):
    """An argparse type: an int >= ``low`` (a negative or zero size would price nonsense)."""
    def check(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v
    check.__name__ = f"int >= {low}"
    return check


def _ranks(text: str) -> list:
    """--ranks: comma-separated group sizes, each >= 2."""
    sizes = [_count(2)(x) for x in text.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r}: give group sizes, e.g. 2,3,4")
    return sizes


def _args(argv):
    p = _Parser(prog="tessera-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="llama3-70b", help=f"a preset ({', '.join(MODELS)}) or a JSON file")
    p.add_argument("--cluster", default="nvl72", help=f"a preset ({', '.join(CLUSTERS)}, local) or a JSON file")
    p.add_argument("--workload", default="train", choices=["train", "decode"])
    p.add_argument("--batch", type=_count(1), default=None, help="global batch in sequences (default: the model's)")
    p.add_argument("--seq", type=_count(1), default=None, help="sequence length; decode: context length")
    p.add_argument("--dtype", default=None, help="compute policy dtype (op.numeric), e.g. fp8_e4m3")
    p.add_argument("--mesh", default=None, help="price one factorization, e.g. tp=8,ep=9,pp=1,dp=1")
    p.add_argument("--remat", default=None, choices=["none", "every_other", "every"], help="fix remat (with --mesh)")
    p.add_argument("--micro-batch", type=_count(1), default=None, help="fix the micro-batch (with --mesh)")
    p.add_argument("--recipes", action="store_true", help="add the seed's recipes for this cluster, labelled")
    p.add_argument("--top", type=_count(0), default=10, help="candidates to print (0: all)")
    p.add_argument("--json", action="store_true", help="print the candidates as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="memory vs step time for every candidate")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and save the `local` cluster")
    p.add_argument("--ranks", type=_ranks, default="2,3,4", help="--calibrate: group sizes to measure")
    return p.parse_args(argv)


def _table(cands: list) -> str:
    """One row per candidate; labels are never cut (the column is as wide as the longest), and
    an infeasible row says why (every rule it breaks)."""
    w = max([len(c.label) for c in cands] + [0])
    rows = [f"{'':{w}} {'tp':>3} {'ep':>3} {'pp':>3} {'dp':>3}  {'fits':4} {'GB/GPU':>7} {'step':>9} "
            f"{'compute':>9} {'exposed':>9} {'bubble':>9}  schedule, micro-batches x size, remat"]
    for c in cands:
        t, mem = c.step_time, c.memory
        sched = f"{c.config.schedule}, " if c.pp > 1 else ""
        rows.append(f"{c.label:{w}} {c.tp:>3} {c.ep:>3} {c.pp:>3} {c.dp:>3}  {'yes' if c.feasible else 'no':4} "
                    f"{mem['total'] / GB:7.3g} {duration(t['total']):>9} {duration(t['compute']):>9} "
                    f"{duration(t['exposed']):>9} {duration(t['pp_bubble']):>9}  "
                    f"{sched}{t['n_micro']} x {t['micro_batch']}, {c.config.remat}"
                    + ("" if c.feasible or not c.violations else f"  (no: {'; '.join(c.violations)})"))
    return "\n".join(rows)


def _uncalibrated(c) -> bool:
    """A cluster whose figures are stand-ins until measured (the ``local`` preset before
    ``--calibrate``): its own note says so, and the report repeats it."""
    return not c.calibrated and "uncalibrated" in c.notes.lower()


def _report(a, m, c, cands: list) -> str:
    batch, seq = a.batch or m.batch, a.seq or m.seq_len
    out = [f"{m.name} ({m.total_params() / 1e9:.3g}B params) on {c.name} ({c.n_gpus} x {c.hbm_bytes / GB:.0f} GB), "
           f"{a.workload}, global batch {batch} sequences of {seq}"
           + ("" if a.batch else " (the model's default; --batch changes it)")]
    if _uncalibrated(c):
        out.append(f"note: cluster {c.name!r}: {c.notes}")
    if not c.devices_per_node and c.topology != "host":          # host: ranks of one machine
        out.append(f"note: cluster {c.name!r} gives no devices_per_node, so tp may cross nodes; add "
                   '"devices_per_node" (e.g. 8 for H100 nodes) to the cluster file to keep tp inside a node')
    best = cands[0]
    out += [_table(cands), f"\nbest: {best.label or best.config.label()}"]
    out += [f"  - {w}" for w in best.why + best.violations]
    out.append(f"launch: {best.launch}")
    if a.plot:
        out.append(f"wrote {a.plot}")
    return "\n".join(out)


def _flag(flag: str, value: str, read):
    """``read(value)``; its error names the flag, as the CLI's user wrote it (not the Python API)."""
    try:
        return read(value)
    except ValueError as e:
        raise ValueError(f"{flag} {value}: {e}".replace("use a preset", f"pass {flag} a preset")) from None


def main(argv=None) -> int:
    a = _args(argv)
    try:
        if a.calibrate:
            from .calibrate import calibrate
            path = calibrate(ranks=a.ranks)
            print(f"saved the calibrated `local` cluster to {path}")
            return 0
        m, c = _flag("--model", a.model, get_model), _flag("--cluster", a.cluster, get_cluster)
        policy = None
        if a.dtype:
            from ..kernels.numerics import numeric
            policy = numeric(dtype=a.dtype)
        kw = dict(workload=a.workload, batch=a.batch, seq=a.seq, policy=policy)
        if a.mesh:
            knobs = {k: v for k, v in (("remat", a.remat), ("micro_batch", a.micro_batch)) if v is not None}
            cands = [evaluate(m, c, **parse_mesh(a.mesh), knobs=knobs, **kw)]
        elif a.recipes:
            everything = search(m, c, require_feasible=False, **kw)
            labelled = recipes(m, c, **kw)
            cands = labelled + everything[: (a.top or None)]
            allc = labelled + everything
        else:
            cands = search(m, c, **kw)
            allc = cands
            cands = cands[: (a.top or None)]
        if a.plot:
            from .plot import plot_candidates
            plot_candidates(allc if not a.mesh else cands, a.plot, hbm=c.hbm_bytes,
                            title=f"{m.name} on {c.name} ({a.workload})")
    except ValueError as e:
        print(f"tessera-plan: error: {e}", file=sys.stderr)
        return 2
    if a.json and _uncalibrated(c):                  # (stdout stays the JSON list)
        print(f"tessera-plan: note: cluster {c.name!r}: {c.notes}", file=sys.stderr)
    try:
        print(json.dumps([k.to_json() for k in cands], indent=1) if a.json else _report(a, m, c, cands))
    except BrokenPipeError:                          # piped into head
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
