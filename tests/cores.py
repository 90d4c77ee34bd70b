"""The ranks that the tests of a parallel run (``pytest -n N``, pytest-xdist) may run at once.

A test that starts jobs of several ranks (an mpi_*.py launch, ``tessera-run -n 4``) is marked
``mpi``: ``@pytest.mark.mpi`` (up to 4 ranks) or ``@pytest.mark.mpi(ranks=2)``.  Under
pytest-xdist each such test holds as many slots as its job has ranks, from a pool of
max(4, cores) + 2 slots that the run's workers share (file locks in a folder of the run's
temp root), so on 2 cores two 4-rank jobs never run side by side with 8 ranks busy-polling MPI
(a rank waiting for a peer that has no core spins until the scheduler moves it).  A 2-rank job
may run beside a 4-rank one (ranks spend much of a test waiting), and a single-process test
always may.

The slots are taken before the test's timeout starts (tests/conftest.py,
pytest_runtest_protocol), so a test's wait for them is not counted against its timeout, and
a worker that dies (a timeout ends it) frees its locks with its process.  ``allow`` checks
that a test starts no job of more ranks than its mark says (multirank.mpi_env calls it): an
unmarked test is a single-process test, which the fast tier (scripts/test.sh --fast) runs.
"""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

MAX_RANKS = 4            # the largest job a test starts
_pool: Path | None = None
_ranks: int | None = None  # the ranks the running test may start (None: no test is running)


def slots() -> int:
    # Two more than the largest job (or the cores): a job's ranks spend much of their time
    # waiting (start-up, the timeouts the fault tests wait out), so a 2-rank job beside a
    # 4-rank one finishes the suite sooner on 2 cores than a worker left idle (the suite's
    # times: BENCHMARKS.md); TESSERA_TEST_RANK_SLOTS sets another size.
    return int(os.environ.get("TESSERA_TEST_RANK_SLOTS", max(MAX_RANKS, len(os.sched_getaffinity(0))) + 2))


def activate(folder: Path) -> None:
    """This process (an xdist worker) takes its slots from the pool in ``folder``."""
    global _pool
    folder.mkdir(parents=True, exist_ok=True)
    _pool = folder


def _lock(path: Path, block: bool):
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return f
    except BlockingIOError:
        f.close()
        return None


@contextmanager
def held(ranks: int):
    """Run a test that starts jobs of up to ``ranks`` ranks (1: none), holding their slots."""
    global _ranks
    got = []
    if _pool is not None and ranks > 1:
        # one taker at a time: two that each hold part of what they need would wait forever
        gate = _lock(_pool / "gate", block=True)
        try:
            while len(got) < min(ranks, slots()):
                for i in range(slots()):
                    f = _lock(_pool / f"slot{i}", block=False)
                    if f is not None:
                        got.append(f)
                        if len(got) == min(ranks, slots()):
                            break
                else:
                    time.sleep(0.05)
        finally:
            gate.close()                         # closing a file releases its lock
    _ranks = ranks
    try:
        yield
    finally:
        _ranks = None
        for f in got:
            f.close()


def allow(nranks: int) -> None:
    """Fail a test that starts a job of more ranks than its mpi mark allows."""
    if _ranks is not None and nranks > _ranks:
        raise RuntimeError(
            f"this test starts a job of {nranks} ranks: mark it @pytest.mark.mpi" +
            (f" (it says ranks={_ranks})" if _ranks > 1 else
             " (the fast tier, bash scripts/test.sh --fast, runs only tests that start no ranks; "
             "a parallel run gives a marked test the cores its ranks need)"))
