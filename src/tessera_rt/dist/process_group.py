"""The process group: who this rank is, which GPU it drives, and the world communicator.

``init()`` bootstraps from mpi4py's COMM_WORLD, so ``mpiexec -n 4 python x.py`` (or
``tessera-run -n 4 x.py``) gives four ranks and a plain ``python x.py`` gives one.  On a
GPU machine each rank takes the GPU at its node-local rank (modulo the GPUs on the node);
the NCCL unique id of each group travels over MPI when the group's communicator is made.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field

from mpi4py import MPI

from .. import runtime
from ..backend import Backend, get_backend
from .comm import Communicator, make_communicator

__all__ = ["World", "init", "world", "is_initialized", "get_rank", "get_world_size", "abort"]


@dataclass(frozen=True)
class Seat:
    """Where one rank runs: its host, its rank among the host's ranks, and its GPU."""
    rank: int
    host: str
    local_rank: int
    device: int | None


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    backend: Backend
    mpi: MPI.Comm
    seats: tuple[Seat, ...]
    comm_preference: str = ""
    _comm: Communicator | None = field(default=None, repr=False)

    @property
    def device(self) -> int | None:
        return self.backend.device_id if self.backend.is_gpu else None

    def topology_order(self) -> list[int]:
        """World ranks ordered host by host, then by local rank, so that consecutive mesh
        positions (the innermost mesh axis) share a node and its NVLink domain."""
        host_index: dict[str, int] = {}
        for seat in self.seats:
            host_index.setdefault(seat.host, len(host_index))
        return [s.rank for s in sorted(self.seats, key=lambda s: (host_index[s.host], s.local_rank))]

    def communicator(self) -> Communicator:
        """The communicator over all ranks (made on first use; collective)."""
        if self._comm is None:
            self._comm = make_communicator(self.mpi, self.backend, self.comm_preference)
        return self._comm


_WORLD: World | None = None


def init(*, comm: str | None = None, debug=None, timeout: float | None = None) -> World:
    """Join the process group (idempotent).  ``comm`` forces "mpi", "nccl" or "host"
    (``TESSERA_COMM`` does the same); by default NCCL serves GPU groups it can serve.

    ``debug="collectives"`` (or ``TESSERA_DEBUG=collectives``) checks before every collective
    that all ranks of the mesh issue the same one and keeps a flight recorder; ``"flight"``
    keeps only the recorder.  ``timeout`` (``TESSERA_TIMEOUT``, default 600 s, 0 = off) is the
    watchdog's limit on one collective (see ``dist.debug``).  Given to a later call, they
    change the modes (every rank must pass the same)."""
    global _WORLD
    if _WORLD is not None:
        if debug is not None or timeout is not None:
            from . import debug as _debug
            _debug.configure(debug, timeout, _WORLD)
        return _WORLD
    prefer = (comm or os.environ.get("TESSERA_COMM", "")).strip().lower()
    if prefer not in ("", "mpi", "nccl", "host"):
        raise ValueError(f"comm={prefer!r}: use 'mpi', 'nccl' or 'host' (or leave it unset)")
    world_comm = MPI.COMM_WORLD
    rank, size = world_comm.Get_rank(), world_comm.Get_size()
    node = world_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    backend = get_backend()
    if backend.is_gpu:
        backend.use_device(local_rank % backend.device_count())
        runtime.stream("compute")         # created on this GPU and made CuPy's current stream
    host = MPI.Get_processor_name()
    seats = tuple(Seat(*s) for s in world_comm.allgather((rank, host, local_rank, backend.device_id)))
    _WORLD = World(rank, size, local_rank, local_size, host, backend, world_comm, seats, prefer)
    from . import debug as _debug
    _debug.configure(debug, timeout, _WORLD)
    if size > 1 and os.environ.get("TESSERA_ABORT_ON_ERROR", "1") != "0":
        _install_excepthook(rank)
    return _WORLD


def _install_excepthook(rank: int) -> None:
    """An uncaught exception on one rank ends the whole job (also without ``python -m mpi4py``):
    the traceback is printed with the rank, then MPI_Abort stops every rank."""
    previous = sys.excepthook

    def hook(etype, value, tb):
        if etype is KeyboardInterrupt or etype is SystemExit:
            return previous(etype, value, tb)
        sys.stderr.write(f"[rank {rank}] uncaught {etype.__name__}; aborting the job:\n"
                         + "".join(traceback.format_exception(etype, value, tb)))
        sys.stderr.flush()
        time.sleep(0.3)          # let mpiexec forward the traceback before the abort kills the pipes
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def world() -> World:
    """The process group, joining it first if needed."""
    return _WORLD if _WORLD is not None else init()


def is_initialized() -> bool:
    return _WORLD is not None


def get_rank() -> int:
    return world().rank


def get_world_size() -> int:
    return world().size


def abort(code: int = 1) -> None:
    """End every rank of the job now (what an uncaught exception does under tessera-run)."""
    MPI.COMM_WORLD.Abort(code)
