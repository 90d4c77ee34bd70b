"""Distributed checkpoints: one safetensors file per rank plus a JSON index (issue 7, item 5).

    dist.save({"model": {"w": W, "b": b}, "step": 10}, "ckpt/")        # collective over the job
    state = dist.load("ckpt/", like={"model": {"w": W2, "b": b2}, "step": 0})   # any mesh/layout

Layout on disk (``path`` is a directory on a file system every rank sees)::

    path/index.json                      the commit point: written last, atomically
    path/data-<id>/rank00003.safetensors this save's pieces held by rank 3

* Leaves of the nested dicts: DTensors (each distinct piece written once, by the rank at
  coordinate 0 of the axes it is replicated over; a pending reduction is completed first),
  arrays (written whole by rank 0) and JSON values (ints, floats, str, bool, None; kept in
  the index).  Keys are strings without "/".  Tensor data is safetensors, never pickle;
  dtypes safetensors' NumPy API lacks (bf16, fp8) are stored as their bytes (uint8) with the
  real dtype in the index.
* Atomic: every rank writes its file into a fresh ``data-<id>`` directory (temporary name,
  fsync, rename); once all have, rank 0 writes ``index.json.tmp`` and renames it over
  ``index.json`` (one atomic rename), then removes older data directories.  A save killed at
  any point before that rename leaves the previous index and its data untouched.
* Leftovers: a killed save leaves its ``data-<id>`` directory and temporary files
  (``*.tmp-<pid>``).  The next save removes them after it commits, and so does
  ``load(path, cleanup=True)`` (or ``checkpoint.cleanup(path)``), which removes everything in
  ``path`` the committed index does not use.  ``save`` returns a :class:`SaveInfo` (the index
  path, a str) that reports the bytes the checkpoint takes and the bytes of leftovers it
  removed; a save that fails says which data it left behind, and how many bytes.
* Checked: the index holds the sha256 of every file and of every piece; ``load`` verifies the
  files it reads and names the file and tensor that fail.
* Resharding: ``load`` computes each rank's piece of the target layout (``like``'s DTensors,
  on any mesh) from the global offsets of the saved pieces, reading only the files that
  overlap it.  Errors on any rank are raised on every rank (the ranks stay in step).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from itertools import product

import numpy as np

from .._format import human_bytes
from ..backend import get_backend
from ..dtypes import dtype_name, resolve_dtype
from .dtensor import DTensor, from_local
from .layout import Layout
from .process_group import world
from .shard import local_offsets, local_shape

__all__ = ["save", "load", "cleanup", "SaveInfo", "CheckpointError", "read_index"]

_FORMAT, _VERSION = "tessera_rt.checkpoint", 1
_SAFE_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64))


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; names the path, file and tensor."""


# --------------------------------------------------------------------------- helpers

def _flatten(tree, prefix="", out=None) -> dict:
    out = {} if out is None else out
    if not isinstance(tree, dict):
        raise TypeError(f"dist.save/load: the state must be a (nested) dict, got {type(tree).__name__}")
    for k, v in tree.items():
        if not isinstance(k, str) or "/" in k or not k:
            raise ValueError(f"dist.save/load: key {k!r} under {prefix or 'the top'!r} must be a non-empty str "
                             "without '/'")
        key = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            _flatten(v, key, out)
        else:
            out[key] = v
    return out


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        *parents, last = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else (a.get() if hasattr(a, "get") else np.asarray(a))


def _sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


def _to_disk(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a if a.dtype in _SAFE_DTYPES else a.reshape(-1).view(np.uint8)


def _from_disk(a: np.ndarray, dtype: np.dtype, shape) -> np.ndarray:
    return (a if a.dtype == dtype else a.view(dtype)).reshape(tuple(shape))


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


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _all_or_raise(w, err: str | None, what: str, note=None) -> None:
    """Every rank raises if any rank failed (so no rank walks on into a collective alone);
    ``note()`` adds to the message (what a failed save left on disk)."""
    errs = w.mpi.allgather(err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        r, e = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        msg = e if r == w.rank else f"rank {w.rank}: {what} failed on rank {r}{more}: {e}"
        raise CheckpointError(msg + (note() if note is not None else ""))


# --------------------------------------------------------------------------- leftovers

class SaveInfo(str):
    """What ``save`` returns: the index path (a str, as before) plus what is on disk.

    ``bytes``/``files``: the committed checkpoint (data files and index); ``replaced_bytes``:
    the previous checkpoint's data, deleted; ``leftovers``/``leftover_bytes``: what killed or
    failed saves had left in ``path``, deleted now; ``left_bytes``: leftovers that could not
    be deleted (still on disk)."""

    bytes: int
    files: int
    replaced_bytes: int
    leftovers: list
    leftover_bytes: int
    left_bytes: int

    def summary(self) -> str:
        out = f"{human_bytes(self.bytes)} in {self.files} files at {os.path.dirname(self)}"
        if self.leftovers:
            out += (f"; removed {human_bytes(self.leftover_bytes)} left by killed saves "
                    f"({', '.join(self.leftovers[:3])}{', ...' if len(self.leftovers) > 3 else ''})")
        if self.left_bytes:
            out += f"; {human_bytes(self.left_bytes)} of leftovers could not be removed (dist.checkpoint.cleanup)"
        return out


def _bytes_under(p: str) -> int:
    if os.path.isfile(p):
        return os.path.getsize(p)
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _leftovers(path: str, keep: str | None) -> list[str]:
    """Names in ``path`` the committed index (data dir ``keep``) does not use: other data
    directories, temporary files of interrupted writes."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if (n.startswith("data-") and n != keep) or ".tmp-" in n)


def _remove(path: str, names: list[str]) -> tuple[list[str], int, int]:
    removed, gone, left = [], 0, 0
    for n in names:
        full = os.path.join(path, n)
        size = _bytes_under(full)
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.remove(full)
            except OSError:
                pass
        if os.path.exists(full):
            left += size
        else:
            removed.append(n)
            gone += size
    return removed, gone, left


def cleanup(path: str) -> dict:
    """Remove what killed saves left in ``path`` (everything the committed index does not
    use); not collective: call it on one rank, with no save to ``path`` running.  Returns
    {"removed": names, "removed_bytes": n, "left_bytes": n}.  Without an index (no save ever
    committed) every ``data-*`` directory and temporary file is a leftover."""
    keep = read_index(path)["data_dir"] if os.path.exists(os.path.join(path, "index.json")) else None
    removed, gone, left = _remove(path, _leftovers(path, keep))
    return {"removed": removed, "removed_bytes": gone, "left_bytes": left}


# --------------------------------------------------------------------------- save

def _encode_file(tensors: dict, sid: str, rank: int) -> bytes:
    from safetensors.numpy import save as st_save
    return st_save(tensors, metadata={"format": _FORMAT, "save_id": sid, "rank": str(rank)})


def save(state: dict, path: str) -> SaveInfo:
    """Write ``state`` (nested dicts of DTensors, arrays and JSON values) to the directory
    ``path``; collective over every rank of the job.  Returns the path of the new index as a
    :class:`SaveInfo` (``.bytes`` on disk, ``.removed_bytes`` of older or killed saves; the
    same on every rank)."""
    w = world()
    flat = _flatten(state)
    entries: dict = {}
    values: dict = {}
    mine: dict = {}
    for key, v in flat.items():
        if type(v) is DTensor:
            if v.layout.partial:
                v = v.redistribute(Layout(v.layout.dims))           # finish pending reductions
            lay, mesh = v.layout, v.mesh
            pieces = []
            for i, (owner, offs, shp) in enumerate(_pieces(v.shape, lay, mesh)):
                if int(np.prod(shp)) == 0:
                    continue
                pieces.append({"rank": owner, "offsets": list(offs), "shape": list(shp)})
                if owner == w.rank:
                    mine[key] = _host(v.to_local())
            entries[key] = {"kind": "dtensor", "shape": list(v.shape), "dtype": dtype_name(v.dtype),
                            "layout": repr(lay), "dims": [list(a) for a in lay.dims], "mesh": _mesh_info(mesh),
                            "pieces": pieces}
        elif get_backend().is_array(v) or isinstance(v, (np.ndarray, np.generic)):
            a = _host(v) if not isinstance(v, np.generic) else np.asarray(v)
            entries[key] = {"kind": "array", "shape": list(a.shape), "dtype": dtype_name(a.dtype),
                            "pieces": [{"rank": 0, "offsets": [0] * a.ndim, "shape": list(a.shape)}]}
            if w.rank == 0:
                mine[key] = a
        elif v is None or isinstance(v, (bool, int, float, str)):
            values[key] = v
        else:
            raise TypeError(f"rank {w.rank}: dist.save: {key!r} is a {type(v).__name__}; leaves must be DTensors, "
                            "arrays or JSON values (int, float, str, bool, None)")
    os.makedirs(path, exist_ok=True) if w.rank == 0 else None
    sid = w.mpi.bcast(f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}" if w.rank == 0 else None, root=0)
    data_dir = f"data-{sid}"
    fname = f"rank{w.rank:05d}.safetensors"
    err, report = None, None
    try:
        if w.rank == 0:
            os.makedirs(os.path.join(path, data_dir))
        w.mpi.Barrier()
        tensors = {k: _to_disk(a) for k, a in mine.items()}
        blob = _encode_file(tensors, sid, w.rank)
        _write_atomic(os.path.join(path, data_dir, fname), blob)
        report = (fname, _sha(blob), len(blob),
                  {k: _sha(np.ascontiguousarray(a).tobytes()) for k, a in mine.items()})
    except OSError as e:
        err = f"rank {w.rank}: dist.save({path!r}): writing {data_dir}/{fname} failed: {e}"
    _all_or_raise(w, err, "dist.save", _left_note(path, data_dir))
    reports = w.mpi.gather(report, root=0)
    err, info = None, None
    if w.rank == 0:
        try:
            files = {}
            for r, (fn, sha, nbytes, piece_sha) in enumerate(reports):
                files[fn] = {"sha256": sha, "bytes": nbytes, "rank": r}
                for key, psha in piece_sha.items():
                    for p in entries[key]["pieces"]:
                        if p["rank"] == r:
                            p["file"], p["sha256"] = fn, psha
            try:                                       # the checkpoint this one replaces
                prev = read_index(path)["data_dir"] if os.path.exists(os.path.join(path, "index.json")) else None
            except CheckpointError:
                prev = None
            index = {"format": _FORMAT, "version": _VERSION, "save_id": sid, "data_dir": data_dir,
                     "world_size": w.size, "files": files, "tensors": entries, "values": values}
            _write_atomic(os.path.join(path, "index.json"), json.dumps(index, indent=1).encode())
            _fsync_dir(path)
            # older saves and leftovers of killed ones: data dirs and half-written temporaries
            replaced = _remove(path, [prev] if prev and prev != data_dir else [])[1]
            removed, gone, left = _remove(path, _leftovers(path, data_dir))
            kept = sum(f["bytes"] for f in files.values()) + os.path.getsize(os.path.join(path, "index.json"))
            info = (kept, len(files) + 1, replaced, removed, gone, left)
        except OSError as e:
            err = f"rank 0: dist.save({path!r}): committing index.json failed: {e}"
    _all_or_raise(w, err, "dist.save", _left_note(path, data_dir))
    info = w.mpi.bcast(info, root=0) if w.size > 1 else info
    out = SaveInfo(os.path.join(path, "index.json"))
    out.bytes, out.files, out.replaced_bytes, out.leftovers, out.leftover_bytes, out.left_bytes = info
    return out


def _left_note(path: str, data_dir: str):
    """For a failed save's error: what it left on disk (read after every rank stopped writing)."""
    def note() -> str:
        left = _bytes_under(os.path.join(path, data_dir))
        return (f" [this save left {human_bytes(left)} in {os.path.join(path, data_dir)}; the previous checkpoint "
                "is unchanged; the next dist.save or dist.load(path, cleanup=True) removes it]")
    return note


# --------------------------------------------------------------------------- load

def read_index(path: str) -> dict:
    """The checkpoint's index (global shapes, layouts, pieces, checksums, values)."""
    ipath = os.path.join(path, "index.json")
    try:
        with open(ipath, "rb") as f:
            index = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path!r}: {ipath} does not exist (a save that never "
                              "committed leaves none)") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint index {ipath} is not valid JSON ({e}); it is corrupt") from None
    if index.get("format") != _FORMAT:
        raise CheckpointError(f"{ipath} is not a tessera_rt checkpoint index (format={index.get('format')!r})")
    return index


class _Reader:
    """Reads and verifies the files this rank needs, each once."""

    def __init__(self, path: str, index: dict):
        self.path, self.index, self.cache = path, index, {}

    def tensors(self, fname: str, key: str) -> dict:
        got = self.cache.get(fname)
        if got is not None:
            return got
        from safetensors.numpy import load as st_load
        rel = f"{self.index['data_dir']}/{fname}"
        full = os.path.join(self.path, rel)
        try:
            with open(full, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.path!r}: file {rel} (holding {key!r}) is missing") from None
        want = self.index["files"][fname]["sha256"]
        if _sha(blob) != want:
            bad = self._which(blob, fname)
            raise CheckpointError(
                f"checkpoint {self.path!r}: file {rel} fails its sha256 check (expected {want[:16]}..., got "
                f"{_sha(blob)[:16]}...){bad}: it is corrupt or was changed after the save; restore it or load "
                "an older checkpoint")
        got = self.cache[fname] = st_load(blob)
        return got

    def _which(self, blob: bytes, fname: str) -> str:
        from safetensors.numpy import load as st_load
        try:
            arrays = st_load(blob)
        except Exception as e:
            return f"; its header cannot be read ({e})"
        bad = []
        for key, t in self.index["tensors"].items():
            for p in t["pieces"]:
                if p.get("file") == fname:
                    a = arrays.get(key)
                    if a is None or _sha(np.ascontiguousarray(a).tobytes()) != p["sha256"]:
                        bad.append(key)
        return f"; tensor(s) {bad} differ" if bad else ""


def _assemble(reader: _Reader, key: str, t: dict, offs, shape, dtype) -> np.ndarray:
    """The region [offs, offs+shape) of saved tensor ``key`` from the pieces that overlap it."""
    saved_dt = resolve_dtype(t["dtype"])
    out = np.empty(tuple(shape), saved_dt)
    filled = 0
    for p in t["pieces"]:
        lo = [max(a, b) for a, b in zip(offs, p["offsets"])]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offs, shape, p["offsets"], p["shape"])]
        if any(h <= l for l, h in zip(lo, hi)) and len(shape):
            continue
        arr = reader.tensors(p["file"], key).get(key)
        if arr is None:
            raise CheckpointError(f"checkpoint {reader.path!r}: file {p['file']} has no tensor {key!r} "
                                  "although the index says it holds a piece")
        piece = _from_disk(arr, saved_dt, p["shape"])
        src = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, p["offsets"]))
        dst = tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, offs))
        out[dst] = piece[src]
        filled += int(np.prod([h - l for l, h in zip(lo, hi)]))
    if filled != int(np.prod(shape)):
        raise CheckpointError(f"checkpoint {reader.path!r}: the saved pieces of {key!r} cover {filled} of the "
                              f"{int(np.prod(shape))} elements this rank needs; the index is inconsistent")
    return out.astype(dtype, copy=False) if dtype is not None else out


def load(path: str, like: dict | None = None, *, cleanup: bool = False) -> dict:
    """Read a checkpoint written by :func:`save`; collective over every rank of the job.

    ``cleanup=True``: after a good load, rank 0 removes what killed saves left in ``path``
    (see :func:`cleanup`; no other job may be saving to ``path`` then).

    ``like`` gives the structure and where each tensor goes: a DTensor there is loaded as a
    DTensor of its layout, mesh and dtype (any mesh and layout: pieces are cut from the saved
    ones by global offsets); an array is loaded whole (its dtype kept); another value is
    replaced by the saved value.  Without ``like`` every tensor is loaded whole as a NumPy array."""
    w = world()
    err, result = None, None
    try:
        index = read_index(path)
        reader = _Reader(path, index)
        tensors, values = index["tensors"], index["values"]
        targets = _flatten(like) if like is not None else {k: None for k in list(tensors) + list(values)}
        out = {}
        for key, tmpl in targets.items():
            if key in values and key not in tensors:
                out[key] = values[key]
                continue
            t = tensors.get(key)
            if t is None:
                raise CheckpointError(f"checkpoint {path!r} has no entry {key!r}; it holds "
                                      f"{sorted(list(tensors) + list(values))[:20]}")
            shape = tuple(t["shape"])
            if type(tmpl) is DTensor:
                if tuple(tmpl.shape) != shape:
                    raise CheckpointError(f"checkpoint {path!r}: {key!r} was saved with shape {shape}, `like` has "
                                          f"{tuple(tmpl.shape)}")
                lay, mesh = tmpl.layout, tmpl.mesh
                dense = Layout(lay.dims)
                local = _assemble(reader, key, t, local_offsets(shape, dense, mesh), local_shape(shape, dense, mesh),
                                  tmpl.dtype)
                if lay.partial and any(op == "sum" and mesh.coordinate(a) != 0 for a, op in lay.partial):
                    local = np.zeros_like(local)                    # a pending sum: coordinate 0 holds it
                out[key] = ("dt", local, lay, mesh, shape)
            else:
                dt = tmpl.dtype if hasattr(tmpl, "dtype") and tmpl is not None else None
                if hasattr(tmpl, "shape") and tuple(tmpl.shape) != shape:
                    raise CheckpointError(f"checkpoint {path!r}: {key!r} was saved with shape {shape}, `like` has "
                                          f"{tuple(tmpl.shape)}")
                out[key] = _assemble(reader, key, t, (0,) * len(shape), shape, dt)
        result = out
    except (CheckpointError, OSError, KeyError, ValueError) as e:
        err = f"rank {w.rank}: dist.load: {e}" if not isinstance(e, CheckpointError) else str(e)
    _all_or_raise(w, err, "dist.load")
    if cleanup and w.rank == 0:
        _remove(path, _leftovers(path, index["data_dir"]))
    xp = get_backend().xp
    final = {}
    for key, v in result.items():
        if isinstance(v, tuple) and v and v[0] == "dt":
            _, local, lay, mesh, shape = v
            final[key] = from_local(xp.asarray(local), layout=lay, mesh=mesh, shape=shape, validate=False)
        elif isinstance(v, np.ndarray):
            final[key] = xp.asarray(v)
        else:
            final[key] = v
    return _unflatten(final)
