"""The docs site: it builds with warnings as errors, every page is in its navigation, and the
CLI reference lists every console command and script with every flag it takes.

The build needs mkdocs, mkdocs-material and mkdocstrings[python] (the ``dev`` extra); without
them that test skips and says so.  ``python tests/docs/test_docs.py --write-cli`` regenerates
docs/cli.md from the commands' own ``--help``.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CLI = DOCS / "cli.md"
# console command -> the module that defines its flags (setup.cfg's console_scripts)
CONSOLE = {"tessera-run": "src/tessera_rt/launcher.py", "tessera-plan": "src/tessera_rt/plan/cli.py"}
# scripts whose --help starts work (they make a venv): described by hand in cli.md
NO_HELP = ("demo.sh", "test.sh")


def flags_in_source(path: Path) -> set[str]:
    """The long options a script's argparse parser defines and shows (not help=SUPPRESS ones)."""
    calls = path.read_text().split("add_argument(")[1:]
    return {m.group(1) for c in calls if "SUPPRESS" not in c.split(")\n")[0]
            for m in [re.match(r"\s*(?:\"-\w\",\s*)?\"(--[\w-]+)\"", c)] if m}


def cli_sections(text: str) -> dict[str, str]:
    """``### name`` -> the text of that section of cli.md."""
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {name.strip(): body for name, body in zip(parts[1::2], parts[2::2])}


def _help(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{cmd}: {p.stderr}"
    return p.stdout.rstrip()


def write_cli() -> None:
    """docs/cli.md from the --help of every console command and script (keeps the hand-written
    sections: everything before "## Scripts" apart from the help blocks, which are refreshed)."""
    text = CLI.read_text()
    head = text[: text.index("## Scripts")]
    helps = {"tessera-run": [sys.executable, "-m", "tessera_rt.launcher", "--help"],
             "tessera-plan": [sys.executable, "-m", "tessera_rt.plan.cli", "--help"],
             "scripts/gpu_check.sh": [sys.executable, "scripts/gpu_check.py", "--help"]}
    for name, cmd in helps.items():
        head = re.sub(rf"(^### {re.escape(name)}\n.*?```text\n).*?(^```)", lambda m: m.group(1) + _help(cmd) + "\n" + m.group(2),
                      head, count=1, flags=re.M | re.S)
    out = [head, "## Scripts\n"]
    for s in sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.name != "gpu_check.py"):
        out.append(f"\n### scripts/{s}\n\n```text\n{_help([sys.executable, f'scripts/{s}', '--help'])}\n```\n")
    CLI.write_text("".join(out))


@pytest.mark.timeout(60)
def test_cli_reference_lists_every_command_script_and_flag():
    sections = cli_sections(CLI.read_text())
    scripts = {p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    documented = {n.split("/", 1)[1] for n in sections if n.startswith("scripts/")}
    assert documented | {"gpu_check.py"} >= scripts, f"scripts without a section in docs/cli.md: {sorted(scripts - documented)}"
    for name, src in [*CONSOLE.items(), *((f"scripts/{s}", f"scripts/{s}") for s in scripts if s.endswith(".py"))]:
        key = "scripts/gpu_check.sh" if name == "scripts/gpu_check.py" else name
        missing = flags_in_source(ROOT / src) - set(re.findall(r"--[\w-]+", sections[key]))
        assert not missing, (f"docs/cli.md's {key} section lacks {sorted(missing)}: regenerate it with "
                             "`python tests/docs/test_docs.py --write-cli`")


@pytest.mark.timeout(60)
def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages, DOCS
    missing = {p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, flags=re.M)}
    assert not missing, f"pages not in mkdocs.yml's nav: {sorted(missing)}"


@pytest.mark.timeout(600)
def test_site_builds_with_warnings_as_errors(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
    if missing:
        pytest.skip(f"the docs site needs {missing} (setup.cfg's dev extra: pip install -e '.[dev]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), NO_MKDOCS_2_WARNING="1")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{(p.stdout + p.stderr)[-6000:]}"
    for page in ("index.html", "cli/index.html", "api/dist/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "dist" / "index.html").read_text()
    assert 'id="tessera_rt.dist.all_reduce"' in api        # the API reference is generated, not empty


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-cli"]:
        write_cli()
    else:
        sys.exit(__doc__)
