"""Launch every multi-rank test file (tests/*/mpi_*.py) under mpiexec at 1, 2, 3 and 4 ranks.

3 ranks finds uneven-shard bugs.  A failing rank aborts the job (tests/rank_hooks.py);
``timeout`` bounds each launch in case something hangs anyway.
"""
import pytest

from conftest import LAUNCH_TIMEOUT_S, ROOT, run_mpi_suite

# the suites that run on the CuPy/NCCL stand-in only (launched by the tests beside them)
STANDIN_ONLY = {"gpu/mpi_gpu_path.py", "gpu/mpi_nccl_standin.py", "moe/mpi_moe_gpu_path.py"}
SUITES = sorted(str(p.relative_to(ROOT / "tests")) for p in (ROOT / "tests").glob("*/mpi_*.py")
                if str(p.relative_to(ROOT / "tests")) not in STANDIN_ONLY)


@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite_under_mpiexec(suite, nranks):
    run_mpi_suite(suite, nranks)
