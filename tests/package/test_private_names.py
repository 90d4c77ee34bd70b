"""A private name stays in its package (issue 41): explicit state, no hidden protocols.

A name that starts with one underscore is private to the package it lives in (a "package"
here is each subpackage of tessera_rt: ``dist.comm`` and ``dist.tensor`` are two; a
top-level module such as ``backend`` or ``launcher`` is one of its own).  What another
package needs is a public name of the owning module (documented, in its ``__all__``), or the
code moves.  The scan covers, in ``src/`` (every import counts, also inside functions):

* ``from pkg.mod import _name`` and ``import pkg._mod`` (a private module too);
* ``mod._name`` on a module imported from another package.

and in ``tests/``: the same forms on any tessera_rt module, and
``monkeypatch.setattr(mod, "_name", ...)`` on one.  Tests use public names; per-layer state
has a public ``reset()`` (``dist.comm.calls.GROUPS``, ``dist.checks.consistency.STATE``).

ALLOWED_SRC and ALLOWED_TESTS list today's exceptions; both are empty and only shrink.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_architecture import PKG, SRC, modules

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parents[1]

ALLOWED_SRC: set = set()        # (importer module, "what") pairs
ALLOWED_TESTS: set = set()      # (test file relative to tests/, "what") pairs


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_of(module: str, mods: dict) -> str:
    """The package a module belongs to: its parent package, or itself for a package
    ``__init__`` and for a top-level module (``tessera_rt.backend``)."""
    path = mods[module]
    if path.name == "__init__.py":
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent == PKG else parent


def _owner(name: str, mods: dict) -> str | None:
    """The longest existing module ``name`` starts with (None: not a package module)."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in mods else None


def private_uses(path: Path, mods: dict, module: str | None = None) -> list:
    """(line, what) for each use of another package's private name in ``path``.  ``module``:
    the file's dotted name when it is in src/ (same-package uses are its own business); None
    for a test file (every tessera_rt private counts)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if module is not None:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        mine = package_of(module, mods)
    else:
        base, mine = [], None

    def foreign(target: str) -> bool:
        owner = _owner(target, mods)
        return owner is not None and (mine is None or package_of(owner, mods) != mine)

    alias: dict = {}            # local name -> the package module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            m = (".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                 if node.level else node.module or "")
            if m.split(".")[0] != PKG:
                continue
            for a in node.names:
                full = f"{m}.{a.name}"
                if full in mods:
                    alias[a.asname or a.name] = full
                target = full if full in mods else m
                if (_private(a.name) or any(_private(p) for p in m.split("."))) and foreign(target):
                    out.append((node.lineno, f"from {m} import {a.name}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != PKG:
                    continue
                if a.asname:
                    alias[a.asname] = a.name
                if any(_private(p) for p in a.name.split(".")) and foreign(a.name):
                    out.append((node.lineno, f"import {a.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in alias and foreign(alias[node.value.id])):
            out.append((node.lineno, f"{node.value.id}.{node.attr} ({alias[node.value.id]})"))
        if (module is None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setattr" and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                and node.args[0].id in alias and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            out.append((node.lineno, f"setattr({node.args[0].id}, {node.args[1].value!r}) ({alias[node.args[0].id]})"))
    return sorted(set(out))


def src_uses(src: Path = SRC) -> set:
    mods = modules(src)
    return {(name[len(PKG) + 1:], what) for name, path in mods.items() if path.suffix == ".py"
            for _, what in private_uses(path, mods, name)}


def test_no_package_uses_another_packages_private_names():
    found = src_uses()
    new = found - ALLOWED_SRC
    assert not new, ("private name(s) used across packages: make each a public name of its module (documented, "
                     "in __all__) or move the code:\n" + "\n".join(f"  {m}: {w}" for m, w in sorted(new)))
    gone = ALLOWED_SRC - found
    assert not gone, f"remove from ALLOWED_SRC (the list only shrinks): {sorted(gone)}"


def test_tests_use_only_public_names_of_the_package():
    mods = modules()
    found = {(str(p.relative_to(TESTS)), what) for p in sorted(TESTS.rglob("*.py"))
             if "gpu_emu" not in p.parts for _, what in private_uses(p, mods)}
    new = found - ALLOWED_TESTS
    assert not new, ("test(s) reach private names of tessera_rt (use or add a public name; per-layer state "
                     "has a public reset()):\n" + "\n".join(f"  {f}: {w}" for f, w in sorted(new)))
    gone = ALLOWED_TESTS - found
    assert not gone, f"remove from ALLOWED_TESTS (the list only shrinks): {sorted(gone)}"


def test_the_scan_sees_every_form(tmp_path):
    # the scanner itself, on a small package: relative and absolute, inside a function, a private
    # module, an attribute of an imported module, a monkeypatch by name; same-package uses pass
    pkg = tmp_path / PKG
    for d in ("dist/comm", "dist/tensor"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "dist" / "__init__.py").write_text("")
    (pkg / "backend.py").write_text("_KERNELS = {}\n")
    (pkg / "dist" / "comm" / "work.py").write_text("_group = 1\n")
    (pkg / "dist" / "comm" / "_hot.py").write_text("")
    (pkg / "dist" / "comm" / "collectives.py").write_text("from .work import _group\n")          # same package
    (pkg / "dist" / "tensor" / "plan.py").write_text(
        "from ..comm import collectives as C\n"
        "def f():\n    from ..comm.work import _group\n    from tessera_rt.dist.comm import _hot\n"
        "    return C._issue\n"
        "from ... import backend\nbackend._KERNELS\n")
    assert src_uses(tmp_path) == {
        ("dist.tensor.plan", "from tessera_rt.dist.comm.work import _group"),
        ("dist.tensor.plan", "from tessera_rt.dist.comm import _hot"),
        ("dist.tensor.plan", "C._issue (tessera_rt.dist.comm.collectives)"),
        ("dist.tensor.plan", "backend._KERNELS (tessera_rt.backend)"),
    }
    test = tmp_path / "test_x.py"
    test.write_text("from tessera_rt.dist.comm import work\nfrom tessera_rt.backend import _KERNELS\n"
                    "def test(monkeypatch):\n    monkeypatch.setattr(work, '_group', 2)\n    work.public\n")
    mods = modules(tmp_path)
    assert [w for _, w in private_uses(test, mods)] == [
        "from tessera_rt.backend import _KERNELS", "setattr(work, '_group') (tessera_rt.dist.comm.work)"]
