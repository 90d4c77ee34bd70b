"""The checkpoint's files: atomic writes, the index on disk, verified reads, the older
checkpoints kept, and what killed or failed saves leave behind.

    path/index.json                      the newest checkpoint; the commit point: written last, atomically
    path/data-<id>/rank00003.safetensors a save's pieces held by rank 3
    path/index-000005.json               an older checkpoint kept (save(keep=K)): the 5th save's index
    path/.lock                           while a save runs: who writes (``lock.DirLock``)

* Atomic: a file is written under a temporary name (``*.tmp-<pid>``), fsynced and renamed;
  ``index.json`` is replaced by one rename, so a save killed before it leaves the previous
  index and its data untouched.  With ``keep=K`` the previous index is first linked to its
  own name (``index-<seq>.json``), and the oldest beyond K go once the new one is committed.
* One writer: a save holds ``path``'s lock from its start to its commit; a second writer is
  refused naming the first, so a save never removes files another one is writing.
* Leftovers: what killed or failed saves left (``data-*`` directories no kept index uses,
  temporary files); the next save removes them before it writes, as does ``cleanup(path)``.
* Checked: reads verify each file's sha256 against the index and name the file and tensor
  that fail.  Tensor data is safetensors, never pickle.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np

from ...dirlock import DirInUse, DirLock, describe
from ...formatting import human_bytes
from .format import _FORMAT, CheckpointError, _sha

INDEX = "index.json"
_KEPT = re.compile(r"^index-(\d+)\.json$")          # an older checkpoint kept beside the newest

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


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, fsync, rename); the writer
    writes a save's files with it (the tests fail it to model a full disk)."""
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
    the data of the checkpoints it retired (the previous one, or with ``keep=K`` the oldest
    beyond K), deleted; ``older``: the older checkpoints still kept; ``leftovers``/
    ``leftover_bytes``: what killed or failed saves had left in ``path``, deleted now;
    ``left_bytes``: leftovers that could not be deleted (still on disk); ``cleanup_error``:
    why removing those failed after the commit ("" when it did not; the next save retries)."""

    bytes: int
    files: int
    replaced_bytes: int
    older: int
    leftovers: list
    leftover_bytes: int
    left_bytes: int
    cleanup_error: str

    def summary(self) -> str:
        """One line for a log: bytes, files, where, and what was removed.

        Returns
        -------
        str
            The line.
        """
        out = f"{human_bytes(self.bytes)} in {self.files} files at {os.path.dirname(self)}"
        if self.older:
            out += f" (and {self.older} older checkpoint{'s' * (self.older > 1)} kept)"
        if self.cleanup_error:
            out += f"; removing what it replaced failed ({self.cleanup_error}): the next save retries"
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


def _leftovers(path: str, keep: set | None) -> list[str]:
    """Names in ``path`` no kept checkpoint uses: data directories not in ``keep`` (None: an
    index could not be read, so every data directory stays), temporary files of interrupted
    writes."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if (n.startswith("data-") and keep is not None and n not in keep) or ".tmp-" in n)


def _kept(path: str) -> list[tuple[int, str]]:
    """The older checkpoints kept beside the newest: (seq, index file name), newest first."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(((int(m[1]), n) for n in names if (m := _KEPT.match(n))), reverse=True)


def _in_use(path: str) -> set | None:
    """The data directories of every checkpoint kept in ``path`` (None when an index cannot be
    read: then no data directory is a leftover)."""
    used = set()
    for name in [INDEX] + [n for _, n in _kept(path)]:
        try:
            used.add(_head(os.path.join(path, name))[0])
        except FileNotFoundError:
            continue
        except (CheckpointError, OSError):
            return None
    return used


def _lock(path: str, what: str) -> DirLock:
    """``path``'s writer lock, taken, or a CheckpointError naming the writer that holds it."""
    try:
        return DirLock(path).acquire()
    except DirInUse as e:
        raise CheckpointError(
            f"{what}: another process is writing this checkpoint directory ({describe(e.holder)}); one directory "
            "takes one writer at a time, so nothing of the other's is removed: give each job its own "
            "directory") from None


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
    """Remove what killed saves left in ``path`` (everything no kept checkpoint uses); not
    collective: call it on one rank.  A save running there (its lock) is an error naming its
    process.  Without an index (no save ever committed) every ``data-*`` directory and
    temporary file is a leftover.

    Parameters
    ----------
    path : str
        The checkpoint directory.

    Returns
    -------
    dict
        ``{"removed": names, "removed_bytes": n, "left_bytes": n}``.
    """
    if not os.path.isdir(path):
        return {"removed": [], "removed_bytes": 0, "left_bytes": 0}
    with _lock(path, f"dist.checkpoint.cleanup({path!r})"):
        removed, gone, left = _remove(path, _leftovers(path, _in_use(path)))
    return {"removed": removed, "removed_bytes": gone, "left_bytes": left}


def history(path: str) -> list[str]:
    """The checkpoints kept in ``path``, newest first, as index file paths (``index.json``,
    then the older ones ``save(..., keep=K)`` keeps); ``load`` takes any of them.

    Parameters
    ----------
    path : str
        The checkpoint directory.

    Returns
    -------
    list of str
        Index file paths; empty without a checkpoint.  An unreadable index is listed too
        (``load`` then says why).
    """
    out, seen = [], set()
    for name in [INDEX] + [n for _, n in _kept(path)]:
        ipath = os.path.join(path, name)
        try:
            data_dir = _head(ipath)[0]
        except FileNotFoundError:
            continue
        except (CheckpointError, OSError):
            data_dir = ipath
        if data_dir not in seen:           # (a copy kept just before a commit that was then killed)
            seen.add(data_dir)
            out.append(ipath)
    return out


def rollback(path: str) -> str | None:
    """Drop the newest checkpoint in ``path``: the newest older one kept becomes the committed
    one (one atomic rename over ``index.json``) and the dropped one's data goes.  Not
    collective: call it on one rank, with no save to ``path`` running.

    Parameters
    ----------
    path : str
        The checkpoint directory.

    Returns
    -------
    str or None
        The index path now committed, or None when no older checkpoint is kept (nothing changes).
    """
    with _lock(path, f"dist.checkpoint.rollback({path!r})"):
        older = history(path)[1:]
        if not older:
            return None
        os.replace(older[0], os.path.join(path, INDEX))
        _fsync_dir(path)
        _remove(path, _leftovers(path, _in_use(path)))
    return os.path.join(path, INDEX)


# --------------------------------------------------------------------------- save

def _encode_file(tensors: dict, sid: str, rank: int) -> bytes:
    from safetensors.numpy import save as st_save
    return st_save(tensors, metadata={"format": _FORMAT, "save_id": sid, "rank": str(rank)})


_SEEN: dict = {}         # index path -> (its stat's identity, (data_dir, seq)): each save reads it once


def _head(ipath: str) -> tuple[str, int]:
    """(data directory, save number) of the index file ``ipath``; FileNotFoundError without
    it, CheckpointError when it cannot be read."""
    st = os.stat(ipath)
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    seen = _SEEN.get(ipath)
    if seen is None or seen[0] != key:     # the same inode, time and size: the index this process read
        index = read_index(ipath)
        seen = _SEEN[ipath] = (key, (index["data_dir"], int(index.get("seq", 0))))
    return seen[1]


def _committed(path: str) -> tuple[str | None, int]:
    """(data directory, save number) of the committed checkpoint in ``path`` ((None, 0)
    without one); raises CheckpointError when an index exists but cannot be read."""
    try:
        return _head(os.path.join(path, INDEX))
    except FileNotFoundError:
        return None, 0


def _keep_previous(path: str, seq: int) -> None:
    """Before a commit with keep > 1: the committed index under its own name, so the rename
    of the new one over ``index.json`` keeps it (a hard link; a copy where links fail)."""
    src, dst = os.path.join(path, INDEX), os.path.join(path, f"index-{seq:06d}.json")
    if os.path.exists(dst):
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError:
        with open(src, "rb") as f:
            write_atomic(dst, f.read())


def _retired(path: str, keep: int, index: dict, prev: str | None) -> list[str]:
    """After the commit of ``index``: what it retires, the kept index files beyond the newest
    ``keep - 1`` older ones, then the data directories only the retired ones used (with
    keep=1, the previous checkpoint's, ``prev``)."""
    older = _kept(path)
    stay, go = older[:keep - 1], older[keep - 1:]
    used, dirs = {index["data_dir"]}, {prev} if prev else set()
    for group, into in ((stay, used), (go, dirs)):
        for _, name in group:
            try:
                into.add(_head(os.path.join(path, name))[0])
            except (CheckpointError, OSError):
                pass
    return [n for _, n in go] + sorted(dirs - used)


def _left_note(path: str, data_dir: str):
    """For a failed save's error: what it left on disk (read after every rank stopped writing)."""
    def note() -> str:
        left = _bytes_under(os.path.join(path, data_dir))
        return (f" [this save left {human_bytes(left)} in {os.path.join(path, data_dir)}; the previous checkpoint "
                "is unchanged; the next dist.save or dist.load(path, cleanup=True) removes it]")
    return note


# --------------------------------------------------------------------------- load

def _where(path) -> tuple[str, str]:
    """(checkpoint directory, index file) of ``path``: a directory (its newest checkpoint) or
    one of its index files (``history``: an older one kept)."""
    path = str(path)
    if path.endswith(".json"):
        return os.path.dirname(path) or ".", path
    return path, os.path.join(path, INDEX)


def read_index(path: str) -> dict:
    """The checkpoint's index (global shapes, layouts, pieces, checksums, values).

    Parameters
    ----------
    path : str
        The checkpoint directory (its newest checkpoint), or one of its index files
        (``history``).

    Returns
    -------
    dict
        The parsed index.
    """
    path, ipath = _where(path)
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
        self.path, self.index = path, index
        self.cache: dict = {}

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


