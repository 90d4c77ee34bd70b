"""Runs under mpiexec (launched by tests/test_cupy_standin.py) with the CuPy stand-in as
``cupy``; skipped when collected by a plain pytest run.  A failing rank aborts the job, so
the others cannot wait forever in a collective (as tests/mpi/conftest.py does)."""
import os
import sys

import pytest

UNDER_MPIEXEC = os.environ.get("TESSERA_STANDIN_MPI") == "1"


def pytest_collection_modifyitems(config, items):
    if not UNDER_MPIEXEC:
        skip = pytest.mark.skip(reason="runs under mpiexec from tests/test_cupy_standin.py")
        for item in items:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and UNDER_MPIEXEC:
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() > 1:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
