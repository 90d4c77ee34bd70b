"""Redistribution plans: from one layout to another, chosen, cached and run.

A ``RedistributionPlan`` is a list of ``Step``s (``plan_steps``): by default one mesh axis per
step, each exactly one collective or one local action.  When that takes several steps, the same
change without a change of pending reductions can also run as one direct all_to_all(v)
over the group of axes that shard the changed dims.  The registered cost model
(``dist.cost``) picks the cheaper of the two; ties keep the steps.  Each step's predicted
time is part of the plan's printout.

Plans are pure functions of (global shape, layouts, mesh, itemsize, cost model) and this
rank's mesh position, so they are cached (a new cost model clears the cache).  A plan runs
one way (``RedistributionPlan.run``): compiled once, on its first run, into communicator calls
and local copies (``compiled_plan``), which every run takes -- watched or not;
``dist/comm/_hot.c`` runs the same compiled form for a repeat.
"""
from __future__ import annotations

from functools import lru_cache

from ...deprecation import aliases
from ..comm import collectives as C
from ..comm.hooks import SEAM
from ..comm.mesh import Mesh
from .cost import get_cost_model, on_change, plan_time, step_time
from .layout import Layout
from .plan_steps import Step, direct_step, one_axis_steps

# RedistributionPlan.run's repeat path in C (guard, the check's remembered site, the compiled
# function), with the collectives' C path; None keeps it in Python (TESSERA_HOT=0, no compiler)
_fast_run = C.HOT.run_compiled if C.HOT is not None else None

__all__ = ["Step", "RedistributionPlan", "plan_redistribute"]


class RedistributionPlan:
    """The steps from ``src`` to ``dst`` for a tensor of global ``shape`` on ``mesh``
    (``plan_redistribute`` makes them; ``run`` runs one on a rank's piece).

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    src, dst : Layout
        The layouts before and after.
    mesh : Mesh
        The mesh.
    steps : iterable of Step
        In order.
    dtype_name : str
        The element type's name.
    """

    __slots__ = ("shape", "src", "dst", "mesh", "steps", "dtype_name", "check_meta", "_exec", "_verified")

    def __init__(self, shape: tuple, src: Layout, dst: Layout, mesh: Mesh, steps: tuple, dtype_name: str) -> None:
        self.shape, self.src, self.dst, self.mesh = shape, src, dst, mesh
        self.steps: tuple[Step, ...] = tuple(steps)
        self.dtype_name = dtype_name
        # what the agreement check reports for a collective run by this plan (SEAM.moving)
        self.check_meta = (dtype_name, tuple(shape), repr(src), repr(dst))
        # (array type, dtype, input shape, compiled function, check arguments per collective)
        # once compiled (compiled_plan)
        self._exec = None
        self._verified = None            # consistency.check_run's record of the last verified run

    def run(self, x: object, out: object = None) -> object:
        """This rank's piece ``x`` in ``dst`` (written into ``out``, a C-contiguous array of the
        result's local shape and dtype, when given).  Every run takes the compiled form
        (``compiled_plan``, made on the first run; a repeat on a plain array runs it from C):
        the agreement check for every collective of the plan before the first moves data,
        then the steps; while something watches collectives each communicator call reports
        to the watchers as the array collective's does.

        Parameters
        ----------
        x : array
            This rank's piece in ``src``.
        out : array, optional
            Receives the result.

        Returns
        -------
        array
            This rank's piece in ``dst``.
        """
        ex = self._exec
        if ex is not None and _fast_run is not None:     # this path in C (dist/comm/_hot.c), or NotImplemented
            # (1: this frame, as check_run counts)
            res = _fast_run(self, x, 1) if out is None else _fast_run(self, x, 1, out)
            if res is not NotImplemented:
                return res
        if not self.steps:
            return x if out is None else _into(out, x)
        watched = SEAM.watchers
        if watched:                              # the watchers' records name the DTensor moved
            moving, SEAM.moving = SEAM.moving, self.check_meta
        try:
            if ex is None or x.__class__ is not ex[0] or x.dtype != ex[1] or x.shape != ex[2]:
                ex = self._compile(x)
            check_run = SEAM.check_run
            if check_run is not None:            # (the agreement check is on)
                check_run(self, ex[4])
            x = x if x.flags.c_contiguous else C.backend().xp.ascontiguousarray(x)
            return ex[3](x) if out is None else ex[3](x, out)
        finally:
            if watched:
                SEAM.moving = moving

    def _compile(self, x):
        """The compiled form for pieces like ``x`` (kept for the next run); makes the groups its
        steps need that do not exist yet (collectively, as on every rank)."""
        from .compiled_plan import compile_plan
        fn, in_shape, checks = compile_plan(self, C.backend(), x)
        self._exec = (x.__class__, x.dtype, in_shape, fn, checks)
        return self._exec

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps if s.is_collective)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends over the whole plan."""
        return sum(s.bytes_sent for s in self.steps)

    def step_times(self) -> list[float]:
        """Seconds the registered cost model (dist.cost) predicts for each step.

        Returns
        -------
        list of float
            One per step.
        """
        return [step_time(s, self.mesh) for s in self.steps]

    @property
    def predicted_s(self) -> float:
        """Seconds the registered cost model predicts for the whole plan."""
        return sum(self.step_times())

    @property
    def max_bytes_sent(self) -> int:
        """The most any one rank sends over the whole plan."""
        if not self.steps:
            return 0
        return max(sum(col) for col in zip(*(s.bytes_by_position for s in self.steps)))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __repr__(self) -> str:
        head = (f"redistribute {self.dtype_name}{list(self.shape)} on {self.mesh!r}: "
                f"{self.src!r} -> {self.dst!r}")
        if not self.steps:
            return head + "\n  (nothing to do)"
        lines = [head]
        times = self.step_times()
        for i, (s, t) in enumerate(zip(self.steps, times), 1):
            lines.append(f"  {i}. {s.kind:<14} over {s.axis:<6} {s.src!r} -> {s.dst!r}  [{s.detail}]  "
                         f"sends {s.bytes_sent} B (max over ranks {max(s.bytes_by_position)} B)  "
                         f"predicted {_fmt_s(t)}")
        n = len(self.collectives)
        lines.append(f"  total: {n} collective{'s' * (n != 1)}, {self.bytes_sent} B sent by this rank, "
                     f"at most {self.max_bytes_sent} B by any rank, predicted {_fmt_s(sum(times))} "
                     f"({get_cost_model().name})")
        return "\n".join(lines)

    __str__ = __repr__


def _fmt_s(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _into(out, x):
    C.backend().xp.copyto(out, x)
    return out


@lru_cache(maxsize=4096)
def _plan_cached(shape: tuple, src: Layout, dst: Layout, mesh, itemsize: int, dtype_name: str,
                 direct: bool | None = None) -> RedistributionPlan:
    if src == dst:
        return RedistributionPlan(shape, src, dst, mesh, [], dtype_name)
    stepwise = RedistributionPlan(shape, src, dst, mesh, one_axis_steps(shape, src, dst, mesh, itemsize), dtype_name)
    if direct is False or len(stepwise.collectives) == 0 or (direct is None and len(stepwise.steps) < 2):
        return stepwise
    one = direct_step(shape, src, dst, mesh, itemsize)
    if one is None:
        return stepwise
    alt = RedistributionPlan(shape, src, dst, mesh, [one], dtype_name)
    # ties keep the one-axis-per-step plan; every rank compares the same numbers
    return alt if direct or plan_time(alt) < plan_time(stepwise) * (1 - 1e-9) else stepwise


on_change(_plan_cached.cache_clear)


def plan_redistribute(shape: tuple, src: Layout, dst: Layout, mesh: Mesh, dtype: object, *,
                      direct: bool | None = None) -> RedistributionPlan:
    """The (cached) plan taking a tensor of global ``shape`` from ``src`` to ``dst``.

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    src, dst : Layout
        The layouts before and after.
    mesh : Mesh
        The mesh.
    dtype : str or dtype
        The element type.
    direct : bool, optional
        None picks, by the registered cost model (``dist.cost``), between the
        one-axis-per-step plan and one direct all_to_all over the axes involved (ties: the
        steps); False forces the steps, True the direct all_to_all where one applies (the
        same pending reductions before and after).

    Returns
    -------
    RedistributionPlan
        The plan (cached per shape, layouts, mesh and dtype).
    """
    import numpy as np

    from ...dtypes import dtype_name
    dt = np.dtype(dtype)
    return _plan_cached(tuple(shape), src, dst, mesh, dt.itemsize, dtype_name(dt), direct)


# renamed (issue 41: one name per thing; ``Plan`` was also dist.comm's per-call plan)
__getattr__ = aliases(__name__, {"Plan": ("tessera_rt.dist.RedistributionPlan", lambda: RedistributionPlan)})
