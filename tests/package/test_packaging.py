"""The conventions of an installable library: what the wheel holds, importing and planning
without an MPI library, and ``--help`` on every script."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def no_mpi_env() -> dict:
    # mpi4py's wheels load the MPI library named here: a missing one is a machine without MPI
    return dict(os.environ, MPI4PY_LIBMPI="/nonexistent/libmpi.so", PYTHONPATH=str(ROOT / "src"))


@pytest.mark.timeout(180)
def test_the_wheel_holds_the_license_the_type_marker_and_every_subpackage(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = tmp_path.glob("tessera_rt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tessera_rt/py.typed" in names and "tessera_rt/dist/comm/_hot.pyi" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), \
        sorted(n for n in names if "dist-info" in n)
    packages = {str(d.relative_to(ROOT / "src")) for d in (ROOT / "src" / "tessera_rt").rglob("__init__.py")}
    assert packages <= names, packages - names
    # the collectives' C path, built from dist/comm/_hot.c, sits beside the module that loads it
    assert any(n.startswith("tessera_rt/dist/comm/_hot.") and n.endswith((".so", ".pyd")) for n in names), \
        sorted(n for n in names if "_hot" in n)


@pytest.mark.timeout(120)
def test_import_and_plan_work_without_mpi_and_init_says_what_to_install():
    code = ("import tessera_rt, tessera_rt.dist as d\n"
            "try:\n    d.init()\nexcept ImportError as e:\n    print('INIT:', e)\n")
    p = subprocess.run([sys.executable, "-c", code], env=no_mpi_env(), capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "INIT:" in p.stdout and "tessera_rt[mpich]" in p.stdout and "cannot load MPI library" in p.stdout, p.stdout
    plan = subprocess.run([str(BIN / "tessera-plan"), "--model", "char", "--cluster", "local"], env=no_mpi_env(),
                          capture_output=True, text=True, timeout=100)
    assert plan.returncode == 0 and "tessera-run -n" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_script_answers_help():
    # the shell scripts answer before they make or touch a venv; scripts/_*.py and _venv.sh are
    # the scripts' own libraries, not commands
    runs = [[sys.executable, str(s), "--help"] for s in sorted((ROOT / "scripts").glob("*.py")) if not s.name.startswith("_")]
    runs += [["bash", str(s), "--help"] for s in sorted((ROOT / "scripts").glob("*.sh")) if not s.name.startswith("_")]
    procs = {Path(r[1]).name: subprocess.Popen(r, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               env=dict(os.environ, OMP_NUM_THREADS="1")) for r in runs}
    bad = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=180)
        if p.returncode != 0 or ("usage:" not in out and not name.endswith(".sh")) or "== installing" in out:
            bad[name] = out[-400:]
    assert not bad, bad
