"""The backend-agnostic multi-rank suites on CuPy arrays (run on the GPU machine).

One rank per GPU uses NCCL; at 2 and 4 ranks on one GPU the ranks share it, so the same
tests exercise the host-staged MPI path.  One launch per rank count runs every suite.
"""
import pytest

from conftest import BACKEND_AGNOSTIC, LAUNCH_TIMEOUT_S, run_mpi_suite


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_suites_on_gpu(nranks):
    run_mpi_suite(BACKEND_AGNOSTIC, nranks, device="cuda")
