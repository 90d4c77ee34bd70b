"""Distributed checkpoints: one safetensors file per rank plus a JSON index (issue 7, item 5).

    dist.save({"model": {"w": W, "b": b}, "step": 10}, "ckpt/")        # collective over the job
    state = dist.load("ckpt/", like={"model": {"w": W2, "b": b2}, "step": 0})   # any mesh/layout

Layout on disk (``path`` is a directory on a file system every rank sees)::

    path/index.json                      the commit point: written last, atomically
    path/data-<id>/rank00003.safetensors this save's pieces held by rank 3

* Leaves of the nested dicts and lists (a list's item i is named "i", so ``model.init()``'s
  block list and a tree keyed by layer number name the same entries): DTensors (each distinct
  piece written once, by the rank at coordinate 0 of the axes it is replicated over; a pending
  reduction is completed first), arrays (written whole by the first rank holding them) and
  JSON values (ints, floats, str, bool, None; kept in the index).  Keys are strings without
  "/".  Tensor data is safetensors, never pickle; dtypes safetensors' NumPy API lacks (bf16,
  fp8) are stored as their bytes (uint8) with the real dtype in the index.
* Every rank's tree: ranks may pass different trees (each pipeline stage its own blocks, under
  names of their own: ``nn.Transformer.checkpoint_tree``).  Rank 0 gathers every rank's entries
  as metadata (names, shapes, dtypes, layouts, meshes; an array's sha256) in one collective and
  indexes them all, each with the ``ranks`` that passed it; ranks that pass the same name must
  mean the same thing (a DTensor on the same mesh and layout, passed by every rank of that
  mesh; an array with the same bytes; the same value), else the save fails naming both ranks.
* Atomic: every rank writes its file into a fresh ``data-<id>`` directory (temporary name,
  fsync, rename); once all have, rank 0 writes ``index.json.tmp`` and renames it over
  ``index.json`` (one atomic rename), then removes older data directories.  A save killed at
  any point before that rename leaves the previous index and its data untouched.
* Leftovers: a killed or failed save leaves its ``data-<id>`` directory and temporary files
  (``*.tmp-<pid>``).  The next save removes them before it writes (so a save after a disk-full
  failure has the space back; the committed checkpoint is never touched), and so does
  ``load(path, cleanup=True)`` (or ``checkpoint.cleanup(path)``), which removes everything in
  ``path`` the committed index does not use.  ``save`` returns a :class:`SaveInfo` (the index
  path, a str) that reports the bytes the checkpoint takes and the bytes of leftovers it
  removed; a save that fails says which data it left behind, and how many bytes.
* Checked: the index holds the sha256 of every file and of every piece; ``load`` verifies the
  files it reads and names the file and tensor that fail.
* Resharding: ``load`` computes each rank's piece of the target layout (``like``'s DTensors,
  on any mesh) from the global offsets of the saved pieces, reading only the files that
  overlap it.  An entry no rank saved, or a shape or dtype other than the saved one, is an
  error naming the entry, the file and what was saved.  Errors on any rank are raised on
  every rank (the ranks stay in step).
"""
from __future__ import annotations

import difflib
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
    """{"a/b/0": leaf}: dict keys and list/tuple positions joined by "/" (a list's item i and
    a dict's key "i" are the same entry, so ``model.init()``'s block lists and trees whose
    blocks are keyed by layer number name the same tensors)."""
    out = {} if out is None else out
    if isinstance(tree, (list, tuple)):
        tree = {str(i): v for i, v in enumerate(tree)}
    if not isinstance(tree, dict):
        raise TypeError(f"dist.save/load: the state must be a (nested) dict, got {type(tree).__name__}")
    for k, v in tree.items():
        if not isinstance(k, str) or "/" in k or not k:
            raise ValueError(f"dist.save/load: key {k!r} under {prefix or 'the top'!r} must be a non-empty str "
                             "without '/'")
        key = f"{prefix}/{k}" if prefix else k
        if isinstance(v, (dict, list, tuple)):
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


def _like_shape(like, flat: dict, prefix: str = ""):
    """``flat`` (every leaf of ``like``, by flat name) in the containers of ``like``: its lists
    and tuples stay lists and tuples."""
    items = enumerate(like) if isinstance(like, (list, tuple)) else like.items()
    got = {k: _like_shape(v, flat, f"{prefix}/{k}" if prefix else str(k)) if isinstance(v, (dict, list, tuple))
           else flat[f"{prefix}/{k}" if prefix else str(k)] for k, v in items}
    return type(like)(got.values()) if isinstance(like, (list, tuple)) else got


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


def _describe(e: dict) -> str:
    """An entry's metadata for people: kind, shape, dtype, layout and mesh (or checksum)."""
    what = f"{e['kind']} of shape {tuple(e['shape'])} {e['dtype']}"
    if e["kind"] == "dtensor":
        m = e["mesh"]
        return (f"{what}, layout {e['layout']} on mesh "
                f"{', '.join(f'{a}={n}' for a, n in zip(m['axes'], m['shape']))} of ranks {m['devices']}")
    return what + (f", sha256 {e['sha256'][:12]}..." if "sha256" in e else "")


def _merge(path: str, metas: list) -> tuple[dict, dict]:
    """Rank 0: every rank's entries (metadata only) as one index: each entry records the ranks
    that passed it; ranks that pass the same name must mean the same tensor (a DTensor on
    the same mesh and layout; an array with the same bytes) or the same value, and every rank
    holding a piece of a DTensor must have passed it."""
    tensors: dict = {}
    values: dict = {}
    where: dict = {}                                   # name -> (first rank, what it passed)
    advice = ("; an entry held by several ranks must be the same on each: give per-rank or per-stage state its "
              "own names (a pipelined nn.Transformer: save model.checkpoint_tree(params), whose blocks carry their "
              "global layer number)")
    for r, (ents, vals) in enumerate(metas):
        for key, e in list(ents.items()) + [(k, {"kind": "value", "value": v}) for k, v in vals.items()]:
            sig = {k: v for k, v in e.items() if k != "pieces"}
            if e["kind"] == "value":
                sig["value"] = repr(e["value"])             # NaN == NaN; 1 != True
            if key not in where:
                where[key] = (r, sig)
                if e["kind"] == "value":
                    values[key] = e["value"]
                else:
                    tensors[key] = dict(e, ranks=[r])
                continue
            r0, sig0 = where[key]
            if sig != sig0:
                show = (lambda x: f"the value {x['value']}" if x["kind"] == "value" else "a " + _describe(x))
                raise CheckpointError(f"dist.save({path!r}): ranks {r0} and {r} disagree about {key!r}: rank {r0} "
                                      f"passed {show(sig0)}, rank {r} passed {show(sig)}{advice}")
            if key in tensors:
                tensors[key]["ranks"].append(r)
                if "pieces" in e:                    # sent by the mesh's first rank only
                    tensors[key]["pieces"] = e["pieces"]
    for key, t in tensors.items():
        if t["kind"] == "dtensor":
            lost = sorted(set(t["mesh"]["devices"]) - set(t["ranks"]))
            if lost:
                raise CheckpointError(f"dist.save({path!r}): {key!r} is a {_describe(t)}, but rank(s) {lost} of that "
                                      f"mesh did not pass it (only ranks {t['ranks']} did): every rank of a DTensor's "
                                      "mesh passes it to dist.save")
        else:                                          # one copy, written by the first rank holding it
            t["pieces"] = [{"rank": t["ranks"][0], "offsets": [0] * len(t["shape"]), "shape": t["shape"],
                            "sha256": t.pop("sha256")}]
        for p in t["pieces"]:
            p["file"] = _fname(p["rank"])
    return tensors, values


def _fname(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _committed(path: str) -> str | None:
    """The data directory of the committed checkpoint in ``path`` (None without one); raises
    CheckpointError when an index exists but cannot be read."""
    return read_index(path)["data_dir"] if os.path.exists(os.path.join(path, "index.json")) else None


def save(state: dict, path: str) -> SaveInfo:
    """Write ``state`` (nested dicts and lists of DTensors, arrays and JSON values) to the
    directory ``path``; collective over every rank of the job.  Ranks may pass different trees
    (each pipeline stage its own blocks): the index holds every rank's entries, each with the
    ranks that passed it; ranks passing the same name must pass the same tensor or value.
    Returns the path of the new index as a :class:`SaveInfo` (``.bytes`` on disk,
    ``.removed_bytes`` of older or failed saves; the same on every rank)."""
    w = world()
    flat = _flatten(state)
    entries: dict = {}
    values: dict = {}
    local: dict = {}                                   # what this rank would write, by name
    for key, v in flat.items():
        if type(v) is DTensor:
            if v.layout.partial:
                v = v.redistribute(Layout(v.layout.dims))           # finish pending reductions
            lay, mesh = v.layout, v.mesh
            e = {"kind": "dtensor", "shape": list(v.shape), "dtype": dtype_name(v.dtype), "layout": repr(lay),
                 "dims": [list(a) for a in lay.dims], "mesh": _mesh_info(mesh)}
            pieces = [{"rank": owner, "offsets": list(offs), "shape": list(shp)}
                      for owner, offs, shp in _pieces(v.shape, lay, mesh) if int(np.prod(shp))]
            if w.rank == min(mesh.devices):            # one rank sends the piece list
                e["pieces"] = pieces
            if any(p["rank"] == w.rank for p in pieces):
                local[key] = _host(v.to_local())
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
    # the one metadata exchange: rank 0 checks and merges every rank's entries, removes what
    # failed or killed saves left (a full disk stays full otherwise), makes this save's directory
    metas = w.mpi.gather((entries, values), root=0)
    plan = None
    if w.rank == 0:
        sid = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        try:
            tensors, values = _merge(path, metas)
            os.makedirs(path, exist_ok=True)
            try:
                prev = _committed(path)
                stale = _leftovers(path, prev)
            except CheckpointError:                    # an unreadable index: keep every data dir until commit
                prev, stale = None, [n for n in _leftovers(path, None) if not n.startswith("data-")]
            removed, gone, left = _remove(path, stale)
            os.makedirs(os.path.join(path, f"data-{sid}"))
            writers = {k: t["pieces"][0]["rank"] for k, t in tensors.items() if t["kind"] == "array"}
            plan = (sid, None, writers)
        except (CheckpointError, OSError) as e:
            plan = (sid, f"rank 0: {e}" if isinstance(e, OSError) else str(e), None)
    sid, err, writers = w.mpi.bcast(plan, root=0)
    if err:
        raise CheckpointError(err if w.rank == 0 else f"rank {w.rank}: dist.save failed on rank 0: {err}")
    mine = {k: a for k, a in local.items() if entries[k]["kind"] == "dtensor" or writers[k] == w.rank}
    data_dir, fname = f"data-{sid}", _fname(w.rank)
    err, report = None, None
    try:
        blob = _encode_file({k: _to_disk(a) for k, a in mine.items()}, sid, w.rank)
        _write_atomic(os.path.join(path, data_dir, fname), blob)
        report = (_sha(blob), len(blob), {k: entries[k].get("sha256") or _sha(np.ascontiguousarray(a).tobytes())
                                          for k, a in mine.items()})
    except OSError as e:
        err = f"rank {w.rank}: dist.save({path!r}): writing {data_dir}/{fname} failed: {e}"
    _all_or_raise(w, err, "dist.save", _left_note(path, data_dir))
    reports = w.mpi.gather(report, root=0)
    err, info = None, None
    if w.rank == 0:
        try:
            files = {}
            for r, (sha, nbytes, piece_sha) in enumerate(reports):
                files[_fname(r)] = {"sha256": sha, "bytes": nbytes, "rank": r}
                for key, psha in piece_sha.items():
                    for p in tensors[key]["pieces"]:
                        if p["rank"] == r:
                            p["sha256"] = psha
            index = {"format": _FORMAT, "version": _VERSION, "save_id": sid, "data_dir": data_dir,
                     "world_size": w.size, "files": files, "tensors": tensors, "values": values}
            _write_atomic(os.path.join(path, "index.json"), json.dumps(index, indent=1).encode())
            _fsync_dir(path)
            replaced = _remove(path, [prev] if prev else [])[1]
            more = _remove(path, _leftovers(path, data_dir))      # any the start could not tell apart
            removed, gone, left = removed + more[0], gone + more[1], more[2]
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


def _assemble(reader: _Reader, key: str, t: dict, offs, shape) -> np.ndarray:
    """The region [offs, offs+shape) of saved tensor ``key`` from the pieces that overlap it."""
    saved_dt = resolve_dtype(t["dtype"])
    out = np.empty(tuple(shape), saved_dt)
    filled = 0
    for p in t["pieces"]:
        lo = [max(a, b) for a, b in zip(offs, p["offsets"])]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offs, shape, p["offsets"], p["shape"])]
        if any(h <= l for l, h in zip(lo, hi)) and len(shape):
            continue
        if "file" not in p:
            raise CheckpointError(f"checkpoint {reader.path!r}: the index names no file for rank {p['rank']}'s "
                                  f"piece of {key!r}; it is incomplete")
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
    return out


def _saved(path: str, index: dict, key: str) -> str:
    """What the checkpoint holds under ``key``, and where, for errors."""
    t = index["tensors"][key]
    files = sorted({p["file"] for p in t["pieces"] if "file" in p})
    held = f", passed by ranks {t['ranks']}" if "ranks" in t else ""
    return (f"{_describe(t)}{held}, in {index['data_dir']}/{files[0] if len(files) == 1 else files} under "
            f"{path!r}")


def _missing(path: str, index: dict, key: str) -> CheckpointError:
    names = list(index["tensors"]) + list(index["values"])
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    return CheckpointError(
        f"checkpoint {path!r} has no entry {key!r} ({os.path.join(path, 'index.json')} lists {len(names)}"
        + (f"; the nearest: {near}" if near else f": {sorted(names)[:8]}{' ...' if len(names) > 8 else ''}")
        + "); no rank saved it: load with a `like` tree whose names the save used")


def _check_requests(w, path: str, mine: dict) -> str | None:
    """One tensor lives on one mesh: ranks that load the same entry as DTensors on different
    meshes (pipeline stages that name their own blocks 0, 1, ...) would each get the same
    saved tensor.  Checked on rank 0 over every rank's requests; returns the error."""
    seen: dict = {}
    for r, req in enumerate(w.mpi.gather(mine, root=0) or []):
        for key, devices in req.items():
            r0, d0 = seen.setdefault(key, (r, devices))
            if d0 != devices:
                return (f"dist.load({path!r}): ranks {r0} and {r} load {key!r} as DTensors on different meshes (of "
                        f"ranks {list(d0)} and {list(devices)}), so both would get the same saved tensor; give each "
                        "stage's tensors their own names (a pipelined nn.Transformer: like=model.checkpoint_tree("
                        "model.init()), whose blocks carry their global layer number)")
    return None


def load(path: str, like=None, *, cleanup: bool = False):
    """Read a checkpoint written by :func:`save`; collective over every rank of the job.

    ``cleanup=True``: after a good load, rank 0 removes what killed saves left in ``path``
    (see :func:`cleanup`; no other job may be saving to ``path`` then).

    ``like`` gives the structure and where each tensor goes (nested dicts and lists, e.g.
    ``{"params": model.init()}``; ranks may ask for different entries): a DTensor there is
    loaded as a DTensor of its layout and mesh (any mesh and layout: pieces are cut from the
    saved ones by global offsets); an array is loaded whole; another value is replaced by the
    saved value.  Shapes and dtypes must be the saved ones.  Without ``like`` every entry is
    loaded, tensors whole as arrays, in nested dicts (a list's items under "0", "1", ...)."""
    w = world()
    err, result, index, targets = None, None, None, None
    try:
        targets = _flatten(like) if like is not None else None
        index = read_index(path)
        reader = _Reader(path, index)
        tensors, values = index["tensors"], index["values"]
        if targets is None:
            targets = {k: None for k in list(tensors) + list(values)}
        out = {}
        for key, tmpl in targets.items():
            if key in values and key not in tensors:
                out[key] = values[key]
                continue
            t = tensors.get(key)
            if t is None:
                raise _missing(path, index, key)
            shape, dt = tuple(t["shape"]), resolve_dtype(t["dtype"])
            want = (tuple(tmpl.shape), np.dtype(tmpl.dtype)) if hasattr(tmpl, "shape") else None
            if want is not None and want != (shape, dt):
                raise CheckpointError(f"checkpoint {path!r}: {key!r} was saved with shape {shape} and dtype "
                                      f"{dtype_name(dt)}, `like` has {want[0]} and {dtype_name(want[1])}; the saved "
                                      f"entry is a {_saved(path, index, key)}: load it as saved and convert after")
            if type(tmpl) is DTensor:
                lay, mesh = tmpl.layout, tmpl.mesh
                dense = Layout(lay.dims)
                local = _assemble(reader, key, t, local_offsets(shape, dense, mesh), local_shape(shape, dense, mesh))
                if lay.partial and any(op == "sum" and mesh.coordinate(a) != 0 for a, op in lay.partial):
                    local = np.zeros_like(local)                    # a pending sum: coordinate 0 holds it
                out[key] = ("dt", local, lay, mesh, shape)
            else:
                out[key] = _assemble(reader, key, t, (0,) * len(shape), shape)
        result = out
    except (CheckpointError, OSError, KeyError, ValueError, TypeError) as e:
        err = f"rank {w.rank}: dist.load: {e}" if not isinstance(e, CheckpointError) else str(e)
    clash = _check_requests(w, path, {k: tuple(v.mesh.devices) for k, v in (targets or {}).items()
                                      if type(v) is DTensor})
    _all_or_raise(w, err or clash, "dist.load")
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
    return _like_shape(like, final) if like is not None else _unflatten(final)
