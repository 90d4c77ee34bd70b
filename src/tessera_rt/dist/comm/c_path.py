"""The plain collectives' C path: ``_hot`` (built from ``_hot.c``) loaded and set up, and a
collective wrapped with it.

A plan hit on a plain array with mesh= given, no hooks and a raw MPI call to make runs the
collective's steps in C (``collectives.prologue`` and its direct path): same order, same
plan dict, the check's remembered-site path; everything else is handed to the Python
function before anything happens.  Each wrapped collective lists what follows (op,
id(group), type, shape, dtype) in its plan key (the C side builds the same key) and the
parameters that must be None there.  TESSERA_HOT=0 keeps the Python functions (and so does
a build without a C compiler).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from ... import runtime as rt
from ...backend import CpuWorkerStream
from .hooks import SEAM
from .mesh import mesh_stacks
from .plans import _CLEARS, _PLANS

__all__ = ["load", "wrap", "pending"]


def load(routes: dict, world_group: list, in_place):
    """(the extension, whether it reads NumPy arrays' fields directly): dist/comm/_hot.c set up
    with the tables it reads live (the plan table, the collectives' ``routes`` and
    ``world_group`` list, the seam, the role streams, the mesh stacks), or (None, False)
    (TESSERA_HOT=0, or no compiler at build).  ``in_place``: ``MPI.IN_PLACE`` (None without MPI)."""
    if os.environ.get("TESSERA_HOT", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, False
    try:
        from . import _hot
    except ImportError:
        return None, False
    probe = np.zeros((3, 4), np.int16)[:, ::2]       # setup checks the array fields it reads on this
    fields = _hot.setup(_PLANS, _CLEARS, routes, SEAM, rt.ROLE_STREAMS, CpuWorkerStream, in_place, *mesh_stacks(),
                        world_group, np.ndarray, probe, probe.shape, probe.dtype)
    return _hot, fields


def wrap(hot, fn, key: tuple, none: tuple = ()):
    """``fn`` with its repeat path in C: ``key`` lists what follows (op, id(group), type, shape,
    dtype) in its plan key (``prologue``'s args; the C side builds the same key), ``none`` the
    parameters that must be None there.  ``fn`` itself without the extension (``hot`` None)."""
    if hot is None:
        return fn
    return functools.update_wrapper(hot.Collective(getattr(hot, fn.__name__.upper()), fn, key, none), fn)


def pending():
    """(call number, plan, x, thread id) of the collective a thread is in through the C path
    (from its check to the end of its MPI call, which leaves no Python frame of its own), or
    None: none, or no extension (the watchdog's report reads it)."""
    try:
        from . import _hot
    except ImportError:
        return None
    return _hot.pending()
