"""The main job (scripts/demo.sh runs it) keeps working: 4 ranks, 2x2 mesh, checked vs NumPy."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, mpi_env

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")


@pytest.mark.mpi
def test_demo_runs_on_four_ranks_and_matches_numpy():
    p = subprocess.run(["timeout", "120", TESSERA_RUN, "-n", "4", str(ROOT / "scripts" / "demo.py")],
                       env=mpi_env(4), capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "matches NumPy on the full tensors: True" in p.stdout
    assert p.stdout.count("reduce_scatter(tp, n=2)") == 4 and p.stdout.count("all_gather(tp, n=2)") == 4


@pytest.mark.mpi(ranks=2)
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
        import torch  # noqa: F401  (can torch be imported? find_spec would miss a broken install)
    except ImportError:
        assert "torch is not installed: timing tessera only" in p.stdout
        return
    for row in ("1rank", "dp2"):
        assert f"# {row}: the same weights on both sides: losses of two steps agree" in p.stdout, p.stdout
    assert all(float(r.rstrip(" |").split(" | ")[-1]) > 0 for r in rows), p.stdout        # a ratio per row


def test_bench_gemm_libs_quick_times_every_shape_and_lists_missing_libraries(tmp_path):
    # scripts/bench_gemm_libs.py's smoke run with an empty --lib-path: MKL, scipy-openblas32 and
    # BLIS are 'not installed' rows instead of a failure; numpy (and torch when installed) are
    # checked against numpy and timed at all 22 shapes (training step, micro-batch, prefill)
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gemm_libs.py"), "--quick", "--markdown",
                        "--lib-path", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [r for r in p.stdout.splitlines() if r.startswith(("| train |", "| micro-batch |", "| prefill |"))]
    assert len(rows) == 22 and all(r.split(" | ")[4].endswith(", 1.00x") for r in rows), p.stdout
    summary = {r.split(" | ")[0].lstrip("| "): r for r in p.stdout.splitlines() if "GEMM ms" not in r}
    for lib in ("MKL cblas_sgemm", "scipy-openblas32 cblas_sgemm", "BLIS"):
        assert "not installed" in summary.get(lib, ""), p.stdout
    assert summary["numpy (bundled OpenBLAS)"].endswith("| 1.000 |"), p.stdout


@pytest.mark.mpi(ranks=2)
def test_bench_all_quick_rewrites_only_its_blocks_and_draws_the_plot(tmp_path):
    # scripts/bench_all.py's smoke run on a copy of BENCHMARKS.md: the collectives block is
    # regenerated (date, machine, command, the nccl-tests table, the plot beside raw MPI) and
    # everything outside that block's markers stays as it was; the debug topic's script runs too
    # (it called a check function that had moved)
    import re
    import runpy
    bench = tmp_path / "BENCHMARKS.md"
    original = (ROOT / "BENCHMARKS.md").read_text()
    bench.write_text(original)
    begin, end = "<!-- bench_all:collectives -->", "<!-- /bench_all:collectives -->"
    assert begin in original and end in original, "BENCHMARKS.md lost the collectives markers"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_all.py"), "--quick",
                        "--only", "collectives,debug", "--out", str(bench)],
                       cwd=ROOT, env=mpi_env(2), capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    new = bench.read_text()
    block = new.split(begin)[1].split(end)[0]
    outside = re.compile(r"<!-- bench_all:(collectives|debug) -->.*?<!-- /bench_all:\1 -->", re.S)
    assert outside.sub("", new) == outside.sub("", original)
    assert "--quick (smoke sizes)" in block and "load average" in block
    assert "tessera-run -n 2 scripts/bench_collectives.py" in block
    assert "| all_reduce | 8 B |" in block and "| broadcast | 32 KiB |" in block, block
    assert "](docs/img/bench_collectives.png)" in block
    assert "desync check (collectives)" in new.split("<!-- bench_all:debug -->")[1], new
    assert (tmp_path / "docs" / "img" / "bench_collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every topic has its markers in BENCHMARKS.md; one whose markers are missing is appended
    mod = runpy.run_path(str(ROOT / "scripts" / "bench_all.py"), run_name="bench_all")
    missing = [t.key for t in mod["TOPICS"] if f"<!-- bench_all:{t.key} -->" not in original
               or f"<!-- /bench_all:{t.key} -->" not in original]
    assert not missing, f"BENCHMARKS.md has no markers for the topics {missing}"
    replace_block = mod["replace_block"]
    out = replace_block("# B\n\nprose\n", "moe", "MoE", "table")
    assert out == "# B\n\nprose\n\n## MoE\n\n<!-- bench_all:moe -->\ntable\n<!-- /bench_all:moe -->\n"
    assert replace_block(out, "moe", "MoE", "new") == out.replace("table", "new")
