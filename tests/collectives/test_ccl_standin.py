"""tests/collectives/mpi_ccl.py on the cuda backend's Python, on the CPU: TESSERA_DEVICE=cuda with the
strict CuPy/NCCL stand-in (tests/gpu_emu), two ranks on two emulated devices (the NCCL
stand-in's grouped send/recv carry the rings).  Nothing here runs on a GPU."""
import pytest

from conftest import LAUNCH_TIMEOUT_S, run_mpi_suite, standin_env


@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_ccl_suite_on_the_nccl_standin():
    run_mpi_suite("collectives/mpi_ccl.py", 2, env=standin_env(2))
