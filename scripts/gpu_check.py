#!/usr/bin/env python
"""One short run that says what tessera_rt does on this machine's GPU (scripts/gpu_check.sh
sets up the Python environment and calls this).

    python scripts/gpu_check.py [--quick] [--emulate] [--out DIR] [--budget SECONDS]

Parts, each in its own processes under its own time limit (a part that runs over is killed
and reported as such; one that finds the run's budget spent is reported as not run):

  gpu tests    the `gpu`-marked single-process tests (pass/fail counts)
  kernels      scripts/bench_kernels.py: tile GEMM vs cuBLAS, dual GEMM vs two matmuls, the
               MoE grouped GEMMs vs one dense cuBLAS GEMM, flash attention vs torch SDPA (or
               the tensor-core roofline), row kernels, FP8 quantize and paged decode vs a
               device-to-device copy; the own kernel beside the table's default provider
  train        scripts/train.py on the GPU beside the same run on the CPU (final losses equal
               within the dtype's tolerance)
  train_torch  scripts/bench_train_gpu.py: the 152M-parameter step beside torch on the same GPU,
               f32 and bf16, f32 gradients against float64 first
  decode       nn.Llama against transformers on the same GPU (a random fp16 checkpoint it
               writes): greedy tokens compared first, then prompt + first token and decode
               ms/token at batch 1 and 16 (scripts/_gpu_check_decode.py)
  multi-rank   the backend-agnostic multi-rank suites at 1, 2 and 4 ranks on the one GPU
               (ranks sharing it use the host-staged path)

Without a GPU the same parts run on the CuPy stand-in and the CUDA emulation harness
(tests/gpu_emu), and the first line says so: the figures are then not GPU figures.  Prints one
table and writes it to OUT/table.md, with everything in OUT/results.json and each part's
output in OUT/<part>.log (OUT: --out, else $OUT, else ./gpu_check_out).  Exit status 0 when
every part ran and passed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_EMU = ROOT / "tests" / "gpu_emu"
NO_GPU = ("NO GPU: running on the CuPy stand-in and the CUDA emulation harness "
          "(figures are not GPU figures)")
# final-loss agreement of train.py on the two backends (as tests/gpu/test_gpu_path_standin.py)
TRAIN_RTOL = {"float32": 1e-4, "fp16": 2e-3}
# the quick run's single-process gpu tests: each launcher kind, the backend switch, the streams
QUICK_TESTS = ("matmul_cuda_default or swiglu_dual_gemm or row_kernels and 256-float16 or "
               "paged_decode_attention and 4-2-64-float16 or ordering_events or flash_forward and case4")

PROBE = r"""
import json
import cupy
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0) if n else {}
name = props.get("name", b"")
info = dict(count=n, name=name.decode() if isinstance(name, bytes) else name, cupy=cupy.__version__,
            standin=bool(getattr(cupy, "__tessera_standin__", False)))
try:
    info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    info["driver"] = cupy.cuda.runtime.driverGetVersion()
except Exception:
    pass
print(json.dumps(info))
"""


class Run:
    """The run's settings, environment and clock."""

    def __init__(self, args):
        self.quick = args.quick
        self.python = sys.executable
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu_check_out").resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.base = dict(os.environ)
        self.base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), self.base.get("PYTHONPATH")) if p)
        self.base.setdefault("PYTHONUNBUFFERED", "1")
        self.gpu = None if args.emulate else self.probe()
        self.emulated = self.gpu is None
        if self.emulated:
            self.base["PYTHONPATH"] = os.pathsep.join((str(GPU_EMU), self.base["PYTHONPATH"]))
            self.base["TESSERA_STANDIN_DEVICES"] = "1"
        self.base.pop("TESSERA_DEVICE", None)

    def probe(self) -> dict | None:
        """The GPU CuPy sees (its own CuPy, never the stand-in), or None."""
        env = dict(self.base)
        env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                            if p and Path(p).resolve() != GPU_EMU.resolve())
        try:
            p = subprocess.run([self.python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
            info = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
            error = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            info, error = None, f"{type(exc).__name__}: {exc}"
        if info and info["count"] > 0 and not info["standin"]:
            return info
        self.probe_error = error if not info else "CuPy reports 0 devices"
        return None

    def gpu_cupy_cannot_use(self) -> str:
        """The GPU nvidia-smi lists when CuPy sees none (a broken or missing CuPy), else ''."""
        try:
            p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""

    def first_line(self) -> str:
        if self.emulated:
            return NO_GPU
        g = self.gpu
        cuda = g.get("cuda_runtime")
        return (f"GPU: {g['name']} (CuPy {g['cupy']}"
                + (f", CUDA runtime {cuda // 1000}.{cuda % 1000 // 10}" if cuda else "")
                + (f", driver API {g['driver'] // 1000}.{g['driver'] % 1000 // 10}" if g.get("driver") else "") + ")")

    def env(self, device: str | None = "cuda") -> dict:
        """The parts' environment; ``device`` sets TESSERA_DEVICE (None: left to tests/conftest.py)."""
        env = dict(self.base)
        if device:
            env["TESSERA_DEVICE"] = device
        return env

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, cmd, env, limit, log: Path):
        """Run ``cmd`` (its whole process group killed at ``limit`` seconds); (rc, output, timed out)."""
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n")
        p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=max(1.0, limit))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:     # a process outside the group holds the pipe open
                out = "(output lost: a process left the killed group and kept its pipe open)"
            timed_out = True
        with open(log, "a") as f:
            f.write(out + (f"\n[killed after {limit:.0f} s]\n" if timed_out else f"\n[exit {p.returncode}]\n"))
        return p.returncode, out, timed_out


class PartFailed(Exception):
    """The part ran but did not pass; the message says what failed."""


class TimedOut(Exception):
    pass


def row(item, value="", peer="", ratio="", note=""):
    return dict(item=item, value=value, peer=peer, ratio=ratio, note=note)


# ------------------------------------------------------------------------------------ parts

def pytest_counts(out: str) -> dict:
    tail = "\n".join(out.strip().splitlines()[-3:])
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", tail)}


def gpu_test_files() -> list[str]:
    """The suite's files that hold gpu-marked tests (collecting only these keeps the optional
    test dependencies, hypothesis or transformers, out of the way)."""
    return sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                  if "gpu_emu" not in f.parts and "mark.gpu" in f.read_text())


def mpiexec(python: str) -> str | None:
    """The mpiexec tests/conftest.py launches with (the venv's own, else the PATH's)."""
    here = Path(python).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def pytest_part(run: Run, limit: float, log: Path, args: list, item) -> list[dict]:
    """Run pytest with ``args`` (the process's backend left to tests/conftest.py); one row
    ``item(passed, failed, skipped)`` plus one per failing test.  Fails unless all passed."""
    cmd = [run.python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args]
    rc, out, timed_out = run.sh(cmd, run.env(device=None), limit, log)
    if timed_out:
        raise TimedOut
    counts = pytest_counts(out)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    rows = [item(counts.get("passed", 0), failed, counts.get("skipped", 0))]
    rows += [row("  " + line.split(" ", 1)[1][:110], "FAILED") for line in out.splitlines()
             if line.startswith(("FAILED ", "ERROR "))][:20]
    if rc != 0 or failed or not counts.get("passed"):
        raise PartFailed(rows, f"pytest exited {rc}")
    return rows


def part_tests(run: Run, limit: float, log: Path) -> list[dict]:
    where = "on the stand-in, kernels in the emulation harness" if run.emulated else "on the GPU"
    args = ["-m", "gpu and not mpi"] + (["tests/kernels/test_gpu.py", "-k", QUICK_TESTS] if run.quick
                                        else gpu_test_files())
    return pytest_part(run, limit, log, args, lambda passed, failed, skipped: row(
        "gpu-marked tests" + (" (quick subset)" if run.quick else ""),
        f"{passed} passed, {failed} failed, {skipped} skipped", note=where))


def part_kernels(run: Run, limit: float, log: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.json"
        cmd = [run.python, "scripts/bench_kernels.py", "--json", path] + (["--quick"] if run.quick else [])
        rc, out, timed_out = run.sh(cmd, run.env(), limit, log)
        if timed_out:
            raise TimedOut
        if not path.exists():
            raise PartFailed([], f"bench_kernels.py exited {rc} without results")
        res = json.loads(path.read_text())
    rows = []
    for r in res["rows"]:
        unit = r["unit"]
        peak = f"{r['of_peak']:.0%} of peak" if r.get("of_peak") else ""
        # both providers side by side: the project's own kernel (the value) and the kernel table's
        # default where a vendor library runs it
        default = (f"default {r['provider']}: {r['default_rate']:.3g} {unit} ({r['ms'] / r['default_ms']:.2f}x own)"
                   if r.get("default_ms") else "")
        rows.append(row(f"{r['kernel']} {r['shape']}", f"own {r['rate']:.3g} {unit}",
                        f"{r['peer']} {r['peer_rate']:.3g}" if r.get("peer_rate") else r["peer"],
                        f"{r['speedup']:.2f}x" if r.get("speedup") else "",
                        "; ".join(x for x in (default, peak, r["check"], r["note"], "emulated" if res["emulated"] else "")
                                  if x)))
    rows += [row("  " + e[:110], "FAILED") for e in res["errors"]]
    if rc != 0:
        raise PartFailed(rows, f"bench_kernels.py exited {rc}")
    return rows


def train_args(quick: bool, dtype: str) -> list[str]:
    return ["--steps", "3" if quick else "6", "--batch", "8", "--seq", "32" if quick else "64", "--d-model",
            "32" if quick else "64", "--heads", "4", "--layers", "2", "--no-plot", "--no-checkpoint", "--quiet",
            "--data", "tests/data/tiny_corpus.txt", "--dtype", dtype]


def train_only(argv: list[str]) -> int:
    """scripts/train.py in this process (its losses at full precision): one TRAIN line."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train  # sets the thread pools' sizes before NumPy loads
    # isort: split
    import numpy as np
    res = train.train(train.parse_args(argv))
    times = res["step_times"][1:] or res["step_times"]
    print("TRAIN " + json.dumps(dict(loss=float(res["losses"][-1]), step_ms=float(np.median(times)) * 1e3)))
    return 0


def part_train(run: Run, limit: float, log: Path) -> list[dict]:
    rows, bad = [], []
    end = time.monotonic() + limit
    for dtype in (["float32"] if run.quick else ["float32", "fp16"]):
        got = {}
        args = train_args(run.quick, dtype)
        for device in ("cuda", "cpu"):
            cmd = [run.python, "scripts/gpu_check.py", "--train-only", *args]
            rc, out, timed_out = run.sh(cmd, run.env(device), end - time.monotonic(), log)
            if timed_out:
                raise TimedOut(rows)
            res = [json.loads(line[len("TRAIN "):]) for line in out.splitlines() if line.startswith("TRAIN ")]
            if rc != 0 or not res:
                raise PartFailed(rows, f"train.py --dtype {dtype} on {device} exited {rc}")
            got[device] = (res[0]["loss"], res[0]["step_ms"])
        (gl, gms), (cl, cms) = got["cuda"], got["cpu"]
        rel = abs(gl - cl) / abs(cl)
        same = rel <= TRAIN_RTOL[dtype]
        bad += [] if same else [dtype]
        rows.append(row(f"train.py {dtype}, {args[1]} steps: final loss / median step",
                        f"{gl:.6f} / {gms:.1f} ms", f"CPU {cl:.6f} / {cms:.1f} ms", f"{cms / gms:.2f}x",
                        f"{'equal' if same else 'DIFFERENT'}: rel diff {rel:.1e} "
                        f"({'<=' if same else '>'} {TRAIN_RTOL[dtype]:g})"))
    if bad:
        raise PartFailed(rows, f"GPU and CPU losses differ beyond tolerance for {', '.join(bad)}")
    return rows


def part_train_torch(run: Run, limit: float, log: Path) -> list[dict]:
    """scripts/bench_train_gpu.py: the GPU-size training step beside torch on the same GPU, f32
    and bf16, after each side's f32 gradients are checked against its float64 run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.json"
        cmd = [run.python, "scripts/bench_train_gpu.py", "--json", path] + (["--quick"] if run.quick or run.emulated
                                                                           else [])
        rc, out, timed_out = run.sh(cmd, run.env(), limit, log)
        if timed_out:
            raise TimedOut
        if not path.exists():
            raise PartFailed([], f"bench_train_gpu.py exited {rc} without results")
        res = json.loads(path.read_text())
    c = res["config"]
    model = f"d_model {c['d']}, {c['layers']} layers, seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']}"
    rows = [row(f"f32 gradients vs float64, {g['side']} (2 layers): max relative error", f"{g['value']:.1e}", "", "",
                f"{'ok' if g['ok'] else 'ABOVE 1e-4'}: {g['where']}") for g in res["grads"]]
    for r in res["steps"]:
        if "error" in r:
            rows.append(row(f"{r['row']} ({model})", "FAILED", note=r["error"]))
            continue
        rows.append(row(f"{r['row']} ({model})", f"{r['tessera_ms']:.1f} ms",
                        f"torch {r['torch_ms']:.1f} ms" if "torch_ms" in r else "no torch",
                        f"{r['ratio']:.2f}x" if "ratio" in r else "", "emulated" if res["emulated"] else ""))
    if rc != 0:
        raise PartFailed(rows, f"bench_train_gpu.py exited {rc}")
    return rows


def part_decode(run: Run, limit: float, log: Path) -> list[dict]:
    cmd = [run.python, "scripts/gpu_check.py", "--decode-only"] + (["--quick"] if run.quick or run.emulated else [])
    rc, out, timed_out = run.sh(cmd, run.env(), limit, log)
    if timed_out:
        raise TimedOut
    lines = [json.loads(line[len("DECODE "):]) for line in out.splitlines() if line.startswith("DECODE ")]
    rows = []
    for r in lines:
        peer = r.get("peer_device")
        ratio = (lambda a, b: f"{a / b:.2f}x" if peer == "GPU" and b else "")          # transformers / tessera
        where = f"transformers on the {peer}" if peer else "no transformers"
        if "first_ms" in r:
            rows.append(row(f"nn.Llama prompt + first token, batch {r['batch']}, prompt {r['prompt']}",
                            f"{r['first_ms']:.1f} ms", f"{r['peer_first_ms']:.1f} ms" if peer else "",
                            ratio(r.get("peer_first_ms"), r["first_ms"]), f"{r['model']}; {where}"))
            rows.append(row(f"nn.Llama decode, batch {r['batch']}", f"{r['ms_per_token']:.2f} ms/token",
                            f"{r['peer_ms_per_token']:.2f} ms/token" if peer else "",
                            ratio(r.get("peer_ms_per_token"), r["ms_per_token"]),
                            (f"weights at HBM peak {r['roofline_ms']:.2f} ms; " if r.get("roofline_ms") else "")
                            + ("CUDA graphs; " if r.get("graphs") else
                               f"eager steps ({'; '.join(r.get('refused') or ['no graph'])}); ")
                            + r.get("tokens", "tokens not compared")))
    if rc != 0 or not lines:
        raise PartFailed(rows, f"the decode run exited {rc}" + (": tokens differ from transformers'"
                                                              if "FAILED: tessera_rt's greedy" in out else ""))
    return rows


def part_multirank(run: Run, limit: float, log: Path) -> list[dict]:
    if mpiexec(run.python) is None:
        raise PartFailed([], "no mpiexec beside this Python or on PATH: install tessera_rt[mpich]")
    ranks = "2 ranks" if run.quick else "1, 2 and 4 ranks"
    # the gpu launches of the multi-rank suites (tests/multirank.py: the backend-agnostic ones),
    # one item per file and launch; the files are not imported here
    suites = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("*/mpi_*.py"))
    args = ["-m", "gpu and mpi", *suites] + (["-k", "gpu-2"] if run.quick else [])
    return pytest_part(run, limit, log, args, lambda passed, failed, skipped: row(
        f"multi-rank suites (collectives, mesh, numeric scope, streams) at {ranks} on one "
        f"{'emulated GPU' if run.emulated else 'GPU'}", f"{passed} launches passed, {failed} failed",
        note="1 rank: NCCL; several: host-staged (ranks share the GPU); collectives' C path "
             + ("off (TESSERA_HOT=0: not built)" if os.environ.get("TESSERA_HOT") == "0" else "built")))


# (name, title, limit in seconds on a GPU, on the stand-in with --quick, on the stand-in)
PARTS = [("tests", "gpu tests", part_tests, 100, 60, 500),
         ("kernels", "kernels vs the vendor library", part_kernels, 120, 60, 300),
         ("train", "train.py GPU vs CPU", part_train, 40, 60, 120),
         ("train_torch", "training step vs torch", part_train_torch, 120, 90, 150),
         ("decode", "decode vs transformers", part_decode, 100, 60, 90),
         ("multirank", "multi-rank suites on one GPU", part_multirank, 80, 60, 400)]


# ------------------------------------------------------------------------------------ decode

def decode_only(quick: bool) -> int:
    """nn.Llama against transformers on this process's backend (scripts/_gpu_check_decode.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from _gpu_check_decode import run
    return run(quick)


# ------------------------------------------------------------------------------------ report

def last_line(output: str) -> str:
    """The last line a part's commands printed (the usual place of the reason it failed)."""
    lines = [ln.strip() for ln in output.splitlines()
             if ln.strip() and not ln.startswith(("$ ", "[exit ", "[killed ")) and set(ln.strip()) != {"="}]
    return lines[-1] if lines else ""


def table(first: str, header: str, parts: list[dict]) -> str:
    head = ("part", "item", "tessera_rt", "peer", "ratio", "notes", "status")
    lines = [first, "", header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in parts:
        status = p["status"] + (f" ({p['detail']})" if p["detail"] else "")
        rows = p["rows"] or [row("", "", "", "", "")]
        for i, r in enumerate(rows):
            cells = (p["title"] if i == 0 else "", r["item"], r["value"], r["peer"], r["ratio"], r["note"],
                     f"{status}, {p['seconds']:.0f} s" if i == 0 else "")
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        # -dirty: a working tree copied onto a GPU machine may differ from its .git's HEAD
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset and small sizes (the suite runs this)")
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all the parts together")
    ap.add_argument("--emulate", action="store_true", help="run on the stand-in even where a GPU is present")
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train-only"]:                 # (internal) the rest is train.py's command line
        return train_only(argv[1:])
    args = ap.parse_args(argv)
    if args.decode_only:
        return decode_only(args.quick)
    run = Run(args)
    first = run.first_line()
    print(first, flush=True)
    unused = run.gpu_cupy_cannot_use() if run.emulated and not args.emulate else ""
    if unused:
        print(f"WARNING: nvidia-smi lists {unused}, but CuPy cannot use it ({run.probe_error}): install "
              "tessera_rt[cuda12] (or [cuda13]) into this Python; this run is emulated", flush=True)
    header = (f"tessera_rt gpu_check{' --quick' if run.quick else ''}, commit {git_commit()}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python {sys.version.split()[0]}, "
              f"budget {args.budget:.0f} s")
    results = []
    for name, title, fn, gpu_s, quick_s, emu_s in PARTS:
        limit = min(gpu_s if not run.emulated else quick_s if run.quick else emu_s, run.left())
        log = run.out / f"{name}.log"
        log.write_text("")
        t0 = time.monotonic()
        rows, status, detail = [], "ok", ""
        if run.left() < 5:
            status, detail = "NOT RUN", f"the run's {args.budget:.0f} s budget was spent"
        else:
            print(f"== {title} (limit {limit:.0f} s)", flush=True)
            try:
                rows = fn(run, limit, log)
            except TimedOut as exc:
                rows = exc.args[0] if exc.args else []
                status, detail = "TIMED OUT", f"killed after {limit:.0f} s; see {log.name}"
            except PartFailed as exc:
                rows, (status, detail) = exc.args[0], ("FAILED", f"{exc.args[1]}; see {log.name}")
            except Exception as exc:             # a defect of this script: reported like a failed part
                status, detail = "FAILED", f"{type(exc).__name__}: {exc}"
            if status == "FAILED" and log.exists() and last_line(log.read_text()):
                detail += f"; its output ends: {last_line(log.read_text())[-160:]}"
        results.append(dict(name=name, title=title, status=status, detail=detail, rows=rows,
                            seconds=time.monotonic() - t0, limit_s=limit))
        print(f"   {status} {detail}", flush=True)
    text = table(first, header, results)
    (run.out / "table.md").write_text(text)
    (run.out / "results.json").write_text(json.dumps(dict(
        first_line=first, header=header, gpu=run.gpu, gpu_cupy_cannot_use=unused or None, emulated=run.emulated,
        quick=run.quick, budget_s=args.budget, elapsed_s=time.monotonic() - run.start, parts=results), indent=1))
    print()
    print(text, end="")
    print(f"\nwritten: {run.out / 'table.md'}, {run.out / 'results.json'} and a log per part")
    return 0 if all(p["status"] == "ok" for p in results) and not unused else 1


if __name__ == "__main__":
    sys.exit(main())
