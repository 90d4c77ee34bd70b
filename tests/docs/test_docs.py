"""The docs site: it builds with warnings as errors, every page is in its navigation, and the
CLI reference lists every console command and script with every flag it takes.

The build needs mkdocs, mkdocs-material and mkdocstrings[python] (the ``dev`` extra); without
them that test skips and says so.  ``python tests/docs/test_docs.py --write-cli`` regenerates
docs/cli.md from the commands' own ``--help``.
"""
from __future__ import annotations

import functools
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


@pytest.mark.slow
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
    entry = api[api.index('id="tessera_rt.dist.all_reduce"'):][:8000]
    assert "Parameters" in entry and "async_op" in entry, "the NumPy docstrings' sections are not rendered"


# --- the public API's docstrings and type hints
# Every public function and class of these packages (their ``__all__``) has a NumPy-style
# docstring: a summary line, a ``Parameters`` section naming each parameter of its signature,
# and ``Returns`` (or ``Yields``) when its return annotation is not None; and type hints on
# every parameter and on the return.  A class is checked through its constructor's signature.
# Skipped: ``self``/``cls``, ``_private`` parameters (a dataclass's private fields), and
# ``*args``/``**kwargs``, which forward to something documented elsewhere (a docstring may
# still list them as ``*args``/``**kwargs``).
API_PACKAGES = ("tessera_rt", "tessera_rt.dist", "tessera_rt.op", "tessera_rt.nn", "tessera_rt.optim",
                "tessera_rt.autodiff", "tessera_rt.profiler", "tessera_rt.launcher",
                "tessera_rt.inference", "tessera_rt.moe", "tessera_rt.pipeline", "tessera_rt.plan",
                "tessera_rt.kernels", "tessera_rt.dist.ccl", "tessera_rt.dist.checkpoint")


def public_callables() -> dict[str, object]:
    """``"module.name" -> object`` for every public function and class of ``API_PACKAGES``
    (each object once, under the first package that exports it), and ``"module.Class.method"``
    for the public methods a public class defines itself."""
    import importlib
    import inspect
    seen, out = set(), {}
    for pkg in API_PACKAGES:
        mod = importlib.import_module(pkg)
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            out[f"{pkg}.{name}"] = obj
            if inspect.isclass(obj):
                out.update((f"{pkg}.{name}.{m}", f) for m, f in vars(obj).items()
                           if not m.startswith("_") and inspect.isfunction(f))
    return out


def doc_sections(doc: str) -> dict[str, list[str]]:
    """A NumPy-style docstring's sections: ``"Parameters" -> the names its entries list``
    (``a, b : int`` lists two) and the other section titles -> []."""
    import inspect
    lines = inspect.cleandoc(doc).splitlines()
    out, current = {}, None
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and line.strip() and re.fullmatch(r"\s*-{3,}\s*", lines[i + 1]):
            current = line.strip()
            out[current] = []
        elif current and line and not line[0].isspace() and not re.fullmatch(r"-{3,}", line.strip()):
            out[current] += [n.strip() for n in line.split(" : ")[0].split(",") if n.strip()]
    return out


def api_doc_problems(name: str, obj) -> list[str]:
    """What ``obj``'s docstring and signature lack (empty when complete)."""
    import inspect
    doc = inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return [f"{name}: no docstring"]
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):            # an exception class taking the message as it is
        sig = inspect.Signature()
    problems, sections = [], doc_sections(doc)
    params = [p for p in sig.parameters.values()             # (a dataclass's _private fields are not API)
              if p.name not in ("self", "cls") and not p.name.startswith("_")
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    documented = {n.lstrip("*") for n in sections.get("Parameters", [])}
    lacking = [p.name for p in params if p.name not in documented]
    if lacking:
        problems.append(f"{name}: Parameters section lacks {lacking}")
    unhinted = [p.name for p in params if p.annotation is p.empty]
    if unhinted:
        problems.append(f"{name}: no type hint on {unhinted}")
    if not inspect.isclass(obj):
        ret = sig.return_annotation
        if ret is sig.empty:
            problems.append(f"{name}: no return type hint")
        elif ret not in (None, "None") and not {"Returns", "Yields"} & set(sections):
            problems.append(f"{name}: returns {ret} but has no Returns section")
    return problems


@pytest.mark.timeout(120)
def test_public_api_has_numpy_docstrings_and_type_hints():
    problems = [p for name, obj in public_callables().items()  for p in api_doc_problems(name, obj)]
    assert not problems, f"{len(problems)} gaps in the public API's docs:\n" + "\n".join(problems)


@pytest.mark.timeout(60)
def test_help_on_a_collective_shows_its_parameters():
    # the collectives are C callables (dist/_hot.c) wrapping the Python functions: pydoc shows
    # their docstring, not a signature, so the Parameters section is what help() lists
    import inspect
    import pydoc

    from tessera_rt import dist
    for fn in (dist.all_reduce, dist.all_gather, dist.reduce_scatter, dist.all_to_all, dist.broadcast):
        text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
        missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"^\s*{p}\b", text, flags=re.M)]
        assert "Parameters" in text and not missing, f"help({fn.__name__}) does not list {missing}:\n{text}"


# --- every public name is in the API reference (docs/api/*.md, rendered by mkdocstrings)
# A name of a package's ``__all__`` (and each name a package serves from above: ``dist.UPPER``,
# ``nn.UPPER``) is in the reference when a page renders the object: a ``::: pkg.name``
# directive for it, or a ``::: pkg`` page whose member it is as griffe (mkdocstrings' loader)
# sees the package -- a member that is a submodule there is hidden, which is how a function
# named like its module (``plan.search``, ``dist.tensor``) went missing -- or another package's
# page that renders the same object (``ts.grad`` is ``autodiff.grad``).  A module in
# ``__all__`` needs a page of its own.
REFERENCE_PACKAGES = API_PACKAGES + ("tessera_rt.graph", "tessera_rt.models")


def api_directives() -> set[str]:
    """Every ``::: path`` of the API pages."""
    return {m for page in (DOCS / "api").glob("*.md") for m in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)}


@functools.cache
def _griffe_package():
    """tessera_rt as griffe loads it (the whole package, subpackages included: loaded once)."""
    import griffe
    return griffe.load("tessera_rt", search_paths=[str(ROOT / "src")], allow_inspection=False)


def rendered_members(pkg: str) -> set[str]:
    """The members mkdocstrings renders on a ``::: pkg`` page: griffe's public members of the
    package that are not modules (a submodule of the same name hides an attribute)."""
    obj = _griffe_package()
    for part in pkg.split(".")[1:]:
        obj = obj.members[part]
    out = set()
    for name, member in obj.members.items():
        try:
            if not name.startswith("_") and not member.is_module:
                out.add(name)
        except Exception:                      # an alias griffe cannot resolve is not rendered
            continue
    return out


def missing_from_reference() -> list[str]:
    import importlib
    import inspect
    directives = api_directives()
    shown = {pkg: rendered_members(pkg) for pkg in REFERENCE_PACKAGES if pkg in directives}
    where: dict[int, str] = {}             # id(object) -> a path the reference renders it at
    for pkg, names in shown.items():
        mod = importlib.import_module(pkg)
        for n in names & set(getattr(mod, "__all__", ())):
            where.setdefault(id(getattr(mod, n)), f"{pkg}.{n}")
    for d in directives:
        mod_name, _, attr = d.rpartition(".")
        try:
            where.setdefault(id(getattr(importlib.import_module(mod_name), attr)), d)
        except (ImportError, AttributeError, ValueError):
            pass
    missing = []
    for pkg in REFERENCE_PACKAGES:
        mod = importlib.import_module(pkg)
        upper = getattr(mod, "UPPER", None)
        names = list(getattr(mod, "__all__", ())) + (list(upper.sources) if upper is not None else [])
        for n in names:
            obj = getattr(mod, n)
            if inspect.ismodule(obj):
                ok = obj.__name__ in directives
            else:                               # (op's kernels are differentiable() wrappers)
                ok = (f"{pkg}.{n}" in directives or n in shown.get(pkg, ()) and pkg in directives
                      or id(obj) in where or id(getattr(obj, "__wrapped__", None)) in where)
            if not ok and not isinstance(obj, (str, int, float, tuple, dict, frozenset)):
                missing.append(f"{pkg}.{n}")
    return missing


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_public_name_is_in_the_api_reference():
    import tessera_rt as ts
    ts.grad                                 # every layer imported: the names served from above are there
    missing = missing_from_reference()
    assert not missing, (f"{len(missing)} public name(s) the API reference (docs/api/*.md) does not render: "
                         + ", ".join(missing) + ".  Add a `::: module.name` directive (a name a submodule "
                         "hides, or one served from above) or a page for the package.")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-cli"]:
        write_cli()
    else:
        sys.exit(__doc__)
