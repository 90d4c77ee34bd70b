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


def test_bench_vs_torch_quick_checks_the_same_losses_then_times_both_sides():
    # the smoke run of scripts/bench_vs_torch.py: one rank and dp=2 on a tiny model; with torch
    # installed both sides must give the same losses before anything is timed
    p = subprocess.run(["timeout", "200", sys.executable, str(ROOT / "scripts" / "bench_vs_torch.py"), "--quick",
                        "--rows", "1rank,dp2", "--markdown"], cwd=ROOT, env=mpi_env(2), capture_output=True,
                       text=True, timeout=230)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| 1 rank vs torch eager", "| dp=2 vs DDP (gloo)"], p.stdout
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "torch is not installed: timing tessera only" in p.stdout
        return
    for row in ("1rank", "dp2"):
        assert f"# {row}: the same weights on both sides: losses of two steps agree" in p.stdout, p.stdout
    assert all(float(r.rstrip(" |").split(" | ")[-1]) > 0 for r in rows), p.stdout        # a ratio per row
