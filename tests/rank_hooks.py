"""The hooks of a rank of a multi-rank suite (tests/*/mpi_*.py under mpiexec; tests/conftest.py
loads them there): every rank runs the same tests; the first failure aborts the job.

A failing rank calls MPI.COMM_WORLD.Abort(1), so the other ranks cannot wait forever in
a collective that will never complete.  The launcher (tests/conftest.py) sends the
stdout of ranks other than 0 to /dev/null; a failing rank writes its failure to stderr.
"""
import sys

import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt.dist.checks import consistency
from tessera_rt.dist.comm import calls

RANK = MPI.COMM_WORLD.Get_rank()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.write(f"\n[rank {RANK}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def _checks_in_step() -> None:
    """The cross-rank check's per-group call counts equal on every rank again, nothing pending.

    The check verifies a call site once, then every 1024th call on a group by that group's
    count; a test whose ranks issue different collectives on purpose (tests/debug/mpi_debug.py)
    leaves the counts apart, and a later test in the same launch then has one rank verify
    alone: it waits in the check's Allgather for peers that never come (a hang)."""
    calls.GROUPS.reset()
    consistency.STATE.reset()


@pytest.fixture(autouse=True)
def _in_step():
    """Each test starts and ends with every rank in step and default streams."""
    MPI.COMM_WORLD.Barrier()
    yield
    ts.runtime.reset()
    ts.dist.set_mesh(None)
    _checks_in_step()
    MPI.COMM_WORLD.Barrier()


@pytest.fixture
def world():
    return ts.dist.init()
