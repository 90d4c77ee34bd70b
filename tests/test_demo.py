"""The main job (scripts/demo.sh runs it) keeps working: 4 ranks, 2x2 mesh, checked vs NumPy."""
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, mpi_env

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")


def test_demo_runs_on_four_ranks_and_matches_numpy():
    p = subprocess.run(["timeout", "120", TESSERA_RUN, "-n", "4", str(ROOT / "scripts" / "demo.py")],
                       env=mpi_env(4), capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "matches NumPy on the full tensors: True" in p.stdout
    assert p.stdout.count("reduce_scatter(tp, n=2)") == 4 and p.stdout.count("all_gather(tp, n=2)") == 4
