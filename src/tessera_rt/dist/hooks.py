"""Slots the distributed core's hot paths read and the layers above fill (issue 29's seam).

The core never imports upward: a layer above plugs in by filling a slot here on import.

``TRACE`` is autodiff's: ``TRACE.tape`` is the active tape (None outside ``ts.grad``),
``TRACE.record(name, fn, args, kw, tape, argnames)`` records one op on it and ``TRACE.var``
is the traced-value type. ``tessera_rt.autodiff.tape`` fills them when it is imported;
until then nothing is ever traced, and ``differentiable`` costs one attribute read a call.
"""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["TRACE", "differentiable"]


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
