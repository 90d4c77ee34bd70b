import os
import re
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

# One folder per capability.  Its test_*.py files run in this process; its mpi_*.py files are
# multi-rank suites (every rank runs the same tests), run under mpiexec at the rank counts
# tests/test_mpi_suites.py launches, never collected by a plain run (pytest collects
# test_*.py).  tests/kernels/sim_tile_kernels.py runs in a process with
# NUMBA_ENABLE_CUDASIM=1 (tests/kernels/test_cudasim_suite.py); tests/gpu_emu/ holds the
# CuPy/NCCL stand-in and the emulation harness.
collect_ignore = ["gpu_emu"]


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Decided when this file is imported, before any test module is: tests/gpu/test_cupy_standin.py
# and tests/gpu/test_cuda_emu.py put the stand-in on sys.path during collection, and its
# `cupy` must not make this process look like a GPU machine.  A process started with the
# stand-in on PYTHONPATH (tests/gpu/test_gpu_path_standin.py, tests/test_gpu_machine.py) runs the
# gpu-marked tests on it, emulated.
GPU_AT_START = gpu_available()
# Every test runs on the backend it was written for, whatever the machine: the tests are
# written for the CPU unless marked `gpu`, and the backend is chosen once per process from
# TESSERA_DEVICE (an unset one picks cuda where CuPy sees a GPU).  Subprocesses and mpiexec
# launches inherit it; the fixture below switches to cuda for the gpu-marked tests.
# A rank of a multi-rank suite (this file is loaded there too) keeps the device its launch
# chose: cpu, or cuda for the stand-in's and tests/gpu/test_gpu_suites.py's launches.
UNDER_MPIEXEC = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
if not UNDER_MPIEXEC:
    os.environ["TESSERA_DEVICE"] = "cpu"
else:
    # a rank of a multi-rank suite: ranks kept in step, a failing rank aborts the job
    from rank_hooks import _in_step, pytest_runtest_makereport, world  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if not GPU_AT_START and any(item.get_closest_marker("gpu") for item in items):
        skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy: runs on the GPU machine (pytest -m gpu)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def use_backend(device: str) -> None:
    """Make ``device`` ("cpu" or "cuda") this process's backend from the next get_backend().

    The runtime's streams belong to the old backend: they are finished and dropped (a fresh
    compute stream is made on the new one if there were any).  A dist world, made once per
    process, keeps the backend it was made on: the gpu-marked tests that use the cuda backend
    in this process (tests/kernels/test_gpu.py) use no world, and the multi-rank ones launch
    their ranks."""
    from tessera_rt import runtime
    from tessera_rt.backend import reset_backend
    os.environ["TESSERA_DEVICE"] = device
    reset_backend()
    runtime.reset()


@pytest.fixture(autouse=True)
def _backend_written_for(request):
    """gpu-marked tests on the cuda backend, every other test on the CPU backend (switched
    only where a test of the other kind follows: the gpu-marked ones sit together)."""
    want = "cuda" if request.node.get_closest_marker("gpu") else "cpu"
    if not UNDER_MPIEXEC and os.environ.get("TESSERA_DEVICE") != want:
        use_backend(want)
    yield


# The multi-rank suites written against the backend's array module: they run on the cuda
# backend too, on the GPU machine (tests/gpu/test_gpu_suites.py) and on the stand-in.
BACKEND_AGNOSTIC = [f"collectives/mpi_{n}.py" for n in ("collectives", "mesh_and_comm", "numeric_scope", "streams")]


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
    # where mpiexec is Open MPI's (a machine image's), it refuses root and more ranks than
    # cores unless told; MPICH ignores these
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env["NUMBA_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["TESSERA_DEVICE"] = device
    env.update(extra or {})
    return env


# skip reasons that depend on the launch's rank count or device, which each launch expects
EXPECTED_RANK_SKIP = re.compile(
    r"needs (2|two|3) ranks|needs stages|needs two stages|ranks? (to disagree|outside the mesh)|a ring needs|"
    r"group of one|several ranks|one ep position|even rank count|2x2 mesh|sharded contraction|"
    r"CPU worker threads themselves|"
    # a parametrization built from the rank count can be empty at some sizes
    r"got empty parameter set")


def run_mpi_suite(suite, nranks: int, device: str = "cpu", env: dict | None = None) -> None:
    """Run tests/<suite> (a path under tests/ such as "moe/mpi_moe.py", or a list run in one
    launch) under mpiexec; fail with the job's output if it fails or hangs.  ``env`` adds
    variables (e.g. ``standin_env()``, which also sets the device)."""
    where = ROOT / "tests"
    files = [str(where / s) for s in ([suite] if isinstance(suite, str) else suite)]
    # the hypothesis and anyio pytest plugins cost ~1.2 s of CPU per rank at start-up and no
    # multi-rank test needs them (@given runs without the plugin); 10 ranks per suite, 2 cores
    pytest_cmd = shlex.join([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "--tb=short", "-p", "no:cacheprovider",
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
    # a suite whose tests skip for a reason other than the rank count would pass on its exit
    # code alone (every test skipped is exit 0): rank 0's skips must all be expected ones
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED [")]
    unexpected = [line for line in skipped if not EXPECTED_RANK_SKIP.search(line)]
    assert not unexpected, (f"{suite} at {nranks} ranks on {device}: skips that are not about the rank "
                            f"count (fix the environment or the test):\n" + "\n".join(unexpected))
