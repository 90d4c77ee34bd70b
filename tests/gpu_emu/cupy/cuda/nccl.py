"""``cupy.cuda.nccl`` over mpi4py: NCCL's semantics, run eagerly as blocking MPI calls.

* Rendezvous: members of a communicator meet by its unique id, without assuming every world
  rank joins (tessera_rt makes one communicator per mesh-axis group).  Each member writes its
  world rank to ``<tmp>/tessera_nccl_standin/<id>/<nccl rank>``, waits (bounded) until all
  ``ndev`` files exist, then ``MPI.COMM_WORLD.Create_group`` over those world ranks in NCCL
  rank order (collective over the members only).
* Collectives are issued in the same order on every rank (as NCCL requires) and run as
  blocking MPI calls on the group; reductions go through an Allgather and NumPy, in rank
  order, so every rank gets bit-identical results (bf16 is reduced in float32, rounded once).
* Between ``groupStart()`` and ``groupEnd()`` calls are queued; ``groupEnd`` posts every
  send/recv non-blocking, runs the queued collectives in order, then waits for all.  Sends
  and receives carry no tag: MPI's non-overtaking order matches them in issue order, as NCCL.
* Buffers are device pointers, resolved to their pool block (pointer arithmetic inside a
  block is fine); running past the block is an error.  Every call is recorded for the
  stream-order tracker as an op on its stream (sends read, receives write).
"""
from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import _tracker
from .memory import resolve_pointer

__all__ = ["available", "get_unique_id", "NcclCommunicator", "NcclError", "groupStart", "groupEnd",
           "get_version", "NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG"]

available = True
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("TESSERA_STANDIN_NCCL_TIMEOUT", "60"))

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
           6: np.float16, 7: np.float32, 8: np.float64}
try:
    import ml_dtypes
    _DTYPES[9] = ml_dtypes.bfloat16
except ImportError:      # pragma: no cover - ml-dtypes is a tessera_rt dependency
    pass
for _code, _name in ((0, "INT8"), (1, "UINT8"), (2, "INT32"), (3, "UINT32"), (4, "INT64"),
                     (5, "UINT64"), (6, "FLOAT16"), (7, "FLOAT32"), (8, "FLOAT64"), (9, "BFLOAT16")):
    globals()[f"NCCL_{_name}"] = _code
_REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum,
           NCCL_AVG: np.add}

_INVALID_ARGUMENT = 4
_INVALID_USAGE = 5


class NcclError(RuntimeError):
    """As cupy_backends.cuda.libs.nccl.NcclError: "<NAME>: <description>"."""

    _NAMES = {_INVALID_ARGUMENT: "NCCL_ERROR_INVALID_ARGUMENT", _INVALID_USAGE: "NCCL_ERROR_INVALID_USAGE"}

    def __init__(self, status: int, detail: str):
        self.status = status
        super().__init__(f"{self._NAMES.get(status, f'NCCL_ERROR_{status}')}: {detail}")


def get_version() -> int:
    return 22105


def get_unique_id() -> tuple:
    """128 bytes as a tuple of ints, as CuPy returns ncclUniqueId."""
    return tuple(secrets.token_bytes(16)) + (0,) * 112


def _id_key(comm_id) -> str:
    return bytes(int(c) & 0xFF for c in comm_id[:16]).hex()


def _rendezvous_dir(comm_id) -> Path:
    root = os.environ.get("TESSERA_STANDIN_NCCL_DIR") or tempfile.gettempdir()
    return Path(root) / "tessera_nccl_standin" / _id_key(comm_id)


# -- groups -----------------------------------------------------------------------------

_group_depth = 0
_group_queue: list = []


def groupStart() -> None:
    global _group_depth
    _group_depth += 1


def groupEnd() -> None:
    global _group_depth
    if _group_depth == 0:
        raise NcclError(_INVALID_USAGE, "groupEnd() without groupStart()")
    _group_depth -= 1
    if _group_depth == 0:
        queue, _group_queue[:] = list(_group_queue), []
        _run_group(queue)


def _run_group(queue: list) -> None:
    from mpi4py import MPI
    requests = []
    for call in queue:                      # post every point-to-point first: they can pair up
        if call[0] == "send":               # in any order across ranks, as NCCL's do
            _, comm, data, peer = call
            requests.append(comm._mpi.Isend(data, peer, tag=0))
        elif call[0] == "recv":
            _, comm, view, peer = call
            requests.append(comm._mpi.Irecv(view, peer, tag=0))
    for call in queue:
        if call[0] == "collective":
            call[1]()
    MPI.Request.Waitall(requests)


# -- the communicator -------------------------------------------------------------------

class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)``: a member of an ``ndev``-rank communicator."""

    def __init__(self, ndev: int, commId, rank: int):
        from mpi4py import MPI
        if not 0 <= rank < ndev:
            raise NcclError(_INVALID_ARGUMENT, f"rank {rank} not in [0, {ndev})")
        self._ndev, self._rank = int(ndev), int(rank)
        self._mpi = _rendezvous(MPI, commId, self._ndev, self._rank)
        self._closed = False

    # -- queries ---------------------------------------------------------
    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def device_id(self) -> int:
        from .device import current_device_id
        return current_device_id()

    def abort(self) -> None:
        self._close()

    def destroy(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._mpi.Free()
            except Exception:       # MPI already finalized, or aborting
                pass

    # -- buffers and bookkeeping ----------------------------------------
    def _view(self, ptr: int, count: int, datatype: int, what: str):
        if self._closed:
            raise NcclError(_INVALID_USAGE, "communicator was destroyed or aborted")
        try:
            dtype = np.dtype(_DTYPES[datatype])
        except KeyError:
            raise NcclError(_INVALID_ARGUMENT, f"unknown ncclDataType_t {datatype}") from None
        nbytes = int(count) * dtype.itemsize
        if nbytes == 0:
            # CuPy gives zero-size arrays no memory (data.ptr == 0) and NCCL moves nothing
            # for count 0, whatever the pointer: an empty part of an uneven collective
            return None, np.empty(0, dtype)
        mem, offset = resolve_pointer(ptr)
        if offset + nbytes > mem.requested:
            raise NcclError(_INVALID_ARGUMENT,
                            f"{what} buffer {ptr:#x}: {count} x {dtype} = {nbytes} bytes from offset "
                            f"{offset} runs past its {mem.requested}-byte allocation")
        return mem, mem.host_view(offset, nbytes).view(dtype)

    def _record(self, kind: str, stream: int, reads=(), writes=()) -> None:
        accesses = [(mem, view.ctypes.data, view.ctypes.data + view.nbytes, w)
                    for w, pairs in ((False, reads), (True, writes)) for mem, view in pairs if view.nbytes]
        _tracker.record_op(f"nccl.{kind}", _tracker.stream_state(int(stream)), accesses)

    def _captured(self, kind: str, stream: int, reads, writes, run) -> bool:
        """On a capturing stream a collective is a graph node that reads its send buffer when the
        graph runs (NCCL supports capture; every rank launches its graphs in the same order).
        True when captured."""
        from .. import _capture
        state = _tracker.stream_state(int(stream))
        cap = _capture.capture_of(state)
        if cap is None:
            return False
        if _group_depth or kind in ("send", "recv"):
            from .._errors import StandinLimitation
            raise StandinLimitation(f"nccl.{kind} inside a stream capture{' group' if _group_depth else ''} is not "
                                    "modelled by the stand-in (collectives outside groups are)")
        accesses = [(mem, view.ctypes.data, view.ctypes.data + view.nbytes, w)
                    for w, pairs in ((False, reads), (True, writes)) for mem, view in pairs if view.nbytes]
        cap.add(f"nccl.{kind}", "kernel", 0, accesses, lambda _state: run(), state)
        return True

    def _issue(self, run) -> None:
        if _group_depth:
            _group_queue.append(("collective", run))
        else:
            run()

    def _gathered(self, data: np.ndarray) -> np.ndarray:
        """Every rank's ``data`` stacked in rank order (shape (ndev, n))."""
        out = np.empty((self._ndev, data.size), data.dtype)
        self._mpi.Allgather(data.reshape(-1).view(np.uint8), out.view(np.uint8))
        return out

    def _reduce(self, data: np.ndarray, op: int) -> np.ndarray:
        if op not in _REDUCE:
            raise NcclError(_INVALID_ARGUMENT, f"unknown ncclRedOp_t {op}")
        parts = self._gathered(data)
        wide = parts.astype(np.float32) if parts.dtype.char not in "?bhilqBHILQefd" else parts
        with np.errstate(all="ignore"):
            acc = _REDUCE[op].reduce(wide, axis=0)
            if op == NCCL_AVG:
                acc = acc / self._ndev
        return acc.astype(data.dtype)

    # -- collectives -----------------------------------------------------
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        (smem, send), (rmem, recv) = (self._view(sendbuf, count, datatype, "send"),
                                      self._view(recvbuf, count, datatype, "recv"))
        if self._captured("allReduce", stream, [(smem, send)], [(rmem, recv)],
                          lambda: recv.__setitem__(Ellipsis, self._reduce(send.copy(), op))):
            return
        self._record("allReduce", stream, [(smem, send)], [(rmem, recv)])
        data = send.copy()
        self._issue(lambda: recv.__setitem__(Ellipsis, self._reduce(data, op)))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream) -> None:
        smem, send = self._view(sendbuf, recvcount * self._ndev, datatype, "send")
        rmem, recv = self._view(recvbuf, recvcount, datatype, "recv")
        lo = self._rank * recvcount
        if self._captured("reduceScatter", stream, [(smem, send)], [(rmem, recv)],
                          lambda: recv.__setitem__(Ellipsis, self._reduce(send.copy(), op)[lo:lo + recvcount])):
            return
        self._record("reduceScatter", stream, [(smem, send)], [(rmem, recv)])
        data = send.copy()
        self._issue(lambda: recv.__setitem__(Ellipsis, self._reduce(data, op)[lo:lo + recvcount]))

    def allGather(self, sendbuf, recvbuf, sendcount, datatype, stream) -> None:
        smem, send = self._view(sendbuf, sendcount, datatype, "send")
        rmem, recv = self._view(recvbuf, sendcount * self._ndev, datatype, "recv")
        if self._captured("allGather", stream, [(smem, send)], [(rmem, recv)],
                          lambda: recv.__setitem__(Ellipsis, self._gathered(send.copy()).reshape(-1))):
            return
        self._record("allGather", stream, [(smem, send)], [(rmem, recv)])
        data = send.copy()
        self._issue(lambda: recv.__setitem__(Ellipsis, self._gathered(data).reshape(-1)))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream) -> None:
        is_root = root == self._rank
        rmem, recv = self._view(recvbuf, count, datatype, "recv")
        reads = [self._view(sendbuf, count, datatype, "send")] if is_root else []

        sview = reads[0][1] if is_root else None       # (views only: a graph holds no allocation)

        def bcast():
            buf = sview.copy() if is_root else np.empty_like(recv)
            self._mpi.Bcast(buf.view(np.uint8), root)
            recv[...] = buf
        if self._captured("broadcast", stream, reads, [(rmem, recv)], bcast):
            return
        self._record("broadcast", stream, reads, [(rmem, recv)])
        data = reads[0][1].copy() if is_root else None

        def run():
            buf = data if is_root else np.empty_like(recv)
            self._mpi.Bcast(buf.view(np.uint8), root)
            recv[...] = buf
        self._issue(run)

    def bcast(self, buff, count, datatype, root, stream) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream) -> None:
        smem, send = self._view(sendbuf, count, datatype, "send")
        writes = [self._view(recvbuf, count, datatype, "recv")] if root == self._rank else []

        rview = writes[0][1] if writes else None

        def reduce_now():
            result = self._reduce(send.copy(), op)
            if rview is not None:
                rview[...] = result
        if self._captured("reduce", stream, [(smem, send)], writes, reduce_now):
            return
        self._record("reduce", stream, [(smem, send)], writes)
        data = send.copy()

        def run():
            result = self._reduce(data, op)     # every rank computes it; only the root keeps it
            if writes:
                writes[0][1][...] = result
        self._issue(run)

    # -- point to point --------------------------------------------------
    def send(self, sendbuf, count, datatype, peer, stream) -> None:
        mem, view = self._view(sendbuf, count, datatype, "send")
        self._captured("send", stream, [(mem, view)], (), None)
        self._record("send", stream, [(mem, view)])
        data = view.copy().view(np.uint8)
        if _group_depth:
            _group_queue.append(("send", self, data, peer))
        else:
            self._mpi.Send(data, peer, tag=0)

    def recv(self, recvbuf, count, datatype, peer, stream) -> None:
        mem, view = self._view(recvbuf, count, datatype, "recv")
        self._captured("recv", stream, (), [(mem, view)], None)
        self._record("recv", stream, (), [(mem, view)])
        target = view.view(np.uint8)
        if _group_depth:
            _group_queue.append(("recv", self, target, peer))
        else:
            self._mpi.Recv(target, peer, tag=0)


def _rendezvous(MPI, comm_id, ndev: int, rank: int):
    world = MPI.COMM_WORLD
    where = _rendezvous_dir(comm_id)
    where.mkdir(parents=True, exist_ok=True)
    mine = where / str(rank)
    tmp = where / f".{rank}.{os.getpid()}"
    tmp.write_text(str(world.Get_rank()))
    tmp.replace(mine)                      # atomic: readers never see a half-written file
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while True:
        present = sorted(int(p.name) for p in where.iterdir() if p.name.isdigit())
        if len(present) == ndev:
            break
        if time.monotonic() > deadline:
            raise NcclError(_INVALID_USAGE,
                            f"NcclCommunicator rendezvous timed out after {RENDEZVOUS_TIMEOUT_S:.0f}s in "
                            f"{where}: {len(present)} of {ndev} ranks arrived (nccl ranks {present}); "
                            "every member must call NcclCommunicator(ndev, same id, its rank)")
        time.sleep(0.005)
    world_ranks = [int((where / str(r)).read_text()) for r in range(ndev)]
    comm = world.Create_group(world.Get_group().Incl(world_ranks))
    comm.Barrier()                          # everyone has read the files: safe to clean up
    mine.unlink(missing_ok=True)
    try:
        where.rmdir()
    except OSError:                         # another member's file is still there
        pass
    return comm
