"""The phases of one save (see ``saving``): prepare (collective: the metadata exchange and
this rank's pieces on the host), write (local: this rank's file), commit (collective: rank 0
writes the index).  ``saving`` runs them in a row, or the write on the io worker.
"""
from __future__ import annotations

import functools
import json
import os
import time
import uuid
from itertools import product

import numpy as np

from ... import runtime as rt
from ...backend import get_backend
from ...dtypes import dtype_name
from ..tensor.dtensor import DTensor
from ..tensor.layout import Layout
from ..tensor.shard import local_offsets, local_shape
from . import files
from .files import (
    INDEX,
    SaveInfo,
    _committed,
    _encode_file,
    _fsync_dir,
    _in_use,
    _keep_previous,
    _left_note,
    _leftovers,
    _lock,
    _remove,
    _retired,
)
from .format import (
    _FORMAT,
    _VERSION,
    CheckpointError,
    _all_or_raise,
    _fname,
    _host,
    _merge,
    _sha,
    _to_disk,
    flatten,
)


class _Save:
    """One save between its phases (``prev``, ``seq``, ``cleaned`` and ``lock``: rank 0's, for
    the commit: the committed checkpoint's data directory and number, what the start removed,
    and the directory's writer lock, held until the commit is shared)."""

    def __init__(self, path, sid, tensors, values, prev=None, cleaned=None, keep=1, seq=0, lock=None):
        self.path, self.sid, self.data_dir = path, sid, f"data-{sid}"
        self.tensors, self.values, self.prev, self.cleaned = tensors, values, prev, cleaned
        self.keep, self.seq, self.lock = keep, seq, lock
        self.mine = self.ready = self.report = self.err = self.info = None
        self.hashes: dict = {}       # name -> sha256 known from the metadata (arrays)

    def release(self) -> None:
        """Let go of the directory's writer lock (rank 0; a no-op elsewhere and the second time)."""
        if self.lock is not None:
            self.lock.release()


def _mesh_info(mesh) -> dict:
    return {"axes": list(mesh.axes), "shape": list(mesh.sizes), "devices": list(mesh.devices)}


def _pieces(shape, lay: Layout, mesh) -> list[tuple[int, tuple, tuple]]:
    """(world rank, offsets, shape) of each distinct piece, held by the position at coordinate
    0 of every axis the tensor is replicated over."""
    used = {a for axes in lay.dims for a in axes}
    out = []
    for pos in product(*(range(n) for n in mesh.sizes)):
        if any(c for a, c in zip(mesh.axes, pos) if a not in used):
            continue
        coords = dict(zip(mesh.axes, pos))
        out.append((int(mesh.device_grid[pos]), local_offsets(shape, lay, mesh, coords),
                    local_shape(shape, lay, mesh, coords)))
    return out


@functools.lru_cache(maxsize=4096)
def _dtensor_entry(shape: tuple, dtype, lay: Layout, mesh) -> tuple[dict, tuple]:
    """A DTensor's index entry and its pieces, the same at every save of a training (cached:
    a few hundred entries cost a step's worth of time otherwise)."""
    e = {"kind": "dtensor", "shape": list(shape), "dtype": dtype_name(dtype), "layout": repr(lay),
         "dims": [list(a) for a in lay.dims], "mesh": _mesh_info(mesh)}
    return e, tuple({"rank": owner, "offsets": list(offs), "shape": list(shp)}
                    for owner, offs, shp in _pieces(shape, lay, mesh) if int(np.prod(shp)))


def _entries(w, flat: dict) -> tuple[dict, dict, dict]:
    """This rank's entries (metadata), values, and the arrays it would write, by name."""
    entries, values, local = {}, {}, {}
    for key, v in flat.items():
        if type(v) is DTensor:
            if v.layout.partial:
                v = v.redistribute(Layout(v.layout.dims))           # finish pending reductions
            base, pieces = _dtensor_entry(tuple(v.shape), v.dtype, v.layout, v.mesh)
            e = dict(base)                              # fresh dicts: the merge and the commit fill them in
            if w.rank == min(v.mesh.devices):          # one rank sends the piece list
                e["pieces"] = [dict(p) for p in pieces]
            if any(p["rank"] == w.rank for p in pieces):
                local[key] = v.to_local()               # to host in _stage
            entries[key] = e
        elif get_backend().is_array(v) or isinstance(v, (np.ndarray, np.generic)):
            a = local[key] = _host(v) if not isinstance(v, np.generic) else np.asarray(v)
            entries[key] = {"kind": "array", "shape": list(a.shape), "dtype": dtype_name(a.dtype),
                            "sha256": _sha(np.ascontiguousarray(a).tobytes())}
        elif v is None or isinstance(v, (bool, int, float, str)):
            values[key] = v
        else:
            raise TypeError(f"rank {w.rank}: dist.save: {key!r} is a {type(v).__name__}; leaves must be DTensors, "
                            "arrays or JSON values (int, float, str, bool, None)")
    return entries, values, local


def _prepare(w, state: dict, path: str, copy: bool, keep: int = 1) -> _Save:
    """Phase 1 (collective): the one metadata exchange, then this rank's pieces on the host."""
    entries, values, local = _entries(w, flatten(state))
    # rank 0 checks and merges every rank's entries, takes the directory's writer lock (until
    # the commit: no other writer's files are ever taken for leftovers), removes what failed
    # or killed saves left (a full disk stays full otherwise), makes this save's directory
    metas = w.mpi.gather((entries, values), root=0)
    plan: tuple | None = None
    s: _Save | None = None
    if w.rank == 0:
        sid = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        lock = None
        try:
            tensors, merged = _merge(path, metas)
            lock = _lock(path, f"dist.save({path!r})")
            try:
                prev, seq = _committed(path)
            except CheckpointError:                    # an unreadable index: no data dir is a leftover
                prev, seq = None, 0
            cleaned = _remove(path, _leftovers(path, _in_use(path)))
            os.makedirs(os.path.join(path, f"data-{sid}"))
            s = _Save(path, sid, tensors, merged, prev, cleaned, keep, seq, lock)
            writers = {k: t["pieces"][0]["rank"] for k, t in tensors.items() if t["kind"] == "array"}
            plan = (sid, None, writers)
        except (CheckpointError, OSError) as e:
            if lock is not None:
                lock.release()
            plan = (sid, f"rank 0: {e}" if isinstance(e, OSError) else str(e), None)
    sid, err, writers = w.mpi.bcast(plan, root=0)
    if err:
        raise CheckpointError(err if w.rank == 0 else f"rank {w.rank}: dist.save failed on rank 0: {err}")
    s = s or _Save(path, sid, None, None, None, None)
    mine = {k: a for k, a in local.items() if entries[k]["kind"] == "dtensor" or writers[k] == w.rank}
    s.hashes = {k: entries[k]["sha256"] for k in mine if "sha256" in entries[k]}
    s.mine, s.ready = _stage(mine, copy)
    return s


def _stage(arrays: dict, copy: bool) -> tuple[dict, object]:
    """This rank's pieces in host memory, and what the writer waits for before reading them.
    Synchronous: as they are (a GPU array copied now).  Asynchronous: copies the training
    cannot touch; a GPU array is copied on the io stream after an event from compute (its
    work so far), into pinned memory, without blocking the caller, and compute waits for
    the copy on the device, so the state may change once save returns."""
    dev = {k: a for k, a in arrays.items() if not isinstance(a, np.ndarray)}
    host = {k: np.array(a) if copy else a for k, a in arrays.items() if isinstance(a, np.ndarray)}
    if not copy or not dev:
        return dict(host, **{k: _host(a) for k, a in dev.items()}), None
    import cupyx
    compute, io = rt.stream("compute"), rt.stream("io")
    io.wait_event(compute.record())
    xp = get_backend().xp
    with io:
        for k, a in dev.items():
            a = dev[k] = xp.ascontiguousarray(a)
            host[k] = a.get(stream=io.raw, out=cupyx.empty_pinned(a.shape, a.dtype), blocking=False)
    ready = io.record()
    compute.wait_event(ready)
    return host, (ready, dev)            # the device arrays stay alive until the copy is done


def _write(s: _Save, rank: int) -> None:
    """Phase 2 (local; on the io worker when asynchronous): this rank's file.  Never raises:
    the error is the commit's to share (a raise would leave the worker stream failed)."""
    fname = _fname(rank)
    try:
        if s.ready is not None:
            s.ready[0].synchronize()
        mine, s.mine, s.ready = s.mine, None, None
        blob = _encode_file({k: _to_disk(a) for k, a in mine.items()}, s.sid, rank)
        files.write_atomic(os.path.join(s.path, s.data_dir, fname), blob)
        s.report = (_sha(blob), len(blob), {k: s.hashes.get(k) or _sha(np.ascontiguousarray(a).tobytes())
                                            for k, a in mine.items()})
    except Exception as e:  # any failure of this rank's write is the save's error
        why = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        s.err = f"rank {rank}: dist.save({s.path!r}): writing {s.data_dir}/{fname} failed: {why}"


def _agree(w, s: _Save) -> dict | None:
    """Commit, part 1 (collective): every rank's write went well (else all raise); rank 0
    gets the index, with every rank's file and piece checksums (None on the others)."""
    _all_or_raise(w, s.err, "dist.save", _left_note(s.path, s.data_dir))
    reports = w.mpi.gather(s.report, root=0)
    if w.rank != 0:
        return None
    listing = {}
    for r, (sha, nbytes, piece_sha) in enumerate(reports):
        listing[_fname(r)] = {"sha256": sha, "bytes": nbytes, "rank": r}
        for key, psha in piece_sha.items():
            for p in s.tensors[key]["pieces"]:
                if p["rank"] == r:
                    p["sha256"] = psha
    return {"format": _FORMAT, "version": _VERSION, "save_id": s.sid, "seq": s.seq + 1, "data_dir": s.data_dir,
            "world_size": w.size, "files": listing, "tensors": s.tensors, "values": s.values}


def _write_index(s: _Save, index: dict) -> None:
    """Commit, part 2 (rank 0, local; on the io worker when asynchronous): the previous index
    kept under its own name (keep > 1), the new one renamed over it (the commit point), then
    what that retires and what killed saves left removed.  Sets ``s.info`` (what ``SaveInfo``
    reports) or ``s.err``; never raises."""
    path = s.path
    try:
        if s.keep > 1 and s.prev:
            _keep_previous(path, s.seq)
        files.write_atomic(os.path.join(path, INDEX), json.dumps(index, indent=1).encode())
        _fsync_dir(path)
    except OSError as e:
        s.err = f"rank 0: dist.save({path!r}): committing index.json failed: {e}"
        return
    # Committed.  Only now may the retired checkpoints' data go: a save killed before the
    # rename above must leave the previous checkpoint whole (tests/checkpoint kill it there).
    # A failure from here on leaves files behind, never a checkpoint without its data.
    kept = sum(f["bytes"] for f in index["files"].values()) + len(json.dumps(index, indent=1))
    removed, gone, _ = s.cleaned
    try:
        replaced = _remove(path, _retired(path, s.keep, index, s.prev))[1]
        more = _remove(path, _leftovers(path, _in_use(path)))      # any the start could not tell apart
        older = len(files._kept(path))
        s.info = (kept, len(index["files"]) + 1, replaced, older, removed + more[0], gone + more[1], more[2], "")
    except OSError as e:
        s.info = (kept, len(index["files"]) + 1, 0, 0, removed, gone, 0, str(e))


def _share(w, s: _Save) -> SaveInfo:
    """Commit, part 3 (collective): rank 0's outcome on every rank; rank 0 lets go of the
    directory."""
    try:
        _all_or_raise(w, s.err if w.rank == 0 else None, "dist.save", _left_note(s.path, s.data_dir))
    finally:
        s.release()
    info = w.mpi.bcast(s.info, root=0) if w.size > 1 else s.info
    out = SaveInfo(os.path.join(s.path, INDEX))
    (out.bytes, out.files, out.replaced_bytes, out.older, out.leftovers, out.leftover_bytes, out.left_bytes,
     out.cleanup_error) = info
    return out


def _commit(w, s: _Save) -> SaveInfo:
    """Phase 3 of a synchronous save: all three parts in a row."""
    try:
        index = _agree(w, s)
        if index is not None:                          # (rank 0's)
            _write_index(s, index)
        return _share(w, s)
    finally:
        s.release()
