import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the venv's own mpiexec: one from another MPI would give every rank size 1
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
LAUNCH_TIMEOUT_S = 240

# tests/mpi/ runs under mpiexec, launched by tests/test_mpi_suites.py at 1-4 ranks;
# tests/cudasim/ runs in a process with NUMBA_ENABLE_CUDASIM=1 (tests/test_cudasim_suite.py).
collect_ignore = ["mpi", "cudasim"]


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy: runs on the GPU machine (pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def mpi_env(nranks: int, device: str = "cpu") -> dict:
    env = dict(os.environ)
    env["NUMBA_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["TESSERA_DEVICE"] = device
    return env


def run_mpi_suite(suite: str, nranks: int, device: str = "cpu") -> None:
    """Run tests/mpi/<suite> under mpiexec; fail with the job's output if it fails or hangs."""
    pytest_cmd = shlex.join([sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "-p", "no:cacheprovider",
                             "--rootdir", str(ROOT / "tests" / "mpi"), str(ROOT / "tests" / "mpi" / suite)])
    # only rank 0 prints progress (MPICH sets PMI_RANK, Open MPI OMPI_COMM_WORLD_RANK)
    quiet = 'if [ "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" != 0 ]; then exec >/dev/null; fi; exec '
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), MPIEXEC, "-n", str(nranks),
           "sh", "-c", quiet + pytest_cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(nranks, device), capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"{suite} at {nranks} ranks on {device} exited {proc.returncode}"
        f"{' (timed out)' if proc.returncode == 124 else ''}\n--- stdout\n{proc.stdout[-6000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}")
