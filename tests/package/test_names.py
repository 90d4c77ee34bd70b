"""One name per thing, and import what you use (issue 41).

* The renamed names (``ts.checkpoint`` -> ``ts.remat``, the two ``Plan``s, the planner's
  ``Layout``, ``inference.checkpoint`` -> ``inference.hf``, ``inference.llama_train`` ->
  ``models.llama``) are kept for one release: each old name warns, naming the new one, and
  gives the same object.
* ``import tessera_rt.dist`` loads the distributed core only, in a fresh process; the names
  that live above their home (``dist.Pipeline``, ``nn.Llama``) and ``nn.Transformer``'s parts
  from above (MoE, pipeline stages) arrive when their package is imported, and say which
  package to import before.
"""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("module, old, new", [
    ("tessera_rt", "checkpoint", "remat"),
    ("tessera_rt.autodiff", "checkpoint", "remat"),
    ("tessera_rt.autodiff.engine", "checkpoint", "remat"),
    ("tessera_rt.dist", "Plan", "RedistributionPlan"),
    ("tessera_rt.dist.tensor.redistribute", "Plan", "RedistributionPlan"),
    ("tessera_rt.dist.comm.plans", "Plan", "CallPlan"),
    ("tessera_rt.plan", "Layout", "ParallelConfig"),
    ("tessera_rt.plan.memory", "Layout", "ParallelConfig"),
])
def test_a_renamed_name_warns_and_works(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use \S*\b{new}\b"):
        got = getattr(mod, old)
    assert got is getattr(mod, new)
    assert old not in getattr(mod, "__all__", ()) and new in getattr(mod, "__all__", (new,))


def test_the_moved_training_model_warns_at_its_old_places_and_is_the_same():
    from tessera_rt import inference, models
    from tessera_rt.inference import runs
    for name in ("LlamaLM", "export_hf"):
        with pytest.warns(DeprecationWarning, match=rf"inference\.{name} is deprecated: use tessera_rt\.models\.{name}"):
            assert getattr(inference, name) is getattr(models, name)
    for old, check in (("tessera_rt.inference.llama_train",
                        lambda m: m.LlamaLM is models.LlamaLM and m.load_run is runs.load_run),
                       ("tessera_rt.inference.checkpoint",
                        lambda m: m.CheckpointReader is importlib.import_module("tessera_rt.inference.hf").CheckpointReader)):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"the module {old} is deprecated: use tessera_rt\."):
            mod = importlib.import_module(old)
        assert check(mod)


def test_a_planner_candidates_layout_is_its_config():
    from tessera_rt import plan
    k = plan.search(model="char", cluster="local", workload="train", batch=8)[0]
    with pytest.warns(DeprecationWarning, match=r"Candidate\.layout is deprecated: use Candidate\.config"):
        assert k.layout is k.config
    assert isinstance(k.config, plan.ParallelConfig)


def test_the_old_part_registry_warns_and_registers():
    from tessera_rt.moe.model import MoEMLP
    from tessera_rt.nn import parts
    with pytest.warns(DeprecationWarning, match=r"register_part\('MoEMLP', \.\.\.\) is deprecated: use nn\.parts\.register_moe_mlp"):
        parts.register_part("MoEMLP", MoEMLP)
    assert parts.PARTS.moe_mlp is MoEMLP


def test_importing_dist_loads_the_distributed_core_only():
    # a fresh process: tessera_rt/__init__.py runs as it does for any user
    out = _run("""
import sys
import tessera_rt.dist
layers = sorted({m.split(".")[1] for m in sys.modules if m.startswith("tessera_rt.")})
print(" ".join(layers))
""")
    assert set(out.split()) <= {"backend", "cpu_streams", "dtypes", "formatting", "runtime", "deprecation", "upper",
                                "dirlock", "kernels", "dist"}, out


def test_tessera_run_starts_without_the_distributed_core():
    # the launcher spawns mpiexec and watches its ranks: NumPy, MPI and the layers are the ranks' cost
    out = _run("""
import sys
import tessera_rt.launcher
print(" ".join(sorted(m for m in ("numpy", "mpi4py", "numba", "tessera_rt.dist", "tessera_rt.kernels")
                      if m in sys.modules)))
""")
    assert out.strip() == "", f"import tessera_rt.launcher loaded {out.strip()}"


def test_a_name_read_on_the_package_imports_every_layer():
    out = _run("""
import sys
import tessera_rt as ts
assert not any(m.startswith("tessera_rt.") for m in sys.modules), sorted(sys.modules)
ts.grad
from tessera_rt import dist, nn
# a CPU program never launches a Numba CUDA tile kernel: numba.cuda loads with the first one
assert "numba.cuda" not in sys.modules, "numba.cuda loaded by the import"
from tessera_rt.kernels import tile
tile.cuda_target()
assert "numba.cuda" in sys.modules
print(dist.Pipeline.__module__, nn.Llama.__module__, nn.KVCache.__module__)
from tessera_rt.nn.parts import PARTS
print(PARTS.moe_mlp.__module__, PARTS.stage_plan.__module__)
""")
    assert out.split() == ["tessera_rt.pipeline.runner", "tessera_rt.inference.llama", "tessera_rt.inference.kv_cache",
                           "tessera_rt.moe.model", "tessera_rt.pipeline.stages"], out


def test_a_part_from_above_says_which_package_to_import():
    out = _run("""
import tessera_rt.nn as nn
import tessera_rt.dist as dist
for what, f in (("moe", lambda: nn.Transformer(32, 16, 2, 1, 8, moe=dict(num_experts=2))),
                ("Pipeline", lambda: dist.Pipeline), ("Llama", lambda: nn.Llama)):
    try:
        f()
    except (RuntimeError, AttributeError) as e:
        print(what, "|", e)
""")
    lines = dict(line.split(" | ", 1) for line in out.splitlines())
    assert "import tessera_rt.moe first" in lines["moe"], out
    assert "import tessera_rt.pipeline first" in lines["Pipeline"], out
    assert "import tessera_rt.inference first" in lines["Llama"], out
