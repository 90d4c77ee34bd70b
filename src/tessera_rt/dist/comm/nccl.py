"""``NcclCommunicator``: CuPy buffers over NCCL, each call issued on a CUDA stream (the GPU
kind of ``communicators``; ``make_communicator`` picks it where NCCL can serve a group)."""
from __future__ import annotations

import os
import weakref

import numpy as np

from ...dtypes import dtype_name
from .interface import Communicator, displacements
from .mpi import MPI

__all__ = ["NcclCommunicator", "NCCL_COMMS"]

# Every NCCL communicator made (weakly): the watchdog aborts them (ncclCommAbort) before MPI_Abort
NCCL_COMMS: weakref.WeakSet = weakref.WeakSet()


# NCCL's ncclDataType_t / ncclRedOp_t values (stable across NCCL 2.x releases)
_NCCL_DTYPES = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
    np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6,
    np.dtype(np.float32): 7, np.dtype(np.float64): 8,
}
try:
    import ml_dtypes
    _NCCL_DTYPES[np.dtype(ml_dtypes.bfloat16)] = 9
except ImportError:  # pragma: no cover - ml-dtypes is a base dependency
    pass
_NCCL_UINT8 = 1
_NCCL_OPS = {"sum": 0, "max": 2, "min": 3, "avg": 4}


class _GroupedP2P:
    """A non-blocking NCCL send/recv waiting for its group launch (see NcclCommunicator)."""

    __slots__ = ("_comm", "launched")

    def __init__(self, comm: NcclCommunicator):
        self._comm = comm
        self.launched = False

    def test(self) -> bool:
        return self.launched

    def wait_done(self) -> None:
        self._comm.flush()


class _TaggedNccl:
    """``NcclCommunicator.tagged``'s communicator, made on first use of anything but its
    identity (``kind``, ``mpi``, ``rank``, ``size``, ``algo_env``, what it was made with)."""

    kind = "nccl"

    def __init__(self, base: NcclCommunicator, algo: str):
        self._comm = None
        self._base, self.algo_env = base, algo
        self.mpi, self.rank, self.size = base.mpi, base.rank, base.size

    def __getattr__(self, name):         # (only for names not set above: the communicator's calls)
        if self._comm is None:
            self._comm = self._base._made_with(self.algo_env)
        return getattr(self._comm, name)

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, size={self.size}, NCCL_ALGO={self.algo_env})"


class NcclCommunicator(Communicator):
    """CuPy buffers over NCCL; every call is enqueued on ``stream`` and returns at once.

    Non-blocking sends and recvs are held back and launched together, in one NCCL group,
    by the first wait on any of them or the next other call on this communicator.  On a
    stream a lone ncclRecv blocks until the peer's matching send runs, and NCCL needs the
    halves of an exchange grouped; MPI's irecv-then-isend ring would otherwise hang.
    """

    kind = "nccl"

    def __init__(self, mpi_comm: MPI.Comm):
        super().__init__(mpi_comm)
        self._held: list = []            # (launch, request) of the held sends/recvs
        from cupy.cuda import nccl
        self._nccl = nccl
        # rank 0 of the group makes the id; MPI carries it to the others
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.raw = nccl.NcclCommunicator(self.size, uid, self.rank)
        NCCL_COMMS.add(self)           # the watchdog aborts it (ncclCommAbort) before MPI_Abort

    _ALGO_NAMES = {"tree": "Tree", "ring": "Ring"}

    def tagged(self, op: str, tag: str) -> Communicator:
        """NCCL reads NCCL_ALGO once, when a communicator is created, and takes no per-call
        choice; so a tagged all-reduce runs on a second communicator of this group created
        with NCCL_ALGO=Tree or Ring, on its first call (collectively, like the group's first;
        after that call's agreement check, so ranks passing different tags get the check's
        error instead of hanging in the creation).  NCCL has no tree for the other
        collectives: they keep this communicator."""
        if op != "all_reduce":
            return self
        cache = self.__dict__.setdefault("_by_tag", {})
        comm = cache.get(tag)
        if comm is None:
            comm = cache[tag] = _TaggedNccl(self, self._ALGO_NAMES[tag])
        return comm

    def _made_with(self, algo: str) -> NcclCommunicator:
        """A communicator of this group made with NCCL_ALGO=algo (collective over the group)."""
        old = os.environ.get("NCCL_ALGO")
        os.environ["NCCL_ALGO"] = algo
        try:
            comm = NcclCommunicator(self.mpi)
        finally:
            if old is None:
                os.environ.pop("NCCL_ALGO", None)
            else:
                os.environ["NCCL_ALGO"] = old
        comm.algo_env = algo
        return comm

    @staticmethod
    def _reduce_type(a) -> int:
        try:
            return _NCCL_DTYPES[a.dtype]
        except KeyError:
            raise TypeError(
                f"NCCL cannot reduce {dtype_name(a.dtype)}; cast to float32 or bf16 before the reduction"
            ) from None

    def all_reduce(self, send, recv, op="sum", blocking=True, stream=None):
        self.flush()
        self.raw.allReduce(send.data.ptr, recv.data.ptr, send.size, self._reduce_type(send),
                           _NCCL_OPS[op], stream.ptr)

    def reduce_scatter(self, send, recv, counts=None, op="sum", blocking=True, stream=None):
        self.flush()
        dtype, nop = self._reduce_type(send), _NCCL_OPS[op]
        if counts is None:
            self.raw.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, dtype, nop, stream.ptr)
            return
        # uneven parts: one reduce per root, grouped so NCCL schedules them together
        item = send.dtype.itemsize
        self._nccl.groupStart()
        for root, (count, off) in enumerate(zip(counts, displacements(counts))):
            dst = recv.data.ptr if root == self.rank else send.data.ptr + off * item
            self.raw.reduce(send.data.ptr + off * item, dst, count, dtype, nop, root, stream.ptr)
        self._nccl.groupEnd()

    def all_gather(self, send, recv, counts=None, blocking=True, stream=None):
        self.flush()
        item = send.dtype.itemsize
        if counts is None:
            self.raw.allGather(send.data.ptr, recv.data.ptr, send.nbytes, _NCCL_UINT8, stream.ptr)
            return
        self._nccl.groupStart()
        for root, (count, off) in enumerate(zip(counts, displacements(counts))):
            dst = recv.data.ptr + off * item
            src = send.data.ptr if root == self.rank else dst
            self.raw.broadcast(src, dst, count * item, _NCCL_UINT8, root, stream.ptr)
        self._nccl.groupEnd()

    def all_to_all(self, send, recv, send_counts=None, recv_counts=None, blocking=True, stream=None):
        self.flush()
        item = send.dtype.itemsize
        if send_counts is None:
            send_counts = recv_counts = [send.size // self.size] * self.size
        self._nccl.groupStart()
        for peer, (sc, so, rc, ro) in enumerate(zip(send_counts, displacements(send_counts),
                                                    recv_counts, displacements(recv_counts))):
            if sc:
                self.raw.send(send.data.ptr + so * item, sc * item, _NCCL_UINT8, peer, stream.ptr)
            if rc:
                self.raw.recv(recv.data.ptr + ro * item, rc * item, _NCCL_UINT8, peer, stream.ptr)
        self._nccl.groupEnd()

    def broadcast(self, buf, root, blocking=True, stream=None):
        self.flush()
        self.raw.broadcast(buf.data.ptr, buf.data.ptr, buf.nbytes, _NCCL_UINT8, root, stream.ptr)

    def _untagged(self, op: str, peer: int, tag: int) -> None:
        # NCCL has no tags: messages between two ranks match in the order they are issued.
        # Dropping a tag would pair messages the program meant to keep apart, silently.
        if tag != 0:
            raise ValueError(
                f"{op}: tag={tag} to/from group rank {peer}, but this group runs on NCCL, which has no "
                "message tags (messages between two ranks match in issue order); drop tag= and issue the "
                "sends and recvs in the same order on both ranks, or run this group on MPI (TESSERA_COMM=host)")

    def flush(self) -> None:
        """Launch the held sends and recvs as one NCCL group, in the order they were issued."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._nccl.groupStart()
        try:
            for launch, _ in held:
                launch()
        finally:
            self._nccl.groupEnd()
        for _, request in held:
            request.launched = True

    def _p2p(self, launch, blocking: bool):
        request = _GroupedP2P(self)
        self._held.append((launch, request))    # the closure keeps the buffer alive until launch
        if blocking:
            self.flush()
            return None
        return request

    def send(self, buf, peer, tag=0, blocking=True, stream=None):
        self._untagged("send", peer, tag)
        return self._p2p(lambda: self.raw.send(buf.data.ptr, buf.nbytes, _NCCL_UINT8, peer, stream.ptr), blocking)

    def recv(self, buf, peer, tag=0, blocking=True, stream=None):
        self._untagged("recv", peer, tag)
        return self._p2p(lambda: self.raw.recv(buf.data.ptr, buf.nbytes, _NCCL_UINT8, peer, stream.ptr), blocking)

    def barrier(self, blocking=True, stream=None):
        # NCCL has no barrier; the MPI group orders the hosts once the stream is drained
        self.flush()
        if stream is not None:
            stream.synchronize()
        self.mpi.Barrier()

    def abort(self) -> None:
        self.raw.abort()
