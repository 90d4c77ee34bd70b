"""The checkpoint's tree format and index: how a state tree becomes named entries, how every
rank's entries merge into one index, and the error every rank raises together.

* Names: dict keys and list positions joined by "/" (a list's item i is named "i", so
  ``model.init()``'s block list and a tree keyed by layer number name the same entries).
* Entries: DTensors (each distinct piece once, by the rank at coordinate 0 of the axes it is
  replicated over), arrays (whole, by the first rank holding them) and JSON values.  dtypes
  safetensors' NumPy API lacks (bf16, fp8) are stored as their bytes with the real dtype in
  the index.
* ``_merge`` (rank 0) checks that ranks passing the same name mean the same thing.
"""
from __future__ import annotations

import hashlib

import numpy as np

_FORMAT, _VERSION = "tessera_rt.checkpoint", 1
_SAFE_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64))


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; names the path, file and tensor."""


# --------------------------------------------------------------------------- helpers

def flatten(tree, prefix="", out=None) -> dict:
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
            flatten(v, key, out)
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


