"""What a GPU would pay for the work the stand-in runs: kernel launches, host syncs, copies
and casts, counted for tests (``cupy.testing.count_device_work``).

Every op the tracker records is reported here (``note_op``) with its class: ``kernel`` (a
kernel, cuBLAS call, memset or NCCL collective), ``h2d`` or ``d2h`` (a memcpy).  Host waits
(``note_sync``) and dtype conversions (``note_cast``) are reported by the code that models
them.  Counting is global, not per thread: the stream workers of tessera_rt issue device work
on their own threads and that work is part of what a step costs.
"""
from __future__ import annotations

import threading
from collections import Counter

__all__ = ["DeviceWork", "count_device_work", "note_op", "note_sync", "note_cast"]

_LOCK = threading.Lock()
_ACTIVE: list[DeviceWork] = []


class DeviceWork:
    """Counts since the ``with`` block was entered (live while it runs, frozen after).

    * ``launches``: kernel launches: every device op but host<->device memcpys (ufunc,
      reduction and function kernels, fills, device-to-device copies, cuBLAS GEMMs, RawKernel
      launches, NCCL collectives); one per op as the stand-in models CuPy's calls, so a real
      call that launches helper kernels (CUB/thrust internals) costs more: a lower bound;
    * ``syncs``: host waits for the device (stream/event/device synchronize, blocking copies
      to the host: ``get``, ``float(x)``, ``item``, ``tolist``, ``repr``, and CuPy functions
      that read a count back: ``nonzero``, boolean-mask indexing, ``unique``, ...);
    * ``h2d`` / ``d2h``: host->device / device->host copies (``h2d_bytes`` / ``d2h_bytes``);
    * ``casts``: dtype conversions of device data: ``astype`` to another dtype (a launch
      too) and implicit ones inside a kernel (an operand read as, or a result written to,
      another dtype than the loop's: no extra launch);
    * ``graph_launches``: CUDA graph launches (``cupy.cuda.Graph.launch``); each node of a
      launched graph counts as what it is (a launch, an h2d or d2h copy), with the site that
      captured it; a capture itself counts nothing (nothing runs);
    * ``ops``: every device op (``launches + h2d + d2h``);
    * ``by_kind`` / ``syncs_by_kind`` / ``casts_by_kind``: ``Counter`` of what each was
      (op names as the tracker records them, e.g. ``cupy.add``, ``RawKernel adamw``);
    * ``launch_sites`` / ``cast_sites``: ``Counter`` of the ``file:line in function`` (first
      frame outside the stand-in) that issued each launch / cast.

    ``report()`` prints all of it, for a failing assertion's message.
    """

    def __init__(self):
        self.launches = self.syncs = self.h2d = self.d2h = self.casts = self.graph_launches = 0
        self.h2d_bytes = self.d2h_bytes = 0
        self.by_kind: Counter = Counter()
        self.syncs_by_kind: Counter = Counter()
        self.casts_by_kind: Counter = Counter()
        self.launch_sites: Counter = Counter()
        self.cast_sites: Counter = Counter()

    @property
    def ops(self) -> int:
        return self.launches + self.h2d + self.d2h

    def __enter__(self) -> DeviceWork:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _ACTIVE.remove(self)

    def report(self, top: int = 20) -> str:
        lines = [f"device work: {self.launches} launches, {self.syncs} syncs, {self.h2d} h2d "
                 f"({self.h2d_bytes} B), {self.d2h} d2h ({self.d2h_bytes} B), {self.casts} casts, "
                 f"{self.graph_launches} graph launches"]
        for title, counter in (("ops by kind", self.by_kind), ("syncs", self.syncs_by_kind),
                               ("casts", self.casts_by_kind), ("launch sites", self.launch_sites),
                               ("cast sites", self.cast_sites)):
            if counter:
                lines.append(f"  {title}:")
                lines.extend(f"    {n:6d}  {k}" for k, n in counter.most_common(top))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"DeviceWork(launches={self.launches}, syncs={self.syncs}, h2d={self.h2d}, "
                f"d2h={self.d2h}, casts={self.casts}, graph_launches={self.graph_launches})")


def count_device_work() -> DeviceWork:
    """``with cupy.testing.count_device_work() as work: ...`` then ``work.launches``, ...

    Counters nest (each counts what ran while it was open) and may be opened on any thread.
    Stand-in only: real CuPy has no such function, so a test using it runs on the stand-in."""
    return DeviceWork()


def note_op(kind: str, op_class: str, nbytes: int = 0, where: str = "") -> None:
    if not _ACTIVE:
        return
    with _LOCK:
        for w in _ACTIVE:
            w.by_kind[kind] += 1
            if op_class == "h2d":
                w.h2d += 1
                w.h2d_bytes += nbytes
            elif op_class == "d2h":
                w.d2h += 1
                w.d2h_bytes += nbytes
            elif op_class == "graph":
                w.graph_launches += 1
            else:
                w.launches += 1
                w.launch_sites[where] += 1


def note_sync(kind: str) -> None:
    if not _ACTIVE:
        return
    with _LOCK:
        for w in _ACTIVE:
            w.syncs += 1
            w.syncs_by_kind[kind] += 1


def note_cast(kind: str, n: int = 1) -> None:
    if not _ACTIVE or n <= 0:
        return
    from ._tracker import caller_site
    where = caller_site()
    with _LOCK:
        for w in _ACTIVE:
            w.casts += n
            w.casts_by_kind[kind] += n
            w.cast_sites[where] += n
