"""``save``: every rank writes its pieces, rank 0 commits the index; synchronous, or
asynchronous (``async_=True``): the writes run on the ``io`` role's host worker while the
training goes on (PyTorch DCP's ``async_save``).

One save, in three phases (the same code either way):

1. prepare (collective, on the caller): flatten the state and exchange its metadata once
   (rank 0 merges every rank's entries, removes what killed saves left, makes
   ``data-<id>``); take this rank's pieces to host memory.  An asynchronous save copies them
   (on GPU: device-to-host into pinned memory on the io stream after an event from compute,
   and compute waits for that copy on the device), so the state may change once ``save``
   returns.
2. write (local): encode, hash, write and fsync this rank's file; on the worker when async.
3. commit: every rank says how its write went (collective, on the caller); rank 0 writes the
   index (one atomic rename: the commit point) and removes the previous data (on the worker
   when async); every rank learns the outcome (collective, on the caller).

No collective runs on the worker (it would race the training's collectives on the same
communicator): an asynchronous save moves on at each ``handle.poll()`` (every file written:
rank 0 queues the index; the index written: committed), and finishes at ``handle.wait()``
or at the next ``save``/``load``, which wait for it first (at most one save is in flight).
A job killed before the index is renamed into place keeps the previous checkpoint.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any, NoReturn

from ... import runtime as rt
from ..comm.process_group import World, world
from .files import SaveInfo
from .format import CheckpointError, _fname
from .writer import _agree, _commit, _prepare, _Save, _share, _write, _write_index

_PENDING: list = [None]          # the asynchronous save not committed yet (at most one)


class SaveHandle:
    """An asynchronous save in flight (what ``save(..., async_=True)`` returns; not made by hand).

    ``done()``: this rank's part so far is written (local: no communication).  ``poll()``:
    once every rank's file is written, rank 0 queues the index on its worker; once that is
    written too, the save is committed: True from then on.  ``wait()``: the same, waiting;
    returns the :class:`SaveInfo`.  ``poll`` and ``wait`` are collective (every rank calls
    them at the same points, like the step's collectives) and raise the save's error on
    every rank, naming the rank and file that failed.  ``abandon()`` (local) drops it
    uncommitted, for a training that stops with an error between saves.

    Parameters
    ----------
    w : World
        The process group.
    s : _Save
        The save's prepared state.
    task : task
        The io worker's task (``test()``, ``wait_done()``): this rank's file, then rank 0's index.
    """

    def __init__(self, w: World, s: _Save, task: Any) -> None:
        self._w, self._task = w, task                  # task: this rank's file, then rank 0's index
        self._s: _Save | None = s                       # None once committed, failed or abandoned
        self._agreed = False                            # every rank wrote its file
        self._info: SaveInfo | None = None
        self._error: CheckpointError | None = None

    def __repr__(self) -> str:
        state = "committed" if self._info else "failed" if self._error else "written" if self.done() else "writing"
        return f"SaveHandle({self.path!r}, {state})"

    @property
    def path(self) -> str:
        return os.path.join(self._s.path, "index.json") if self._s else str(self._info or "")

    def done(self) -> bool:
        """Whether this rank's part so far is written (local: no communication).

        Returns
        -------
        bool
            True once written.
        """
        return self._s is None or self._task.test()

    def poll(self) -> bool:
        """Advance the save without waiting (collective); raises its error on every rank.

        Returns
        -------
        bool
            True once committed.
        """
        w = self._w
        if self._s is not None:
            if not self._agreed:
                if not all(w.mpi.allgather(self._task.test())):
                    return False
                self._agree()
                return False                            # rank 0's index write has just been queued
            if not w.mpi.bcast(self._task.test() if w.rank == 0 else None, root=0):
                return False
            self._finish()
        return self.wait() is not None

    def wait(self) -> SaveInfo:
        """Wait until the save is committed (collective); raises its error on every rank.

        Returns
        -------
        SaveInfo
            What ``save`` returns.
        """
        if self._s is not None:
            if not self._agreed:
                self._agree()
            self._finish()
        if self._error is not None:
            raise self._error
        assert self._info is not None                   # (committed)
        return self._info

    def abandon(self) -> None:
        """Drop the save uncommitted (local), for a training that stops with an error between saves.
        """
        if self._s is not None:
            self._local_wait()
            self._s.release()
            self._s, self._error = None, CheckpointError(f"rank {self._w.rank}: dist.save: this asynchronous save "
                                                         "was abandoned uncommitted (SaveHandle.abandon)")
        if _PENDING[0] is self:
            _PENDING[0] = None

    def _local_wait(self) -> None:
        s = self._s
        assert s is not None                            # (the save is open)
        try:
            self._task.wait_done()
        except BaseException as e:  # a task before ours failed the shared worker stream
            if s.err is None and (s.info if self._agreed else s.report) is None:
                what = "index.json" if self._agreed else f"{s.data_dir}/{_fname(self._w.rank)}"
                s.err = (f"rank {self._w.rank}: dist.save({s.path!r}): the io worker failed before writing {what}: "
                         f"{type(e).__name__}: {e}")

    def _agree(self) -> None:
        self._local_wait()
        s = self._s
        assert s is not None                            # (the save is open)
        try:
            index = _agree(self._w, s)
        except CheckpointError as e:
            self._fail(e)
        self._agreed = True
        if index is not None:                           # (rank 0's)
            self._task = rt.host_worker("io").submit(lambda: _write_index(s, index))

    def _finish(self) -> None:
        self._local_wait()
        assert self._s is not None                      # (the save is open)
        try:
            self._info = _share(self._w, self._s)
        except CheckpointError as e:
            self._fail(e)
        self._s = None
        if _PENDING[0] is self:
            _PENDING[0] = None

    def _fail(self, e: CheckpointError) -> NoReturn:
        assert self._s is not None                      # (the save is open)
        self._s.release()
        self._s = None
        if _PENDING[0] is self:
            _PENDING[0] = None
        self._error = CheckpointError(f"{e} (an asynchronous dist.save, raised where it was waited for)")
        raise self._error from None


@atexit.register
def _never_waited() -> None:
    # no collective at exit (the other ranks may be gone): say so instead of losing it silently
    h = _PENDING[0]
    if h is not None and h._s is not None:
        print(f"rank {h._w.rank}: dist.save({h._s.path!r}, async_=True) was never waited for: it is not committed "
              "(the previous checkpoint stays); call its handle's wait() (or dist.checkpoint.wait_pending()) on "
              "every rank before the end", file=sys.stderr, flush=True)


def wait_pending() -> SaveInfo | None:
    """Commit the asynchronous save in flight, if any (collective).

    Returns
    -------
    SaveInfo or None
        Its SaveInfo; None when no save was in flight.
    """
    h = _PENDING[0]
    return h.wait() if h is not None else None


def save(state: dict, path: str, *, async_: bool = False, keep: int = 1) -> SaveInfo | SaveHandle:
    """Write ``state`` to the directory ``path``; collective over every rank of the job.
    Any save or load first waits for (commits) the one in flight, raising its error.

    Parameters
    ----------
    state : dict
        Nested dicts and lists of DTensors, arrays and JSON values.  Ranks may pass different
        trees (each pipeline stage its own blocks): the index holds every rank's entries, each
        with the ranks that passed it; ranks passing the same name must pass the same tensor
        or value.
    path : str
        A directory on a file system every rank sees.
    async_ : bool
        Return at once with a :class:`SaveHandle` once the state is copied to host memory;
        the files are written on the io role's host worker (see the module doc).
    keep : int
        How many checkpoints ``path`` keeps, this one included: the older ones stay loadable
        (``checkpoint.history(path)`` lists them, newest first; ``load`` takes any) and the
        oldest beyond ``keep`` go once this one is committed.

    Returns
    -------
    SaveInfo or SaveHandle
        The path of the new index as a :class:`SaveInfo` (``.bytes`` and ``.files`` on disk,
        ``.replaced_bytes`` of the previous checkpoint and ``.leftover_bytes`` of failed saves,
        deleted; the same on every rank), or the handle with ``async_``.
    """
    if not (isinstance(keep, int) and keep >= 1):
        raise ValueError(f"dist.save(keep={keep!r}): keep counts the checkpoints kept, this one included: an int >= 1")
    w = world()
    wait_pending()                         # at most one save in flight: the next one waits for it
    s = _prepare(w, state, path, copy=async_, keep=keep)
    if not async_:
        _write(s, w.rank)
        return _commit(w, s)
    rank = w.rank
    task = rt.host_worker("io").submit(lambda: _write(s, rank))
    handle = _PENDING[0] = SaveHandle(w, s, task)
    return handle


def async_save(state: dict, path: str) -> SaveHandle:
    """``save(state, path, async_=True)``: the files are written while the caller goes on.

    Parameters
    ----------
    state : dict
        Nested dicts and lists of DTensors, arrays and JSON values.
    path : str
        A directory on a file system every rank sees.

    Returns
    -------
    SaveHandle
        Poll or wait on it to commit.
    """
    handle = save(state, path, async_=True)
    assert isinstance(handle, SaveHandle)
    return handle
