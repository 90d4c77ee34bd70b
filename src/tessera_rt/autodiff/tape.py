"""The tape: traced values, the hook every differentiable entry point calls, and the
reverse sweep (seed 002 §2.5: "autodiff is first-class ... collectives generate gradient
rules").

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
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ..dist.tensor import dtensor_collectives as _dtc_routes
from ..dist.comm.hooks import EFFECT_OPS, FORWARDS, SOURCE_OPS, VJPS, differentiable, vjp_rule
from ..dist.comm.hooks import TRACE as STATE

__all__ = [
    "Var", "Tape", "differentiable", "VJPS", "FORWARDS", "vjp_rule", "no_grad", "detach", "is_traced", "current_tape",
    "EFFECT_OPS", "SOURCE_OPS",
]


class Tape:
    """The ops recorded by one ``ts.grad`` call, in program order (a topological order)."""

    __slots__ = ("nodes", "recording", "parent")

    def __init__(self):
        self.nodes: list[Var] = []
        self.recording = True
        self.parent: Tape | None = None


class Var:
    """A traced value: ``value`` plus how it was made (``op``, plain ``args``/``kw``, parents)."""

    __slots__ = ("value", "tape", "op", "args", "kw", "parents", "grad", "uses", "leaf", "name", "finish")
    __array_ufunc__ = None               # ndarray (op) Var -> Var's reflected operator
    __array_priority__ = 1000
    __hash__ = object.__hash__

    def __init__(self, value, tape: Tape, op: str | None = None, args: tuple = (), kw: dict | None = None,
                 parents: tuple = ()):
        self.value = value
        self.tape = tape
        self.op = op
        self.args = args
        self.kw = kw
        self.parents = parents           # ((arg position, Var), ...)
        self.grad = None
        self.uses = 0
        self.leaf = op is None
        self.name = None                 # a leaf's path in the argument pytree (for errors)
        self.finish = None               # a leaf's hook when its gradient is complete

    # metadata --------------------------------------------------------------------
    shape = property(lambda self: tuple(self.value.shape))
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)
    layout = property(lambda self: self.value.layout)
    mesh = property(lambda self: self.value.mesh)
    size = property(lambda self: self.value.size)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"Var({self.op or 'leaf'}: {self.value!r})"

    def __array__(self, *a, **k):
        raise TypeError("a traced value (ts.grad is differentiating through it) cannot become a NumPy "
                        "array; call ts.detach(x) for its value without a gradient")

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a traced value depends on data the gradient cannot follow; "
                        "branch on ts.detach(x) instead")

    # operators: all go through op.* (whose hooks record) -------------------------
    def __add__(self, o): return _op().add(self, o)
    def __radd__(self, o): return _op().add(o, self)
    def __sub__(self, o): return _op().sub(self, o)
    def __rsub__(self, o): return _op().sub(o, self)
    def __mul__(self, o): return _op().mul(self, o)
    def __rmul__(self, o): return _op().mul(o, self)
    def __truediv__(self, o): return _op().div(self, o)
    def __rtruediv__(self, o): return _op().div(o, self)
    def __pow__(self, o): return _op().pow(self, o)
    def __rpow__(self, o): return _op().pow(o, self)
    def __matmul__(self, o): return _op().matmul(self, o)
    def __rmatmul__(self, o): return _op().matmul(o, self)
    def __neg__(self): return _op().neg(self)
    def __pos__(self): return self
    def __abs__(self): return _op().abs(self)
    def __lt__(self, o): return _op().less(self, o)
    def __le__(self, o): return _op().less_equal(self, o)
    def __gt__(self, o): return _op().greater(self, o)
    def __ge__(self, o): return _op().greater_equal(self, o)
    def __eq__(self, o): return _op().equal(self, o)           # type: ignore[override]
    def __ne__(self, o): return _op().not_equal(self, o)       # type: ignore[override]
    def __getitem__(self, index): return _op().getitem(self, index)

    def sum(self, axis=None, keepdims: bool = False): return _op().sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims: bool = False): return _op().mean(self, axis, keepdims)
    def max(self, axis=None, keepdims: bool = False): return _op().max(self, axis, keepdims)
    def min(self, axis=None, keepdims: bool = False): return _op().min(self, axis, keepdims)
    def astype(self, dtype): return _op().astype(self, dtype)

    def transpose(self, *axes):
        return _op().transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int)
                               else (axes or None))

    @property
    def T(self): return _op().transpose(self, None)              # noqa: N802

    def reshape(self, *shape):
        return _op().reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def redistribute(self, layout): return _dtc().redistribute(self, layout)
    def full_tensor(self): return _dtc().full_tensor(self)
    def to_local(self): return _dtc().to_local(self)


_MODS: dict[str, Any] = {}


def _op():
    m = _MODS.get("op")
    if m is None:
        from .. import op as m
        _MODS["op"] = m
    return m


def _dtc():
    m = _MODS.get("dtc")
    if m is None:
        from . import dist_vjps as m
        _MODS["dtc"] = m
    return m


def current_tape() -> Tape | None:
    return STATE.tape


def is_traced(x) -> bool:
    return type(x) is Var


# --------------------------------------------------------------------------- the hook

_KINDS: dict = {}     # dtype -> "f" (float), "b" (bf16), "h" (fp16), "8" (fp8), "" (other); dtype.name is slow


def _kind(dt) -> str:
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
    return _kind(dt) != ""


def _positional(args: tuple, kw: dict, argnames: tuple) -> tuple[tuple, dict]:
    """(args, kw) with the differentiable arguments given by name moved to their positions.
    (A function of its own: a comprehension over ``kw`` in ``_call`` would make ``kw`` a
    closure cell there, a cost on every traced op.)"""
    if not any(n in kw for n in argnames):
        return args, kw
    kw, args = dict(kw), list(args)
    for i, n in enumerate(argnames):
        if n in kw:
            while len(args) <= i:
                args.append(None)
            args[i] = kw.pop(n)
    return tuple(args), kw


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
    from ..dist.comm.collectives import Work    # lazy: dist imports this module
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
        k = _kind(dt)
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
    raise ValueError(f"{name}: an argument is a traced value from another ts.grad/ts.checkpoint trace (a "
                     "value captured from outside the function); pass it to the function as an argument")


# --------------------------------------------------------------------------- no_grad, detach

class no_grad:
    """Inside the block ops on traced values run on their plain values and record nothing
    (for evaluation, metrics, and the forward of ``ts.checkpoint``).  Also a decorator."""

    def __enter__(self):
        self._tape = STATE.tape
        self._rec = self._tape.recording if self._tape is not None else None
        if self._tape is not None:
            self._tape.recording = False
        return self

    def __exit__(self, *exc):
        if self._tape is not None:
            self._tape.recording = self._rec
        return None

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with no_grad():
                return fn(*a, **k)
        return wrapped


def detach(x):
    """The plain value of ``x`` (no gradient flows through it); works on pytrees."""
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
