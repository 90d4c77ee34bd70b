"""Regenerate BENCHMARKS.md's tables and plots: every bench script in scripts/, one topic each.

    python scripts/bench_all.py                      # every topic (sized for ~15 minutes on a quiet 2-core machine)
    python scripts/bench_all.py --only collectives,redistribution
    python scripts/bench_all.py --quick --out /tmp/b/BENCHMARKS.md   # smoke run: tiny sizes
    python scripts/bench_all.py --list               # the topics and the commands they run

Each topic runs its commands (multi-rank ones through ``tessera-run``), then writes its tables
between the markers ``<!-- bench_all:TOPIC -->`` and ``<!-- /bench_all:TOPIC -->`` of the
output file, so the prose around them stays; a topic whose markers are missing is appended as
a new section.  Each block records the date, the machine (cores, CPU, load average before and
after, GPU or not) and the command that regenerates it.  Plots (PNG, matplotlib) go to
``docs/img/`` beside the output file: collective bandwidth against size beside raw MPI,
redistribution against hand-written mpi4py, and the vs-torch ratios as bars.  A topic whose
command fails keeps its previous block; the script names the failure and exits 1.  Every run
gets one BLAS/OpenMP/Numba thread per process (the ranks share the cores).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREADS = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}


@dataclass
class Cmd:
    """One command: a script in scripts/ at ``ranks`` ranks (0: one plain python process)."""
    script: str
    args: list[str]
    quick: list[str] | None      # the --quick arguments; None: not run by --quick
    ranks: int = 0
    timeout: int = 600
    json_out: bool = False       # pass --json FILE and hand its contents to the renderer
    label: str = ""              # the row's name where a topic's renderer tabulates several commands

    def argv(self, quick: bool, json_path: str | None, tmp: str) -> list[str]:
        args = [a.replace("{tmp}", tmp) for a in (self.quick if quick else self.args)]
        args += ["--json", json_path] if json_path else []
        script = str(ROOT / "scripts" / self.script)
        if self.ranks:
            return [sys.executable, "-m", "tessera_rt.launcher", "-n", str(self.ranks), script, *args]
        return [sys.executable, script, *args]

    def shown(self, quick: bool) -> str:
        """The command as a reader types it from the repository root."""
        args = [a.replace("{tmp}", "DIR") for a in (self.quick if quick else self.args)]
        args += ["--json", "FILE"] if self.json_out else []
        head = ["tessera-run", "-n", str(self.ranks)] if self.ranks else ["python"]
        return shlex.join([*head, f"scripts/{self.script}", *args])


@dataclass
class Topic:
    key: str
    title: str
    cmds: list[Cmd]
    render: object = None        # (outputs: list[str], ctx) -> markdown; default: the outputs as they are
    note: str = ""
    needs_gpu: bool = False
    plots: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- parsing and rendering

def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The Markdown tables in a script's output: (header, rows) each."""
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cur.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif cur:
            if len(cur) >= 2:
                tables.append((cur[0], [r for r in cur[2:]]))
            cur = []
    return tables


def first_table(text: str) -> tuple[list[str], list[list[str]]]:
    tables = md_tables(text)
    return tables[0] if tables else ([], [])


def as_md(header, rows) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def comments(text: str) -> tuple[str, str]:
    """A script's '# ...' lines: those before its first table as one paragraph, those after as a list."""
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("|")), len(lines))
    before = " ".join(ln.lstrip("# ").strip() for ln in lines[:first] if ln.startswith("# "))
    after = "\n".join("- " + ln.lstrip("# ").strip() for ln in lines[first:] if ln.startswith("# "))
    return before, after


def text_block(text: str) -> str:
    lines = [line for line in text.strip().splitlines()
             if not line.startswith(("[tessera-run]", "tessera-run:")) and line.strip()]
    return "```text\n" + "\n".join(lines) + "\n```"


def markdown_or_text(outputs: list[str], ctx) -> str:
    parts = []
    for out in outputs:
        tables = md_tables(out)
        if tables:
            before, after = comments(out)
            parts.append("\n\n".join(x for x in (before, *(as_md(h, r) for h, r in tables), after) if x))
        else:
            parts.append(text_block(out))
    return "\n\n".join(parts)


def size_bytes(s: str) -> float:
    num, unit = s.split()
    return float(num) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def size_panels(rows, panel, size, series, ylabel: str, title: str):
    """One log-log panel per ``panel(row)``: each (label, value) series against ``size(row)``."""
    plt = _plt()
    names = list(dict.fromkeys(panel(r) for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.1 * len(names), 3.2), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if panel(r) == name]
        for (label, value), style in zip(series, ("o-", "s--")):
            ax.plot([size(r) for r in mine], [value(r) for r in mine], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("bytes")
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def render_callcost(outputs, ctx) -> str:
    """bench_callcost.py's lines, one column per rank count: us over the raw call (median of pairs)."""
    line = re.compile(r"(\w+)\s+tessera_rt\s+([\d.]+) us\s+raw mpi4py\s+([\d.]+) us\s+\+\s*(-?[\d.]+)"
                      r"\s+\(median of pairs\s*\+\s*(-?[\d.]+)\)")
    cols = [f"{ctx.ranks_of(i)} rank{'s' * (ctx.ranks_of(i) > 1)}: +us (median of pairs)" for i in range(len(outputs))]
    table: dict[str, list[str]] = {}
    for i, out in enumerate(outputs):
        for m in line.finditer(out):
            plus, median = float(m.group(4)), float(m.group(5))
            table.setdefault(m.group(1), ["-"] * len(outputs))[i] = f"{plus:+.2f} ({median:+.2f}); raw {m.group(3)} us"
    if not table:
        raise ValueError("no 'CASE tessera_rt X us raw mpi4py Y us' lines in bench_callcost.py's output")
    return as_md(["case", *cols], [[k, *v] for k, v in table.items()])


def render_collectives(outputs, ctx) -> str:
    """The nccl-tests table, and busbw against size per op beside the raw call."""
    text, (header, rows) = markdown_or_text(outputs, ctx), first_table(outputs[0])
    if not rows:
        return text
    col = {h: i for i, h in enumerate(header)}
    n = ctx.ranks_of(0)
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}     # nccl-tests' busbw; (n-1)/n for the rest

    def busbw(r, time_col):     # from the time (the table rounds busbw to 3 decimals: 0 for small sizes)
        return size_bytes(r[col["size"]]) / float(r[col[time_col]]) / 1e3 * factor.get(r[col["op"]], (n - 1) / n)
    return text + "\n\n" + ctx.plot("bench_collectives.png", "busbw against message size, tessera_rt beside raw mpi4py",
                                    lambda: size_panels(
        rows, lambda r: r[col["op"]], lambda r: size_bytes(r[col["size"]]),
        [("tessera_rt", lambda r: busbw(r, "time us")), ("raw mpi4py", lambda r: busbw(r, "peer us"))],
        "busbw GB/s", f"Collective bandwidth, {n} ranks: tessera_rt beside the raw call"))


def render_dtensor(outputs, ctx, part: str) -> str:
    """bench_dtensor.py's JSON: the eager dispatch table or the redistribution table (+ plot)."""
    res = ctx.json[0]
    tor = res.get("torch", {})
    if part == "dispatch":
        tover = {r["op"]: r["overhead_us"] for r in tor.get("overhead", [])}
        rows = [[r["op"], r["layout"], f"{r['local_us']:.2f}", f"{r['dtensor_us']:.2f}", f"{r['overhead_us']:.2f}",
                 f"{r['target_us']:.0f}", _num(tover.get(r["op"]))] for r in res["overhead"]]
        return (f"{res['ranks']} ranks, float32 [64*n, 64], median us/call; overhead = DTensor - the same op on the "
                f"local arrays{_torch_note(tor)}.\n\n"
                + as_md(["op", "layout", "local us", "DTensor us", "overhead us", "target us",
                         "torch DTensor overhead us"], rows))
    red = res["redistribute"]
    tred = {(r["case"], tuple(r["shape"])): r["torch_us"] for r in tor.get("redistribute", [])}
    rows = [[r["case"], "x".join(map(str, r["shape"])), f"{r['bytes'] / 2**20:.2f}", ",".join(r["steps"]) or "-",
             f"{r['tessera_us']:.1f}", f"{r['mpi4py_us']:.1f}", f"{r['ratio']:.2f}", f"{r['tessera_out_us']:.1f}",
             f"{r['ratio_out']:.2f}", _num(tred.get((r["case"], tuple(r["shape"]))), ".1f")] for r in red]
    text = (f"{res['ranks']} ranks, float32; median us/call of the slowest rank; ratio = hand-written mpi4py / "
            "tessera_rt (>= 1: as fast); out= = `redistribute(dst, out=Y)` into a kept result, as the hand-written "
            f"side keeps its buffers{_torch_note(tor)}.\n\n"
            + as_md(["case", "shape", "MiB", "steps", "tessera_rt us", "mpi4py us", "ratio", "out= us", "out= ratio",
                     "torch DTensor us"], rows))
    return text + "\n\n" + ctx.plot("bench_redistribution.png", "redistribution time against size", lambda: size_panels(
        red, lambda r: r["case"], lambda r: r["bytes"],
        [("tessera_rt", lambda r: r["tessera_us"]), ("hand-written mpi4py", lambda r: r["mpi4py_us"])],
        "us per call", f"Redistribution, {res['ranks']} ranks: tessera_rt beside hand-written mpi4py"))


def _torch_note(tor) -> str:
    if "version" in tor:
        return f"; torch {tor['version']} DTensor on gloo in the same run"
    return f" (torch peer: {tor['error']})" if "error" in tor else ""


def _num(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def render_vs_torch(outputs, ctx) -> str:
    text, (_, rows) = markdown_or_text(outputs, ctx), first_table(outputs[0])
    if not rows:
        return text
    rows = [r for r in rows if re.fullmatch(r"[\d.]+", r[-1] or "")]
    if not rows:
        return text
    return text + "\n\n" + ctx.plot("bench_vs_torch.png", "torch time over tessera_rt time per workload",
                                    lambda: vs_torch_figure(rows))


def vs_torch_figure(rows: list[list[str]]):
    """The vs-torch bars: one per table row (workload, ..., ratio).  Each workload's name is
    wrapped onto lines of its own (never cut), the figure grows with the lines, and the x range
    leaves room for the value printed past the longest bar."""
    import textwrap
    labels = ["\n".join(textwrap.wrap(r[0].replace("`", ""), 34)) for r in rows]
    lines = sum(lb.count("\n") + 1 for lb in labels)
    fig, ax = _plt().subplots(figsize=(9, 1.4 + 0.22 * lines + 0.15 * len(rows)))
    ratios = [float(r[-1]) for r in rows]
    drawn = ax.barh(range(len(rows)), ratios, color=["tab:green" if v >= 1 else "tab:orange" for v in ratios])
    ax.bar_label(drawn, fmt="%.2f", fontsize=8, padding=3, bbox=dict(fc="white", ec="none", pad=0.5))
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, max(ratios + [1.0]) * 1.12)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("torch time / tessera_rt time (> 1: tessera_rt faster)")
    fig.suptitle("The same step in tessera_rt and PyTorch", fontsize=10)
    return fig


def render_train(outputs, ctx) -> str:
    """train.py's summary line per command: median step and final loss, and the whole job's wall
    time (a checkpoint save happens between steps, outside train.py's step times)."""
    rows = []
    for cmd, out, wall in zip(ctx.cmds, outputs, ctx.walls):
        m = re.search(r"final loss (\S+) after \d+ steps; median step ([\d.]+) ms on (\d+) ranks", out)
        if not m:
            raise ValueError(f"no 'final loss ... median step' line in the output of {cmd.shown(False)}")
        rows.append([cmd.label, m.group(3), m.group(2), f"{wall:.1f}", m.group(1)])
    return as_md(["run", "ranks", "median ms/step", "job s (start-up included)", "final loss"], rows)


# ---------------------------------------------------------------- topics

def _train(label, ranks, *mesh, steps=40, extra=("--no-checkpoint",)):
    """train.py on a mesh; its run directory (checkpoints) is a temporary one."""
    tail = ["--no-plot", "--run-dir", "{tmp}", *extra]
    return Cmd("train.py", [*mesh, "--steps", str(steps), *tail], [*mesh, "--steps", "3", *tail], ranks=ranks,
               label=label)


TOPICS = [
    Topic("callcost", "Per-call cost of the collectives against raw mpi4py", [
        Cmd("bench_callcost.py", [], None, ranks=2),
        Cmd("bench_callcost.py", [], ["all_reduce"], ranks=0)], render=render_callcost,
        note="us over the raw mpi4py call on the same 1 KiB buffers (min over 25 x 2000 calls per side, "
             "interleaved; the median of the paired differences in brackets); 2 ranks, then 1 rank."),
    Topic("collectives", "Collective bandwidth against size, beside raw MPI", [
        Cmd("bench_collectives.py", ["--min", "8", "--max", "32M", "--factor", "4", "--markdown"],
            ["--min", "8", "--max", "64K", "--factor", "64", "--reps", "2", "--budget-ms", "2", "--markdown"],
            ranks=2)], render=render_collectives, plots=["bench_collectives.png"]),
    Topic("dispatch", "DTensor eager dispatch", [
        Cmd("bench_dtensor.py", [], ["--calls", "100", "--redis-calls", "3", "--no-torch"], ranks=2, json_out=True)],
        render=lambda o, c: render_dtensor(o, c, "dispatch")),
    Topic("redistribution", "Redistribution against hand-written mpi4py", [
        Cmd("bench_dtensor.py", [], ["--calls", "100", "--redis-calls", "3", "--no-torch"], ranks=2, json_out=True)],
        render=lambda o, c: render_dtensor(o, c, "redistribution"), plots=["bench_redistribution.png"]),
    Topic("ccl", "Topology-aware collectives (dist.ccl) against the plain collective", [
        Cmd("bench_ccl.py", ["--min", "64K", "--max", "16M", "--factor", "4", "--reps", "5", "--markdown"],
            ["--min", "64K", "--max", "64K", "--reps", "1", "--budget-ms", "2", "--markdown"], ranks=2)]),
    Topic("kernels", "Kernels on the CPU", [
        Cmd("bench_kernels.py", ["--quick", "--device", "cpu", "--markdown"],
            ["--quick", "--device", "cpu", "--markdown", "--reps", "1"])]),
    Topic("fused", "Fused CPU kernels against the NumPy references", [
        Cmd("bench_kernels.py", ["--device", "cpu", "--fused", "--reps", "5", "--markdown"],
            ["--quick", "--device", "cpu", "--fused", "--reps", "1", "--markdown"])]),
    Topic("gemm_libs", "GEMM library on the CPU", [
        Cmd("bench_gemm_libs.py", ["--markdown"], ["--quick", "--markdown"])],
        note="MKL, scipy-openblas32 and BLIS are optional (looked for on sys.path and in /tmp/blaslibs, or "
             "`--lib-path DIR`); one that is missing is a 'not installed' row."),
    Topic("gpu_kernels", "Kernels on a GPU", [
        Cmd("bench_kernels.py", ["--device", "cuda", "--markdown"], ["--quick", "--device", "cuda", "--markdown"])],
        needs_gpu=True),
    Topic("vs_torch", "Training step against PyTorch", [
        Cmd("bench_vs_torch.py", ["--markdown"], ["--quick", "--markdown", "--rows", "1rank"])],
        render=render_vs_torch, plots=["bench_vs_torch.png"]),
    Topic("training", "Training step per mesh (scripts/train.py)", [
        _train("1 rank", 0), _train("dp=2", 2, "--dp", "2"), _train("tp=2", 2, "--tp", "2")], render=render_train,
        note="train.py's character model (d_model 64, 2 layers, 4 heads, seq 64, global batch 8, f32); "
             "median step after the first."),
    Topic("autodiff", "Tape bookkeeping per op", [
        Cmd("bench_autodiff.py", ["--ops", "1000", "--reps", "5"], ["--ops", "50", "--reps", "1"])]),
    Topic("debug", "Debugging and profiling hooks per call", [
        Cmd("bench_debug.py", ["--iters", "5000", "--reps", "5"], ["--iters", "200", "--reps", "1"], ranks=2)]),
    Topic("overlap", "Overlap of collectives with compute on CPU ranks", [
        Cmd("bench_overlap.py", ["--reps", "5", "--steps", "4"], ["--reps", "1", "--steps", "1"], ranks=2)]),
    Topic("pipelines", "Pipeline schedules against data parallelism", [
        Cmd("bench_pipeline.py", ["--steps", "2", "--microbatches", "4", "16", "--d-model", "128", "--seq", "64",
                                  "--batch", "32"],
            ["--steps", "1", "--microbatches", "4", "--d-model", "32", "--seq", "16", "--batch", "8", "--layers", "2"],
            ranks=2)]),
    Topic("moe", "Mixture of experts against a hand-written mpi4py dispatch", [
        Cmd("bench_moe.py", ["--reps", "5"], ["--tokens", "256", "--d-model", "32", "--d-ff", "64", "--reps", "1"],
            ranks=2)]),
    Topic("inference", "Llama decode and prefill against transformers", [
        Cmd("bench_decode.py", ["--repeats", "2", "--new", "8"],
            ["--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--vocab", "256",
             "--prompt", "8", "--new", "2", "--repeats", "1", "--batches", "1"], ranks=1)]),
    Topic("checkpoints", "Checkpoint saves during training", [
        _train("dp=2, no checkpoint", 2, "--dp", "2", steps=60),
        _train("dp=2, asynchronous save every 10 steps", 2, "--dp", "2", steps=60, extra=("--save-every", "10")),
        _train("dp=2, synchronous save every 10 steps", 2, "--dp", "2", steps=60,
               extra=("--save-every", "10", "--sync-save"))], render=render_train,
        note="train.py dp=2, 60 steps: no checkpoint, an asynchronous save every 10 steps (the default) and a "
             "synchronous one.  A save runs between steps, so the job's wall time shows its cost, the median step "
             "does not."),
    Topic("planner", "The planner: predictions checked against train.py", [
        Cmd("validate_plan.py", [], ["--steps", "2", "--configs", "dp2"], timeout=900)]),
]


# ---------------------------------------------------------------- machine, markers, runs

def machine_line(load0: float, gpu: str) -> str:
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu or platform.machine()}), load average {load0:.1f} before / "
            f"{os.getloadavg()[0]:.1f} after, {gpu or 'no GPU'}")


def gpu_name() -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = [n.strip() for n in p.stdout.splitlines() if n.strip()] if p.returncode == 0 else []
    return f"{len(names)} x {names[0]}" if names else ""


def replace_block(text: str, key: str, title: str, body: str) -> str:
    begin, end = f"<!-- bench_all:{key} -->", f"<!-- /bench_all:{key} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"


class Ctx:
    def __init__(self, topic: Topic, img_dir: Path):
        self.topic, self.img_dir, self.json, self.cmds, self.walls = topic, img_dir, [], [], []

    def ranks_of(self, i: int) -> int:
        return self.cmds[i].ranks or 1

    def plot(self, name: str, alt: str, make) -> str:
        """Draw ``make()``'s figure into docs/img/NAME; the Markdown that shows it."""
        if importlib.util.find_spec("matplotlib") is None:
            return "*(No plot: matplotlib is not installed; `pip install matplotlib`, the dev extra has it.)*"
        fig = make()
        self.img_dir.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(self.img_dir / name, dpi=90)
        _plt().close(fig)
        return f"![{alt}](docs/img/{name})"


def cpu_seconds() -> float:
    """CPU seconds of the finished child processes (ranks included): a topic's cost on a loaded
    machine, where its wall time says more about the other jobs."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def took(t0: float, cpu0: float) -> str:
    return f"{time.time() - t0:.0f} s ({cpu_seconds() - cpu0:.0f} CPU s)"


def run_topic(topic: Topic, quick: bool, img_dir: Path, env: dict, cache: dict) -> tuple[str | None, str, str]:
    """(the block's Markdown or None on failure, its wall and CPU seconds, what failed)."""
    gpu = gpu_name()
    load0, t0, cpu0 = os.getloadavg()[0], time.time(), cpu_seconds()
    outputs, ctx = [], Ctx(topic, img_dir)
    cmds = [c for c in topic.cmds if not quick or c.quick is not None]
    for cmd in cmds:
        key = (cmd.script, tuple(cmd.quick if quick else cmd.args), cmd.ranks)
        if key not in cache:                  # bench_dtensor feeds two topics: run it once
            with tempfile.TemporaryDirectory() as tmp:
                jpath = os.path.join(tmp, "out.json") if cmd.json_out else None
                t_cmd = time.time()
                try:
                    p = subprocess.run(cmd.argv(quick, jpath, os.path.join(tmp, "run")), cwd=ROOT, env=env,
                                       capture_output=True, text=True, timeout=cmd.timeout)
                    rc, out, err = p.returncode, p.stdout, p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, out = "timeout", (e.stdout or b"").decode(errors="replace")
                    err = f"timed out after {cmd.timeout} s"
                data = json.load(open(jpath)) if jpath and rc == 0 and os.path.exists(jpath) else None
            cache[key] = (rc, out, err, data, time.time() - t_cmd)
        rc, out, err, data, wall = cache[key]
        if rc != 0:
            return None, took(t0, cpu0), f"`{cmd.shown(quick)}` exited {rc}:\n{(err or out)[-2000:]}"
        outputs.append(out)
        ctx.json.append(data)
        ctx.cmds.append(cmd)
        ctx.walls.append(wall)
    try:
        body = (topic.render or markdown_or_text)(outputs, ctx)
    except Exception as e:                    # a script changed its output: say which topic and why
        return None, took(t0, cpu0), f"rendering failed: {type(e).__name__}: {e}"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    shown = "\n".join(cmd.shown(quick) for cmd in cmds)
    head = (f"*{stamp}{', --quick (smoke sizes)' if quick else ''}; {machine_line(load0, gpu)}; "
            f"{took(t0, cpu0)}.*  Regenerate: `python scripts/bench_all.py --only {topic.key}`, which runs:\n\n"
            f"```\n{shown}\n```")
    return "\n\n".join(x for x in (head, topic.note, body) if x), took(t0, cpu0), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated topics (default: all; --list names them)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, one repeat: a smoke run of every script and the file's markers, not figures")
    ap.add_argument("--out", default=None,
                    help="the Markdown file to update (default: BENCHMARKS.md; with --quick a copy in a temporary "
                         "directory, so smoke figures never land in the repository); plots go to docs/img/ beside it")
    ap.add_argument("--list", action="store_true", help="print the topics and their commands, run nothing")
    args = ap.parse_args(argv)
    wanted = [t.strip() for t in args.only.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in {tp.key for tp in TOPICS}]
    if unknown:
        ap.error(f"unknown topics {unknown}; pick from {[t.key for t in TOPICS]}")
    topics = [t for t in TOPICS if not wanted or t.key in wanted]
    if args.list:
        for t in topics:
            print(f"{t.key:<15} {t.title}" + ("  (only on a machine with a GPU)" if t.needs_gpu else ""))
            for cmd in t.cmds:
                print(f"{'':<15}   {cmd.shown(False)}")
        return 0
    if args.out:
        out = Path(args.out).resolve()
    elif args.quick:
        out = Path(tempfile.mkdtemp(prefix="bench_all_quick_")) / "BENCHMARKS.md"
        shutil.copy(ROOT / "BENCHMARKS.md", out)
    else:
        out = ROOT / "BENCHMARKS.md"
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    env = dict(os.environ, **THREADS)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    has_gpu, cache, failed, written = bool(gpu_name()), {}, [], False
    t_all, cpu_all = time.time(), cpu_seconds()
    for topic in topics:
        if topic.needs_gpu and not has_gpu:
            print(f"bench_all: {topic.key}: skipped (no GPU here; its block stays as it was)", flush=True)
            continue
        print(f"bench_all: {topic.key} ...", end=" ", flush=True)
        body, spent, why = run_topic(topic, args.quick, out.parent / "docs" / "img", env, cache)
        print(spent + (" FAILED" if body is None else ""), flush=True)
        if body is None:
            failed.append(topic.key)
            print(f"bench_all: {topic.key}: {why}\n  (its block in {out.name} is left as it was)", file=sys.stderr)
            continue
        text = replace_block(text, topic.key, topic.title, body)
        out.write_text(text)                  # after every topic: an interrupted run keeps what it measured
        written = True
    print(f"bench_all: {'wrote ' + str(out) if written else 'nothing written'} in {took(t_all, cpu_all)}"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
