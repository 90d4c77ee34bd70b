"""Recording on the tape: the hook every differentiable entry point calls, ``no_grad`` and
``detach`` (seed 002 §2.5: "autodiff is first-class ... collectives generate gradient
rules"); ``Var`` and ``Tape`` are in ``var``, the reverse sweep in ``engine``.

A ``Var`` boxes a value (an array, a DTensor, a scalar) that depends on the arguments
``ts.grad`` differentiates.  Every public op entry point is wrapped by ``differentiable``:
outside ``ts.grad`` the wrapper costs one attribute test; inside, an op that sees a Var
unwraps its arguments, runs the op on the plain values, and appends one ``Var`` (the op's
name, its plain arguments and result, its parent Vars) to the active tape.  The reverse
sweep walks the tape backwards and calls the op's VJP rule from ``VJPS`` (keyed by op
name; rules are written with ``op.*``, so one rule serves arrays and DTensors and the
dispatcher picks the gradient's layouts and collectives).

The hook itself (``differentiable``) and the slots it reads live in ``dist.comm.hooks``, below
autodiff: this module fills them on import (``STATE`` is ``dist.comm.hooks.TRACE``), so the
distributed core records on the tape without importing autodiff.

The op layer sits above: a traced value's operators (``x + y``, ``x @ w``, ``x.sum()``) call
the namespace ``tessera_rt.op`` registers here on import (``register_ops``), and its VJP rules
register into the same table; this module never imports op.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dist.comm.hooks import EFFECT_OPS, FORWARDS, SOURCE_OPS, TRACE as STATE, VJPS, differentiable, vjp_rule
from ..dist.comm.work import Work
from ..dist.tensor import dtensor_collectives as _dtc_routes
from .var import Tape, Var, current_tape, is_traced, ops, register_ops

__all__ = [
    "Var", "Tape", "differentiable", "VJPS", "FORWARDS", "vjp_rule", "no_grad", "detach", "is_traced", "current_tape",
    "EFFECT_OPS", "SOURCE_OPS", "register_ops", "ops", "float_kind",
]


# --------------------------------------------------------------------------- the hook

_KINDS: dict = {}     # dtype -> "f" (float), "b" (bf16), "h" (fp16), "8" (fp8), "" (other); dtype.name is slow


def float_kind(dt) -> str:
    """What a dtype is to differentiation: "f" (float32/64, complex), "b" (bf16), "h" (fp16),
    "8" (fp8) or "" (not differentiable: integers, bools); cached per dtype."""
    k = _KINDS.get(dt)
    if k is None:
        d = np.dtype(dt)
        n = d.name
        k = _KINDS[dt] = ("8" if "float8" in n else "b" if n == "bfloat16" else "h" if n == "float16"
                          else "f" if d.kind in "fc" else "")
    return k


def _float_like(x) -> bool:
    dt = getattr(x, "dtype", None)
    if dt is None:
        return isinstance(x, float)
    return float_kind(dt) != ""


def _positional(args: tuple, kw: dict, argnames: tuple) -> tuple[tuple, dict]:
    """(args, kw) with the differentiable arguments given by name moved to their positions.
    (A function of its own: a comprehension over ``kw`` in ``_call`` would make ``kw`` a
    closure cell there, a cost on every traced op.)"""
    if not any(n in kw for n in argnames):
        return args, kw
    kw, pos = dict(kw), list(args)
    for i, n in enumerate(argnames):
        if n in kw:
            while len(pos) <= i:
                pos.append(None)
            pos[i] = kw.pop(n)
    return tuple(pos), kw


def _call(name: str, fn: Callable, args: tuple, kw: dict, tape: Tape, argnames: tuple):
    if argnames and kw:
        args, kw = _positional(args, kw, argnames)
    parents = None
    for i, a in enumerate(args):
        if type(a) is Var:
            if parents is None:
                parents, vals = [], list(args)
            if a.tape is not tape:
                _foreign(name, a, tape)
            parents.append((i, a))
            vals[i] = a.value
    for k, v in kw.items():
        if type(v) is Var:
            raise TypeError(f"{name}: argument {k}= is a traced value but is not differentiable; pass "
                            f"ts.detach({k}) or pass it positionally")
    if parents is None:
        if name not in SOURCE_OPS or not tape.recording:
            return fn(*args, **kw)
        parents, vals = [], list(args)
    if not tape.recording:
        return fn(*vals, **kw)
    if kw.get("out") is not None:
        raise ValueError(f"{name}(out=...) writes into a buffer the gradient cannot follow; leave out= "
                         "out inside ts.grad")
    async_op = kw.get("async_op")
    if async_op:
        kw = dict(kw, async_op=False)     # traced collectives complete at once (order = tape order)
    _check_mix(name, vals)
    fwd = FORWARDS.get(name)
    if fwd is None:
        out = fn(*vals, **kw)
    else:
        out, saved = fwd(fn, vals, kw)
        kw = dict(kw, _saved=saved)
    primary = out[0] if type(out) is tuple else out
    if name not in EFFECT_OPS and not _float_like(primary):
        return out                        # comparisons, integer results: no gradient flows
    if name not in VJPS:
        raise NotImplementedError(f"{name} has no VJP rule, so ts.grad cannot differentiate through it; "
                                  f"wrap the argument in ts.detach(...) if no gradient should flow, or "
                                  f"register one with tessera_rt.autodiff.vjp_rule({name!r})")
    v = Var(primary, tape, name, tuple(vals), kw, tuple(parents))
    for _, p in parents:
        p.uses += 1
    tape.nodes.append(v)
    if name in EFFECT_OPS and not _float_like(primary):
        return _completed(out) if async_op else out      # send: nothing to trace downstream
    res = (v,) + out[1:] if type(out) is tuple else v
    return _completed(res) if async_op else res


def _completed(result):
    """The handle a traced ``async_op=True`` collective returns (it ran at once)."""
    return Work.completed(result)


def _check_mix(name: str, vals) -> None:
    """The mixed-precision policy: bf16 and fp16 never meet in one op (NumPy would silently
    pick f32 for one side and the gradient dtype would be a guess), and fp8 values are
    storage, not something to differentiate through."""
    low = None
    for a in vals:
        dt = getattr(a, "dtype", None)
        if dt is None:
            continue
        k = float_kind(dt)
        if k == "f" or k == "" or not hasattr(a, "shape"):     # (f32/f64 first: the common case)
            continue
        if k == "8":
            raise TypeError(f"{name}: an fp8 ({np.dtype(dt).name}) operand inside ts.grad; fp8 is a storage "
                            "format: dequantize to bf16/f32 (op.dequantize_fp8) or use op.fake_quantize_fp8 on "
                            "a higher-precision value")
        if k in ("b", "h"):
            if low is not None and low != k:
                shapes = ", ".join(f"{np.dtype(x.dtype).name}{list(x.shape)}" for x in vals
                                   if hasattr(x, "dtype") and hasattr(x, "shape"))
                raise TypeError(f"{name}({shapes}): bfloat16 and float16 operands in one op; the policy keeps "
                                "one low-precision type per model: cast one with op.astype(x, 'bf16') first")
            low = k


def _foreign(name: str, a: Var, tape: Tape) -> None:
    raise ValueError(f"{name}: an argument is a traced value from another ts.grad/ts.remat trace (a "
                     "value captured from outside the function); pass it to the function as an argument")


# --------------------------------------------------------------------------- no_grad, detach

class no_grad:
    """Inside the block ops on traced values run on their plain values and record nothing
    (for evaluation, metrics, and the forward of ``ts.remat``).  Also a decorator:
    ``@no_grad()``.  Takes no parameters."""

    def __enter__(self) -> no_grad:
        self._tape = STATE.tape
        self._rec = self._tape.recording if self._tape is not None else None
        if self._tape is not None:
            self._tape.recording = False
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tape is not None:
            self._tape.recording = self._rec
        return None

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with no_grad():
                return fn(*a, **k)
        return wrapped


def detach(x: Any) -> Any:
    """The plain value of ``x``: no gradient flows through it.

    Parameters
    ----------
    x : Any
        A traced value, a plain one, or a pytree (lists, tuples, dicts) of them.

    Returns
    -------
    Any
        ``x`` with every traced value replaced by its plain value.
    """
    if type(x) is Var:
        return x.value
    if isinstance(x, (list, tuple)):
        return type(x)(detach(v) for v in x)
    if isinstance(x, dict):
        return {k: detach(v) for k, v in x.items()}
    return x


# plug into the distributed core (dist.comm.hooks): ops wrapped by ``differentiable`` record here,
# DTensor operators leave traced operands to Var's reflected operators, and the collectives
# route traced values to their hooked DTensor versions
STATE.record = _call
STATE.var = Var
_dtc_routes.route_traced(Var)
