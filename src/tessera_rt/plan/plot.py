"""``tessera-plan --plot``: memory per GPU against predicted step time for every candidate,
the feasible Pareto frontier drawn through, the seed's recipes labelled."""
from __future__ import annotations

from typing import Any

from .timing import duration

__all__ = ["plot_candidates", "pareto_frontier"]


def pareto_frontier(cands: list) -> list:
    """Feasible candidates no other feasible one beats on both memory and step time,
    ordered by memory."""
    feas = sorted((c for c in cands if c.feasible), key=lambda c: (c.memory["total"], c.step_time["total"]))
    out, best = [], float("inf")
    for c in feas:
        if c.step_time["total"] < best:
            out.append(c)
            best = c.step_time["total"]
    return out


def plot_candidates(cands: list, path: str, *, title: str = "", hbm: float | None = None) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("tessera-plan --plot needs matplotlib (pip install matplotlib)") from e
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles: list[tuple[bool, dict[str, Any]]] = [(False, dict(c="0.7", marker="x", label="infeasible")),
                                                 (True, dict(c="tab:blue", marker="o", label="feasible"))]
    for feas, style in styles:
        pts = [c for c in cands if c.feasible == feas and not c.label]
        ax.scatter([c.memory["total"] / 1e9 for c in pts], [c.step_time["total"] * 1e3 for c in pts], s=18, **style)
    front = pareto_frontier(cands)
    if front:
        ax.plot([c.memory["total"] / 1e9 for c in front], [c.step_time["total"] * 1e3 for c in front], "-",
                c="tab:green", lw=1.5, label="feasible frontier")
    labelled = sorted((c for c in cands if c.label), key=lambda c: c.step_time["total"])
    for i, c in enumerate(labelled):
        x, y = c.memory["total"] / 1e9, c.step_time["total"] * 1e3
        ax.scatter([x], [y], marker="*", s=120, c="tab:red" if c.feasible else "tab:orange", zorder=3)
        # labels fan out to the right, one row each, so neighbouring recipes stay readable
        ax.annotate(f"{c.label}: {c.config.label()} ({duration(c.step_time['total'])})", (x, y), fontsize=7,
                    xytext=(0.62, 0.05 + 0.07 * i), textcoords="axes fraction",
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.4"))
    limit = 3 * hbm if hbm else None
    if limit and max(c.memory["total"] for c in cands) > limit:
        ax.set_xlim(0, limit / 1e9)                      # far-off infeasible points would hide the frontier
    if hbm:
        ax.axvline(hbm / 1e9, c="k", ls="--", lw=1, label="HBM per GPU")
    ax.set_xlabel("memory per GPU (GB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")      # labels that run past the axes stay whole
    plt.close(fig)
    return path
