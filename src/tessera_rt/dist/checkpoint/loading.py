"""``load``: a checkpoint onto any mesh and layout (resharding from the saved pieces' global
offsets), with every request checked against the index.

``like``'s DTensors get this rank's piece of their layout, cut from the saved pieces that
overlap it (only the files that hold those are read); arrays are read whole; values come
from the index.  An entry no rank saved, or a shape or dtype other than the saved one, is
an error naming the entry, the file and what was saved; errors on any rank are raised on
every rank (the ranks stay in step).
"""
from __future__ import annotations

import difflib
import os
from typing import Any

import numpy as np

from ...backend import get_backend
from ...dtypes import dtype_name, resolve_dtype
from ..comm.process_group import world
from ..tensor.dtensor import DTensor, from_local
from ..tensor.layout import Layout
from ..tensor.shard import local_offsets, local_shape
from .files import _in_use, _leftovers, _lock, _Reader, _remove, _where, read_index
from .format import CheckpointError, _all_or_raise, _describe, _from_disk, _like_shape, _unflatten, flatten
from .saving import wait_pending


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


def load(path: str, like: object = None, *, cleanup: bool = False) -> Any:
    """Read a checkpoint written by :func:`save`; collective over every rank of the job.

    Parameters
    ----------
    path : str
        The checkpoint directory (its newest checkpoint), or one of its index files
        (``checkpoint.history(path)``: an older checkpoint ``save(keep=K)`` kept).
    like : dict or list, optional
        The structure and where each tensor goes (nested dicts and lists, e.g.
        ``{"params": model.init()}``; ranks may ask for different entries): a DTensor there is
        loaded as a DTensor of its layout and mesh (any mesh and layout: pieces are cut from
        the saved ones by global offsets); an array is loaded whole; another value is replaced
        by the saved value.  Shapes and dtypes must be the saved ones.  Without ``like`` every
        entry is loaded, tensors whole as arrays, in nested dicts (a list's items under "0",
        "1", ...).
    cleanup : bool
        After a good load, rank 0 removes what killed saves left in ``path`` (see
        :func:`cleanup`; no other job may be saving to ``path`` then).

    Returns
    -------
    dict or list
        ``like``'s structure (or nested dicts) holding the loaded values.
    """
    w = world()
    wait_pending()                     # an asynchronous save in flight commits first
    err, result, index, targets = None, None, None, None
    folder = _where(path)[0]
    try:
        targets = flatten(like) if like is not None else None
        index = read_index(path)
        reader = _Reader(folder, index)
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
        try:
            with _lock(folder, "dist.load(cleanup=True)"):
                _remove(folder, _leftovers(folder, _in_use(folder)))
        except CheckpointError:
            pass                        # another process writes there: its files are not leftovers
    xp = get_backend().xp
    final = {}
    assert result is not None                       # (else _all_or_raise raised)
    for key, v in result.items():
        if isinstance(v, tuple) and v and v[0] == "dt":
            _, local, lay, mesh, shape = v
            final[key] = from_local(xp.asarray(local), layout=lay, mesh=mesh, shape=shape, validate=False)
        elif isinstance(v, np.ndarray):
            final[key] = xp.asarray(v)
        else:
            final[key] = v
    return _like_shape(like, final) if like is not None else _unflatten(final)
