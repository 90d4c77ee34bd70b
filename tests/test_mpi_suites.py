"""Launch every multi-rank test file under mpiexec at 1, 2, 3 and 4 ranks.

3 ranks finds uneven-shard bugs.  A failing rank aborts the job (tests/mpi/conftest.py);
``timeout`` bounds each launch in case something hangs anyway.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MPIEXEC, ROOT, mpi_env

SUITES = sorted(p.name for p in (ROOT / "tests" / "mpi").glob("test_*.py"))
LAUNCH_TIMEOUT_S = 240


@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite_under_mpiexec(suite, nranks):
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), MPIEXEC, "-n", str(nranks),
           sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "-p", "no:cacheprovider",
           "--rootdir", str(ROOT / "tests" / "mpi"), str(ROOT / "tests" / "mpi" / suite)]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(nranks), capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"{suite} at {nranks} ranks exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}")
