"""The checkpoint's files: atomic writes, the index on disk, verified reads, and what killed
or failed saves leave behind.

    path/index.json                      the commit point: written last, atomically
    path/data-<id>/rank00003.safetensors a save's pieces held by rank 3

* Atomic: a file is written under a temporary name (``*.tmp-<pid>``), fsynced and renamed;
  ``index.json`` is replaced by one rename, so a save killed before it leaves the previous
  index and its data untouched.
* Leftovers: what killed or failed saves left (other ``data-*`` directories, temporary
  files); the next save removes them before it writes, as does ``cleanup(path)``.
* Checked: reads verify each file's sha256 against the index and name the file and tensor
  that fail.  Tensor data is safetensors, never pickle.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from ..._format import human_bytes
from .format import _FORMAT, CheckpointError, _sha

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
        """One line for a log: bytes, files, where, and what was removed.

        Returns
        -------
        str
            The line.
        """
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
    use); not collective: call it on one rank, with no save to ``path`` running.  Without an
    index (no save ever committed) every ``data-*`` directory and temporary file is a leftover.

    Parameters
    ----------
    path : str
        The checkpoint directory.

    Returns
    -------
    dict
        ``{"removed": names, "removed_bytes": n, "left_bytes": n}``.
    """
    keep = read_index(path)["data_dir"] if os.path.exists(os.path.join(path, "index.json")) else None
    removed, gone, left = _remove(path, _leftovers(path, keep))
    return {"removed": removed, "removed_bytes": gone, "left_bytes": left}


# --------------------------------------------------------------------------- save

def _encode_file(tensors: dict, sid: str, rank: int) -> bytes:
    from safetensors.numpy import save as st_save
    return st_save(tensors, metadata={"format": _FORMAT, "save_id": sid, "rank": str(rank)})


_SEEN: dict = {}         # index path -> (its stat's identity, data_dir): each save reads it once


def _committed(path: str) -> str | None:
    """The data directory of the committed checkpoint in ``path`` (None without one); raises
    CheckpointError when an index exists but cannot be read."""
    ipath = os.path.join(path, "index.json")
    try:
        st = os.stat(ipath)
    except FileNotFoundError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    seen = _SEEN.get(ipath)
    if seen is None or seen[0] != key:     # the same inode, time and size: the index this process read
        seen = _SEEN[ipath] = (key, read_index(path)["data_dir"])
    return seen[1]


def _left_note(path: str, data_dir: str):
    """For a failed save's error: what it left on disk (read after every rank stopped writing)."""
    def note() -> str:
        left = _bytes_under(os.path.join(path, data_dir))
        return (f" [this save left {human_bytes(left)} in {os.path.join(path, data_dir)}; the previous checkpoint "
                "is unchanged; the next dist.save or dist.load(path, cleanup=True) removes it]")
    return note


# --------------------------------------------------------------------------- load

def read_index(path: str) -> dict:
    """The checkpoint's index (global shapes, layouts, pieces, checksums, values).

    Parameters
    ----------
    path : str
        The checkpoint directory.

    Returns
    -------
    dict
        The parsed ``index.json``.
    """
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


