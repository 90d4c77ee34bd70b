"""What a pipeline step measured: per-stage busy and idle time, the bubble, peak live
activations; and the per-micro-batch spans put on the profiler's Chrome trace."""
from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import theory_bubble

__all__ = ["PipelineStats", "record_spans"]


@dataclass
class PipelineStats:
    """``busy[s]``: seconds stage s spent computing its forwards and backwards; ``wall[s]``:
    from the step's start (the stages start together, after the signature all_gather) to
    its last action; the step takes ``max(wall)``, and a stage's idle time is that minus
    its busy time (waiting on a neighbour, or done early), as in the textbook bubble;
    ``peak_live[s]``: the most micro-batches whose activations it held at once.

    Parameters
    ----------
    schedule : str
        The schedule run.
    pp : int
        Pipeline stages.
    microbatches : int
        Micro-batches per step.
    virtual : int
        Chunks per rank.
    loss : float
        The step's loss.
    busy, wall : list of float
        Per stage, seconds.
    peak_live : list of int
        Per stage.
    """
    schedule: str
    pp: int
    microbatches: int
    virtual: int
    loss: float
    busy: list = field(default_factory=list)
    wall: list = field(default_factory=list)
    peak_live: list = field(default_factory=list)

    @property
    def step(self) -> float:
        return max(self.wall)

    @property
    def idle(self) -> list:
        return [self.step - b for b in self.busy]

    @property
    def stage_bubble(self) -> list:
        return [i / self.step if self.step > 0 else 0.0 for i in self.idle]

    @property
    def bubble(self) -> float:
        """The measured idle fraction, averaged over stages."""
        return sum(self.stage_bubble) / len(self.stage_bubble)

    @property
    def theory(self) -> float:
        return theory_bubble(self.schedule, self.pp, self.microbatches, self.virtual)

    def __str__(self) -> str:
        rows = [f"pipeline {self.schedule} pp={self.pp} microbatches={self.microbatches}"
                + (f" virtual={self.virtual}" if self.virtual > 1 else "")
                + f": bubble {self.bubble:.1%} measured, {self.theory:.1%} in theory"]
        for s in range(self.pp):
            rows.append(f"  stage {s}: busy {self.busy[s] * 1e3:8.2f} ms  idle {self.idle[s] * 1e3:8.2f} ms  "
                        f"bubble {self.stage_bubble[s]:6.1%}  peak live activations {self.peak_live[s]}")
        return "\n".join(rows)


def record_spans(stage: int, spans: list) -> None:
    """Put each forward/backward of this stage on the active profilers' traces: one row
    ("pp stage s") per rank, one span per micro-batch (``F3``, ``B3`` / chunk ``c``)."""
    from ..profiler import active_profiles
    profs = active_profiles()
    if not profs:
        return
    for prof in profs:
        for kind, c, mb, t0, t1 in spans:
            name = f"{kind}{mb}" + (f" chunk {c}" if c else "") if kind != "R" else f"grad reduce chunk {c}"
            prof.span(name, f"pp stage {stage}", t0, t1)
