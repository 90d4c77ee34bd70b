import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the venv's own mpiexec: one from another MPI would give every rank size 1
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"


# tests/mpi/ runs under mpiexec, launched by tests/test_mpi_suites.py at 1-4 ranks.
collect_ignore = ["mpi"]


@pytest.fixture(scope="session")
def mpiexec():
    return MPIEXEC


def mpi_env(nranks: int) -> dict:
    env = dict(os.environ)
    env["NUMBA_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env.setdefault("TESSERA_DEVICE", "cpu")
    return env
