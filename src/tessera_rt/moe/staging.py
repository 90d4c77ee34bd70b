"""What every dispatch step shares: ``DispatchBuffers`` (the persistent staging buffers),
``Clock`` (per-phase host times for scripts/bench_moe.py) and ``A2AStream`` (a block of
packing or unpacking work on the ``a2a`` stream, ordered against ``compute``)."""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .. import runtime as rt
from ..backend import get_backend

__all__ = ["DispatchBuffers", "Clock", "A2AStream"]


class DispatchBuffers:
    """Two sets of grow-only staging buffers, used alternately (one set per call), so the
    buffers of call i are still intact while call i+1 packs.  ``allocations`` counts the
    times a buffer had to be (re)allocated: it stops growing once the sizes are seen.

    Parameters
    ----------
    headroom : float
        A buffer grows to this multiple of the size asked for.
    """

    def __init__(self, headroom: float = 1.25):
        self._sets: list[dict] = [{}, {}]
        self._cur = 0
        self.headroom = headroom          # dropless sizes vary a little per step
        self.allocations = 0

    def flip(self) -> None:
        """Switch to the other set (once per call).
        """
        self._cur ^= 1

    def get(self, name: str, shape: tuple, dtype: DTypeLike, zero: bool = False) -> Any:
        """A buffer of the current set for ``name`` (grown when too small; counted in
        ``allocations``).

        Parameters
        ----------
        name : str
            The buffer's role.
        shape : tuple
            The shape asked for.
        dtype : dtype
            The element type.
        zero : bool
            Zero it first.

        Returns
        -------
        array
            A ``shape`` view of the buffer.
        """
        xp = get_backend().xp
        n = math.prod(shape)
        key = (name, np.dtype(dtype))
        buf = self._sets[self._cur].get(key)
        if buf is None or buf.size < n:
            buf = xp.empty(max(int(n * self.headroom), 1), dtype)
            self._sets[self._cur][key] = buf
            self.allocations += 1
        view = buf[:n].reshape(shape)
        if zero:
            view.fill(0)
        return view

    def ids(self) -> list[set]:
        """The identities of each set's buffers (tests check that the two sets alternate).

        Returns
        -------
        list of set
            Per set, its buffers' ids.
        """
        return [{id(b) for b in s.values()} for s in self._sets]


class Clock:
    """Phase times (seconds, host clock) added into ``layer.timings`` when it is a dict
    (scripts/bench_moe.py); free when it is None.  On a GPU the host clock sees issue time
    unless the caller synchronizes."""

    __slots__ = ("t", "last")

    def __init__(self, layer):
        self.t = layer.timings
        self.last = time.perf_counter() if self.t is not None else 0.0

    def lap(self, name: str) -> None:
        if self.t is not None:
            now = time.perf_counter()
            self.t[name] = self.t.get(name, 0.0) + now - self.last
            self.last = now


class A2AStream:
    """Run a block on the ``a2a`` stream: it waits for compute first, and compute waits for it
    after (the packing works on values compute made, and compute reads what it unpacks)."""

    def __enter__(self):
        self.s, self.c = rt.stream("a2a"), rt.stream("compute")
        self.s.wait_event(self.c.record())
        self.s.__enter__()
        return self

    def __exit__(self, *exc):
        self.s.__exit__(*exc)
        self.c.wait_event(self.s.record())
