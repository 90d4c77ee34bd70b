"""Slots the distributed core's hot paths read and the checkers fill (issue 29's seam).

The core never imports upward, and no module writes another's globals: whatever watches or
checks the hot paths plugs in by filling a slot of ``SEAM`` (one object; ``dist/comm/_hot.c``
reads the same one):

* ``check`` / ``check_plan`` / ``check_run``: the cross-rank agreement check for a call,
  a planned call and a compiled redistribution (``consistency.configure`` fills them, None
  when off); ``agreement`` is the check's state for the C path (``Agreement``: the call ring,
  the verify function, the config with ``metas`` and ``mask``); ``metas`` the same config
  while DTensor ops must note their global shapes/layouts (``dispatch`` reads it per op).
* ``watchers``: everything that watches collectives (``trace_collectives``, ``debug``'s flight
  recorder, the profiler, deterministic reductions' mark): a collective with nothing
  watching pays one list check.  ``op_watchers``: the profiler's per-op hooks (``dispatch``).
* ``det``: ``[compensated]`` while deterministic reductions are on (``determinism``), else [];
  ``fixed_order``: op -> the fixed-order reduction the collectives run then (``determinism``
  fills it on import).
* ``precheck``: the desync check a collective runs before it makes a mesh group's
  communicator (collective too); ``debug`` fills it while ``TESSERA_DEBUG=collectives`` is on.
* ``moving``: the ``check_meta`` of the redistribution plan whose steps run now (``RedistributionPlan.run``
  sets it around its step loop), so the check names the DTensor moved.
* ``notes``: what the main thread waits for, pushed by a layer above (``note(...)``: the
  pipeline's stage and micro-batch) and read by the watchdog's report.
* ``trace``: autodiff's slot (``TRACE`` below).

``count_copy(nbytes)`` counts bytes copied only to give a kernel the layout it needs (the
matmul rule's contiguous copy of an operand BLAS cannot read in place); the profiler reports
``bytes_copied()``, so a change that brings hidden copies back shows.

The user's call site is read from the interpreter stack in one place, ``user_frame`` (code
object and offset only, never a frame's locals): the agreement check keys on it, and
nothing else names the line the user called from without changing every public signature.

``TRACE`` is autodiff's: ``TRACE.tape`` is the active tape (None outside ``ts.grad``),
``TRACE.record(name, fn, args, kw, tape, argnames)`` records one op on it and ``TRACE.var``
is the traced-value type. ``tessera_rt.autodiff.tape`` fills them when it is imported;
until then nothing is ever traced, and ``differentiable`` costs one attribute read a call.
The VJP table (``vjp_rule``) is here too, so an op of the core (ring attention) registers
its rule where it is defined; autodiff reads the table.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["count_copy", "bytes_copied", "SEAM", "Seam", "Agreement", "note", "user_frame", "caller", "is_internal", "known_internal", "TRACE", "differentiable", "vjp_rule",
           "VJPS", "FORWARDS", "EFFECT_OPS", "SOURCE_OPS"]


class _Untraced:
    """The traced-value type before autodiff is imported: no value is one."""


class Trace:
    __slots__ = ("tape", "record", "var")

    def __init__(self):
        self.tape = None
        self.record: Callable | None = None
        self.var: type = _Untraced


TRACE = Trace()

_COPIED = [0]           # always counted: an add per layout copy, nothing where none is made


def count_copy(nbytes: int) -> None:
    """Count a copy made only to change an array's memory layout (a contiguity copy).

    Parameters
    ----------
    nbytes : int
        The bytes copied.
    """
    _COPIED[0] += int(nbytes)


def bytes_copied() -> int:
    """Bytes copied for layout since the process started (see ``count_copy``).

    Returns
    -------
    int
        The running total; a regression in the hot paths shows as a larger difference.
    """
    return _COPIED[0]


class Agreement:
    """The agreement check's state the C path uses (filled by ``consistency``): ``ring`` (append
    one call to the recent-call ring), ``verify(st, seq, key)``, ``cfg`` (``metas``, ``mask``)
    and ``check_plan`` (what the C path stands in for: it runs only while ``SEAM.check_plan``
    is this one)."""
    __slots__ = ("ring", "verify", "cfg", "check_plan")

    def __init__(self, ring, verify, cfg, check_plan):
        self.ring, self.verify, self.cfg, self.check_plan = ring, verify, cfg, check_plan


class Seam:
    """The one object the hot paths read (see the module docstring for each slot)."""
    __slots__ = ("check", "check_plan", "check_run", "agreement", "metas", "watchers", "op_watchers", "det",
                 "moving", "notes", "trace", "fixed_order", "precheck")

    def __init__(self):
        self.check = self.check_plan = self.check_run = self.agreement = self.metas = None
        self.watchers: list = []
        self.op_watchers: list = []
        self.det: list = []
        self.moving = None
        self.notes: list = []          # (thread ident, text), innermost last
        self.trace = TRACE
        self.fixed_order: dict = {}
        self.precheck: Callable | None = None


SEAM = Seam()


@contextlib.contextmanager
def note(text: str):
    """While the block runs, the watchdog's report says the thread waits for ``text`` (a layer
    above dist names what a wait means: the pipeline's stage and micro-batch)."""
    item = (threading.get_ident(), text)
    SEAM.notes.append(item)
    try:
        yield
    finally:
        SEAM.notes.remove(item)


# --------------------------------------------------------------------------- the user's call site

PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../tessera_rt
_INTERNAL: dict = {}              # code object -> True if it belongs to tessera_rt (or mpi4py, runpy)
caller = sys._getframe            # the frame ``depth`` calls up (the check's remembered-site test)
known_internal = _INTERNAL.get    # code -> is_internal(code), or None before it was looked at


def is_internal(code) -> bool:
    v = _INTERNAL.get(code)
    if v is None:
        f = code.co_filename
        v = _INTERNAL[code] = f.startswith(PKG_DIR) or f.startswith("<frozen") or "/mpi4py/" in f
    return v


def user_frame(depth: int, lasti: bool = False):
    """(code, line) of the first caller outside tessera_rt, ``depth`` frames up from the caller
    of this function (``lasti``: the instruction offset in place of the line)."""
    f: FrameType | None = sys._getframe(depth + 1)
    internal = _INTERNAL
    while f is not None:
        code = f.f_code
        v = internal.get(code)
        if v is None:
            v = is_internal(code)
        if not v:
            return code, f.f_lasti if lasti else f.f_lineno
        f = f.f_back
    return None, 0


def differentiable(name: str, argnames: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Wrap a public op entry point so that, under ``ts.grad``, autodiff records it.

    Parameters
    ----------
    name : str
        The op's name: the key of its VJP rule (``vjp_rule``).
    argnames : tuple of str
        Keyword names of differentiable arguments that may also be passed by keyword
        (autodiff moves them to their position).

    Returns
    -------
    callable
        A decorator; outside ``ts.grad`` the wrapped op costs one attribute read more.
    """
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


def vjp_rule(*names: str, effect: bool = False, source: bool = False,
             forward: Callable | None = None) -> Callable[[Callable], Callable]:
    """Register ``rule(g, out, args, kw, needs)`` as the VJP of ops ``names``.

    The rule gets ``args`` (the plain positional arguments), ``out`` (the plain result) and
    ``needs`` (``needs[i]``: whether argument i wants a cotangent), and returns one cotangent
    (or None) per positional argument.

    Parameters
    ----------
    *names : str
        The op names the rule serves.
    effect : bool
        The rule runs even when no cotangent reached the op (a peer waits for its message).
    source : bool
        The op is recorded even when no argument is traced (a recv's data comes from a peer).
    forward : callable, optional
        ``forward(fn, args, kw) -> (result, saved)`` runs the op when traced; the rule finds
        ``saved`` in ``kw["_saved"]`` (flash attention keeps its logsumexp this way).

    Returns
    -------
    callable
        A decorator that registers the rule and returns it unchanged.
    """
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
