"""A directory that one process writes at a time: ``DirLock`` (a run directory for a job's
whole life, a checkpoint directory for one save, tessera-run's folder for its job).

The lock is ``flock`` on ``DIR/.lock``, a file that says who holds it (host, pid, start time,
command).  The kernel releases it when the holder ends, however it ends (SIGKILL included),
so a lock left by a dead process is never mistaken for a live one: the file's text is only
read to name a live holder.  The holder deletes the file as it releases it; a process that
opened the file just before that checks, once it holds the lock, that the path still names
the file it locked, else takes the new one.  Over NFS, Linux takes flock as a POSIX lock on
the server, which releases it when the holder's client goes away.

It sits at the bottom of the package, on the standard library alone, so that tessera-run,
which locks its job's folder, starts without loading the distributed core (half a second of
CPU a launch).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

__all__ = ["DirLock", "DirInUse", "LOCK_NAME"]

LOCK_NAME = ".lock"


class DirInUse(RuntimeError):
    """Another live process holds the directory's lock.

    Parameters
    ----------
    path : str
        The directory.
    holder : dict
        Who holds it: ``host``, ``pid``, ``started`` (epoch seconds), ``command``.
    """

    def __init__(self, path: str, holder: dict):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is in use by {describe(holder)}")


def describe(holder: dict) -> str:
    """``pid 812 on host node1, started 2026-11-28 10:04:05 UTC: python train.py ...``."""
    if not holder:
        return "another process (it has not said which yet)"
    started = holder.get("started")
    when = time.strftime(", started %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else ""
    cmd = f": {holder['command']}" if holder.get("command") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}{cmd}"


def _read_holder(lock_path: str) -> dict:
    """What the holder wrote (it writes right after it takes the lock: wait a moment for it)."""
    for _ in range(20):
        try:
            with open(lock_path, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            time.sleep(0.025)
    return {}


class DirLock:
    """An exclusive lock on directory ``path`` (made if missing) while held.

    Parameters
    ----------
    path : str
        The directory.
    """

    def __init__(self, path: str):
        self.path = str(path)
        self.lock_path = os.path.join(self.path, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DirLock:
        """Take the lock without waiting.

        Returns
        -------
        DirLock
            self.
        """
        os.makedirs(self.path, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise DirInUse(self.path, _read_holder(self.lock_path)) from None
            try:                                 # the holder before may have deleted it as it let go
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(me).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Let go (a no-op when not held): the lock file goes, then the lock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> DirLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def holder(path: str) -> dict | None:
        """Who holds ``path``'s lock: their record, or None when nobody does (no lock file, or
        one left by a process that has ended).  Not for a directory this process holds.

        Parameters
        ----------
        path : str
            The directory.

        Returns
        -------
        dict or None
            ``host``, ``pid``, ``started``, ``command``; None when free.
        """
        try:
            fd = os.open(os.path.join(str(path), LOCK_NAME), os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_holder(os.path.join(str(path), LOCK_NAME))
        finally:
            os.close(fd)
        return None
