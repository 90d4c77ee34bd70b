"""Distributed checkpoints: one safetensors file per rank plus a JSON index (issue 7, item 5).

    dist.save({"model": {"w": W, "b": b}, "step": 10}, "ckpt/")        # collective over the job
    state = dist.load("ckpt/", like={"model": {"w": W2, "b": b2}, "step": 0})   # any mesh/layout
    h = dist.save(state, "ckpt/", async_=True)     # written while training goes on; h.poll()/h.wait()

``path`` is a directory on a file system every rank sees.  Ranks may pass different trees
(each pipeline stage its own blocks, under names of their own: ``nn.Transformer.checkpoint_tree``);
rank 0 indexes every rank's entries.  A save commits with one atomic rename of
``index.json``: a save killed at any point before it (an asynchronous one too) leaves the
previous checkpoint whole; the next save removes what it left.  ``save(..., keep=K)`` keeps
the K newest checkpoints (``history(path)`` lists them, newest first).  One process writes a
directory at a time (its ``.lock``; a second writer is refused naming the first).  ``load``
reshards onto any mesh and layout and verifies every file it reads.

The package, by responsibility:

* ``format``: the tree format (names, entries, dtypes on disk) and the index merge;
* ``lock``: ``DirLock``, one writer per directory (also the run directory of scripts/train.py
  and tessera-run's folder);
* ``files``: atomic writes, the index on disk, verified reads, kept checkpoints (``history``,
  ``rollback``), leftovers and ``cleanup``;
* ``writer``: the phases of one save (prepare, write this rank's file, commit the index);
* ``saving``: ``save`` and its asynchronous form (``SaveHandle``: the write on the io role's
  worker, the commit on the caller);
* ``loading``: ``load`` with resharding and its checks.
"""
from ...dirlock import DirInUse, DirLock
from .files import SaveInfo, cleanup, history, read_index, rollback
from .format import CheckpointError
from .loading import load
from .saving import SaveHandle, async_save, save, wait_pending

__all__ = ["save", "async_save", "load", "cleanup", "history", "rollback", "DirLock", "DirInUse", "SaveInfo",
           "SaveHandle", "CheckpointError", "read_index",
           "wait_pending"]
