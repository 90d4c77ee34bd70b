import os
from pathlib import Path

import pytest

import cores

# the multi-rank launcher and the environments of the processes tests start
from multirank import (  # noqa: F401  (re-exported: the tests import them from conftest)
    EXPECTED_RANK_SKIP,
    GPU_EMU,
    LAUNCH_TIMEOUT_S,
    MPIEXEC,
    ROOT,
    MpiLaunch,
    MpiSuite,
    group_timeouts,
    mpi_env,
    standin_env,
)

# One folder per capability.  Its test_*.py files run in this process; its mpi_*.py files are
# multi-rank suites (every rank runs the same tests), collected as their mpiexec launches
# (tests/multirank.py).  tests/kernels/sim_tile_kernels.py runs in a process with
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
# chose (tests/multirank.py: cpu, or cuda on the stand-in or the GPU machine).
UNDER_MPIEXEC = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
if not UNDER_MPIEXEC:
    os.environ["TESSERA_DEVICE"] = "cpu"
else:
    # a rank of a multi-rank suite: ranks kept in step, a failing rank aborts the job
    from rank_hooks import _in_step, pytest_runtest_makereport, world  # noqa: F401  (a hook and fixtures: pytest looks here)


def pytest_configure(config):
    if UNDER_MPIEXEC and config.pluginmanager.hasplugin("randomly"):
        # every rank runs the same tests in the same order, on the same data: pytest-randomly
        # would draw a seed per rank (to see one order in a plain run: -p no:randomly)
        config.option.randomly_reorganize = False
        config.option.randomly_reset_seed = False
    # `pytest -n N` (--dist load, its default) distributes as --dist loadgroup: the items of one
    # mpiexec launch (their xdist_group) go to one worker, which launches once
    # (tests/multirank.py).  Not in addopts: a GPU machine's pytest may lack xdist.
    if config.getoption("dist", None) == "load":
        config.option.dist = "loadgroup"
    if hasattr(config, "workerinput"):
        # a worker (its dist is "no") names each item with its group for the scheduler
        # (checked in pytest_collection_modifyitems)
        config.option.loadgroup = True
    # a pytest-xdist worker: the workers share one pool of rank slots (tests/cores.py) in the
    # run's temp root, beside their own folders (xdist gives each root/popen-gwN)
    if hasattr(config, "workerinput") and config.option.basetemp:
        cores.activate(Path(config.option.basetemp).parent / "rank-slots")


def pytest_collect_file(file_path, parent):
    # a file named on the command line comes through pytest_pycollect_makemodule instead
    if (not UNDER_MPIEXEC and file_path.suffix == ".py" and file_path.name.startswith("mpi_")
            and not parent.session.isinitpath(file_path)):
        return MpiSuite.from_parent(parent, path=file_path)


def pytest_pycollect_makemodule(module_path, parent):
    # here an mpi_*.py file is its launches, never imported: its tests run in the ranks
    if not UNDER_MPIEXEC and module_path.name.startswith("mpi_"):
        return MpiSuite.from_parent(parent, path=module_path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not UNDER_MPIEXEC:
        group_timeouts(items)
        if hasattr(config, "workerinput") and any(isinstance(i, MpiLaunch) and "@" not in i.nodeid for i in items):
            raise pytest.UsageError("pytest-xdist did not group the items of each mpiexec launch (--dist loadgroup): "
                                    "with pytest 9.2 it cannot (pytest-xdist issue 1386); pip install 'pytest<9.2'")
        # the launches and slow tests first, each kind in the (shuffled) order it had: a long one
        # started last would run alone at the end while the other workers idle
        items.sort(key=lambda i: not (i.get_closest_marker("mpi") or i.get_closest_marker("slow")))
    if not GPU_AT_START and any(item.get_closest_marker("gpu") for item in items):
        skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy: runs on the GPU machine (pytest -m gpu)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def ranks_of(item) -> int:
    """The most ranks a job that ``item`` starts may have: 1 (none) unless it is marked mpi."""
    if isinstance(item, MpiLaunch):
        return item.ranks_to_launch()
    mark = item.get_closest_marker("mpi")
    return 1 if mark is None or item.get_closest_marker("skip") else mark.kwargs.get("ranks", cores.MAX_RANKS)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    # outside pytest-timeout's wrapper: the wait for the ranks' slots is not the test's time
    with cores.held(1 if UNDER_MPIEXEC else ranks_of(item)):
        return (yield)


def pytest_terminal_summary(terminalreporter):
    """The skips counted by reason (scripts/test.sh's skip summary; -rs lists each one)."""
    if UNDER_MPIEXEC:
        return
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section(f"{sum(reasons.values())} skipped, by reason")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.line(f"{n:5d}  {reason}")


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

