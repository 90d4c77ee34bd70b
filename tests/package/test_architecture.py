"""The import graph of tessera_rt points one way: down the layers (issue 29).

Every ``import`` / ``from ... import`` in a module counts, also those inside functions (a lazy
import is still a dependency) and those under ``if TYPE_CHECKING:`` (a type is a dependency
too: no hint may point up the layers).  A type-only import runs at no import time, so it makes
no import circle: the circle check leaves them out. ``from pkg import name`` is an arrow to the submodule when
``name`` is one, otherwise to the package (importing a package runs its ``__init__``).

Layers, lowest first; an arrow may point to the same or a lower layer only:
  0 backend, cpu_streams, dtypes, formatting, runtime, deprecation, upper, dirlock (the base)
  1 kernels
  2 dist, in floors of its own (each subpackage's __init__ says what it owns):
    2a dist.comm        MPI, process group, communicators, meshes, the seam, collectives
    2b dist.checks      the checkers that plug into the seam from above
    2c dist.tensor      layouts, DTensor, dispatch and rules, redistribution
    2d dist.ccl         topology-aware collectives
    2e dist.checkpoint  distributed checkpoints
    2f dist             the package itself (assembles the floors)
  3 autodiff
  4 op, nn, optim, profiler, graph
  5 moe, pipeline, models
  6 inference, plan, launcher (+ launch_hosts, launch_ranks)
  7 the package root tessera_rt                       (assembles everything)
An upper layer plugs into a lower one through a registry the lower one owns and the upper
one fills on import (e.g. ``dist.comm.hooks``), never by the lower one importing it.

ALLOWED lists today's remaining upward arrows and ALLOWED_CIRCLES the circles left without
them. The goal of issue 29 is both lists empty: the test fails on any arrow or circle not
listed, and on any listed one that is gone (remove it from the list then), so they only shrink.
"""
import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PKG = "tessera_rt"
SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS = [
    ["backend", "cpu_streams", "dtypes", "formatting", "runtime", "deprecation", "upper", "dirlock"],
    ["kernels"],
    ["dist.comm"],
    ["dist.checks"],
    ["dist.tensor"],
    ["dist.ccl"],
    ["dist.checkpoint"],
    ["dist"],
    ["autodiff"],
    ["op", "nn", "optim", "profiler", "graph"],
    ["moe", "pipeline", "models"],
    ["inference", "plan", "launcher", "launch_hosts", "launch_ranks"],
]

# Today's upward arrows (importer -> imported, names relative to tessera_rt). Each one is a
# debt: remove it by inverting the dependency (a registry the lower module owns), never by
# making the import lazy. Arrows inside an import circle between same-layer modules are
# listed below in ALLOWED_CIRCLES.
ALLOWED: set = set()

# Today's import circles that remain once the ALLOWED arrows are taken out (each a set of
# modules that import each other, directly or around a loop). Same goal: empty.
ALLOWED_CIRCLES: list = []


def modules(src: Path = SRC) -> dict:
    """{dotted name: file}: every .py module, and every C extension (``dist/comm/_hot.c`` is
    ``tessera_rt.dist.comm._hot``: ``from . import _hot`` imports it, not its package)."""
    out = {}
    for p in sorted((src / PKG).rglob("*.py")) + sorted((src / PKG).rglob("*.c")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def missing_modules(src: Path = SRC) -> list:
    """``(importer, module)`` for every import of a package module that does not exist (a path
    left behind by a move: inside a function it fails only when that line runs)."""
    mods, out = modules(src), []
    for name, path in mods.items():
        if path.suffix == ".c":
            continue
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names if a.name.split(".")[0] == PKG]
            elif isinstance(node, ast.ImportFrom):
                m = (".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                     if node.level else node.module or "")
                wanted = [m] if m.split(".")[0] == PKG else []
            else:
                continue
            out += [(f"{short(name)}:{node.lineno}", short(m)) for m in wanted if m not in mods]
    return out


def _type_only(tree: ast.Module) -> set:
    """The ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def import_graph(src: Path = SRC, type_only: bool = True) -> dict:
    """{module: set of modules it imports}, full dotted names, self-imports dropped;
    ``type_only=False`` leaves out the imports under ``if TYPE_CHECKING:``."""
    mods = modules(src)
    edges = {}
    for name, path in mods.items():
        if path.suffix == ".c":
            edges[name] = set()                 # an extension imports no module of the package
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        skip = set() if type_only else _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == PKG)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    m = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    m = node.module or ""
                if m.split(".")[0] != PKG:
                    continue
                for a in node.names:
                    sub = f"{m}.{a.name}"
                    targets.add(sub if sub in mods else m)
        res = set()
        for t in targets:
            while t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in mods and t != name:
                res.add(t)
        edges[name] = res
    return edges


_LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def layer(module: str) -> int:
    """The layer of a module: that of the longest name in LAYERS it starts with
    (``dist.comm.mesh`` is in ``dist.comm``, ``dist`` itself in ``dist``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)          # the package root sits on top
    for k in range(len(parts), 1, -1):
        i = _LAYER_OF.get(".".join(parts[1:k]))
        if i is not None:
            return i
    raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS in {__file__}")


def short(module: str) -> str:
    return module[len(PKG) + 1:] if module != PKG else PKG


def upward_arrows(edges: dict) -> set:
    return {(short(a), short(b)) for a, bs in edges.items() for b in bs if layer(b) > layer(a)}


def circles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter; counter += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter; counter += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(short(c) for c in comp))
    return out


def _fmt(arrows) -> str:
    return "\n".join(f"    ({a!r}, {b!r})," for a, b in sorted(arrows))


def test_every_import_names_a_module_that_exists():
    gone = missing_modules()
    assert not gone, "imports of modules that do not exist (moved? update the path):\n" + "\n".join(
        f"  {where} imports {m}" for where, m in gone)


def test_layer_map_covers_every_module():
    for m in import_graph():
        layer(m)


def test_no_new_upward_arrow():
    ups = upward_arrows(import_graph())
    new = ups - ALLOWED
    assert not new, (
        f"{len(new)} import(s) point up the layers (see this file's docstring):\n{_fmt(new)}\n"
        "Invert them: the lower module owns a registry/hook that the upper one fills on import.")
    gone = ALLOWED - ups
    assert not gone, (
        f"{len(gone)} allowed upward arrow(s) no longer exist: remove them from ALLOWED in "
        f"{__file__} so the list only shrinks:\n{_fmt(gone)}")


def test_no_new_circle():
    edges = import_graph(type_only=False)
    kept = {a: {b for b in bs if (short(a), short(b)) not in ALLOWED} for a, bs in edges.items()}
    now = [frozenset(c) for c in circles(kept)]
    allowed = [frozenset(c) for c in ALLOWED_CIRCLES]
    new = [c for c in now if c not in allowed]
    assert not new, "import circle(s) not in ALLOWED_CIRCLES (new, or grown):\n" + "\n".join(
        f"  {len(c)} modules: {sorted(c)}" for c in new) + (
        "\nBreak the circle: the lower module owns a registry the upper one fills on import; "
        "if a listed circle only shrank, replace it in the list by what is printed here.")
    gone = [c for c in allowed if c not in now]
    assert not gone, (
        f"allowed circle(s) no longer exist as listed: update ALLOWED_CIRCLES in {__file__} to the "
        "circles left (the list only shrinks):\n" + "\n".join(f"  {sorted(c)}" for c in gone)
        + "\nnow:\n" + "\n".join(f"  {sorted(c)}" for c in now))


_MUTATORS = {"append", "remove", "clear", "extend", "insert", "pop", "update", "add", "discard", "setdefault"}


def private_writes(src: Path = SRC) -> list:
    """(module, line, target) of each write to another package module's private global: an
    assignment to ``mod._name`` (or an item of it) or a mutating call on it, ``mod`` being a
    package module imported by name.  Such a write is a hidden protocol between the two;
    the seam (dist.comm.hooks) and registries are the explicit form (issue 29)."""
    mods = modules(src)
    out = []
    for name, path in mods.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        alias = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                m = (".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                     if node.level else (node.module or ""))
                alias.update({a.asname or a.name: f"{m}.{a.name}" for a in node.names if f"{m}.{a.name}" in mods})
            elif isinstance(node, ast.Import):
                alias.update({a.asname: a.name for a in node.names if a.name in mods and a.asname})

        def foreign(n) -> bool:
            return (isinstance(n, ast.Attribute) and n.attr.startswith("_") and isinstance(n.value, ast.Name)
                    and alias.get(n.value.id, name) != name)

        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                t = t.value if isinstance(t, ast.Subscript) else t
                if foreign(t):
                    out.append((short(name), node.lineno, ast.unparse(t)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                    and foreign(node.func.value)):
                out.append((short(name), node.lineno, ast.unparse(node.func)))
    return out


def test_no_module_writes_another_modules_private_globals():
    bad = private_writes()
    assert not bad, ("module(s) write another module's private globals (fill a slot of dist.comm.hooks.SEAM or "
                     "call a registration function of the lower module instead):\n"
                     + "\n".join(f"  {m}:{line}: {t}" for m, line, t in bad))


def test_dist_works_without_the_layers_above():
    # The distributed core imported without the package root (which imports every layer):
    # nothing above dist is imported, DTensor ops and collectives work, and autodiff imported
    # afterwards plugs in (dist.comm.hooks) and differentiates through them.
    code = """
import importlib.util, sys, types
import numpy as np
stub = types.ModuleType("tessera_rt")
stub.__path__ = list(importlib.util.find_spec("tessera_rt").submodule_search_locations)
sys.modules["tessera_rt"] = stub          # tessera_rt/__init__.py (every layer) is not run
from tessera_rt import dist, kernels
low = ("dist", "kernels", "backend", "cpu_streams", "dtypes", "formatting", "runtime", "deprecation", "upper", "dirlock")
above = sorted(m for m in sys.modules if m.startswith("tessera_rt.") and m.split(".")[1] not in low)
assert not above, above
mesh = dist.Mesh(axes=["tp"], shape={"tp": 1})
a = np.arange(6.).reshape(2, 3)
X = dist.distribute(a, layout=dist.ShardSpec(partition=("row",), mesh_axes=("tp",)), mesh=mesh)
assert np.allclose(((X * X + X) @ X.T).full_tensor(), (a * a + a) @ a.T)
assert np.allclose(dist.all_gather(X, axis="tp").to_local(), a)
assert np.allclose(dist.all_reduce(np.ones(2)), 1)
from tessera_rt.kernels.numerics import numeric
with numeric(deterministic=True):                 # the kernels' policy enters dist's mode
    assert dist.is_deterministic()
assert not dist.is_deterministic()
from tessera_rt import op                         # the op layer: traced values' operators, math VJP rules
from tessera_rt.autodiff import grad
g = grad(lambda W: dist.all_gather(W * W, axis="tp").sum())(X)
assert np.allclose(g.full_tensor(), 2 * a), g.full_tensor()
print("ok")
"""
    import subprocess
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_scanner_sees_lazy_and_relative_imports(tmp_path):
    # the scanner itself: an import inside a function, a relative one, a package import
    pkg = tmp_path / PKG
    (pkg / "dist").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "op.py").write_text("")
    (pkg / "dist" / "__init__.py").write_text("")
    (pkg / "dist" / "a.py").write_text("def f():\n    from ..op import x\n    from . import b\n")
    (pkg / "dist" / "b.py").write_text("from tessera_rt.dist import a\nfrom tessera_rt import dist\n")
    (pkg / "dist" / "c.py").write_text("from . import _ext\n")
    (pkg / "dist" / "_ext.c").write_text("/* a C extension */\n")
    e = import_graph(tmp_path)
    assert e[f"{PKG}.dist.c"] == {f"{PKG}.dist._ext"}          # the extension, not its package
    assert e[f"{PKG}.dist.a"] == {f"{PKG}.op", f"{PKG}.dist.b"}
    assert e[f"{PKG}.dist.b"] == {f"{PKG}.dist.a", f"{PKG}.dist"}
    assert upward_arrows(e) == {("dist.a", "op")}
    assert circles(e) == [["dist.a", "dist.b"]]
    # a type-only import: an arrow for the layers (no hint points up), no circle
    (pkg / "dist" / "t.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from . import u\n    from ..op import y\n")
    (pkg / "dist" / "u.py").write_text("from . import t\n")
    e = import_graph(tmp_path)
    assert e[f"{PKG}.dist.t"] == {f"{PKG}.dist.u", f"{PKG}.op"}
    assert ("dist.t", "op") in upward_arrows(e) and ["dist.t", "dist.u"] in circles(e)
    e = import_graph(tmp_path, type_only=False)
    assert e[f"{PKG}.dist.t"] == set() and ["dist.t", "dist.u"] not in circles(e)
    (pkg / "dist" / "t.py").unlink()
    (pkg / "dist" / "u.py").unlink()
    (pkg / "dist" / "d.py").write_text("from . import b as B\nB._x = 1\nB._seen.append(2)\nB.public = 3\n")
    assert private_writes(tmp_path) == [("dist.d", 2, "B._x"), ("dist.d", 3, "B._seen.append")]


def test_dist_floors_are_layers():
    # inside dist an arrow points down the floors too: the collectives (dist.comm) never
    # import a checker or the DTensor layer; a checker plugs into dist.comm.hooks instead
    c, k, t = (f"{PKG}.dist.{s}.m" for s in ("comm", "checks", "tensor"))
    assert layer(f"{PKG}.dist.comm") == layer(c) < layer(k) < layer(t) < layer(f"{PKG}.dist.ccl.line") \
        < layer(f"{PKG}.dist.checkpoint.files") < layer(f"{PKG}.dist") < layer(f"{PKG}.autodiff")
    assert upward_arrows({c: {k, t}, k: {c}, t: {c, k}}) == {("dist.comm.m", "dist.checks.m"),
                                                           ("dist.comm.m", "dist.tensor.m")}
