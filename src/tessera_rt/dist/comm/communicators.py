"""Communicators: one per mesh-axis group, on flat contiguous buffers.

Three kinds serve one interface:

* ``MpiCommunicator``   NumPy buffers over an MPI communicator (the CPU path);
* ``NcclCommunicator``  CuPy buffers over NCCL, issued on a CUDA stream;
* ``HostStagedCommunicator`` CuPy buffers moved through host memory and MPI, for groups
  NCCL cannot serve (several ranks sharing one GPU, or no NCCL library).

Every method takes flat buffers and element counts; shapes, dims and layouts are the
business of the layer above (``collectives``).  Non-blocking calls return a request with
``test()`` and ``wait_done()`` (CPU) or ``None`` (GPU, where the stream orders the work).
"""
from __future__ import annotations

import os
import weakref

import numpy as np
from .mpi import MPI, MPI_ERROR

from ...dtypes import dtype_name

__all__ = [
    "Communicator", "MpiCommunicator", "NcclCommunicator", "HostStagedCommunicator",
    "REDUCE_OPS", "make_communicator",
]

REDUCE_OPS = ("sum", "max", "min", "avg")
# (empty without an MPI library: import must work, the first collective says what to install)
_MPI_OPS = {} if MPI_ERROR else {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
# dtypes MPI reduces natively; others (bf16, fp8) are reduced in float32 and rounded once
_MPI_REDUCIBLE = frozenset(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
))
# dtypes mpi4py can describe to MPI (others move as bytes)
_MPI_NATIVE = _MPI_REDUCIBLE | {np.dtype(np.bool_)}


def _displs(counts) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


# Every NCCL communicator made (weakly): the watchdog aborts them (ncclCommAbort) before MPI_Abort
NCCL_COMMS: "weakref.WeakSet" = weakref.WeakSet()

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


class Communicator:
    """Interface shared by the three kinds.  ``rank``/``size`` are within the group."""

    kind = "abstract"

    def __init__(self, mpi_comm: MPI.Comm):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    def tagged(self, op: str, tag: str) -> "Communicator":
        """The communicator that runs ``op`` with the ``tag`` ("tree"/"ring") hint.  MPI has no
        per-call algorithm choice (MPICH reads MPIR_CVAR_<OP>_INTRA_ALGORITHM for the run), so
        by default the hint is only recorded and this communicator serves it."""
        return self


def _buf(a):
    """The mpi4py buffer for ``a``: typed where MPI knows the dtype, raw bytes otherwise
    (bf16 and fp8 have no MPI type; moving them as bytes is exact)."""
    return a if a.dtype in _MPI_NATIVE else a.reshape(-1).view(np.uint8)


def _vbuf(a, counts):
    """A vector-collective buffer spec: counts in ``a``'s MPI units, with displacements."""
    if a.dtype not in _MPI_NATIVE:
        item = a.dtype.itemsize
        counts = [c * item for c in counts]
    return [_buf(a), (counts, _displs(counts))]


class MpiCommunicator(Communicator):
    """NumPy buffers over MPI.  Blocking calls use MPI's blocking collectives (lowest
    latency); equal parts use the fixed-size collectives (Allgather, Alltoall,
    Reduce_scatter_block), which MPI implements faster than their -v forms."""

    kind = "mpi"

    def __init__(self, mpi_comm: MPI.Comm, empty=np.empty):
        super().__init__(mpi_comm)
        self._empty = empty   # the backend's pooled allocator, for float32 staging buffers
        self._roles: dict[str, MpiCommunicator] = {}

    def for_role(self, role: str) -> "MpiCommunicator":
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
        return self._call(blocking, *fns, (s32, r32, *extra, _MPI_OPS[op]), then)

    def all_reduce(self, send, recv, op="sum", blocking=True, stream=None):
        if blocking and op != "avg" and send.dtype in _MPI_REDUCIBLE:   # the latency-critical case
            self.mpi.Allreduce(MPI.IN_PLACE if send is recv else send, recv, _MPI_OPS[op])
            return None
        return self._reduce(send, recv, op, blocking, (self.mpi.Allreduce, self.mpi.Iallreduce))

    def reduce_scatter(self, send, recv, counts=None, op="sum", blocking=True, stream=None):
        if counts is None:
            if blocking and op != "avg" and send.dtype in _MPI_REDUCIBLE:
                self.mpi.Reduce_scatter_block(send, recv, _MPI_OPS[op])
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

    def __init__(self, comm: "NcclCommunicator"):
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

    def __init__(self, base: "NcclCommunicator", algo: str):
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

    def tagged(self, op: str, tag: str) -> "Communicator":
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

    def _made_with(self, algo: str) -> "NcclCommunicator":
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
        for root, (count, off) in enumerate(zip(counts, _displs(counts))):
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
        for root, (count, off) in enumerate(zip(counts, _displs(counts))):
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
        for peer, (sc, so, rc, ro) in enumerate(zip(send_counts, _displs(send_counts),
                                                    recv_counts, _displs(recv_counts))):
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


def _gpu_shared(mpi_comm: MPI.Comm, device_id: int) -> bool:
    """True when two ranks of this group drive the same GPU (NCCL rejects that)."""
    seats = mpi_comm.allgather((MPI.Get_processor_name(), device_id))
    return len(set(seats)) != len(seats)


def _nccl_algo_hint() -> None:
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
        from cupy.cuda import nccl  # noqa: F401
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
        _nccl_algo_hint()
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
