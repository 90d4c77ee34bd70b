"""How token rows cross the experts' mesh axis: the one step of an MoE dispatch that talks to
the network (compare Megatron-core's token dispatchers, one class per transport).

``TokenDispatcher`` (``dispatch.py``) does everything local -- routing, packing rows into
send order, unpacking them into the experts' batch, the weighted combine -- and hands each
exchange to ``layer.transport``.  A transport implements one method, ``exchange``: rows go
out in blocks, one per ep position in position order, and come back sender-major into a
buffer the dispatcher owns.  Counts, FP8 wire rows and the backward's cotangents travel
through the same method, so a new transport (NVSHMEM puts, a hierarchical intra/inter-host
all-to-all, a fake for tests) is one new subclass set on ``layer.transport``, not a fork of
the dispatch.

``to_wire`` / ``from_wire`` are the FP8 wire format (e4m3 bits plus each row's f32 scale in
one uint8 row, so the scales need no message of their own); any transport carries it.
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ..backend import get_backend
from ..dist.comm import collectives as C
from ..dist.comm.mesh import Mesh

__all__ = ["Transport", "AllToAll", "to_wire", "from_wire"]


class Transport(abc.ABC):
    """Moves rows between the ``size`` positions of mesh axis ``axis`` of ``mesh``; this rank is
    position ``index``.

    Parameters
    ----------
    axis : str
        The mesh axis.
    mesh : Mesh or None
        The mesh (None: no mesh, one position).
    size : int
        Positions on the axis.
    index : int
        This rank's position.
    """

    def __init__(self, axis: str, mesh: Mesh | None, size: int, index: int):
        self.axis, self.mesh, self.size, self.index = axis, mesh, int(size), int(index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.axis}={self.size})"

    @abc.abstractmethod
    def exchange(self, buf: Any, split: list, recv: list, out: Any) -> Any:
        """Send ``buf``'s first ``split[0]`` rows to position 0, the next ``split[1]`` to position
        1, ...; receive ``recv[j]`` rows from each position j into ``out`` (sender-major) and
        return ``out``.  Every position calls it with matching sizes (split here == recv there).

        Parameters
        ----------
        buf : array
            The rows sent, position-major.
        split : list of int
            Rows to each position.
        recv : list of int
            Rows from each position.
        out : array
            Receives them.

        Returns
        -------
        array
            ``out``.
        """

    def counts(self, mine: Any, ranges: list, out: Any) -> tuple[np.ndarray, np.ndarray]:
        """Per-expert row counts: ``mine`` (E,) this rank sends to each expert; returns the host
        (positions, local experts) counts every position sends this rank's experts, and
        ``mine`` on the host (one wait for both: the payload exchanges need both sizes).

        Parameters
        ----------
        mine : array
            ``(E,)`` rows this rank sends to each expert.
        ranges : list of (int, int)
            Each position's expert range.
        out : array
            A staging buffer for the exchange.

        Returns
        -------
        tuple of numpy.ndarray
            ``(positions, local experts)`` counts and ``(E,)`` ``mine``.
        """
        xp = get_backend().xp
        nle = ranges[self.index][1] - ranges[self.index][0]
        mine = xp.ascontiguousarray(mine).astype(np.int64, copy=False)
        got = self.exchange(mine, [hi - lo for lo, hi in ranges], [nle] * self.size, out)
        both = np.asarray(get_backend().to_host(xp.concatenate([got.reshape(-1), mine])))
        return both[:self.size * nle].reshape(self.size, nle), both[self.size * nle:]


class AllToAll(Transport):
    """One ``all_to_all`` over the axis per exchange (MPI's Alltoallv, NCCL's grouped
    sends/recvs), on the ``a2a`` stream; with one position a copy.

    Parameters
    ----------
    axis : str
        The mesh axis.
    mesh : Mesh or None
        The mesh (None: no mesh, one position).
    size : int
        Positions on the axis.
    index : int
        This rank's position.
    """

    def exchange(self, buf: Any, split: list, recv: list, out: Any) -> Any:
        """``dist.all_to_all`` with these sizes on the ``a2a`` stream (a copy with one position).

        Parameters
        ----------
        buf : array
            The rows sent.
        split : list of int
            Rows to each position.
        recv : list of int
            Rows from each position.
        out : array
            Receives them.

        Returns
        -------
        array
            ``out``.
        """
        if self.size == 1:
            out[...] = buf
            return out
        return C.all_to_all(buf, self.axis, mesh=self.mesh, split_sizes=split, recv_sizes=recv, out=out, role="a2a")


def to_wire(rows, out):
    """rows (N, d) -> ``out`` uint8 (N, d + 4): e4m3 bit patterns then the row's f32 scale."""
    b = get_backend()
    q, s = b.kernel("quantize_fp8", like=rows)(rows, "fp8_e4m3", scale="per_channel", axis=0)
    n, d = rows.shape
    out[:, :d] = q.view(np.uint8)
    out[:, d:] = b.xp.ascontiguousarray(s.reshape(n, 1).astype(np.float32)).view(np.uint8).reshape(n, 4)
    return out


def from_wire(wire, d: int, dtype):
    """The rows ``to_wire`` encoded, dequantized to ``dtype``."""
    b = get_backend()
    n = wire.shape[0]
    bits = b.xp.ascontiguousarray(wire[:, :d])
    s = b.xp.ascontiguousarray(wire[:, d:]).view(np.float32).reshape(n, 1)
    return b.kernel("dequantize_fp8_bits", like=bits)(bits, s, "fp8_e4m3", axis=0).astype(dtype, copy=False)
