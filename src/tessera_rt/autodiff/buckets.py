"""Gradient buckets: the pending sums of finished gradients, packed and all-reduced together.

PyTorch DDP's reducer (``torch/nn/parallel/distributed.py``, ``bucket_cap_mb``) is the model:
gradients that complete during the backward, in the order they complete, are copied into a
flat bucket buffer; a full bucket goes out as ONE async all-reduce (in place, on the
``grad_reduce`` role); the gradients handed back are views of the reduced buffer, so there
is no unpack copy.  Only gradients with the same reduction (mesh, mesh axes, dtype) share a
bucket: a tensor-parallel weight's partial sum over ``("tp", "dp")`` and a replicated bias's
over ``"dp"`` go to different buckets, each over its own group.

* The cap (``TESSERA_GRAD_BUCKET_MB``, ``set_grad_bucket_mb``, or ``bucket_mb=`` on
  ``ts.value_and_grad``/``ts.grad``) is a byte budget per bucket; a gradient at least that
  large is all-reduced on its own (no copy), as DDP gives it a bucket of its own.  ``0``
  turns buckets off (one all-reduce per parameter, the path before buckets).  With no cap
  configured it is ``DEFAULT_BUCKET_MB``, lowered for a small model to a quarter of its
  DTensor parameters' bytes (not below 64 KiB): one bucket holding every gradient would go
  out after the backward, with nothing left to hide it under.  The parameters' global
  sizes decide, so every rank picks the same cap.
* When a bucket closes: a gradient that does not fit closes the open bucket first; the
  backward's order is the same every step, so the gradient that closed a bucket is
  remembered (per reduction and parameter path, DDP's "rebuild buckets after the first
  iteration") and from the next step on the bucket goes out as soon as that gradient is in,
  rather than when the next one arrives.  Every rank of a group runs the same program, so
  every rank makes the same decisions and the buckets match.
* Buffers persist: each (reduction, bucket number) keeps its flat buffers and reuses one
  whose views nobody holds any more (``sys.getrefcount``: a gradient the caller still keeps
  from an earlier step is never overwritten; a second buffer serves the common loop that
  keeps the last step's gradients while computing the next).  Offsets are aligned to 256
  bytes so each view starts where a GPU kernel would like it.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["GradBuckets", "grad_bucket_bytes", "largest_shard", "set_grad_bucket_mb", "DEFAULT_BUCKET_MB", "MIN_BUCKETS",
           "MIN_BUCKET_BYTES", "ENV", "release_buffers"]

ENV = "TESSERA_GRAD_BUCKET_MB"
# The default: small enough that a model of a few MB still gets several buckets (so the first
# goes out early in the backward and the sync overlaps it), large enough that the per-call cost
# (a few µs of MPI on CPU ranks, a GIL hand-off to a worker stream, ~10-20 µs of NCCL launch on
# a GPU) is small beside the bytes (1 MiB: ~0.1-0.3 ms of shared-memory traffic on CPU ranks,
# ~10-40 µs over NVLink).  DDP uses 1 MB for its first bucket and 25 MB after; 25 MB buckets
# would put all of scripts/train.py's gradients (0.4 MB) into one all-reduce after the backward.
DEFAULT_BUCKET_MB = 1.0
MIN_BUCKETS = 4                                 # the default cap leaves a model at least this many
MIN_BUCKET_BYTES = 64 << 10                     # ... unless buckets would get smaller than this
_ALIGN = 256                                    # bytes: each gradient view starts on this
_CAP: list = []                                 # set_grad_bucket_mb's value (None: env/default)
# ((mesh, axes, dtype), cap, parameter path) of a gradient that closed a bucket last time
_CLOSES: set = set()
# (mesh, axes, dtype, bucket number) -> flat buffers of that bucket (reused when free)
_POOL: dict = {}
_POOL_DEPTH = 3                                 # buffers kept per bucket; beyond: fresh each step


def set_grad_bucket_mb(mb: float | None) -> None:
    """Set the gradient bucket cap for the process.

    Parameters
    ----------
    mb : float or None
        The cap in MiB (0: one all-reduce per parameter; None: back to
        ``$TESSERA_GRAD_BUCKET_MB`` or the default).
    """
    _CAP[:] = [] if mb is None else [_check_mb(mb, "set_grad_bucket_mb")]


def release_buffers() -> None:
    """Drop the kept bucket buffers and the learned bucket boundaries (a long-lived process
    that is done with a model: each (mesh, axes, dtype, bucket) keeps up to 3 buffers of the
    cap's size).  Gradients already handed out stay valid (they hold their buffer)."""
    _POOL.clear()
    _CLOSES.clear()


def _check_mb(mb, where: str) -> float:
    try:
        v = float(mb)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: the gradient bucket cap must be a number of MiB (0 turns buckets off), "
                        f"got {mb!r}") from None
    if not v >= 0 or v == float("inf"):
        raise ValueError(f"{where}: the gradient bucket cap must be a finite number of MiB >= 0 "
                         f"(0 turns buckets off), got {mb!r}")
    return v


def grad_bucket_bytes(mb: float | None = None, model_bytes: int = 0) -> int:
    """The bucket cap in bytes: ``mb`` if given, else ``set_grad_bucket_mb``'s, else the
    environment's ``TESSERA_GRAD_BUCKET_MB``, else the default: ``DEFAULT_BUCKET_MB``, at
    most ``model_bytes / MIN_BUCKETS`` but not below ``MIN_BUCKET_BYTES``.

    Parameters
    ----------
    mb : float or None
        The cap in MiB (None: the process's, the environment's or the default).
    model_bytes : int
        The global bytes of the parameters that may need a reduction (sizes the default).

    Returns
    -------
    int
        The cap in bytes (0: no buckets).
    """
    if mb is None:
        if _CAP:
            mb = _CAP[0]
        else:
            env = os.environ.get(ENV, "").strip()
            mb = _check_mb(env, f"${ENV}") if env else None
    else:
        mb = _check_mb(mb, "bucket_mb")
    if mb is not None:
        return int(mb * (1 << 20))
    cap = int(DEFAULT_BUCKET_MB * (1 << 20))
    if model_bytes:
        cap = min(cap, max(model_bytes // MIN_BUCKETS, MIN_BUCKET_BYTES))
    return cap


def largest_shard(shape: tuple, layout: Any, mesh: Any) -> int:
    """Elements of the largest shard of a ``shape`` tensor with ``layout`` on ``mesh`` (a dim
    split over axes of k ranks in all has parts of at most ceil(n / k)).  Cached: the finisher
    asks for every gradient inside the backward's window, and ``mesh.size`` costs a NumPy
    product per axis.

    Parameters
    ----------
    shape : tuple of int
        The global shape.
    layout : Layout
        The tensor's layout.
    mesh : Mesh
        Its mesh.

    Returns
    -------
    int
        The element count, the same on every rank.
    """
    key = (tuple(shape), layout, mesh)
    n = _SHARDS.get(key)
    if n is None:
        if len(_SHARDS) >= 4096:         # a bound: the keys hold their meshes
            _SHARDS.clear()
        n = _SHARDS[key] = _largest_shard(shape, layout, mesh)
    return n


_SHARDS: dict = {}                       # (shape, layout, mesh) -> largest_shard


def _largest_shard(shape, layout, mesh) -> int:
    n = 1
    for length, axes in zip(shape, layout.dims):
        k = 1
        for a in axes:
            k *= mesh.size(a)
        n *= -(-length // k)
    return n


class _Bucket:
    __slots__ = ("key", "buf", "used", "slots")

    def __init__(self, key, buf):
        self.key, self.buf, self.used, self.slots = key, buf, 0, []


class GradBuckets:
    """One backward's buckets.  ``add`` takes a finished gradient's local array and its
    reduction; ``flush`` issues what is still open; ``results`` yields (leaf, reduced local
    array) once every all-reduce is done.

    Parameters
    ----------
    cap_bytes : int
        A bucket's size.
    issue : callable
        ``issue(local, mesh, axis, out) -> Work``: starts one bucket's async all-reduce.
    """

    def __init__(self, cap_bytes: int, issue: Callable):
        self.cap = cap_bytes
        self._issue = issue              # issue(local, mesh, axis, out) -> Work
        self._open: dict = {}            # key -> _Bucket
        self._count: dict = {}           # key -> buckets started this backward
        self._works: list = []           # (Work, [(leaf, view)] or leaf)

    def add(self, leaf, local, mesh, axis, planned: int | None = None) -> None:
        """``planned``: the element count every rank decides by (the largest shard of the
        gradient over the mesh, ``largest_shard``).  With uneven shards the local sizes differ
        between ranks; deciding by them would give ranks different bucket counts, and ranks
        issuing different numbers of collectives (even over groups of their own) break the
        mesh-wide agreement check's view of the program and can hang it."""
        dtype = np.dtype(local.dtype)
        key = (mesh, axis, dtype)
        nbytes = (local.size if planned is None else planned) * dtype.itemsize
        if nbytes >= self.cap:           # big enough alone: all-reduce it as it is, no copy
            self._works.append((self._issue(local, mesh, axis, None), leaf))
            return
        b = self._open.get(key)
        start = 0 if b is None else -(-b.used // _ALIGN) * _ALIGN
        if b is not None and start + nbytes > b.buf.nbytes:
            self._close(b)
            b = None
        if b is None:
            b = self._open[key] = _Bucket(key, self._buffer(key, dtype))
            start = 0
        at = start // dtype.itemsize
        view = b.buf[at:at + local.size].reshape(local.shape)
        view[...] = local
        if local.size * dtype.itemsize < nbytes:     # a smaller shard than the planned one:
            b.buf[at + local.size:at + nbytes // dtype.itemsize] = 0   # reduce zeros, not stale bytes
        b.used = start + nbytes
        b.slots.append((leaf, view))
        if (key, self.cap, leaf.name) in _CLOSES:  # it closed this bucket last step: don't wait for the next
            self._close(b)

    def _buffer(self, key, dtype):
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        bufs = _POOL.setdefault(key + (n, self.cap), [])
        for i in range(len(bufs)):
            # 2: the pool's list and getrefcount's argument; no view of it is alive elsewhere
            if sys.getrefcount(bufs[i]) <= 2:
                return bufs[i]
        from ..backend import get_backend
        buf = get_backend().xp.empty(self.cap // dtype.itemsize, dtype)
        if len(bufs) < _POOL_DEPTH and getattr(buf[:1], "base", None) is buf:
            bufs.append(buf)             # views keep it alive (so the refcount test is sound)
        return buf

    def _close(self, b: _Bucket) -> None:
        del self._open[b.key]
        _CLOSES.add((b.key, self.cap, b.slots[-1][0].name))
        flat = b.buf[:b.used // b.buf.itemsize]
        self._works.append((self._issue(flat, b.key[0], b.key[1], flat), b.slots))

    def flush(self) -> None:
        """Issue every open bucket (the end of the backward)."""
        for b in list(self._open.values()):
            self._close(b)

    def results(self):
        """(leaf, reduced local array) for every gradient added, after its all-reduce."""
        self.flush()
        works, self._works = self._works, []
        self._count.clear()
        for work, what in works:
            out = work.wait()
            if type(what) is list:
                yield from what          # the views of the reduced bucket
            else:
                yield what, out
