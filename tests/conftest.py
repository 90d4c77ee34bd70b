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
# tests/cudasim/ runs in a process with NUMBA_ENABLE_CUDASIM=1 (tests/test_cudasim_suite.py);
# tests/mpi_cuda/ runs under mpiexec with the CuPy stand-in (tests/test_gpu_path_standin.py,
# tests/test_cupy_standin.py); tests/gpu_emu/ holds the stand-in and the emulation harness.
collect_ignore = ["mpi", "cudasim", "mpi_cuda", "gpu_emu"]


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Decided when this file is imported, before any test module is: tests/test_cupy_standin.py
# and tests/test_cuda_emu.py put the stand-in on sys.path during collection, and its
# `cupy` must not make this process look like a GPU machine.  A process started with the
# stand-in on PYTHONPATH (TESSERA_DEVICE=cuda, tests/test_gpu_path_standin.py) runs the
# gpu-marked tests on it, emulated.
GPU_AT_START = gpu_available()
if not GPU_AT_START:
    os.environ.setdefault("TESSERA_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not GPU_AT_START:
        skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy: runs on the GPU machine (pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# The strict CuPy/NCCL stand-in (tests/gpu_emu/cupy) and the CUDA emulation harness
# (tests/gpu_emu/cuda_emu): a process with this on its path runs the cuda backend on the CPU.
GPU_EMU = ROOT / "tests" / "gpu_emu"


def standin_env(devices: int = 1) -> dict:
    """Environment for a process that runs TESSERA_DEVICE=cuda on the stand-in, with
    ``devices`` emulated GPUs (ranks on distinct devices use NCCL, shared ones host staging)."""
    path = os.pathsep.join(p for p in (str(GPU_EMU), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TESSERA_DEVICE": "cuda", "TESSERA_STANDIN_DEVICES": str(devices)}


def mpi_env(nranks: int, device: str = "cpu", extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["NUMBA_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["TESSERA_DEVICE"] = device
    env.update(extra or {})
    return env


def run_mpi_suite(suite, nranks: int, device: str = "cpu", env: dict | None = None, folder: str = "mpi") -> None:
    """Run tests/<folder>/<suite> (a file name, or a list run in one launch) under mpiexec;
    fail with the job's output if it fails or hangs.  ``env`` adds variables (e.g.
    ``standin_env()``, which also sets the device)."""
    where = ROOT / "tests" / folder
    files = [str(where / s) for s in ([suite] if isinstance(suite, str) else suite)]
    # the hypothesis and anyio pytest plugins cost ~1.2 s of CPU per rank at start-up and no
    # multi-rank test needs them (@given runs without the plugin); 10 ranks per suite, 2 cores
    pytest_cmd = shlex.join([sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "-p", "no:cacheprovider",
                             "-p", "no:hypothesispytest", "-p", "no:anyio", "--rootdir", str(where), *files])
    # only rank 0 prints progress (MPICH sets PMI_RANK, Open MPI OMPI_COMM_WORLD_RANK)
    quiet = 'if [ "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" != 0 ]; then exec >/dev/null; fi; exec '
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), MPIEXEC, "-n", str(nranks),
           "sh", "-c", quiet + pytest_cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(nranks, device, env), capture_output=True, text=True)
    if env and env.get("TESSERA_DEVICE"):
        device = f"{env['TESSERA_DEVICE']} (stand-in)" if "TESSERA_STANDIN_DEVICES" in env else env["TESSERA_DEVICE"]
    assert proc.returncode == 0, (
        f"{suite} at {nranks} ranks on {device} exited {proc.returncode}"
        f"{' (timed out)' if proc.returncode == 124 else ''}\n--- stdout\n{proc.stdout[-6000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}")
