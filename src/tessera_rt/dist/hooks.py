"""Slots the distributed core's hot paths read and the layers above fill (issue 29's seam).

The core never imports upward: a layer above plugs in by filling a slot here on import.

``TRACE`` is autodiff's: ``TRACE.tape`` is the active tape (None outside ``ts.grad``),
``TRACE.record(name, fn, args, kw, tape, argnames)`` records one op on it and ``TRACE.var``
is the traced-value type. ``tessera_rt.autodiff.tape`` fills them when it is imported;
until then nothing is ever traced, and ``differentiable`` costs one attribute read a call.
The VJP table (``vjp_rule``) is here too, so an op of the core (ring attention) registers
its rule where it is defined; autodiff reads the table.
"""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["TRACE", "differentiable", "vjp_rule", "VJPS", "FORWARDS", "EFFECT_OPS", "SOURCE_OPS"]


class _Untraced:
    """The traced-value type before autodiff is imported: no value is one."""


class Trace:
    __slots__ = ("tape", "record", "var")

    def __init__(self):
        self.tape = None
        self.record: Callable | None = None
        self.var: type = _Untraced


TRACE = Trace()


def differentiable(name: str, argnames: tuple[str, ...] = ()):
    """Wrap a public op entry point so that, under ``ts.grad``, autodiff records it.
    ``argnames``: keyword names of differentiable arguments that may also be passed by
    keyword (autodiff moves them to their position)."""
    def deco(fn):
        @functools.wraps(fn)
        def hooked(*args, **kw):
            tape = TRACE.tape
            if tape is None:
                return fn(*args, **kw)
            return TRACE.record(name, fn, args, kw, tape, argnames)
        hooked.__wrapped_op__ = name
        return hooked
    return deco


VJPS: dict[str, Callable] = {}       # op name -> rule(g, out, args, kw, needs) -> cotangent per arg
EFFECT_OPS: set[str] = set()         # ops whose VJP runs even without a cotangent (send, recv)
SOURCE_OPS: set[str] = set()         # ops recorded whenever a trace records, traced inputs or not
FORWARDS: dict[str, Callable] = {}   # op name -> forward(fn, args, kw) -> (result, saved residual)


def vjp_rule(*names: str, effect: bool = False, source: bool = False, forward: Callable | None = None):
    """Register ``rule(g, out, args, kw, needs)`` for ops ``names``: ``args`` are the plain
    positional arguments, ``out`` the plain result, ``needs[i]`` whether argument i wants a
    cotangent; returns one cotangent (or None) per positional argument.  ``forward(fn, args,
    kw)``, if given, runs the op when traced and returns ``(result, saved)``; the rule finds
    ``saved`` in ``kw["_saved"]`` (flash attention keeps its logsumexp this way).
    ``effect``: the rule runs even when no cotangent reached the op (a peer waits for its
    message); ``source``: recorded even when no argument is traced (a recv's data comes
    from a peer)."""
    def put(fn):
        for n in names:
            VJPS[n] = fn
            if forward is not None:
                FORWARDS[n] = forward
            if effect:
                EFFECT_OPS.add(n)
            if source:
                SOURCE_OPS.add(n)
        return fn
    return put
