"""mpi4py's ``MPI`` module, or a stand-in that says what to install.

``import tessera_rt`` (and ``tessera-plan``, which needs no MPI) must work on a machine with no
MPI library: mpi4py's wheels load one (the ``mpich`` extra's wheel, or a system MPI) when
``mpi4py.MPI`` is first imported and fail with a bare list of paths otherwise.  The dist modules
import ``MPI`` from here; where the library loads it is mpi4py's own module (no indirection on
the hot path), and where it does not, the first use of any ``MPI`` attribute (``dist.init()``,
a collective) raises one ImportError naming the fix.  No module-level code may touch ``MPI.*``.
"""
from __future__ import annotations

__all__ = ["MPI", "MPI_ERROR"]

INSTALL_HINT = ("tessera_rt's distributed runtime needs an MPI library that mpi4py can load: "
                "`pip install 'tessera_rt[mpich]'` (the MPICH wheel, one machine or many), or install a "
                "system MPI (Open MPI, MPICH) and `pip install --no-binary mpi4py mpi4py` against it")


class _NoMPI:
    """Every attribute access raises ImportError with the install hint and mpi4py's reason."""

    def __init__(self, reason: str):
        self._reason = reason

    def __getattr__(self, name: str):
        raise ImportError(f"{INSTALL_HINT}.  mpi4py could not load one ({self._reason}); "
                          f"needed for MPI.{name}")

    def __repr__(self) -> str:
        return f"<no MPI library: {self._reason}>"


try:
    from mpi4py import MPI
    MPI_ERROR = ""
except (ImportError, RuntimeError, OSError) as exc:     # mpi4py raises RuntimeError for a missing libmpi
    MPI_ERROR = " ".join(str(exc).split())[:300] or type(exc).__name__
    MPI = _NoMPI(MPI_ERROR)  # type: ignore[assignment]  # the module's stand-in: its every use raises
