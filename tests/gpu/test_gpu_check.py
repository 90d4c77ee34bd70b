"""scripts/gpu_check.sh, the one-command GPU check, runs here on the stand-in; the benchmarks'
peers are timed the way tessera_rt is (same synchronization, interleaved, no autograd in a
forward-only measurement)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def _script(name: str):
    """scripts/<name>.py as a module (not via sys.path: scripts/ holds train.py, demo.py, ...)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_collectives, bench_kernels, gpu_check = (_script(n) for n in ("bench_collectives", "bench_kernels", "gpu_check"))

SECTIONS = ["tests", "kernels", "train", "train_torch", "decode", "multirank"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_check_runs_on_the_standin(tmp_path):
    # --emulate: the stand-in even on a GPU machine (where the suite must not spend the GPU check)
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_DEVICE"}
    env.update(TESSERA_PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--emulate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert proc.stdout.splitlines()[0] == gpu_check.NO_GPU
    table = (tmp_path / "table.md").read_text()
    res = json.loads((tmp_path / "results.json").read_text())
    assert table.splitlines()[0] == res["first_line"] == gpu_check.NO_GPU and res["emulated"]
    assert [p["name"] for p in res["parts"]] == SECTIONS
    for part in res["parts"]:
        assert part["status"] == "ok" and part["rows"], part
        assert f"| {part['title']} |" in table
    kernels = {r["item"].split(" ")[0] for r in res["parts"][1]["rows"]}
    assert {"swiglu", "flash_attention", "rmsnorm", "quantize_fp8", "paged_decode_attention", "grouped_matmul",
            "grouped_matmul_wgrad", "matmul_bias_act"} <= kernels
    # the grouped GEMM beside the table's default with host offsets (cuBLAS per group), checked first
    grouped = [r for r in res["parts"][1]["rows"] if r["item"].startswith("grouped_matmul ")]
    assert grouped and "default cublas per group" in grouped[0]["note"] and "ok (err" in grouped[0]["note"]
    assert all("emulated" in r["note"] for r in res["parts"][1]["rows"])
    assert "equal" in res["parts"][2]["rows"][0]["note"]
    # the training step against torch: both sides' f32 gradients within 1e-4 of float64 first
    grads = [r for r in res["parts"][3]["rows"] if r["item"].startswith("f32 gradients vs float64")]
    assert grads and all(r["note"].startswith("ok") for r in grads), res["parts"][3]["rows"]


@pytest.mark.slow
def test_parts_over_their_limit_or_the_budget_are_reported(tmp_path, monkeypatch):
    def slow(run, limit, log):
        if run.sh(["sleep", "30"], run.env(), limit, log)[2]:
            raise gpu_check.TimedOut
        raise AssertionError("sleep 30 was not killed at the part's limit")

    def never(run, limit, log):
        raise AssertionError("ran with the budget spent")
    monkeypatch.setattr(gpu_check, "PARTS", [("slow", "slow part", slow, 4, 4, 4),
                                             ("late", "late part", never, 60, 60, 60)])
    rc = gpu_check.main(["--emulate", "--quick", "--out", str(tmp_path), "--budget", "8"])
    res = json.loads((tmp_path / "results.json").read_text())
    assert rc == 1 and [(p["name"], p["status"]) for p in res["parts"]] == [("slow", "TIMED OUT"), ("late", "NOT RUN")]
    assert res["parts"][0]["seconds"] < 10
    table = (tmp_path / "table.md").read_text()
    assert "TIMED OUT (killed after 4 s" in table and "NOT RUN (the run's 8 s budget was spent)" in table


def test_clock_interleaves_the_two_sides():
    calls = []
    clock = bench_kernels.Clock(gpu=False, reps=4, target_ms=0.0, max_iters=1)
    clock.pair(lambda: calls.append("ours"), lambda: calls.append("peer"))
    # each side: a warm-up and a calibration call, then the samples alternate which side goes first
    assert calls[:4] == ["ours", "ours", "peer", "peer"]
    assert calls[4:] == ["ours", "peer", "peer", "ours", "ours", "peer", "peer", "ours"]


def test_clock_sides_skip_the_missing_ones():
    calls = []
    clock = bench_kernels.Clock(gpu=False, reps=2, target_ms=0.0, max_iters=1)
    got = clock.sides(lambda: calls.append("own"), None, lambda: calls.append("peer"))
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert calls[4:] == ["own", "peer", "peer", "own"]


def test_forward_peer_runs_without_autograd(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        seen.append(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    monkeypatch.setenv("TESSERA_DEVICE", "cpu")
    bench = bench_kernels.Bench(bench_kernels.argparse.Namespace(device="cpu", quick=True, reps=2))
    bench.attention()
    # one call with autograd: the graph the backward peer differentiates; every timed forward without
    assert seen.count(True) == 1 and seen.count(False) >= 4
    fwd, bwd = bench.rows
    assert fwd["peer"] == "torch SDPA" and fwd["check"].startswith("ok") and bwd["peer"] == "torch SDPA backward"


def test_nccl_peer_queues_its_calls_like_tessera(monkeypatch):
    # the loop's one sync() waits for both sides; a peer that synchronized every call would be
    # timed with a host round trip per call that tessera_rt's queued calls do not pay
    class Stream:
        ptr = 7

        def synchronize(self):
            raise AssertionError("the peer synchronized inside the timed loop")

    class Raw:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a: self.calls.append(name)
    buf = type("Buf", (), {"data": type("D", (), {"ptr": 1})(), "size": 8})()
    peer = object.__new__(bench_collectives.Peer)
    peer.gpu, peer.comm = True, type("Comm", (), {"raw": Raw()})()
    monkeypatch.setattr(bench_collectives.ts.runtime, "stream", lambda role: Stream())
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        peer.run(op, buf, buf)
    assert peer.comm.raw.calls == ["allReduce", "reduceScatter", "allGather", "broadcast"]


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_bench_collectives_runs_on_the_standin_nccl():
    # the NCCL peer on 2 emulated GPUs: its stream must be ordered after the inputs' fill on
    # compute (the stand-in reports the hazard a GPU would race on)
    from conftest import mpi_env, standin_env
    cmd = ["timeout", "-k", "5", "180", str(Path(sys.executable).parent / "tessera-run"), "-n", "2",
           "scripts/bench_collectives.py", "--max", "32", "--reps", "1", "--budget-ms", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(2, "cuda", standin_env(2)), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "peer: NCCL" in out, out[-4000:]
    ops = [line.split()[0] for line in proc.stdout.splitlines()[2:]]
    assert sorted(set(ops)) == ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"], out
