"""Launch every multi-rank test file under mpiexec at 1, 2, 3 and 4 ranks.

3 ranks finds uneven-shard bugs.  A failing rank aborts the job (tests/mpi/conftest.py);
``timeout`` bounds each launch in case something hangs anyway.
"""
import pytest

from conftest import LAUNCH_TIMEOUT_S, ROOT, run_mpi_suite

SUITES = sorted(p.name for p in (ROOT / "tests" / "mpi").glob("test_*.py"))


@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite_under_mpiexec(suite, nranks):
    run_mpi_suite(suite, nranks)
