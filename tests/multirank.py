"""The one launcher of the multi-rank suites (tests/<capability>/mpi_*.py).

Every rank of a launch runs the same tests under mpiexec (tests/rank_hooks.py keeps them in
step and aborts the job on the first failure).  A plain pytest run collects each mpi_*.py
file as one item per launch it needs (LAUNCHES: the CPU at 1-4 ranks unless listed), e.g.
``tests/moe/mpi_moe.py::cpu-3``.  Launches are grouped to save the start-up every launch
pays (mpiexec, the interpreter, pytest and imports, on every rank): the first item of a
folder, kind and rank count to run launches every selected file of that folder, kind and rank
count at once, and each file's item then reports that file's own outcome from rank 0's JUnit report: its
failures, and its skips, which must be about the rank count or device (EXPECTED_RANK_SKIP;
a suite whose tests all skip for another reason fails).  A failing file aborts the launch;
the files after it run again without it, so each item says what its own file did.
TESSERA_MPI_GROUP=file launches each file on its own (to time or debug one suite);
TESSERA_MPI_GROUP=all groups across folders (fewer launches; not the default while a suite
still depends on the files before it: mpi_dtensor_layouts.py's agreement test after the
autodiff, checkpoint and collectives suites at 2 ranks).
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

import cores

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the venv's own mpiexec: one from another MPI would give every rank size 1
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
LAUNCH_TIMEOUT_S = 240
# a grouped launch's limit grows with its files (each file's own tests have pytest-timeout's)
PER_EXTRA_FILE_S = 120

# The strict CuPy/NCCL stand-in (tests/gpu_emu/cupy) and the CUDA emulation harness
# (tests/gpu_emu/cuda_emu): a process with this on its path runs the cuda backend on the CPU.
GPU_EMU = ROOT / "tests" / "gpu_emu"


def standin_env(devices: int = 1) -> dict:
    """Environment for a process that runs TESSERA_DEVICE=cuda on the stand-in, with
    ``devices`` emulated GPUs (ranks on distinct devices use NCCL, shared ones host staging)."""
    path = os.pathsep.join(p for p in (str(GPU_EMU), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TESSERA_DEVICE": "cuda", "TESSERA_STANDIN_DEVICES": str(devices)}


def mpi_env(nranks: int, device: str = "cpu", extra: dict | None = None) -> dict:
    """The environment of a job of ``nranks`` ranks (a test that starts one is marked mpi: tests/cores.py)."""
    cores.allow(nranks)
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
    # the collectives' C path switched off (TESSERA_HOT=0: gpu_check.sh on a machine with no compiler)
    r"C path is off|"
    # a parametrization built from the rank count can be empty at some sizes
    r"got empty parameter set")


@dataclass(frozen=True)
class Launch:
    """One way to launch a suite: ``kind`` cpu (the CPU backend), standin (TESSERA_DEVICE=cuda
    on the CuPy/NCCL stand-in with ``devices`` emulated GPUs: one per rank uses the NCCL
    stand-in, fewer the host-staged path) or gpu (the cuda backend on the GPU machine)."""
    kind: str
    nranks: int
    devices: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.nranks}" + (f"-dev{self.devices}" if self.kind == "standin" else "")

    def env(self) -> dict:
        if self.kind == "standin":
            return mpi_env(self.nranks, "cuda", standin_env(self.devices))
        return mpi_env(self.nranks, "cuda" if self.kind == "gpu" else "cpu")

    def where(self) -> str:
        return {"cpu": "cpu", "gpu": "cuda", "standin": f"cuda (stand-in, {self.devices} devices)"}[self.kind]


CPU = [Launch("cpu", n) for n in (1, 2, 3, 4)]
# the suites written against the backend's array module: on the stand-in (NCCL with one
# device per rank, host staging with ranks sharing one) and on the GPU machine (one GPU:
# NCCL at 1 rank, host staging at 2 and 4)
BACKEND_AGNOSTIC = CPU + [Launch("standin", n, d) for n, d in ((1, 1), (2, 2), (3, 3), (4, 4), (2, 1), (3, 1))] \
    + [Launch("gpu", n) for n in (1, 2, 4)]
# how each suite is launched, where not CPU (the CPU at 1, 2, 3 and 4 ranks; 3 finds
# uneven-shard bugs)
LAUNCHES = {
    "collectives/mpi_collectives.py": BACKEND_AGNOSTIC,
    "collectives/mpi_mesh_and_comm.py": BACKEND_AGNOSTIC,
    "collectives/mpi_numeric_scope.py": BACKEND_AGNOSTIC,
    "collectives/mpi_streams.py": BACKEND_AGNOSTIC,
    # the line/ring schedules on the NCCL stand-in's grouped send/recv
    "collectives/mpi_ccl.py": CPU + [Launch("standin", 2, 2)],
    "gpu/mpi_gpu_path.py": [Launch("standin", 2, 2), Launch("standin", 3, 3)],
    "gpu/mpi_nccl_standin.py": [Launch("standin", 2, 2), Launch("standin", 3, 3)],
    "moe/mpi_moe_gpu_path.py": [Launch("standin", 2, 2)],
}


def launches_of(rel: str) -> list[Launch]:
    return LAUNCHES.get(rel, CPU)


@dataclass
class Outcome:
    """What one file did in one launch."""
    failure: str = ""           # empty: it passed
    passed: int = 0
    skips: tuple = ()           # (test, reason) of each skipped test
    seconds: float = 0.0


def _rank0_junit(path: Path) -> dict:
    """rel path under tests/ -> Outcome, from rank 0's JUnit report (xunit1: has file=)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        rel = str(Path(case.get("file", "")).relative_to("tests"))
        o = out.setdefault(rel, Outcome())
        o.seconds += float(case.get("time", 0))
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            o.failure = o.failure or f"{case.get('name')}: {bad.get('message', '')}\n{bad.text or ''}"
        elif skip is not None:
            o.skips += ((case.get("name"), skip.get("message", "")),)
        else:
            o.passed += 1
    return out


def launch(files: list[str], how: Launch) -> dict:
    """Run ``files`` (paths under tests/) in one mpiexec launch; rel -> Outcome for each."""
    limit = LAUNCH_TIMEOUT_S + PER_EXTRA_FILE_S * (len(files) - 1)
    with tempfile.TemporaryDirectory(prefix="tessera-mpi-") as tmp:
        # the hypothesis, anyio and randomly pytest plugins cost ~1 s of CPU per rank at start-up
        # and no multi-rank test needs them (@given runs without the plugin; every rank runs the
        # files' order) nor xdist
        pytest_cmd = shlex.join([sys.executable, "-m", "pytest", "-x", "-rs", "--tb=short", "-p", "no:cacheprovider",
                                 "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:randomly", "-p", "no:xdist",
                                 "--rootdir", str(ROOT),
                                 "-o", "junit_family=xunit1", *[str(ROOT / "tests" / f) for f in files]])
        # only rank 0 prints progress and writes its report (MPICH sets PMI_RANK, Open MPI
        # OMPI_COMM_WORLD_RANK)
        sh = ('r="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"; if [ "$r" != 0 ]; then exec >/dev/null; '
              f'exec {pytest_cmd}; fi; exec {pytest_cmd} --junitxml={shlex.quote(tmp)}/rank0.xml')
        t0 = time.monotonic()
        proc = subprocess.run(["timeout", "-k", "5", str(limit), MPIEXEC, "-n", str(how.nranks), "sh", "-c", sh],
                              cwd=ROOT, env=how.env(), capture_output=True, text=True)
        took = time.monotonic() - t0
        report = Path(tmp) / "rank0.xml"
        results = _rank0_junit(report) if report.exists() else {}
    head = f"at {how.nranks} ranks on {how.where()} (launch of {len(files)} file(s), {took:.0f} s)"
    output = f"--- stdout (rank 0)\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    if proc.returncode == 0 and all(f in results for f in files):
        return results
    # a failing rank aborts the job before rank 0's report is written: find the file from the
    # ranks' own lines ("[rank r] FAILED tests/...", rank 0's "FAILED tests/..." or, for a
    # hang or a crash, the file rank 0 was in)
    text = proc.stderr + "\n" + proc.stdout
    named = re.findall(r"(?:FAILED|ERROR) (tests/\S+?\.py)", text) or re.findall(r"^(tests/\S+?\.py) ", proc.stdout, re.M)
    bad = next((str(Path(n).relative_to("tests")) for n in reversed(named) if str(Path(n).relative_to("tests")) in files),
               None)
    why = "timed out" if proc.returncode == 124 else f"exited {proc.returncode}"
    if bad is None or len(files) == 1:
        return {f: Outcome(failure=f"{f} {head}: {why}\n{output}") for f in files}
    rest = [f for f in files if f != bad]
    return {bad: Outcome(failure=f"{bad} {head}: {why}\n{output}"), **launch(rest, how)}


class MpiLaunchFailed(Exception):
    pass


class MpiLaunch(pytest.Item):
    """One multi-rank file at one launch (rank count, backend); runs in its group's launch."""

    def __init__(self, *, how: Launch, rel: str, **kw):
        super().__init__(**kw)
        self.how, self.rel = how, rel
        self.add_marker(pytest.mark.mpi)
        # pytest-xdist (--dist loadgroup: tests/conftest.py) sends a launch's items to one worker,
        # where the first runs the launch and the others read its report
        self.add_marker(pytest.mark.xdist_group("/".join([how.name, *self.group_key()[1:]])))
        if how.kind == "gpu":
            self.add_marker(pytest.mark.gpu)

    def group_key(self):
        group = os.environ.get("TESSERA_MPI_GROUP", "folder")
        return (self.how,) + {"file": (self.rel,), "all": ()}.get(group, (self.rel.split("/")[0],))

    def ranks_to_launch(self) -> int:
        """The ranks this item starts: its launch's, unless an item before it ran that launch."""
        return 1 if self.group_key() in self.session.stash.get(_RESULTS, {}) else self.how.nranks

    def runtest(self):
        cache = self.session.stash.setdefault(_RESULTS, {})
        key = self.group_key()
        if key not in cache:
            files = [i.rel for i in self.session.items if isinstance(i, MpiLaunch) and i.group_key() == key]
            cache[key] = launch(files, self.how)
        got = cache[key][self.rel]
        if got.failure:
            raise MpiLaunchFailed(got.failure)
        skips = [f"{name}: {reason}" for name, reason in got.skips]
        self.add_report_section("call", "ranks' skips", "\n".join(skips) or "none")
        unexpected = [s for s in skips if not EXPECTED_RANK_SKIP.search(s)]
        if unexpected:
            raise MpiLaunchFailed(f"{self.rel} at {self.how.nranks} ranks on {self.how.where()}: skips that are not "
                                  "about the rank count (fix the environment or the test):\n" + "\n".join(unexpected))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, MpiLaunchFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.rel} under mpiexec ({self.how.name})"


_RESULTS = pytest.StashKey[dict]()


class MpiSuite(pytest.File):
    """A tests/*/mpi_*.py file, collected as its launches (it is never imported here)."""

    def collect(self):
        rel = str(self.path.relative_to(ROOT / "tests"))
        for how in launches_of(rel):
            yield MpiLaunch.from_parent(self, name=how.name, how=how, rel=rel)


def group_timeouts(items) -> None:
    """Each launch item's pytest-timeout: its whole group's launch, which the first one runs."""
    sizes = {}
    for i in items:
        if isinstance(i, MpiLaunch):
            sizes[i.group_key()] = sizes.get(i.group_key(), 0) + 1
    for i in items:
        if isinstance(i, MpiLaunch):
            n = sizes[i.group_key()]
            # a failure relaunches the files after it: room for one more launch
            i.add_marker(pytest.mark.timeout(2 * (LAUNCH_TIMEOUT_S + PER_EXTRA_FILE_S * (n - 1)) + 30))
