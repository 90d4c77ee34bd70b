"""Steps that went bad: the check that stops a run on an inf/nan loss or norm, the guard that
stops it on a finite loss far above the recent ones (a diverging run), the search for the
first bad leaf, and fp16's dynamic loss scaling."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import op
from ..autodiff.engine import tree_flatten, tree_unflatten
from ..backend import array_module
from ..dist.tensor.dtensor import DTensor
from .optimizers import _F32, _local


def _agree_on_device(values: list, mesh, op_name: str):
    """Sum (or max) 0-d values kept on the device, then reduce them over every axis of
    ``mesh`` in one all-reduce of one float64 (none on a one-rank mesh): a 0-d array on the
    device, nothing waited for."""
    from ..dist.tensor import dtensor_collectives as dc
    xp = array_module(*values)
    buf = values[0].astype(np.float64).reshape(()) if len(values) == 1 else \
        xp.stack([xp.asarray(v, dtype=np.float64) for v in values])
    buf = (buf.sum() if op_name == "sum" else buf.max()).reshape(1)
    if mesh.size() > 1:
        axis = mesh.axes if len(mesh.axes) > 1 else mesh.axes[0]
        buf = dc.all_reduce(buf, axis=axis, mesh=mesh, op=op_name)
    return buf.reshape(())


def _agree(values: list, mesh, op_name: str) -> float:
    """``_agree_on_device``'s value on the host: one host sync, however many leaves."""
    return float(_agree_on_device(values, mesh, op_name))


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step are inf or nan (``check_finite``).

    Parameters
    ----------
    message : str
        The error message.
    reason : str
        Which value was not finite (loss, norm).
    step : int, optional
        The training step.
    rank : int, optional
        The rank raising it.
    what : str
        What was searched for the first bad leaf ("gradient", ...).
    first : str, optional
        The path of this rank's first non-finite leaf, or None.
    count, total : int
        How many of how many elements hold inf/nan.
    """

    def __init__(self, message: str, *, reason: str = "", step: int | None = None, rank: int | None = None,
                 what: str = "gradient", first: str | None = None, count: int = 0, total: int = 0):
        super().__init__(message)
        self.reason, self.step, self.rank, self.what = reason, step, rank, what
        self.first, self.count, self.total = first, count, total


class LossSpikeError(NonFiniteError):
    """The loss of a step is far above the recent ones (``LossSpikeGuard``): the run is
    diverging, though every value may still be finite.  A ``NonFiniteError``, so a loop that
    stops on those stops on this too.

    Parameters
    ----------
    message : str
        The error message.
    reason : str
        The loss against the median, for a run's stop message.
    step : int, optional
        The training step.
    rank : int, optional
        The rank raising it.
    what : str
        "loss".
    first : str, optional
        None (no leaf is searched).
    count, total : int
        0.
    """


class LossSpikeGuard:
    """Stop a run whose loss jumps far above its running median (Megatron's rerun machinery
    checks a step's loss against recent ones the same way): weights that diverge stay finite
    for a step or two (|w| ~ 1e14) and would be saved over the good checkpoint before the
    loss turns nan.

    Parameters
    ----------
    factor : float
        A loss above ``factor`` x the median of the recent losses is a spike.
    window : int
        How many recent finite losses the median is over.
    warmup : int
        No check until this many losses were seen (a resumed run passes its saved ones).
    """

    def __init__(self, factor: float = 5.0, window: int = 50, warmup: int = 5):
        if not (factor > 1 and window >= 1 and warmup >= 1):
            raise ValueError(f"LossSpikeGuard(factor={factor}, window={window}, warmup={warmup}): need factor > 1, "
                             "window >= 1, warmup >= 1")
        self.factor, self.warmup = float(factor), int(warmup)
        self.recent: deque = deque(maxlen=int(window))

    def extend(self, losses: Iterable[float]) -> None:
        """Take earlier losses (a resumed run's saved ones) as if checked.

        Parameters
        ----------
        losses : iterable of float
            Oldest first.
        """
        self.recent.extend(float(v) for v in losses if math.isfinite(float(v)))

    def check(self, loss: float, step: int | None = None) -> None:
        """Raise ``LossSpikeError`` if ``loss`` is a spike; else remember it.  Pass the loss
        every rank agrees on, before the step's update, so every rank stops at the same step.

        Parameters
        ----------
        loss : float
            This step's loss (inf/nan are ``check_finite``'s business and not remembered).
        step : int, optional
            The step, for the message.
        """
        loss = float(loss)
        if not math.isfinite(loss):
            return
        if len(self.recent) >= self.warmup:
            med = float(np.median(self.recent))
            if med > 0 and loss > self.factor * med:
                reason = (f"the loss {loss:.4g} is {loss / med:.3g} x the median {med:.4g} of the last "
                          f"{len(self.recent)} steps (a spike: more than {self.factor:g} x)")
                at = f"step {step}: " if step is not None else ""
                raise LossSpikeError(f"{at}{reason}: the run is diverging; stopped before this step's update",
                                     reason=reason, step=step, rank=current_rank(), what="loss")
        self.recent.append(loss)


def non_finite_leaves(tree: Any) -> list[str]:
    """The paths of the leaves of ``tree`` whose local pieces (this rank's) hold inf or nan:
    one pass over every leaf, for after a step was found non-finite or before a save.

    Parameters
    ----------
    tree : pytree
        DTensors and arrays.

    Returns
    -------
    list of str
        The leaves' paths, e.g. ``"['blocks'][0]['attn']['wq']"``.
    """
    leaves, paths, _ = tree_flatten(tree)
    bad = []
    for x, path in zip(leaves, paths):
        a = _local(x)
        if np.dtype(a.dtype).kind in "iub":
            continue
        xp = array_module(a)
        if not bool(xp.isfinite(a).all()):
            bad.append(path)
    return bad


def current_rank():
    """This rank in the process group, or None before ``dist.init`` (messages name it)."""
    from ..dist.comm.process_group import is_initialized, world
    return world().rank if is_initialized() else None


def check_finite(loss: Any = None, norm: Any = None, *, grads: Any = None, step: int | None = None,
                 what: str = "gradient") -> None:
    """Raise ``NonFiniteError`` if ``loss`` or ``norm`` is inf or nan.

    Pass scalars every rank agrees on (the reduced loss, the global gradient norm that
    ``clip_grad_norm`` / ``global_norm`` / ``Pipeline.grad_norm`` return), so every rank
    stops at the same step; the check costs only those scalars.  Call it before
    ``opt.step``, so the non-finite update never reaches the weights.  With
    ``DynamicLossScaler``, check only steps it did not skip.

    Parameters
    ----------
    loss, norm : float, optional
        The scalars checked.
    grads : pytree, optional
        Searched only when one is not finite, to name the first leaf holding inf/nan (this
        rank's pieces).
    step : int, optional
        The step, for the message.
    what : str
        What ``grads`` are, for the message.
    """
    bad = [f"the {name} is {v}" for name, v in (("loss", loss), (f"{what} norm", norm))
           if v is not None and not math.isfinite(float(v))]
    if not bad:
        return
    rank = current_rank()
    at = f"step {step}: " if step is not None else ""
    on = f" on rank {rank}" if rank is not None else ""
    first, count, total = None, 0, 0
    found = ""
    if grads is not None:
        paths = non_finite_leaves(grads)
        count, total = len(paths), len(tree_flatten(grads)[1])
        first = paths[0] if paths else None
        found = (f"; the first non-finite {what}{on} is {first or '(the root)'} ({count} of {total} hold inf/nan)"
                 if paths else f"; every {what}{on} is finite")
    reason = " and ".join(bad)
    raise NonFiniteError(
        f"{at}{reason}{found}: stopped before this step's update. Lower the learning rate, "
        "clip the gradients (optim.clip_grad_norm), or for fp16 scale the loss (optim.DynamicLossScaler)",
        reason=reason, step=step, rank=rank, what=what, first=first, count=count, total=total)


# --------------------------------------------------------------------------- loss scaling

class DynamicLossScaler:
    """Multiply the loss by ``scale`` so fp16 gradients do not underflow; after a step
    with an inf/nan gradient (on any rank) skip it and halve the scale; after
    ``growth_interval`` clean steps double it.

    Parameters
    ----------
    init_scale : float
        The first scale.
    growth_factor : float
        The scale's factor after ``growth_interval`` clean steps.
    backoff_factor : float
        The scale's factor after a skipped step.
    growth_interval : int
        Clean steps between growths.
    min_scale : float
        The scale never goes below it.
    """

    def __init__(self, init_scale: float = 2.0 ** 15, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 200, min_scale: float = 1.0):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and init_scale > 0):
            raise ValueError("DynamicLossScaler: need growth_factor > 1, 0 < backoff_factor < 1, init_scale > 0")
        self.scale_value = float(init_scale)
        self.growth, self.backoff = float(growth_factor), float(backoff_factor)
        self.interval, self.min_scale = int(growth_interval), float(min_scale)
        self.good_steps = 0
        self.skipped = 0

    def scale(self, loss: Any) -> Any:
        """``loss * scale`` (differentiate this one).

        Parameters
        ----------
        loss : DTensor or array
            The loss.

        Returns
        -------
        DTensor or array
            The scaled loss.
        """
        return op.mul(loss, self.scale_value)

    def unscale(self, grads: Any) -> tuple[Any, bool]:
        """``(grads / scale, finite)``; ``finite`` is agreed by every rank (one all-reduce).

        Parameters
        ----------
        grads : pytree
            Gradients of the scaled loss.

        Returns
        -------
        tuple
            ``(grads / scale, finite)``.
        """
        leaves, _, struct = tree_flatten(grads)
        inv = 1.0 / self.scale_value
        out = [op.mul(g if np.dtype(g.dtype) == _F32 else op.astype(g, "float32"), inv) for g in leaves]
        # one flag per leaf, computed on the device; one host sync for all of them
        flags = [array_module(_local(g)).logical_not(array_module(_local(g)).isfinite(_local(g)).all())
                 for g in out]
        mesh = next((g.mesh for g in out if type(g) is DTensor), None)
        if mesh is not None:
            bad = _agree(flags, mesh, "max")
        else:
            bad = float(max((float(f) for f in flags), default=0.0))
        return tree_unflatten(struct, out), bad == 0.0

    def update(self, finite: bool) -> None:
        """After a step: grow the scale after ``growth_interval`` finite steps, shrink it (and count
        a skip) after a non-finite one.

        Parameters
        ----------
        finite : bool
            ``unscale``'s flag (skip the optimizer step when False).
        """
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.interval:
                self.scale_value *= self.growth
                self.good_steps = 0
        else:
            self.skipped += 1
            self.good_steps = 0
            self.scale_value = max(self.scale_value * self.backoff, self.min_scale)

    def state_dict(self) -> dict:
        """The scale and its counters (JSON values), for a resumed run to continue with.

        Returns
        -------
        dict
            ``scale``, ``good_steps``, ``skipped``.
        """
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s values.

        Parameters
        ----------
        state : dict
            ``state_dict()``'s form.
        """
        self.scale_value = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
