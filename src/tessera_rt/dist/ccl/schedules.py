"""Line and ring schedules for reduce-scatter / all-gather over send/recv (seed 004).

Each algorithm is a *schedule*: n-1 steps, each a list of transfers (src, dst, chunk, piece)
between neighbours of the cluster axis.  Chunk c is the part rank c ends up owning.

* ``ring``: the classic ring, bidirectional: every chunk is cut in two pieces; piece 0 goes
  clockwise (r -> r+1), piece 1 counter-clockwise (r -> r-1), so both directions of every
  link carry half the data each step (NCCL's ring, on a torus-like Galaxy row).
* ``line``: no wrap-around link (the ends of a Galaxy line are not neighbours): the part of
  chunk d that ranks < d contribute flows rightward through 0..d-1, the part of ranks > d
  flows leftward; in a reduce-scatter rank r sends n-1 chunks, the same bytes as the ring
  (an all-gather forwards every chunk both ways, so a line moves more than a ring there).

Every rank walks the same transfer list in the same order, so messages between a pair
match in issue order (NCCL has no tags).  ``compile_steps`` turns a schedule into this
rank's program (every bound worked out once); ``run_steps`` runs it on the role's stream
(``OnRole``): reduce-scatter receives into a slot and reduces into the working buffer,
all-gather receives straight into place.  The ops that plan and call these are in ``line``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate

from ... import runtime as rt
from ..comm import collectives as C
from ..tensor.shard import split_sizes

__all__ = ["schedule", "Transfer", "compile_steps", "run_steps", "offsets", "max_piece", "OnRole", "pack_into",
           "unpack_into", "piece_bounds"]


Transfer = tuple  # (src, dst, chunk, piece): piece 0/1 = half of the chunk, None = all of it


@lru_cache(maxsize=256)
def schedule(kind: str, n: int, algo: str) -> tuple[tuple[Transfer, ...], ...]:
    """The steps of ``kind`` over ``n`` ranks by ``algo`` (see the module docstring).

    Parameters
    ----------
    kind : {"reduce_scatter", "all_gather"}
        The collective.
    n : int
        Ranks on the axis.
    algo : {"ring", "line"}
        The algorithm.

    Returns
    -------
    tuple of tuple of Transfer
        ``n - 1`` steps, each its ``(src, dst, chunk, piece)`` transfers.
    """
    steps = []
    for t in range(n - 1):
        step: list[tuple[int, int, int, int | None]] = []
        for r in range(n):
            if algo == "ring":
                if kind == "reduce_scatter":
                    step += [(r, (r + 1) % n, (r - 1 - t) % n, 0), (r, (r - 1) % n, (r + 1 + t) % n, 1)]
                else:
                    step += [(r, (r + 1) % n, (r - t) % n, 0), (r, (r - 1) % n, (r + t) % n, 1)]
            elif kind == "reduce_scatter":
                if r < n - 1 and t >= r:
                    step.append((r, r + 1, r + n - 1 - t, None))
                if r > 0 and t >= n - 1 - r:
                    step.append((r, r - 1, r - n + 1 + t, None))
            else:
                if r < n - 1 and r - t >= 0:
                    step.append((r, r + 1, r - t, None))
                if r > 0 and r + t <= n - 1:
                    step.append((r, r - 1, r + t, None))
        steps.append(tuple(step))
    return tuple(steps)


def piece_bounds(offs: Sequence[int], counts: Sequence[int], c: int, piece) -> tuple[int, int]:
    """[lo, hi) of chunk ``c`` (at ``offs[c]``, ``counts[c]`` long), or of its half ``piece``
    (0: the first, the larger when odd; 1: the second; None: the whole chunk)."""
    lo, cnt = offs[c], counts[c]
    if piece is None:
        return lo, lo + cnt
    h = (cnt + 1) // 2
    return (lo, lo + h) if piece == 0 else (lo + h, lo + cnt)


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each part starts in the flat buffer of the parts one after another."""
    return list(accumulate(counts, initial=0))[:-1]


def max_piece(counts: Sequence[int], algo: str) -> int:
    """The longest message of a schedule over parts of ``counts`` (a ring sends half-chunks)."""
    return max((c + 1) // 2 if algo == "ring" else c for c in counts) if counts else 0


_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum"}


def _links(n: int, links: int):
    """(start, stop) of the ``links`` sub-messages a message of ``n`` elements is cut into."""
    if links == 1:
        return ((0, n),)
    out, acc = [], 0
    for size in split_sizes(n, links):
        if size:
            out.append((acc, acc + size))
            acc += size
    return out


def compile_steps(steps, me: int, offs: Sequence[int], counts: Sequence[int], reducing: bool,
                  links: int = 1) -> tuple:
    """This rank's part of ``steps`` as a program: per step (recvs, sends, reductions) with
    every bound and link split worked out, so running it only makes views and posts messages.
    recv (src, slot, a, b): into ``slots[slot][a:b]`` (slot -1: ``work[a:b]``); send (dst, a, b)
    of ``work[a:b]``; reduction (lo, hi, slot): ``work[lo:hi] op= slots[slot][:hi - lo]``."""
    prog = []
    for step in steps:
        recvs: list = []
        sends: list = []
        reduces: list = []
        for src, dst, c, p in step:
            if dst != me:
                continue
            lo, hi = piece_bounds(offs, counts, c, p)
            if hi == lo:
                continue
            if reducing:
                k = len(reduces)
                reduces.append((lo, hi, k))
                recvs += [(src, k, a, b) for a, b in _links(hi - lo, links)]
            else:
                recvs += [(src, -1, lo + a, lo + b) for a, b in _links(hi - lo, links)]
        for src, dst, c, p in step:
            if src != me:
                continue
            lo, hi = piece_bounds(offs, counts, c, p)
            sends += [(dst, lo + a, lo + b) for a, b in (_links(hi - lo, links) if hi > lo else ())]
        prog.append((tuple(recvs), tuple(sends), tuple(reduces)))
    return tuple(prog)


def run_steps(g, prog, work, slots, op: str | None, stream, between: Callable | None = None) -> None:
    """Execute ``prog`` (``compile_steps``) on this rank: post each step's recvs then sends
    (non-blocking; a message goes as ``links`` sub-messages, all in flight together: seed
    004's num_links), wait, and reduce what arrived (``op``) or leave it in place (a gather).
    ``between`` runs once, after the first step is launched and before it is waited for
    (``_beside``)."""
    comm = g.comm
    recv, send = comm.recv, comm.send
    ufunc = getattr(C.backend().xp, _UFUNC[op]) if op is not None else None
    for recvs, sends, reduces in prog:
        reqs = [recv(work[a:b] if k < 0 else slots[k][a:b], src, 0, blocking=False, stream=stream)
                for src, k, a, b in recvs]
        reqs += [send(work[a:b], dst, 0, blocking=False, stream=stream) for dst, a, b in sends]
        if between is not None:
            _beside(comm, between)
            between = None
        for req in reqs:
            if req is not None:
                req.wait_done()
        for lo, hi, k in reduces:
            assert ufunc is not None                      # (a gather reduces nothing)
            ufunc(work[lo:hi], slots[k][:hi - lo], out=work[lo:hi])
    if between is not None:
        _beside(comm, between)


def _beside(comm, between: Callable) -> None:
    """Run ``between`` while the messages just posted travel.  NCCL holds non-blocking
    send/recv until a wait: launch them first, or they would start only after ``between``.
    On a GPU ``between`` runs on the compute stream (inside ``OnRole`` the current stream
    is the role's, where its kernels would queue behind the transfer); OnRole's events
    order it: the role stream waited for compute's earlier work, and compute waits for the
    role stream when the ring ends."""
    flush = getattr(comm, "flush", None)
    if flush is not None:
        flush()
    if C.backend().is_gpu:
        with rt.stream("compute"):
            between()
    else:
        between()


class OnRole:
    """Run the ring on the role's stream, ordered after compute's work and before its next.

    Parameters
    ----------
    role : str
        The stream role (``runtime.stream``); on the CPU nothing changes streams.
    """

    def __init__(self, role: str):
        self.gpu = C.backend().is_gpu
        self.stream = rt.stream(role)

    def __enter__(self):
        if self.gpu:
            compute = rt.stream("compute")
            if self.stream is not compute:
                self.stream.wait_event(compute.record())
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.gpu:
            self.stream.__exit__(*exc)
            rt.stream("compute").wait_event(self.stream.record())


def pack_into(work, x, dim: int, sizes) -> None:
    """x's parts along ``dim`` one after another in the flat ``work`` (no allocation)."""
    if dim == 0 or math.prod(x.shape[:dim]) == 1:
        work[...] = x.reshape(-1)
        return
    pos = off = 0
    for p in sizes:
        piece = C.with_dim(x.shape, dim, p)
        cnt = math.prod(piece)
        work[pos:pos + cnt].reshape(piece)[...] = x[(slice(None),) * dim + (slice(off, off + p),)]
        pos, off = pos + cnt, off + p


def unpack_into(out, work, dim: int, sizes) -> None:
    """The parts one after another in the flat ``work`` into place along ``dim`` of ``out``
    (``pack_into``'s inverse)."""
    pos = off = 0
    for p in sizes:
        piece = C.with_dim(out.shape, dim, p)
        cnt = math.prod(piece)
        out[(slice(None),) * dim + (slice(off, off + p),)] = work[pos:pos + cnt].reshape(piece)
        pos, off = pos + cnt, off + p
