"""The commands of README.md and docs/*.md work on a fresh clone, as a new user runs them.

The clone is the working tree as git would commit it: every tracked file and every untracked
file .gitignore does not exclude (``git ls-files -co --exclude-standard``), copied to a temp
dir.  That is what ``git clone`` gives once the tree is committed (in CI the two are the
same), and it lets the test check uncommitted work too; ignored paths (.venv, out/, build
outputs) are absent, as in a real clone.  ``TESSERA_README_CLONE=git`` uses a real
``git clone`` of HEAD instead.  The clone shares this venv (``.venv`` is a link to it and
``PYTHONPATH`` points at the clone's src/, so the clone's code runs, not this tree's).

Every fenced ``python`` block that says "save as X.py and run: CMD" is saved and CMD run as
written; every ``bash`` command line runs as written (a command written in two files runs
once), except (each says why in ``SKIP``):
the two scripts that make a venv (demo.sh runs its program, scripts/demo.py, the way
demo.sh would; test.sh would run this suite inside itself), pip installs (network), placeholders
(``my_program.py``), multi-host and Nsight lines.  A command nobody classified fails
the test, so a new command gets run or a reason.

What a command prints is checked too: a ```` ```text ```` block after a code block (before the
next code block or heading) is its output; each of its lines must be a whole line of what the
command printed, ``...`` matching anything (after a bash block, the block's last command).
``EXPECT`` adds a pattern for commands whose output the docs do not show.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

VENV = Path(sys.executable).parent.parent
TIMEOUT_S = 120
# README command -> why the test does not run it as written (matched as a prefix)
SKIP = {
    "bash scripts/demo.sh": "makes a venv; its program runs instead (tessera-run -n 4 scripts/demo.py)",
    "bash scripts/test.sh": "runs this whole suite (this test included)",
    "pip install": "installs from the network",
    "pip download": "downloads from the network",
    ".venv/bin/tessera-run -n 4 my_program.py": "a placeholder program",
    ".venv/bin/tessera-run -n 8": "needs 8 ranks on two hosts",
    ".venv/bin/python scripts/bench_vs_torch.py": "tests/launch/test_demo.py runs this smoke run (with the equality check)",
    ".venv/bin/tessera-run --host": "needs the hosts it names (tests/launch/test_two_hosts.py runs two on this machine)",
    "TESSERA_NVTX=1 nsys": "needs Nsight Systems",
    "bash scripts/gpu_check.sh": "measures a GPU machine for minutes; its no-GPU form (--quick on the stand-in) "
                                 "runs in tests/gpu/test_gpu_check.py",
    "TESSERA_WHEELS=": "bash scripts/gpu_check.sh with the vendor wheels: as above, on a GPU machine",
}
# what demo.sh runs, for the line above (demo.sh ends with `exec tessera-run -n 4 scripts/demo.py`)
DEMO = ".venv/bin/tessera-run -n 4 scripts/demo.py"
# the files whose commands run: the README and every guide
DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
# a line of output each command must print (beyond exiting 0 and its text block); the first key
# in the command wins
EXPECT = {
    "scripts/train.py --help": r"\(default: data/seeds\)",        # (before the key it contains)
    "scripts/train.py": r"^final loss \d",
    "scripts/demo.py": r"matches NumPy on the full tensors: True",
    "tests/collectives/mpi_collectives.py": r"passed",
    "scripts/generate.py": r"^tokens: \d+( \d+){7}$",
}


def readme_commands(text: str) -> list[tuple[str | None, str, str]]:
    """(file name or None, its source, the command) for each runnable thing in a Markdown file."""
    return [(f, src, cmd) for f, src, cmd, _ in doc_commands(text)]


def doc_commands(text: str) -> list[tuple[str | None, str, str, list[str]]]:
    """(file name or None, its source, the command, the output lines its docs show) for each
    runnable thing in a Markdown file."""
    out = []
    blocks = list(re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```", text, flags=re.M | re.S))
    for i, b in enumerate(blocks):
        lang, body = b.group(2), b.group(3)
        if b.group(1) or lang == "text":
            continue
        shown = []
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if nxt is not None and nxt.group(2) == "text":
            shown = [line for line in nxt.group(3).splitlines() if line.strip()]
        if lang == "python":
            m = re.search(r"#\s*save as (\S+\.py) and run:\s*(.+)", body)
            if m:
                out.append((m.group(1), body, m.group(2).strip(), shown))
        elif lang == "bash":
            cmds = [line.split(" #")[0].strip() for line in re.sub(r"\\\n\s*", "", body).splitlines()]
            cmds = [c for c in cmds if c]
            out += [(None, "", c, shown if j == len(cmds) - 1 else []) for j, c in enumerate(cmds)]
    for m in re.finditer(r"`(\.venv/bin/(?:tessera-run|python) [^`]+)`", text):      # commands in the prose
        out.append((None, "", m.group(1), []))
    return out


def all_commands() -> list[tuple[str | None, str, str, list[str]]]:
    """Every file's commands, each (file, command) once, in the order the files list them."""
    seen, out = set(), []
    for doc in DOCS:
        for fname, src, cmd, shown in doc_commands((ROOT / doc).read_text()):
            if (fname, cmd) not in seen:
                seen.add((fname, cmd))
                out.append((fname, src, cmd, shown))
    return out


def shown_line_pattern(line: str) -> str:
    """A regex for one line of a shown output: the whole line, ``...`` matching anything."""
    return r"^\s*" + ".*?".join(re.escape(part) for part in line.strip().split("...")) + r"\s*$"


def _fresh_clone(dest: Path) -> Path:
    repo = dest / "tessera_rt"
    if os.environ.get("TESSERA_README_CLONE") == "git":
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        return repo
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():                  # a tracked file deleted in the tree is not in a clone
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / f)
    return repo


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    repo = _fresh_clone(tmp_path_factory.mktemp("readme"))
    (repo / ".venv").symlink_to(VENV, target_is_directory=True)
    return repo


# a folder a command leaves for later ones (a run directory, a saved model): the commands that
# name the same one are a journey, run in order in one test (tests may run on different
# pytest-xdist workers, and in any order)
HANDED_ON = re.compile(r"\bout/[\w.-]+")


def journeys() -> list[list[tuple[str | None, str, str, list[str]]]]:
    """The commands to run, in the docs' order, joined into journeys: commands naming the same
    out/ folder (in the command or the file it saves) form one; every other command is its own."""
    steps, folders = [], []
    for fname, src, cmd, shown in all_commands():
        if cmd.startswith("bash scripts/demo.sh"):
            steps.append((None, "", DEMO, []))
        elif not any(cmd.startswith(k) for k in SKIP):
            steps.append((fname, src, cmd, shown))
        else:
            continue
        folders.append(set(HANDED_ON.findall(cmd + src)))
    group = list(range(len(steps)))                  # union-find over the steps sharing a folder
    for i in range(len(steps)):
        for j in range(i):
            if folders[i] & folders[j]:
                a, b = _root(group, i), _root(group, j)
                group[max(a, b)] = min(a, b)
    out: dict[int, list] = {}
    for i, step in enumerate(steps):
        out.setdefault(_root(group, i), []).append(step)
    return list(out.values())


def _root(group: list[int], i: int) -> int:
    while group[i] != i:
        i = group[i]
    return i


def _folders(steps) -> list[str]:
    return sorted(set(HANDED_ON.findall(" ".join(cmd + src for _, src, cmd, _ in steps))))


def _cases():
    cases = []
    for steps in journeys():
        fname, _, cmd, _ = steps[0]
        name = "demo.sh:scripts/demo.py" if cmd == DEMO else (
            fname or next((t for t in cmd.split() if t.endswith(".py")), cmd)) + (" --help" if "--help" in cmd else "")
        ranks = max(_ranks(cmd) for _, _, cmd, _ in steps)
        marks = [pytest.mark.timeout(len(steps) * TIMEOUT_S + 30)] + ([pytest.mark.mpi(ranks=ranks)] if ranks > 1 else [])
        cases.append(pytest.param(steps, id=f"journey {' '.join(_folders(steps))}" if len(steps) > 1 else name,
                                  marks=marks))
    return cases


def test_every_readme_command_is_run_or_has_a_reason():
    cmds = all_commands()
    assert any(f == "tp_train.py" for f, _, _, _ in cmds) and any("scripts/train.py" in c for _, _, c, _ in cmds)
    for fname, _, cmd, _ in cmds:
        assert cmd.startswith((".venv/bin/", "NUMBA_NUM_THREADS=1 .venv/bin/", "PYTHONPATH=tests/gpu_emu:src ")) or any(
            cmd.startswith(k) for k in SKIP), f"command {cmd!r} in {DOCS}: run it here or add a reason to SKIP"


def test_the_examples_the_docs_show_output_for_are_checked():
    """The examples whose output matters have it shown (and so compared), not only run."""
    shown = {f for f, _, _, lines in all_commands() if lines}
    assert {"allreduce.py", "dtensor_demo.py", "tp_train.py", "moe_demo.py", "keep_output.py", "pipe_train.py",
            "plan_demo.py", "ccl_demo.py", "make_tiny_llama.py"} <= shown, shown


def test_a_shown_output_is_matched_line_by_line():
    text = "Output:\n\n```python\n# save as a.py and run:  .venv/bin/python a.py\n```\n\n```text\nloss ... ok\n```\n"
    (_, _, _, shown), = doc_commands(text)
    assert shown == ["loss ... ok"]
    pat = shown_line_pattern(shown[0])
    assert re.search(pat, "x\nloss 3.1 ok\n", flags=re.M) and not re.search(pat, "loss 3.1 bad\n", flags=re.M)
    assert not re.search(shown_line_pattern("[1. 2.]"), "[1. 2. 3.]\n", flags=re.M)      # the whole line
    assert doc_commands("```bash\na\n```\n\n## next\n\n```text\nx\n```\n")[0][3] == []   # not across a heading


def test_commands_that_hand_on_a_folder_run_as_one_journey():
    """The README's train -> resume -> generate and the docs' save -> load pairs run in one test,
    in order: apart, a parallel or shuffled run could resume a run that was not made yet."""
    by_folder = {f: steps for steps in journeys() for f in _folders(steps)}
    readme = [cmd for _, _, cmd, _ in by_folder["out/journey"]]
    assert len(readme) == 3 and "--save-every" in readme[0] and "--resume" in readme[1] and "generate" in readme[2]
    assert by_folder["out/tiny_llama"][0][0] == "make_tiny_llama.py"
    assert "--resume" in by_folder["out/resume_demo"][1][2] and by_folder["out/journey"] is not by_folder["out/resume_demo"]


def _ranks(cmd: str) -> int:
    """The ranks a command starts (tessera-run -n N, mpiexec -n N): its test is marked mpi."""
    m = re.search(r"(?:tessera-run|mpiexec) (?:.*? )?-n (\d+)", cmd)
    return int(m.group(1)) if m else 1


@pytest.mark.slow
@pytest.mark.parametrize("steps", _cases())
def test_readme_command_runs_on_a_fresh_clone(clone, steps):
    """Each command (of a journey: each in turn) exits 0 and prints what the docs show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM"))}
    env.update(PYTHONPATH=str(clone / "src"), TESSERA_DEVICE="cpu", PATH=f"{VENV / 'bin'}:{env.get('PATH', '')}")
    for fname, source, cmd, shown in steps:
        if fname:
            (clone / fname).write_text(source)
        start = time.monotonic()
        p = subprocess.run(["timeout", "-k", "5", str(TIMEOUT_S), "bash", "-c", cmd], cwd=clone, env=env,
                           capture_output=True, text=True)
        took = time.monotonic() - start
        out = p.stdout + p.stderr
        assert p.returncode == 0, f"README command {cmd!r} exited {p.returncode} after {took:.0f} s:\n{out[-4000:]}"
        key = next((k for k in EXPECT if k in cmd), None)
        if key:
            assert re.search(EXPECT[key], p.stdout, flags=re.M), f"{cmd!r} printed no line like {EXPECT[key]!r}:\n{out[-3000:]}"
        for line in shown:
            assert re.search(shown_line_pattern(line), p.stdout, flags=re.M), (
                f"{cmd!r} printed no line like the docs show ({line!r}; '...' matches anything):\n{out[-3000:]}")
        if fname == "tp_train.py":         # the profile table is a summary, not hundreds of rows
            assert len(p.stdout.splitlines()) <= 25, p.stdout


# --------------------------------------------------------------------------- scripts/train.py, run alone

_BLAS_THREADS = """
import ctypes, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("train_script", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))     # train.py's top: caps, then NumPy
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "openblas" in l.lower()})
get = None
for lib in libs:
    for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
        get = get or getattr(ctypes.CDLL(lib), sym, None)
print({v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                      "NUMBA_NUM_THREADS")}, get() if get else None)
"""


def test_train_py_run_alone_caps_blas_and_openmp_threads_before_numpy_loads():
    """Uncapped, OpenBLAS starts a thread per core and the small GEMMs of a one-rank run
    spin and contend (about 10x slower on a loaded 2-core machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM"))}
    p = subprocess.run([sys.executable, "-c", _BLAS_THREADS, str(ROOT / "scripts" / "train.py")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    caps, blas = p.stdout.strip().rsplit(" ", 1)
    assert caps == str({v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                         "NUMBA_NUM_THREADS")}), p.stdout
    assert blas in ("1", "None"), p.stdout             # None: NumPy without OpenBLAS
    env["OMP_NUM_THREADS"] = "2"                        # the user's setting wins
    p = subprocess.run([sys.executable, "-c", _BLAS_THREADS, str(ROOT / "scripts" / "train.py")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert "'OMP_NUM_THREADS': '2'" in p.stdout, p.stdout + p.stderr


def test_train_py_help_shows_a_default_and_help_for_every_flag():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    flags = re.findall(r"^  (--[\w-]+)(.*)\n((?:^ {6,}.*\n)*)", p.stdout, flags=re.M)
    assert len(flags) >= 19, p.stdout
    for flag, rest, more in flags:
        text = " ".join((rest + " " + more).split())
        words = [w for w in text.split() if not w.isupper() and not w.startswith("{")]
        assert len(words) >= 3, f"{flag} has no help: {text!r}"
        assert "(default: " in text, f"{flag} shows no default: {text!r}"
    assert "(default: data/seeds)" in p.stdout and (ROOT / "data" / "seeds").is_dir()
