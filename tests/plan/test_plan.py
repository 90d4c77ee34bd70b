"""The mesh planner's memory and time models (tessera_rt.plan): hand-computed values on a
small spec, the runtime's own parameter and activation bytes, the seeds' recipes ranked
with their reasons, the CLI's JSON, and the errors for bad input."""
import io
import json
import math
import os
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from tessera_rt import dist, nn, op, optim, plan
from tessera_rt.plan import cli
from tessera_rt.plan.measure import local_bytes, runtime_counts, traced_activation_bytes
from tessera_rt.plan.plot import pareto_frontier

pytestmark = pytest.mark.timeout(120)

TINY = plan.ModelSpec("tiny", vocab=10, d_model=8, n_layers=2, n_heads=2, ffn_hidden=16, seq_len=4, dtype="f32",
                      batch=4, act_coeffs=(1.0, 2.0, 3.0, 0.0), act_outside=(1.0, 1.0, 0.0))


def test_tiny_params_by_hand():
    # per layer: q, o 8x8, k, v 8x8 (kv heads = heads), 2 norms of 8, SwiGLU 3 x 8 x 16
    layer = 4 * 64 + 2 * 8 + 3 * 8 * 16
    embed = 10 * 8 + 8 * 10 + 8                 # table, head, final norm
    assert TINY.total_params() == 2 * layer + embed
    # tp=2: attention and MLP halve, norms stay; vocab 10 -> 5 rows each
    got = plan.param_counts(TINY, plan.ParallelConfig(tp=2))
    assert got["total"] == 2 * (4 * 32 + 2 * 8 + 3 * 8 * 8) + 5 * 8 + 8 * 5 + 8


def test_tiny_memory_by_hand():
    c = plan.get_cluster("nvl72")
    lay = plan.ParallelConfig(tp=1, dp=1, micro_batch=4)
    mem = plan.memory_per_gpu(TINY, c, lay, workload="train", batch=4, seq=4)
    n = TINY.total_params()
    assert mem["params"] == n * 4 and mem["grads"] == n * 4
    assert mem["optimizer"] == n * 8            # f32: masters alias the params; two moments
    tokens = 16
    per_layer = 1 * 8 + 2 * 8 + 3 * 16          # act_coeffs against d, d/tp, f/tp
    outside = 1 * 8 + 1 * 10
    assert mem["activations"] == tokens * 4 * (2 * per_layer + outside)
    # remat every block keeps one d-vector per token per layer, plus one block's transient
    lay_r = plan.ParallelConfig(micro_batch=4, remat="every")
    mem_r = plan.memory_per_gpu(TINY, c, lay_r, workload="train", batch=4, seq=4)
    assert mem_r["activations"] == tokens * 4 * (2 * 8 + outside)
    assert mem_r["transient"] == tokens * 4 * per_layer
    # bf16 training: 2 + 2 bytes of params and grads, 4 + 8 of masters and moments
    bf = plan.ModelSpec(**{**TINY.to_dict(), "dtype": "bf16"})
    mem_b = plan.memory_per_gpu(bf, c, lay, workload="train", batch=4, seq=4)
    assert (mem_b["params"] + mem_b["grads"] + mem_b["optimizer"]) / n == 16


def test_decode_kv_cache_by_hand():
    m = plan.get_model("llama3-70b")
    c = plan.get_cluster("galaxy")
    # tp=8: one of the 8 kv heads per GPU; tp=32: kv heads replicated, still one per GPU
    for tp, dp in ((8, 4), (32, 1)):
        mem = plan.memory_per_gpu(m, c, plan.ParallelConfig(tp=tp, dp=dp), workload="decode", batch=32, seq=1024)
        assert mem["kv_cache"] == 2 * 80 * 1 * 128 * (32 // dp) * 1024 * 2
        assert mem["grads"] == mem["optimizer"] == 0


def test_presets_match_published_sizes():
    assert plan.get_model("llama3-8b").total_params() == pytest.approx(8.03e9, rel=0.005)
    assert plan.get_model("llama3-70b").total_params() == pytest.approx(70.6e9, rel=0.005)
    moe = plan.get_model("sr-moe")
    assert (moe.n_experts, moe.n_heads, moe.d_model, moe.capacity_factor) == (4096, 128, 8192, 1.25)
    assert plan.get_model("char").total_params() == 149_696          # BENCHMARKS.md, issue 6
    nvl = plan.get_cluster("nvl72")
    assert nvl.n_gpus == 72 and nvl.link_bw * 2 == pytest.approx(1.8e12) and nvl.host_tier_bytes > 0
    assert plan.get_cluster("galaxy").grid == (8, 4)


@pytest.mark.parametrize("remat", ["none", "every_other", "all"])
def test_memory_model_matches_the_runtime(remat):
    """Parameter and activation bytes of the real nn.Transformer (train.py's model) against
    the `char` preset's prediction, within 10%."""
    spec = plan.get_model("char")
    # on a one-rank mesh, as train.py runs it (DTensors: plain arrays take the fused loss)
    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": 1, "tp": 1})
    model = nn.Transformer(spec.vocab, spec.d_model, spec.n_heads, spec.n_layers, spec.seq_len, remat=remat, mesh=mesh)
    params = model.init(0)
    rng = np.random.default_rng(0)
    x, y = (model.batch(rng.integers(0, spec.vocab, (8, spec.seq_len))) for _ in range(2))
    lay = plan.ParallelConfig(micro_batch=8, remat={"all": "every"}.get(remat, remat))
    mem = plan.memory_per_gpu(spec, plan.get_cluster("local"), lay, workload="train", batch=8, seq=spec.seq_len)
    assert local_bytes(params) == mem["params"]
    measured = traced_activation_bytes(model.loss, params, x, y)
    assert measured == pytest.approx(mem["activations"], rel=0.10), (measured, mem["activations"])


def test_bus_factors_and_algorithms():
    c = plan.get_cluster("nvl72")
    bw = c.link_bw * c.links * c.bw_efficiency
    big = 1 << 30
    for op_, fac in (("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8), ("reduce_scatter", 7 / 8)):
        t, algo = plan.collective_time(c, op_, big, 8, algorithm="ring")
        steps = 2 if op_ == "all_reduce" else 1
        assert t == pytest.approx(steps * 7 * c.alpha + big * fac / bw)
    assert plan.collective_time(c, "all_reduce", 1 << 10, 64)[1] == "tree"      # latency-bound
    assert plan.collective_time(c, "all_reduce", 1 << 30, 64)[1] == "ring"      # bandwidth-bound
    g = plan.get_cluster("galaxy")
    assert plan.collective_time(g, "all_reduce", 1 << 20, 32, span=2)[1] == "hierarchical"
    with pytest.raises(ValueError, match="not available"):
        plan.collective_time(c, "all_gather", 1024, 8, algorithm="tree")


def test_pipeline_bubble_per_schedule():
    m, c = plan.get_model("llama3-8b"), plan.get_cluster("nvl72")
    kw = dict(workload="train", batch=64, seq=2048)
    one = plan.step_time(m, c, plan.ParallelConfig(tp=4, pp=2, dp=9, micro_batch=1), **kw)
    inter = plan.step_time(m, c, plan.ParallelConfig(tp=4, pp=2, dp=9, micro_batch=1, schedule="interleaved"), **kw)
    assert one["n_micro"] == 64 // 9 + 1
    assert one["pp_bubble"] == pytest.approx(one["per_microbatch"])     # (pp - 1) micro-batch slots
    assert one["compute"] > one["n_micro"] * one["per_microbatch"]      # + the optimizer
    assert inter["pp_bubble"] == pytest.approx(one["pp_bubble"] / 2)
    # memory: 1F1B keeps pp micro-batches in flight on stage 0, GPipe all of them
    n = one["n_micro"]
    mem = {s: plan.memory_per_gpu(m, c, plan.ParallelConfig(tp=4, pp=2, dp=9, micro_batch=1, schedule=s), workload="train",
                                  batch=64, seq=2048, n_micro=n)["activations"] for s in ("1f1b", "gpipe")}
    assert mem["gpipe"] == pytest.approx(mem["1f1b"] * n / 2)


def test_sr_moe_recipes_ranked_with_reasons():
    cands = plan.recipes("sr-moe", "nvl72", "train")
    by = {c.label.split()[0]: c for c in cands}
    best = next(c for c in cands if c.label == "planner's best")
    a, b = by["A"], by["B"]
    assert a.feasible and b.feasible and best.feasible
    # recipe C as written multiplies to 144 GPUs: named, not silently run on 72
    c_written = next(c for c in cands if "as written" in c.label)
    assert not c_written.feasible and "144" in c_written.violations[0]
    assert any(c.label.startswith("C'") and c.feasible for c in cands)
    for c in cands:
        if c.feasible:
            assert best.step_time["total"] <= c.step_time["total"] + 1e-12
            assert c.memory["total"] <= 186e9 and 4096 / c.ep >= 128
    # B beats A: tp=8 splits 128 heads evenly and its tp all-reduces span 8 GPUs, not 12
    assert b.step_time["total"] < a.step_time["total"]
    assert b.step_time["tp_comm"] < a.step_time["tp_comm"]
    assert any("11 heads" in w for w in a.why)


def test_galaxy_decode_planner_vs_seed():
    pol = op.numeric(dtype="fp8_e4m3")
    cands = plan.recipes("llama3-70b", "galaxy", "decode", batch=32, seq=8192, policy=pol)
    seed = next(c for c in cands if c.label.startswith("seed 004"))
    best = next(c for c in cands if c.label == "planner's best")
    assert seed.mesh_shape == {"tp": 32, "ep": 1, "pp": 1, "dp": 1} and seed.feasible
    assert best.step_time["total"] <= seed.step_time["total"]
    # 8 kv heads: beyond tp=8 each GPU keeps a replicated head, so the seed's tp=32 holds
    # the whole batch's cache on every GPU; a dp split halves it
    if best.dp > 1:
        assert best.memory["kv_cache"] < seed.memory["kv_cache"]


def test_search_is_sorted_and_frontier():
    cands = plan.search("llama3-8b", "nvl72", "train", batch=72, seq=4096)
    feas = [c for c in cands if c.feasible]
    assert feas and cands[0].feasible
    assert [c.step_time["total"] for c in feas] == sorted(c.step_time["total"] for c in feas)
    assert all(c.tp * c.ep * c.pp * c.dp == 72 for c in cands)
    front = pareto_frontier(cands)
    assert front[-1].step_time["total"] == feas[0].step_time["total"]
    assert all(x.memory["total"] <= y.memory["total"] and x.step_time["total"] > y.step_time["total"]
               for x, y in zip(front, front[1:]))


def _run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_json_schema():
    rc, out, _ = _run_cli(["--model", "sr-moe", "--cluster", "nvl72", "--recipes", "--top", "3", "--json"])
    assert rc == 0
    rows = json.loads(out)
    assert len(rows) >= 4
    for r in rows:
        for k in ("tp", "ep", "pp", "dp", "feasible", "params_per_gpu", "memory_bytes", "step_time_s"):
            assert k in r
        assert set(r["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "kv_cache", "buffers",
                                          "total"}
        assert set(r["step_time_s"]) >= {"compute", "tp_comm", "ep_comm", "pp_bubble", "dp_comm", "exposed", "total"}
        assert r["tp"] * r["ep"] * r["pp"] * r["dp"] in (72, 144)
        assert math.isclose(r["memory_bytes"]["total"], sum(v for k, v in r["memory_bytes"].items()
                                                            if k not in ("total", "host_tier")), rel_tol=1e-9)


def test_cli_plot(tmp_path, monkeypatch):
    """--plot draws every candidate once (feasible and infeasible ones apart, the recipes starred
    and labelled), the feasible frontier and the HBM line, with its axes named, and the PNG is a
    real picture, not a blank page.  llama3-70b on nvl72 has infeasible candidates to draw."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from matplotlib.image import imread
    drawn, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: (drawn.append(self), save(self, *a, **kw))[1])
    path = tmp_path / "plan.png"
    rc, out, _ = _run_cli(["--model", "llama3-70b", "--cluster", "nvl72", "--recipes", "--plot", str(path)])
    assert rc == 0 and f"wrote {path}" in out
    everything = plan.search("llama3-70b", "nvl72", require_feasible=False)
    recipes = plan.recipes("llama3-70b", "nvl72")
    assert any(not k.feasible for k in everything) and any(k.feasible for k in everything)
    (fig,) = drawn
    (ax,) = fig.axes
    assert ax.get_title() == "llama3-70b on nvl72 (train)"
    assert ax.get_xlabel() == "memory per GPU (GB)" and ax.get_ylabel() == "predicted step time (ms)"
    assert ax.get_yscale() == "log"
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"feasible", "infeasible", "feasible frontier", "HBM per GPU"} <= legend, legend
    by_label = {c.get_label(): len(c.get_offsets()) for c in ax.collections}
    assert by_label["feasible"] == sum(k.feasible for k in everything), by_label
    assert by_label["infeasible"] == sum(not k.feasible for k in everything), by_label
    points = sum(len(c.get_offsets()) for c in ax.collections)
    assert points == len(everything) + len(recipes)                      # every candidate, once
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    want = [c.memory["total"] / 1e9 for c in pareto_frontier(recipes + everything)]
    assert list(lines["feasible frontier"].get_xdata()) == pytest.approx(want)
    assert list(lines["HBM per GPU"].get_xdata()) == pytest.approx([186.0, 186.0])
    notes = [t.get_text() for t in ax.texts]
    assert len(notes) == len(recipes) and all(sum(n.startswith(f"{k.label}: ") for n in notes) == 1
                                              for k in recipes), notes      # each recipe labelled once
    png = imread(str(path))
    assert png.shape[0] >= 400 and png.shape[1] >= 600, png.shape
    ink = (png[..., :3] < 0.95).any(axis=-1).mean()                     # pixels that are not white
    assert ink > 0.02, ink


def test_model_that_cannot_fit():
    with pytest.raises(ValueError) as e:
        plan.search("llama3-70b", "galaxy", "train", batch=32, seq=8192)
    msg = str(e.value)
    assert "does not fit" in msg and "GB over" in msg and "To fit" in msg and "GPUs" in msg
    rc, _, err = _run_cli(["--model", "llama3-70b", "--cluster", "galaxy", "--workload", "train"])
    assert rc == 2 and "does not fit" in err


def test_bad_cluster_and_mesh(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"name": "x", "n_gpus": 8, "hbm_bytes": 80e9, "flops": {"bf16": 1e15}}))
    with pytest.raises(ValueError, match=r"missing \['hbm_bw', 'link_bw', 'alpha'\]"):
        plan.get_cluster(str(bad))
    rc, _, err = _run_cli(["--model", "llama3-8b", "--cluster", str(bad)])
    assert rc == 2 and "missing" in err
    with pytest.raises(ValueError, match="= 64 GPUs but cluster 'nvl72' has 72"):
        plan.evaluate("llama3-8b", "nvl72", tp=8, dp=8)
    rc, _, err = _run_cli(["--model", "llama3-8b", "--cluster", "nvl72", "--mesh", "tp=8,dp=8"])
    assert rc == 2 and "product is 72" in err
    with pytest.raises(ValueError, match="has no experts"):
        plan.evaluate("llama3-8b", "nvl72", tp=8, ep=9)
    with pytest.raises(ValueError, match="axis=N"):
        cli.parse_mesh("tp=8,xx=2")
    with pytest.raises(ValueError, match="must divide"):
        plan.ModelSpec("m", vocab=8, d_model=8, n_layers=1, n_heads=4, n_kv_heads=3, ffn_hidden=8)
    with pytest.raises(ValueError, match="unknown model"):
        plan.get_model("llama9")
    # the command line's errors name its flags, not the Python API's arguments
    rc, _, err = _run_cli(["--model", "llama9", "--cluster", "local"])
    assert rc == 2 and "error: --model llama9: unknown model 'llama9'; pass --model a preset (" in err, err
    rc, _, err = _run_cli(["--model", "char", "--cluster", "nowhere.json"])
    assert rc == 2 and "error: --cluster nowhere.json: nowhere.json: no such file" in err, err


@pytest.mark.parametrize("argv", [["--seq", "-4096"], ["--seq", "0"], ["--batch", "0"], ["--batch", "-4"],
                                  ["--batch", "4.5"], ["--micro-batch", "0"], ["--top", "-1"],
                                  ["--calibrate", "--ranks", "1,2"]])
def test_cli_numeric_flags_are_checked_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "char", "--cluster", "local", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"tessera-plan: error: argument {argv[-2]}: ") and argv[-1].split(",")[0] in err, err
    with pytest.raises(ValueError, match="seq=-4096 must be a positive int"):
        plan.evaluate("char", "local", dp=4, seq=-4096)


# the CPU-rank terms of the time model (validated against train.py by scripts/validate_plan.py)
def _host(**kw):
    base = dict(n_gpus=4, hbm_bytes=24e9, hbm_bw=5e9, flops={"f32": 1e11}, link_bw=2e9, alpha=50e-6,
                topology="host", op_overhead_s=15e-6, cores=0, overlap=0.0, dp_overlap=1.0, bw_efficiency=1.0)
    return plan.Cluster("host", **{**base, **kw})


def _train(spec, cluster, **lay):
    return plan.step_time(spec, cluster, plan.ParallelConfig(**lay), workload="train", batch=spec.batch, seq=spec.seq_len)


def test_per_op_cost_adds_its_count_to_the_step():
    spec = plan.get_model("char")
    a, b = (_train(spec, _host(op_overhead_s=s), micro_batch=8) for s in (10e-6, 20e-6))
    # every op the step runs pays it once: forward and backward per block and outside, and on CPU
    # ranks one fused AdamW pass and clip_grad_norm's two per tensor (22 tensors)
    ops = (spec.n_layers * (spec.ops_per_layer + spec.bwd_ops_per_layer) + spec.ops_outside + spec.bwd_ops_outside
           + 22 * 3)
    assert b["total"] - a["total"] == pytest.approx(ops * 10e-6)


def _one_rank_mesh(spec):
    """The axes train.py gives the model (ep for experts), one rank."""
    axes = ["dp", "ep", "tp"] if spec.n_experts else ["dp", "tp"]
    return dist.Mesh(axes=axes, shape={a: 1 for a in axes})


@pytest.mark.parametrize("model", ["char", "char-moe"])
def test_op_counts_are_the_runtimes(model):
    """The counts the per-op cost prices are the profiler's counts of the model as the runtime
    runs it (one-rank mesh, as train.py): a kernel fusion that changes them turns this red
    instead of leaving the planner stale.  tp all-reduces and all_to_alls: mpi_plan.py."""
    spec = plan.get_model(model)
    got = runtime_counts(spec, _one_rank_mesh(spec))
    want = {k: getattr(spec, k) for k in ("ops_per_layer", "ops_outside", "bwd_ops_per_layer", "bwd_ops_outside")}
    assert {k: got[k] for k in want} == want


def test_optimizer_passes_per_tensor_are_the_runtimes(monkeypatch):
    """AdamW's and clip_grad_norm's passes on CPU ranks as step_time prices them: per
    parameter tensor one fused AdamW pass, one sum of squares and one in-place scale, counted on
    train.py's models (they run on the local pieces: the profiler sees none).  The GPU's fixed
    launches a step (OPT_OPS_PER_STEP["device"]): tests/training/test_gpu_training.py."""
    from collections import Counter

    from tessera_rt.autodiff.engine import tree_flatten, tree_unflatten
    from tessera_rt.kernels import cpu_fused
    from tessera_rt.plan import timing
    for name in ("char", "char-moe"):          # every tensor step_time counts
        spec = plan.get_model(name)
        moe = dict(num_experts=spec.n_experts) if spec.n_experts else None
        m = nn.Transformer(spec.vocab, spec.d_model, spec.n_heads, spec.n_layers, spec.seq_len, moe=moe,
                           mesh=_one_rank_mesh(spec))
        params = m.init(0)
        leaves, _, struct = tree_flatten(params)
        assert len(leaves) == timing.param_tensors(spec, spec.n_layers, spec.n_moe_layers), name
    n = len(leaves)
    grads = lambda: tree_unflatten(struct, [op.mul(p, 0.5) for p in leaves])
    opt = optim.AdamW(params, lr=1e-3)
    # a first step and clip compile the fused kernels unpatched: Numba reads NumPy's ufuncs when
    # it first compiles or loads one, and np.multiply must be the ufunc then (run alone, this
    # test was the first to compile)
    opt.step(params, grads())
    optim.clip_grad_norm(grads(), 1e-9, in_place=True)
    calls = Counter()
    for mod, fn, key in ((cpu_fused, "adamw_step", "adamw"), (np, "multiply", "np")):
        orig = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _o=orig, _k=key, **kw: calls.update([_k]) or _o(*a, **kw))
    opt.step(params, grads())
    assert calls["adamw"] == n
    g = grads()
    calls.clear()
    optim.clip_grad_norm(g, 1e-9, in_place=True)        # a sum of squares and a scale per tensor
    assert calls["np"] == 2 * n
    assert timing.OPT_OPS_PER_TENSOR["host"] == 3 and timing.OPT_OPS_PER_STEP["host"] == 0


def test_oversubscription_and_lockstep_share():
    spec = plan.get_model("char")
    lay = dict(tp=1, dp=4, micro_batch=2)
    one_core_each = _train(spec, _host(cores=4), **lay)["compute"]
    two_cores = _train(spec, _host(cores=2), **lay)["compute"]
    assert two_cores == pytest.approx(2 * one_core_each)          # 4 ranks on 2 cores: half a core each
    # where ranks meet inside the compute (tp), a calibrated share of 4 ranks in lockstep
    # replaces the core count (it measured both)
    tp = dict(tp=2, dp=2, micro_batch=4)
    locked = _train(spec, _host(cores=2, measured={"lockstep_share": {"4": 0.25}}), **tp)["compute"]
    assert locked == pytest.approx(2 * _train(spec, _host(cores=2), **tp)["compute"])
    # ... for the group size it was measured at only, and not for data ranks or pipeline stages
    assert _train(spec, _host(cores=2, measured={"lockstep_share": {"2": 0.25}}), **tp)["compute"] \
        == pytest.approx(_train(spec, _host(cores=2), **tp)["compute"])
    for other in (lay, dict(pp=2, dp=2, micro_batch=1)):
        assert _train(spec, _host(cores=2, measured={"lockstep_share": {"4": 0.25}}), **other)["compute"] \
            == pytest.approx(_train(spec, _host(cores=2), **other)["compute"])


def test_blocking_syncs_are_never_hidden():
    spec = plan.get_model("char")
    t1 = _train(spec, _host(), micro_batch=8)
    t = _train(spec, _host(), dp=2, micro_batch=4)
    assert t1["sync"] == 0.0
    # clip_grad_norm's float64 over all ranks and the loss read over dp (2 ring steps of alpha
    # each at 2 ranks, 8 + 4 bytes), exposed although the gradient all-reduces hide behind the
    # backward (dp_overlap=1)
    assert t["sync"] == pytest.approx(4 * 50e-6 + 12 / 2e9, rel=1e-6)
    assert t["exposed"] == pytest.approx(t["sync"])


def test_char_moe_prices_its_all_to_alls():
    spec = plan.get_model("char-moe")
    t = _train(spec, _host(), ep=2, micro_batch=4)
    # 256 tokens (4 sequences of 64) x d x 4 bytes, x top-2 x capacity factor 1.25
    a2a = plan.collective_time(_host(), "all_to_all", 4 * 64 * 64 * 4 * 2 * 1.25, 2)[0]
    assert t["ep_comm"] == pytest.approx(spec.n_layers * 4 * a2a)
    # blocking, per block: the routing statistics (4 experts' loads, 4 totals in float64 over
    # the token axes), beside clip_grad_norm's float64 and the loss read
    stats = plan.collective_time(_host(), "all_reduce", 8 * 8, 2)[0]
    assert t["sync"] == pytest.approx(spec.n_layers * stats + plan.collective_time(_host(), "all_reduce", 8, 2)[0]
                                      + plan.collective_time(_host(), "all_reduce", 4, 2)[0])
    assert plan.param_counts(spec, plan.ParallelConfig(ep=2))["expert"] == spec.n_layers * 2 * 3 * 64 * 256


def test_calibration_of_the_op_mix_and_share():
    from tessera_rt import dist
    from tessera_rt.plan.calibrate import measure_lockstep_share, measure_op_cost
    dist.init()
    mesh = dist.Mesh(axes=["dp"], shape={"dp": 1}, devices=[dist.init().rank])
    per_op, toy = measure_op_cost(mesh, reps=3)
    assert 1e-6 < per_op < 1e-3 and toy > 50 * per_op           # ~70 ops in the toy block (norm and SwiGLU backward fused)
    assert 0.0 < measure_lockstep_share(seconds=0.05) <= 1.0


def test_uneven_batch_is_gathered_and_run_whole():
    # batch 8 over dp=3: tessera_rt's reshape gathers the batch (30 all_gathers a step for
    # train.py's model) and every rank runs all 8 sequences; no gradient all-reduce
    spec = plan.get_model("char")
    one = _train(spec, _host(cores=4), micro_batch=8)
    three = _train(spec, _host(cores=4), dp=3, micro_batch=3)
    four = _train(spec, _host(cores=4), dp=4, micro_batch=2)
    assert three["dp_comm"] == 0.0 and three["batch_gather"] > 0.0 and four["batch_gather"] == 0.0
    assert three["compute"] == pytest.approx(one["compute"])                # the whole batch on each rank
    assert four["compute"] < 0.7 * one["compute"]          # a quarter of the arithmetic, all of the ops
    ag = plan.collective_time(_host(), "all_gather", 8 * 64 * 64 * 4, 3)[0]
    assert three["batch_gather"] > 22 * ag                                   # 22 of width d, 6 of f, 2 of vocab
    assert three["total"] > 1.5 * four["total"]


def test_calibration_times_its_parts_in_rounds():
    from tessera_rt.plan.calibrate import elementwise_bw, timed_rounds
    calls = []
    t = timed_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, calls=2)
    # one warm-up call each, then per round a's two timed calls (and _cpu_time's warm-up) before b's
    assert calls == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 3 and all(len(v) == 3 for v in t.values())
    rates = {"gemm": 5e10, "gemm_bwd": 5e10, "attention": 3e9, "attention_bwd": 4e9, "hbm_bw": 7e9}
    slow, fast = elementwise_bw(rates, 8e-3), elementwise_bw(rates, 6e-3)
    assert 0 < slow < fast                        # a block that takes longer leaves a lower rate
    assert elementwise_bw(rates, 1e-6) == 7e9    # nothing left after the math: op.add's rate


def test_measure_compute_on_one_rank():
    from tessera_rt import dist
    from tessera_rt.plan.calibrate import measure_compute
    dist.init()
    mesh = dist.Mesh(axes=["dp"], shape={"dp": 1}, devices=[dist.init().rank])
    c = measure_compute(reps=3, mesh=mesh)
    for k in ("gemm", "gemm_bwd", "attention", "attention_bwd", "hbm_bw"):
        assert 1e6 < c[k] < 1e13, (k, c[k])
    assert 1e-6 < c["op_overhead_s"] < 1e-3 and 0 < c["share"] <= 1.0 and 0 < c["lockstep_share"] <= 1.0


# ------------------------------------------------------------------ the planner's plans run
ROOT = Path(__file__).resolve().parents[2]
TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")
# a cluster file as a user writes one: 1024 H100s, no devices_per_node (tp may cross nodes)
H100 = dict(name="h100-1024", n_gpus=1024, hbm_bytes=80e9, hbm_bw=3.35e12, flops={"bf16": 989e12, "f32": 67e12},
            link_bw=450e9, alpha=5e-6)


@pytest.fixture
def uncalibrated(monkeypatch, tmp_path):
    """The `local` cluster's defaults (4 ranks), not this machine's calibration."""
    monkeypatch.setenv("TESSERA_PLAN_HOME", str(tmp_path))


def _runtime_rules(m, k) -> list:
    """pipeline.schedules.layout_problems with the flags the candidate's command passes."""
    from tessera_rt.pipeline.schedules import layout_problems
    return layout_problems(n_layers=m.n_layers, pp=k.pp, microbatches=k.step_time["n_micro"],
                           schedule=k.config.schedule, virtual=2 if k.config.schedule == "interleaved" else 1,
                           batch=m.batch, rows_multiple=k.dp * k.ep if m.n_experts else 1, remat=k.config.remat,
                           moe=m.name == "char-moe")


# every preset model on every preset cluster (a rule the planner gets wrong may show on one pair
# only: dropping dp from the MoE rows rule marks char-moe/nvl72 layouts feasible), and a user's file
PAIRS = [(m, c) for m in plan.MODELS for c in [*plan.CLUSTERS, "local"]] + [("llama3-70b", {**H100, "devices_per_node": 8})]


@pytest.mark.parametrize("model,cluster", PAIRS, ids=[f"{m}-{c if isinstance(c, str) else c['name']}" for m, c in PAIRS])
def test_search_ranks_only_what_the_runtime_runs(model, cluster, uncalibrated):
    m, c = plan.get_model(model), plan.get_cluster(cluster)
    cands = plan.search(m, c, require_feasible=False)
    assert cands and (cands[0].feasible or not any(k.feasible for k in cands))     # feasible ones first
    for k in cands:
        rules = _runtime_rules(m, k)
        assert (k.feasible and not rules) or (not k.feasible and set(rules) <= set(k.violations)), (k.config, rules)
        if c.devices_per_node:                               # tp stays inside a node
            assert k.tp <= c.devices_per_node, k.config


@pytest.mark.parametrize("flags", [["--experts", "4", "--remat", "every_other"],
                                   ["--microbatches", "9", "--batch", "8"],
                                   ["--layers", "3", "--schedule", "interleaved", "--microbatches", "2"]])
def test_train_py_refuses_with_the_shared_rules(flags):
    """train.py stops on what layout_problems refuses, with its words and the flags to change
    (before: a ValueError from deep in nn or the pipeline).  tests/plan/mpi_plan.py: the MoE
    rows rule and the Pipeline's refusal on several ranks."""
    from tessera_rt.pipeline.schedules import layout_problems
    sys.path.insert(0, str(ROOT / "scripts"))
    import train
    a = train.parse_args(flags + ["--steps", "1", "--quiet", "--no-plot", "--no-checkpoint"])
    piped = a.pp > 1 or a.microbatches > 0
    virtual = a.virtual_stages if piped and a.schedule == "interleaved" else 1
    want = layout_problems(n_layers=a.layers, pp=a.pp, microbatches=a.microbatches or 1, schedule=a.schedule,
                           virtual=virtual, batch=a.batch, rows_multiple=1, remat=a.remat, moe=bool(a.experts))
    assert want
    with pytest.raises(SystemExit) as e:
        train.train(a)
    assert str(e.value).startswith("train.py: ") and all(w in str(e.value) for w in want), str(e.value)


def test_cli_commands_notes_and_table(uncalibrated, tmp_path):
    f = tmp_path / "h100.json"
    f.write_text(json.dumps(H100))
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--model", "llama3-70b", "--cluster", str(f), "--top", "3", "--json"]) == 0
    assert all("YOUR_SCRIPT.py --tp" in k["command"] for k in json.loads(out.getvalue()))
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--model", "llama3-70b", "--cluster", str(f), "--top", "3"]) == 0
    text = out.getvalue()
    assert "gives no devices_per_node, so tp may cross nodes" in text and "global batch 32 sequences" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--model", "sr-moe", "--cluster", "nvl72", "--recipes", "--top", "3"]) == 0
    text = out.getvalue()
    labels = [k.label for k in plan.recipes("sr-moe", "nvl72")]
    assert all(f"\n{label} " in text for label in labels), text            # whole labels
    assert "e+0" not in text and "e-0" not in text                         # ms or s, no exponents
    assert "(no: tp*ep*pp*dp = 144" in text                                # an infeasible row says why


def _planned_flags(k: dict, model: str, batch: int) -> dict:
    """The flags a candidate's launch line must carry to run the layout it was priced for:
    its mesh, batch and remat, and its schedule and micro-batches whenever it has more than one
    micro-batch or stage (train.py would run one otherwise)."""
    want = {"--tp": k["tp"], "--dp": k["dp"], "--pp": k["pp"], "--batch": batch,
            "--remat": {"none": "none", "every_other": "every_other", "every": "all"}[k["remat"]]}
    if k["ep"] > 1 or model == "char-moe":
        want["--ep"] = k["ep"]
    if k["pp"] > 1 or k["n_micro"] > 1:
        want.update({"--schedule": k["schedule"], "--microbatches": k["n_micro"]})
    return {f: str(v) for f, v in want.items()}


def _reported_layout(k: dict, model: str, batch: int) -> str:
    """The line train.py prints for the layout it runs, as the candidate says it should."""
    ep = k["ep"] if model == "char-moe" else 1
    line = (f"train.py: layout tp={k['tp']} dp={k['dp']} pp={k['pp']} ep={ep}, batch {batch}, remat "
            + _planned_flags(k, model, batch)["--remat"])
    if k["pp"] > 1 or k["n_micro"] > 1:
        line += f", schedule {k['schedule']}, microbatches {k['n_micro']}"
    return line


@pytest.mark.parametrize("model", ["char", "char-moe"])
def test_every_launch_line_carries_its_layout(model, uncalibrated):
    """Every candidate's ``"command"``, feasible or not, names its rank count and
    scripts/train.py and passes every flag of the layout it was priced for; char-moe has
    one-stage plans of several micro-batches, whose line without ``--microbatches`` would train
    them as one batch (test_planner_commands_run runs some and reads back what ran)."""
    rc, out, _ = _run_cli(["--model", model, "--cluster", "local", "--json", "--top", "0"])
    assert rc == 0
    every, batch = json.loads(out), plan.get_model(model).batch
    assert model == "char" or any(k["pp"] == 1 and k["n_micro"] > 1 for k in every)
    for k in every:
        cmd = shlex.split(k["command"])
        assert cmd[1:4] == ["-n", str(k["tp"] * k["ep"] * k["pp"] * k["dp"]), "scripts/train.py"], k["command"]
        given = dict(zip(cmd[4::2], cmd[5::2]))
        missing = {f: v for f, v in _planned_flags(k, model, batch).items() if given.get(f) != v}
        assert not missing, f"{k['command']}: lacks {missing}"


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["char", "char-moe"])
def test_planner_commands_run(model, uncalibrated, tmp_path, monkeypatch):
    """The top 3 candidates' launch lines, as tessera-plan --json prints them from the repository
    root, the best pipelined one's and a one-stage plan of several micro-batches: each runs as
    printed for 2 steps, and the run reports the layout it was planned for (mesh, batch, remat,
    schedule and micro-batches)."""
    from conftest import mpi_env
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--model", model, "--cluster", "local", "--json", "--top", "0"]) == 0
    m = plan.get_model(model)
    batch = m.batch
    cands = [k for k in json.loads(out.getvalue()) if k["feasible"]]
    picked = cands[:3] + [next(k for k in cands if k["pp"] > 1)]
    # and a one-stage plan of several micro-batches: the uncalibrated cluster ranks none feasible
    # (the seeds' rules refuse them, the runtime does not), so it is priced by hand
    one = plan.evaluate(m, "local", tp=1, ep=2 if m.n_experts else 1, dp=2 if m.n_experts else 4,
                        knobs=dict(micro_batch=1, remat="none"))
    assert one.pp == 1 and one.step_time["n_micro"] > 1 and not _runtime_rules(m, one), one.launch
    picked.append(one.to_json())
    for k in picked:
        cmd, n = shlex.split(k["command"]), k["tp"] * k["ep"] * k["pp"] * k["dp"]
        p = subprocess.run(["timeout", "-k", "5", "120"] + cmd + ["--steps", "2", "--log-every", "100", "--no-plot",
                                                                 "--no-checkpoint", "--out", str(tmp_path)],
                           cwd=ROOT, env=mpi_env(n), capture_output=True, text=True)
        assert p.returncode == 0, f"{k['command']}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        assert _reported_layout(k, model, batch) in p.stdout.splitlines(), f"{k['command']}\n{p.stdout[-2000:]}"


def test_the_launch_line_names_a_tessera_run_that_starts(monkeypatch, tmp_path):
    """A bare ``tessera-run`` only when the one on PATH is this Python's; else its path beside
    this Python, relative from inside the tree (``.venv/bin/tessera-run`` from the repository
    root); else ``python -m tessera_run``."""
    from tessera_rt.plan.search import tessera_run
    here = Path(sys.executable).parent / "tessera-run"
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", str(here.parent) + ":/usr/bin:/bin")
    assert tessera_run() == "tessera-run"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    want = os.path.relpath(here, ROOT)
    assert tessera_run() == (want if not want.startswith("..") else str(here))
    monkeypatch.chdir(tmp_path)                      # outside the tree: the whole path
    rel = os.path.relpath(here)
    assert tessera_run() == (rel if not rel.startswith("..") else str(here))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    assert tessera_run() == f"{tmp_path / 'python3'} -m tessera_run"


def test_an_uncalibrated_cluster_says_so(uncalibrated):
    rc, out, err = _run_cli(["--model", "char", "--cluster", "local", "--top", "1"])
    assert rc == 0 and "note: cluster 'local': uncalibrated defaults: run tessera-plan --calibrate" in out, out
    rc, out, err = _run_cli(["--model", "char", "--cluster", "local", "--top", "1", "--json"])
    assert rc == 0 and json.loads(out) and "uncalibrated defaults" in err, err
    rc, out, _ = _run_cli(["--model", "llama3-8b", "--cluster", "nvl72", "--top", "1"])
    assert rc == 0 and "uncalibrated" not in out
