"""The backend-agnostic multi-rank suites on CuPy arrays (run on the GPU machine).

One rank per GPU uses NCCL; at 2 and 4 ranks on one GPU the ranks share it, so the same
tests exercise the host-staged MPI path.
"""
import pytest

from conftest import LAUNCH_TIMEOUT_S, run_mpi_suite


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("suite", ["test_collectives.py", "test_mesh_and_comm.py"])
def test_suite_on_gpu(suite, nranks):
    run_mpi_suite(suite, nranks, device="cuda")
