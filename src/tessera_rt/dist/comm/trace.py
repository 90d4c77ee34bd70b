"""What watches collectives: the hook list every collective consults, and
``trace_collectives`` (records with the bytes each rank sends, nccl-tests' bus factors)."""
from __future__ import annotations

from dataclasses import dataclass

from .calls import Call
from .hooks import SEAM

__all__ = ["bus_factor", "CollectiveRecord", "TAGS", "trace_collectives"]


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw/algbw factor: what each rank must move for ``op`` over ``n`` ranks.

    Parameters
    ----------
    op : str
        "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", ...
    n : int
        The group size.

    Returns
    -------
    float
        E.g. ``2 (n - 1) / n`` for all_reduce.
    """
    if n <= 1:
        return 0.0 if op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all") else 1.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n}.get(op, 1.0)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: op, group, local shapes, and the bytes this rank sends.

    Parameters
    ----------
    op : str
        The collective.
    axis : str
        The mesh axes of its group.
    group_size : int
        Ranks in the group.
    shape : tuple
        This rank's input shape.
    dtype : str
        The element type.
    bytes_sent : int
        What this rank sends.
    algo : str
        The algorithm a ``dist.ccl`` op ran (ring, line, library, hierarchical).
    tag : str
        The tree/ring hint the call carried.
    """
    op: str
    axis: str
    group_size: int
    shape: tuple
    dtype: str
    bytes_sent: int
    algo: str = ""          # the algorithm a dist.ccl op ran (ring, line, library, hierarchical)
    tag: str = ""           # the tree/ring hint the call carried (seed 000 §3.6)

    def __str__(self) -> str:
        how = "".join(f" {k}={v}" for k, v in (("algo", self.algo), ("tag", self.tag)) if v)
        return (f"{self.op}({self.axis}, n={self.group_size}) {self.dtype}{list(self.shape)} "
                f"sends {self.bytes_sent} B{how}")


# The algorithm hints a collective may carry (see the module docstring for their effect).
TAGS = ("tree", "ring")


# Everything that watches collectives is one entry of the seam's list (dist.comm.hooks), so a
# collective with nothing watching pays one list check.
_HOOKS = SEAM.watchers


class trace_collectives:
    """Record every collective this rank issues inside the block.

        with dist.trace_collectives() as log:
            y = x @ w
        assert log.count("all_gather") == 0
    """

    def __init__(self):
        self.records: list[CollectiveRecord] = []

    def __enter__(self) -> trace_collectives:
        _HOOKS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _HOOKS.remove(self)

    def before(self, call: Call) -> None:
        """Record ``call`` (the collectives' hook; barriers are not recorded).

        Parameters
        ----------
        call : Call
            The collective about to run.
        """
        if call.op == "barrier":
            return
        sent = int(round(call.nbytes * bus_factor(call.op, call.group_size)))
        self.records.append(CollectiveRecord(call.op, call.axis, call.group_size, call.shape, call.dtype, sent,
                                             tag=call.tag))

    def count(self, op: str | None = None) -> int:
        """How many collectives of ``op`` (all with None) the block issued.

        Parameters
        ----------
        op : str, optional
            The collective's name.

        Returns
        -------
        int
            The count.
        """
        return sum(1 for r in self.records if op is None or r.op == op)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)
