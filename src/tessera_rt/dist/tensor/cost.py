"""The cost hook: predicted seconds of redistribution steps, for choices made inside ``dist``.

``dist`` makes two choices by predicted time: which operand keeps its sharding when a
DTensor op's operand layouts conflict (``rules.solve``), and whether a layout change runs
as today's one-axis-per-step plan or as one direct all_to_all (``redistribute``).  Both ask
the registered ``CostModel``.  The built-in one is an alpha-beta model with nccl-tests' bus
factors (the same as ``dist.bus_factor`` and ``plan.timing``); ``tessera_rt.plan`` sits
above ``dist`` and registers its calibrated model through ``set_cost_model`` (arrows point
down: ``dist`` never imports ``plan``).

Sizes follow nccl-tests: ``size`` is the all_reduce/reduce_scatter input, the all_gather
output, the all_to_all per-rank buffer, so one collective costs
``latency_steps x alpha + size x bus_factor / bandwidth``.

Choices depend on the model, so a new model clears the cached plans and dispatch decisions
(``on_change``).  Every input to a choice is the same on every rank (global shapes, layouts,
the most any rank sends), so every rank makes the same choice.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..comm.trace import bus_factor

__all__ = ["CostModel", "AlphaBeta", "set_cost_model", "get_cost_model", "on_change", "step_time",
           "plan_time", "collective_time"]

# all_reduce as a ring: reduce_scatter then all_gather, 2(n-1) latency steps
_LATENCY_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


class CostModel(Protocol):
    """What ``dist`` asks: seconds for one collective (nccl-tests ``size`` in bytes, ``n``
    ranks) and for one local copy of ``nbytes``.  ``name`` is shown by explain."""
    name: str

    def collective_time(self, op: str, size: float, n: int) -> float: ...

    def copy_time(self, nbytes: float) -> float: ...


class AlphaBeta:
    """``steps x (n-1) x alpha + size x bus_factor / bw`` per collective, ``nbytes x 2 / mem_bw``
    per local copy (read + write).  Defaults: uncalibrated CPU ranks over MPI on one host
    (plan's `local` preset before calibration); pass a cluster's numbers for GPUs."""

    def __init__(self, alpha: float = 30e-6, bw: float = 2e9, mem_bw: float = 10e9, name: str = "alpha-beta"):
        if alpha < 0 or bw <= 0 or mem_bw <= 0:
            raise ValueError(f"AlphaBeta(alpha={alpha}, bw={bw}, mem_bw={mem_bw}): alpha must be >= 0 s and "
                             "the bandwidths > 0 bytes/s")
        self.alpha, self.bw, self.mem_bw, self.name = float(alpha), float(bw), float(mem_bw), name

    def collective_time(self, op: str, size: float, n: int) -> float:
        if n <= 1 or size <= 0:
            return 0.0
        return _LATENCY_STEPS.get(op, 1) * (n - 1) * self.alpha + size * bus_factor(op, n) / self.bw

    def copy_time(self, nbytes: float) -> float:
        return 2.0 * nbytes / self.mem_bw

    def __repr__(self) -> str:
        return f"AlphaBeta(alpha={self.alpha:.3g} s, bw={self.bw:.3g} B/s, mem_bw={self.mem_bw:.3g} B/s)"


DEFAULT = AlphaBeta(name="built-in alpha-beta")
# the cost model in use (set_cost_model) and who is told when it changes (on_change): this
# module's state, written only through those two functions
_MODEL: list = [DEFAULT]
_LISTENERS: list[Callable[[], None]] = []


def get_cost_model():
    return _MODEL[0]


def set_cost_model(model=None):
    """Register ``model`` (None: the built-in default) for every choice ``dist`` makes by
    predicted time; returns the previous model.  Call it on every rank alike (an SPMD
    program does), since the choices decide which collectives run."""
    if model is None:
        model = DEFAULT
    for attr in ("collective_time", "copy_time"):
        if not callable(getattr(model, attr, None)):
            raise TypeError(f"set_cost_model: {type(model).__name__} has no {attr}(); a cost model needs "
                            "collective_time(op, size, n) and copy_time(nbytes)")
    old = _MODEL[0]
    _MODEL[0] = model
    for fn in _LISTENERS:
        fn()
    return old


def on_change(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` (a cache clear) whenever the model changes."""
    _LISTENERS.append(fn)
    return fn


def collective_time(op: str, size: float, n: int) -> float:
    return get_cost_model().collective_time(op, size, n)


def step_time(step, mesh, model=None) -> float:
    """Predicted seconds of one plan step: the slowest rank's bytes set the time."""
    model = model or get_cost_model()
    most = max(step.bytes_by_position) if step.bytes_by_position else 0
    if step.is_collective:
        n = mesh.size(step.axis) if "," not in step.axis else _group_size(mesh, step.axis)
        f = bus_factor(step.kind, n)
        t = model.collective_time(step.kind, most / f if f else 0.0, n)
        return t + model.copy_time(step.copy_bytes) if step.copy_bytes else t
    return model.copy_time(step.copy_bytes) if step.copy_bytes else 0.0


def plan_time(plan, model=None) -> float:
    return sum(step_time(s, plan.mesh, model) for s in plan.steps)


def _group_size(mesh, axis: str) -> int:
    n = 1
    for a in axis.split(","):
        n *= mesh.size(a)
    return n
