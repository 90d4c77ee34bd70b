"""Streams per role and the overlap policy (seed 000 §3.3, §4.4).

Four roles by default: ``compute`` (kernels), ``tp_collective`` (tensor-parallel
collectives), ``a2a`` (MoE all-to-all) and ``io`` (checkpoints, prefetch).  The stream map
assigns each role a slot; roles that share a slot share one stream.  ``enable_overlap``
names the role pairs that may run at the same time; a collective role not paired with
``compute`` is serialized with it (compute waits for each of its collectives at once).
On GPU the compute stream is made CuPy's current stream when it is created (``dist.init``
does so), so ordinary CuPy calls run on it.  On the CPU the compute stream is the calling
thread and every other slot's stream has a worker thread (``backend.CpuWorkerStream``), so
collectives on it run while the caller computes.

    rt.set_stream_map({"compute": 0, "tp_collective": 1, "a2a": 2, "io": 3})
    rt.enable_overlap([("a2a", "compute"), ("tp_collective", "compute")])
"""
from __future__ import annotations

import atexit
from collections.abc import Iterable

from .backend import get_backend

__all__ = [
    "ROLES", "ROLE_STREAMS", "stream", "streams", "set_stream_map", "stream_map", "enable_overlap",
    "disable_overlap", "overlaps", "synchronize", "reset", "register_prefetch", "host_worker",
]

ROLES = ("compute", "tp_collective", "a2a", "io")
_DEFAULT_MAP = {"compute": 0, "tp_collective": 1, "a2a": 2, "io": 3}

# this module's state (set_stream_map, enable_overlap, reset): role -> stream slot, then the
# slots' streams and the caches below
_stream_map: dict[str, int] = dict(_DEFAULT_MAP)
_slots: dict[int, object] = {}            # slot -> Stream, created on first use
# role -> Stream: the hot-path cache ``stream`` fills.  Public so the collectives' hot paths
# (dist.comm.work, dist/comm/_hot.c) read it without a call; only this module writes it, and
# clears it in place (set_stream_map, reset), so a reader's reference stays the live table.
ROLE_STREAMS: dict[str, object] = {}
# None means "every role overlaps with every other" (the default).
_overlap: set[frozenset] | None = None
_host_workers: dict[str, object] = {}     # role -> a host thread for roles whose stream has none


def set_stream_map(mapping: dict[str, int]) -> None:
    """Assign roles to stream slots; roles not named keep their slot; new role names are added."""
    for role, slot in mapping.items():
        if not isinstance(role, str) or not isinstance(slot, int) or slot < 0:
            raise ValueError(
                f"set_stream_map: expected {{role: slot>=0}}, got {role!r}: {slot!r}; "
                f"roles are {sorted(_stream_map)} (new names are allowed)"
            )
    synchronize()
    _stream_map.update(mapping)
    ROLE_STREAMS.clear()
    if _slots:
        # Plain CuPy calls run on CuPy's current stream: follow compute to its new slot
        # (stream() does this only when it creates a slot, and this one may exist already).
        stream("compute").make_current()


def stream_map() -> dict[str, int]:
    return dict(_stream_map)


def stream(role: str = "compute"):
    """The stream that serves ``role``."""
    s = ROLE_STREAMS.get(role)
    if s is not None:
        return s
    try:
        slot = _stream_map[role]
    except KeyError:
        raise ValueError(f"unknown stream role {role!r}; roles are {sorted(_stream_map)}") from None
    s = _slots.get(slot)
    if s is None:
        # every stream but compute's runs beside the caller (a worker thread on the CPU)
        s = _slots[slot] = get_backend().new_stream(role, worker=slot != _stream_map["compute"])
        if slot == _stream_map["compute"]:
            # plain CuPy calls go to the current stream: make it the compute stream, so
            # collectives ordered against "compute" are ordered against the user's work
            s.make_current()
    ROLE_STREAMS[role] = s
    return s


def host_worker(role: str = "io"):
    """A worker thread for ``role``'s host-side work (``submit(fn)``, run in order; e.g. the
    checkpoint's file writes on "io"): the role's own stream where that is a CPU worker
    stream, else one made for the role here (a GPU stream or an in-order CPU stream runs no
    host code beside the caller)."""
    s = stream(role)
    if hasattr(s, "submit"):
        return s
    w = _host_workers.get(role)
    if w is None:
        from .cpu_streams import CpuWorkerStream
        w = _host_workers[role] = CpuWorkerStream(f"{role}-host")
    return w


def streams() -> dict[str, object]:
    return {role: stream(role) for role in _stream_map}


def enable_overlap(pairs: Iterable[tuple[str, str]]) -> None:
    """Allow exactly these role pairs to run concurrently; other pairs are serialized."""
    global _overlap
    chosen = set()
    for pair in pairs:
        a, b = pair
        for role in (a, b):
            if role not in _stream_map:
                raise ValueError(f"enable_overlap: unknown role {role!r} in {pair!r}; roles are {sorted(_stream_map)}")
        chosen.add(frozenset((a, b)))
    _overlap = chosen


def disable_overlap() -> None:
    """Serialize every role with compute (useful when debugging an ordering problem)."""
    global _overlap
    _overlap = set()


def overlaps(role: str, other: str = "compute") -> bool:
    if role == other:
        return False
    return _overlap is None or frozenset((role, other)) in _overlap


def synchronize() -> None:
    """Wait for all work on every role's stream."""
    for s in list(_slots.values()):
        s.synchronize()


@atexit.register
def _close_workers() -> None:
    # Before MPI_Finalize (mpi4py's, which runs after Python's exit handlers): let CPU workers
    # finish what they run, briefly, so none is inside MPI when it shuts down.
    for s in list(_slots.values()) + list(_host_workers.values()):
        close = getattr(s, "close", None)
        if close is not None:
            close(timeout=5.0)


def reset() -> None:
    """Back to the default map and overlap policy, dropping all streams (tests only; a
    worker stream that failed is dropped without raising again)."""
    global _overlap
    for s in list(_slots.values()) + list(_host_workers.values()):
        close = getattr(s, "close", None)
        s.synchronize() if close is None else close()
    _host_workers.clear()
    had_streams = bool(_slots)
    _stream_map.clear()
    _stream_map.update(_DEFAULT_MAP)
    _slots.clear()
    ROLE_STREAMS.clear()
    _overlap = None
    if had_streams:
        # a fresh compute stream, current at once: work issued from now on (even before
        # the next collective creates its own stream) must be on the stream collectives wait for
        stream("compute")


_prefetch_impl = None          # filled by tessera_rt.moe.tiers on import (the runtime sits below moe)


def set_prefetch_impl(fn) -> None:
    """Where ``register_prefetch`` sends its calls: ``tessera_rt.moe.tiers`` registers itself."""
    global _prefetch_impl
    _prefetch_impl = fn


def register_prefetch(layer, window: int = 2, tier_order=("HBM", "Grace"), policy: str = "lru_hotness",
                      stream: str = "io", budget: int | None = None):
    """Expert tiers for an ``op.moe`` layer (or a list run in order, sharing the budget): at most
    ``budget`` experts resident on the device,
    the rest in the host tier, prefetched on ``stream`` by router hotness
    (``tessera_rt.moe.tiers``; returns the tiers, whose ``stats()`` gives the hit ratio)."""
    if _prefetch_impl is None:
        raise RuntimeError("rt.register_prefetch needs tessera_rt.moe: import tessera_rt (or tessera_rt.moe) first")
    return _prefetch_impl(layer, window, tier_order, policy, stream, budget)
