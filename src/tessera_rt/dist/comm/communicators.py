"""Communicators: one per mesh-axis group, on flat contiguous buffers.

Three kinds serve one interface (``interface.Communicator``), and ``make_communicator``
picks the kind for a group:

* ``MpiCommunicator``   NumPy buffers over an MPI communicator (the CPU path);
* ``NcclCommunicator``  CuPy buffers over NCCL, issued on a CUDA stream (in ``nccl``);
* ``HostStagedCommunicator`` CuPy buffers moved through host memory and MPI, for groups
  NCCL cannot serve (several ranks sharing one GPU, or no NCCL library).

Every method takes flat buffers and element counts; shapes, dims and layouts are the
business of the layer above (``collectives``).  Non-blocking calls return a request with
``test()`` and ``wait_done()`` (CPU) or ``None`` (GPU, where the stream orders the work).
"""
from __future__ import annotations

import os

import numpy as np

from .interface import REDUCE_OPS, Communicator, displacements
from .mpi import MPI, MPI_ERROR
from .nccl import NcclCommunicator

__all__ = [
    "Communicator", "MpiCommunicator", "NcclCommunicator", "HostStagedCommunicator",
    "REDUCE_OPS", "MPI_OPS", "make_communicator", "nccl_algo_hint",
]

# reduce op -> the MPI op that does it ("avg" sums; the caller divides).  Read by the plans
# and compiled redistribution steps that call mpi4py directly.  (Empty without an MPI
# library: import must work, the first collective says what to install.)
MPI_OPS = {} if MPI_ERROR else {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
# dtypes MPI reduces natively; others (bf16, fp8) are reduced in float32 and rounded once
_MPI_REDUCIBLE = frozenset(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
))
# dtypes mpi4py can describe to MPI (others move as bytes)
_MPI_NATIVE = _MPI_REDUCIBLE | {np.dtype(np.bool_)}


class _MpiRequest:
    """MPI request(s) plus a step to run once they finish (e.g. the avg division)."""

    __slots__ = ("_reqs", "_then")

    def __init__(self, reqs, then=None):
        self._reqs = reqs
        self._then = then

    def test(self) -> bool:
        if self._reqs is None:
            return True
        if MPI.Request.Testall(self._reqs):
            self._finish()
            return True
        return False

    def wait_done(self) -> None:
        if self._reqs is not None:
            MPI.Request.Waitall(self._reqs)
            self._finish()

    def _finish(self) -> None:
        self._reqs = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _buf(a):
    """The mpi4py buffer for ``a``: typed where MPI knows the dtype, raw bytes otherwise
    (bf16 and fp8 have no MPI type; moving them as bytes is exact)."""
    return a if a.dtype in _MPI_NATIVE else a.reshape(-1).view(np.uint8)


def _vbuf(a, counts):
    """A vector-collective buffer spec: counts in ``a``'s MPI units, with displacements."""
    if a.dtype not in _MPI_NATIVE:
        item = a.dtype.itemsize
        counts = [c * item for c in counts]
    return [_buf(a), (counts, displacements(counts))]


class MpiCommunicator(Communicator):
    """NumPy buffers over MPI.  Blocking calls use MPI's blocking collectives (lowest
    latency); equal parts use the fixed-size collectives (Allgather, Alltoall,
    Reduce_scatter_block), which MPI implements faster than their -v forms."""

    kind = "mpi"

    def __init__(self, mpi_comm: MPI.Comm, empty=np.empty):
        super().__init__(mpi_comm)
        self._empty = empty   # the backend's pooled allocator, for float32 staging buffers
        self._roles: dict[str, MpiCommunicator] = {}

    def for_role(self, role: str) -> MpiCommunicator:
        """This group's communicator for collectives run on ``role``'s worker thread: a
        duplicate per role (made on the role's first one; collective over the group), so
        messages of roles running at the same time cannot match each other's.  The caller's
        thread keeps this one."""
        comm = self._roles.get(role)
        if comm is None:
            comm = self._roles[role] = MpiCommunicator(self.mpi.Dup(), self._empty)
        return comm

    @staticmethod
    def _call(blocking, blocking_fn, nonblocking_fn, args, then=None):
        if blocking:
            blocking_fn(*args)
            if then is not None:
                then()
            return None
        return _MpiRequest([nonblocking_fn(*args)], then)

    # reductions ----------------------------------------------------------
    def _reduce(self, send, recv, op, blocking, fns, extra=()):
        """Run a reduction; dtypes MPI cannot reduce (bf16, fp8) go through float32 buffers
        and are rounded once at the end; avg is a sum divided on completion."""
        staged = send.dtype not in _MPI_REDUCIBLE
        if staged:
            s32 = self._empty(send.shape, np.float32)
            s32[...] = send
            r32 = self._empty(recv.shape, np.float32)
        else:
            s32, r32 = (MPI.IN_PLACE if send is recv else send), recv
        then = None
        if staged or op == "avg":
            size = self.size

            def then():
                if op == "avg":
                    r32[...] /= size
                if staged:
                    recv[...] = r32
        return self._call(blocking, *fns, (s32, r32, *extra, MPI_OPS[op]), then)

    def all_reduce(self, send, recv, op="sum", blocking=True, stream=None):
        if blocking and op != "avg" and send.dtype in _MPI_REDUCIBLE:   # the latency-critical case
            self.mpi.Allreduce(MPI.IN_PLACE if send is recv else send, recv, MPI_OPS[op])
            return None
        return self._reduce(send, recv, op, blocking, (self.mpi.Allreduce, self.mpi.Iallreduce))

    def reduce_scatter(self, send, recv, counts=None, op="sum", blocking=True, stream=None):
        if counts is None:
            if blocking and op != "avg" and send.dtype in _MPI_REDUCIBLE:
                self.mpi.Reduce_scatter_block(send, recv, MPI_OPS[op])
                return None
            return self._reduce(send, recv, op, blocking,
                                (self.mpi.Reduce_scatter_block, self.mpi.Ireduce_scatter_block))
        return self._reduce(send, recv, op, blocking, (self.mpi.Reduce_scatter, self.mpi.Ireduce_scatter),
                            extra=(list(counts),))

    # data movement: any dtype ----------------------------------------------
    def all_gather(self, send, recv, counts=None, blocking=True, stream=None):
        if counts is None:
            if blocking and send.dtype in _MPI_NATIVE:
                self.mpi.Allgather(send, recv)
                return None
            return self._call(blocking, self.mpi.Allgather, self.mpi.Iallgather, (_buf(send), _buf(recv)))
        return self._call(blocking, self.mpi.Allgatherv, self.mpi.Iallgatherv,
                          (_buf(send), _vbuf(recv, counts)))

    def all_to_all(self, send, recv, send_counts=None, recv_counts=None, blocking=True, stream=None):
        if send_counts is None and recv_counts is None:
            if blocking and send.dtype in _MPI_NATIVE:
                self.mpi.Alltoall(send, recv)
                return None
            return self._call(blocking, self.mpi.Alltoall, self.mpi.Ialltoall, (_buf(send), _buf(recv)))
        return self._call(blocking, self.mpi.Alltoallv, self.mpi.Ialltoallv,
                          (_vbuf(send, send_counts), _vbuf(recv, recv_counts)))

    def all_to_all_strided(self, send, part_type, recv, blocking=True, stream=None):
        """all_to_all of equal parts that are strided views of the contiguous ``send``, one
        ``part_type`` each (an MPI derived datatype whose extent steps from one part to the
        next): MPI gathers each part while it copies, so no pack buffer is written first."""
        if blocking:
            self.mpi.Alltoall([send, 1, part_type], recv)
            return None
        return _MpiRequest([self.mpi.Ialltoall([send, 1, part_type], recv)])

    def broadcast(self, buf, root, blocking=True, stream=None):
        if blocking:
            self.mpi.Bcast(_buf(buf), root)
            return None
        return _MpiRequest([self.mpi.Ibcast(_buf(buf), root)])

    def send(self, buf, peer, tag=0, blocking=True, stream=None):
        return self._call(blocking, self.mpi.Send, self.mpi.Isend, (_buf(buf), peer, tag))

    def recv(self, buf, peer, tag=0, blocking=True, stream=None):
        return self._call(blocking, self.mpi.Recv, self.mpi.Irecv, (_buf(buf), peer, tag))

    def barrier(self, blocking=True, stream=None):
        return self._call(blocking, self.mpi.Barrier, self.mpi.Ibarrier, ())


class HostStagedCommunicator(Communicator):
    """Device buffers moved through host memory and MPI, for groups NCCL cannot serve.

    Each call copies device->host on the given stream, runs the MPI call, and copies back;
    the MPI part completes before the call returns, so the non-blocking form gives no
    overlap on this path (it is a fallback for correctness, not speed).
    """

    kind = "host"

    def __init__(self, mpi_comm: MPI.Comm, to_host, to_device):
        super().__init__(mpi_comm)
        self._mpi = MpiCommunicator(mpi_comm)
        self._to_host = to_host          # (device_array, stream) -> numpy array
        self._to_device = to_device      # (numpy array, device_array, stream) -> None

    def _staged(self, method, send, recv, *args, stream=None):
        hsend = self._to_host(send, stream)
        hrecv = hsend if recv is send else np.empty(recv.shape, recv.dtype)
        getattr(self._mpi, method)(hsend, hrecv, *args, blocking=True)
        self._to_device(hrecv, recv, stream)
        return None

    def all_reduce(self, send, recv, op="sum", blocking=True, stream=None):
        return self._staged("all_reduce", send, recv, op, stream=stream)

    def reduce_scatter(self, send, recv, counts=None, op="sum", blocking=True, stream=None):
        return self._staged("reduce_scatter", send, recv, counts, op, stream=stream)

    def all_gather(self, send, recv, counts=None, blocking=True, stream=None):
        return self._staged("all_gather", send, recv, counts, stream=stream)

    def all_to_all(self, send, recv, send_counts=None, recv_counts=None, blocking=True, stream=None):
        return self._staged("all_to_all", send, recv, send_counts, recv_counts, stream=stream)

    def broadcast(self, buf, root, blocking=True, stream=None):
        hbuf = self._to_host(buf, stream)
        self._mpi.broadcast(hbuf, root)
        self._to_device(hbuf, buf, stream)

    # Point-to-point stays non-blocking where asked: a ring of irecv-then-isend must not
    # wait in the recv for a send its peer has not issued yet.  The request goes on the
    # stream (CudaStream.enqueue); the device copy of a received message runs when it completes.
    def send(self, buf, peer, tag=0, blocking=True, stream=None):
        return self._mpi.send(self._to_host(buf, stream), peer, tag, blocking=blocking)

    def recv(self, buf, peer, tag=0, blocking=True, stream=None):
        hbuf = np.empty(buf.shape, buf.dtype)
        if blocking:
            self._mpi.recv(hbuf, peer, tag)
            self._to_device(hbuf, buf, stream)
            return None
        return _MpiRequest([self.mpi.Irecv(_buf(hbuf), peer, tag)], lambda: self._to_device(hbuf, buf, stream))

    def barrier(self, blocking=True, stream=None):
        if stream is not None:
            stream.synchronize()
        self._mpi.barrier()


def _gpu_shared(mpi_comm: MPI.Comm, device_id: int) -> bool:
    """True when two ranks of this group drive the same GPU (NCCL rejects that)."""
    seats = mpi_comm.allgather((MPI.Get_processor_name(), device_id))
    return len(set(seats)) != len(seats)


def nccl_algo_hint() -> None:
    """TESSERA_COMM_ALGO=tree|ring reaches NCCL the one way it takes an algorithm: NCCL_ALGO,
    read when a communicator is made (seed 000 §3.6); an explicit NCCL_ALGO wins."""
    v = os.environ.get("TESSERA_COMM_ALGO", "").strip().lower()
    if v in ("tree", "ring") and "NCCL_ALGO" not in os.environ:
        os.environ["NCCL_ALGO"] = v.capitalize()


def make_communicator(mpi_comm: MPI.Comm, backend, prefer: str = "") -> Communicator:
    """The communicator kind for ``backend`` on this group (collective over ``mpi_comm``).

    ``prefer`` (or ``TESSERA_COMM``) forces "mpi", "nccl" or "host" where that kind can serve.
    """
    if not backend.is_gpu:
        if prefer in ("nccl", "host"):
            raise ValueError(f"TESSERA_COMM={prefer} needs the cuda backend; this process runs on cpu")
        return MpiCommunicator(mpi_comm, empty=backend.empty)
    shared = _gpu_shared(mpi_comm, backend.device_id)
    try:
        from cupy.cuda import nccl
        have_nccl = nccl.available if hasattr(nccl, "available") else True
    except ImportError:
        have_nccl = False
    # every rank must pick the same kind: decide from values all ranks share
    use_nccl = prefer not in ("host", "mpi") and have_nccl and not shared
    use_nccl = mpi_comm.allreduce(int(use_nccl), op=MPI.MIN) == 1
    if prefer == "nccl" and not use_nccl:
        raise ValueError("TESSERA_COMM=nccl but NCCL cannot serve this group "
                         f"({'ranks share a GPU' if shared else 'cupy.cuda.nccl is not available'})")
    if use_nccl:
        nccl_algo_hint()
        return NcclCommunicator(mpi_comm)

    # Only the copy is waited for (the raw CUDA stream), not host work queued on the
    # stream: a pending irecv there may need the very send this copy feeds.
    def to_host(a, stream):
        h = a.get(stream=stream.raw if stream is not None else None)
        if stream is not None:
            stream.raw.synchronize()   # the copy may be asynchronous; MPI reads it next
        return h

    def to_device(h, a, stream):
        a.set(h, stream=stream.raw if stream is not None else None)
        if stream is not None:
            stream.raw.synchronize()

    return HostStagedCommunicator(mpi_comm, to_host, to_device)
