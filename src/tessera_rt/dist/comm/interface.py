"""The interface every communicator kind serves (``communicators``: MPI and host-staged;
``nccl``): one communicator per mesh-axis group, on flat contiguous buffers and element
counts."""
from __future__ import annotations

from .mpi import MPI

__all__ = ["Communicator", "REDUCE_OPS", "displacements"]

REDUCE_OPS = ("sum", "max", "min", "avg")


def displacements(counts) -> list[int]:
    """Each part's start offset (MPI's displacements) for parts of ``counts`` elements laid end
    to end."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class Communicator:
    """Interface shared by the three kinds.  ``rank``/``size`` are within the group."""

    kind = "abstract"

    def __init__(self, mpi_comm: MPI.Comm):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    def tagged(self, op: str, tag: str) -> Communicator:
        """The communicator that runs ``op`` with the ``tag`` ("tree"/"ring") hint.  MPI has no
        per-call algorithm choice (MPICH reads MPIR_CVAR_<OP>_INTRA_ALGORITHM for the run), so
        by default the hint is only recorded and this communicator serves it."""
        return self

    # What every kind serves, on flat contiguous buffers: ``blocking=False`` returns a request
    # with ``test()``/``wait_done()`` (CPU) or None (GPU: the stream orders the work).
    def all_reduce(self, send, recv, op="sum", blocking=True, stream=None):
        raise NotImplementedError

    def reduce_scatter(self, send, recv, counts=None, op="sum", blocking=True, stream=None):
        raise NotImplementedError

    def all_gather(self, send, recv, counts=None, blocking=True, stream=None):
        raise NotImplementedError

    def all_to_all(self, send, recv, send_counts=None, recv_counts=None, blocking=True, stream=None):
        raise NotImplementedError

    def broadcast(self, buf, root, blocking=True, stream=None):
        raise NotImplementedError

    def send(self, buf, peer, tag=0, blocking=True, stream=None):
        raise NotImplementedError

    def recv(self, buf, peer, tag=0, blocking=True, stream=None):
        raise NotImplementedError

    def barrier(self, blocking=True, stream=None):
        raise NotImplementedError
