"""Enumerate mesh factorizations (tp, ep, pp, dp), price each with the memory and time
models, apply the seed's rules (seed 000 §6) and rank: feasible first, then by step time.

Per factorization the search also picks the knobs that only trade memory for time
(micro-batch, remat, pipeline schedule, optimizer offload to the host tier) and keeps the
fastest setting that fits, so each candidate is the best that factorization can do.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..pipeline.schedules import layout_problems
from .cluster import Cluster, get_cluster
from .memory import REMATS, ParallelConfig, memory_per_gpu
from .specs import ModelSpec, get_model
from .timing import duration, step_time

__all__ = ["Candidate", "search", "evaluate", "factorizations", "RECIPES", "recipes", "GB", "runtime_problems",
           "launch_command", "tessera_run", "TRAIN_PY_MODELS"]

# The models scripts/train.py builds, and the flags that build them (beside the mesh flags)
TRAIN_PY_MODELS = {"char": [], "char-moe": ["--experts", "4", "--capacity-factor", "1.25"]}
REMAT_FLAG = {"none": "none", "every_other": "every_other", "every": "all"}   # planner -> train.py --remat

GB = 1e9
ACT_KV_SHARE = 0.6          # seed 000 §6 rule 1: (A + K) <= 50-60% of HBM
MIN_EXPERTS_PER_GPU = 128   # rule 2: E / ep >= 128
REMAT_RATIO = 0.5           # rule 3: remat when A > 0.5 x the parameter shard

# Seed 000 §2.1 / §9 for 72 GPUs, and seed 004's tp along the whole 8x4 ring for decode
RECIPES = {
    "nvl72": {"A (attention-heavy)": (12, 6, 1, 1), "B (expert-heavy, SR-MoE)": (8, 9, 1, 1),
              "C (pipeline-friendly)": (8, 6, 3, 1)},
    "galaxy": {"seed 004 (tp over the 8x4 ring)": (32, 1, 1, 1)},
}


@dataclass
class Candidate:
    """One priced factorization (``evaluate`` makes it; ``search`` ranks them).

    Parameters
    ----------
    tp, ep, pp, dp : int
        The mesh factorization.
    feasible : bool
        Every rule holds (memory fits, divisibility).
    params_per_gpu : int
        Parameters on the busiest GPU.
    memory : dict
        ``memory_per_gpu``'s breakdown.
    step_time : dict
        ``step_time``'s breakdown.
    config : ParallelConfig
        The factorization with the knobs chosen (micro-batch, remat, schedule, offload).
    why : list of str
        Why it ranks where it does.
    violations : list of str
        The rules it breaks.
    label : str
        A recipe's name, when it is one.
    launch : str
        The launch line (``launch_command``), set by evaluate.
    """
    tp: int
    ep: int
    pp: int
    dp: int
    feasible: bool
    params_per_gpu: int
    memory: dict
    step_time: dict
    config: ParallelConfig
    why: list = field(default_factory=list)
    violations: list = field(default_factory=list)
    label: str = ""
    launch: str = ""                    # the launch line (launch_command), set by evaluate

    @property
    def layout(self) -> ParallelConfig:
        """``config``'s old name (deprecated: "layout" is a DTensor's placement)."""
        from ..deprecation import warn
        warn("Candidate.layout", "Candidate.config")
        return self.config

    @property
    def mesh_shape(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "dp": self.dp}

    def to_json(self) -> dict:
        """The candidate as JSON values (``tessera-plan --json``).

        Returns
        -------
        dict
            The main figures.
        """
        mem_keys = ("params", "grads", "optimizer", "activations", "kv_cache", "buffers", "transient", "total",
                    "host_tier")
        time_keys = ("compute", "tp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "sync", "exposed", "total")
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "dp": self.dp, "feasible": self.feasible,
                "params_per_gpu": int(self.params_per_gpu),
                "memory_bytes": {k: float(self.memory[k]) for k in mem_keys},
                "step_time_s": {k: float(self.step_time[k]) for k in time_keys},
                "micro_batch": self.step_time["micro_batch"], "n_micro": self.step_time["n_micro"],
                "remat": self.config.remat, "schedule": self.config.schedule, "offload": self.config.offload,
                "algorithms": self.step_time["algorithms"], "label": self.label,
                "violations": list(self.violations), "why": list(self.why), "command": self.launch}


def factorizations(n: int, *, moe: bool, max_tp: int, max_pp: int) -> list[tuple]:
    """Every (tp, ep, pp, dp) with tp * ep * pp * dp == n (ep > 1 only for MoE models).

    Parameters
    ----------
    n : int
        GPUs.
    moe : bool
        Allow ep > 1.
    max_tp : int
        The largest tp.
    max_pp : int
        The largest pp.

    Returns
    -------
    list of tuple
        The factorizations.
    """
    divs = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for tp, ep, pp in itertools.product(divs, divs if moe else [1], divs):
        if tp > max_tp or pp > max_pp or n % (tp * ep * pp):
            continue
        out.append((tp, ep, pp, n // (tp * ep * pp)))
    return out


def runtime_problems(m: ModelSpec, lay: ParallelConfig, n_micro: int, batch: int) -> list[str]:
    """What the runtime (dist.Pipeline, scripts/train.py) refuses in this layout: the same
    rules (pipeline.schedules.layout_problems), so the search never ranks them."""
    return layout_problems(n_layers=m.n_layers, pp=lay.pp, microbatches=n_micro, schedule=lay.schedule,
                           virtual=2 if lay.schedule == "interleaved" else 1, batch=batch,
                           rows_multiple=lay.dp * lay.ep if m.n_experts else 1, remat=lay.remat,
                           moe=_moe_without_remat(m))


def _moe_without_remat(m: ModelSpec) -> bool:
    """train.py's nn.Transformer does not rematerialize MoE blocks; another model's script
    may (the seeds' recipes assume so)."""
    return bool(m.n_experts) and m.name in TRAIN_PY_MODELS


def tessera_run() -> str:
    """``tessera-run`` as this process can start it from the current directory: the bare name
    when the one on PATH is this Python's; else its path beside this Python
    (``.venv/bin/tessera-run`` from the repository root when the venv is not activated);
    else ``python -m tessera_run`` with this Python (the same launcher)."""
    here = Path(sys.executable).parent / "tessera-run"
    found = shutil.which("tessera-run")
    if here.exists():
        if found and Path(found).resolve() == here.resolve():
            return "tessera-run"
        rel = os.path.relpath(here)
        return shlex.quote(rel if not rel.startswith("..") else str(here))
    if found:
        return "tessera-run"
    return f"{shlex.quote(sys.executable)} -m tessera_run"


def launch_command(k: Candidate, model: str, batch: int) -> str:
    """The launch line of a candidate, as it runs from the repository root: scripts/train.py
    with its flags for the models it builds (TRAIN_PY_MODELS), else the mesh flags for the
    user's own script; ``tessera_run()`` says how tessera-run is started."""
    t = k.step_time
    flags = ["--tp", k.tp, "--dp", k.dp, "--pp", k.pp]
    if k.ep > 1 or model == "char-moe":
        flags += ["--ep", k.ep]
    if k.pp > 1 or t["n_micro"] > 1:
        flags += ["--schedule", k.config.schedule, "--microbatches", t["n_micro"]]
    run = f"{tessera_run()} -n {k.tp * k.ep * k.pp * k.dp}"
    if model not in TRAIN_PY_MODELS:
        return f"{run} YOUR_SCRIPT.py " + " ".join(map(str, flags))
    flags += ["--batch", batch, "--remat", REMAT_FLAG[k.config.remat]] + TRAIN_PY_MODELS[model]
    return f"{run} scripts/train.py " + " ".join(map(str, flags))


def _check(m: ModelSpec, c: Cluster, lay: ParallelConfig, mem: dict, workload: str, n_micro: int = 1,
           batch: int = 1) -> list[str]:
    bad = runtime_problems(m, lay, n_micro, batch) if workload == "train" else []
    h = c.hbm_bytes
    if mem["total"] > h:
        bad.append(f"needs {mem['total'] / GB:.1f} GB per GPU, HBM has {h / GB:.1f} GB "
                   f"({(mem['total'] - h) / GB:.1f} GB over)")
    if mem["host_tier"] > (c.host_tier_bytes or 0):
        bad.append(f"offloaded optimizer state {mem['host_tier'] / GB:.1f} GB > host tier "
                   f"{c.host_tier_bytes / GB:.1f} GB per GPU")
    ak = mem["activations"] + mem["kv_cache"] + mem["transient"]
    if ak > ACT_KV_SHARE * h:
        bad.append(f"activations + KV {ak / GB:.1f} GB > {ACT_KV_SHARE:.0%} of HBM (seed 000 §6 rule 1)")
    # rule 2 judges how thinly ep spreads the experts: at ep=1 nothing is spread (a model with
    # fewer than 128 experts could otherwise never fit anywhere)
    if m.n_experts and lay.ep > 1 and m.n_experts / lay.ep < MIN_EXPERTS_PER_GPU:
        bad.append(f"E/ep = {m.n_experts}/{lay.ep} = {m.n_experts / lay.ep:.0f} < {MIN_EXPERTS_PER_GPU} "
                   "(seed 000 §6 rule 2)")
    if workload == "train" and lay.remat == "none" and mem["activations"] > REMAT_RATIO * mem["params"] \
            and not _moe_without_remat(m):                         # advice the runtime cannot follow
        bad.append(f"activations {mem['activations'] / GB:.3g} GB > {REMAT_RATIO} x parameter shard "
                   f"{mem['params'] / GB:.3g} GB without remat (seed 000 §6 rule 3)")
    return bad


def _why(m: ModelSpec, c: Cluster, lay: ParallelConfig, mem: dict, t: dict) -> list[str]:
    g = lambda x: f"{x / GB:.3g}"
    ms = duration
    why = [f"memory {g(mem['total'])} GB/GPU: params {g(mem['params'])}, grads {g(mem['grads'])}, optimizer "
           f"{g(mem['optimizer'])}" + (f" (+{g(mem['host_tier'])} in host tier)" if mem["host_tier"] else "")
           + f", activations {g(mem['activations'])}, KV {g(mem['kv_cache'])}, buffers {g(mem['buffers'])}"
           + (f", remat transient {g(mem['transient'])}" if mem["transient"] else ""),
           f"step {ms(t['total'])}: compute {ms(t['compute'])}, exposed comm {ms(t['exposed'])} of tp "
           f"{ms(t['tp_comm'])} ({t['algorithms']['tp']}), ep {ms(t['ep_comm'])}, pp {ms(t['pp_comm'])}, dp "
           f"{ms(t['dp_comm'])} ({t['algorithms']['dp']}), bubble {ms(t['pp_bubble'])}",
           f"{t['n_micro']} micro-batch(es) of {t['micro_batch']} seq, remat {lay.remat}"
           + (f", {lay.schedule}" if lay.pp > 1 else "")]
    if m.n_heads % lay.tp:
        why.append(f"heads {m.n_heads} do not split evenly over tp={lay.tp}: the busiest GPU has "
                   f"{-(-m.n_heads // lay.tp)} heads ({-(-m.n_heads // lay.tp) * lay.tp / m.n_heads - 1:.0%} over even)")
    if c.devices_per_node and lay.tp > c.devices_per_node:     # asked for with --mesh
        why.append(f"tp={lay.tp} crosses nodes of {c.devices_per_node} devices: its all-reduces leave the node")
    if m.n_experts and m.n_experts % lay.ep:
        why.append(f"experts {m.n_experts} do not split evenly over ep={lay.ep}: {-(-m.n_experts // lay.ep)} on the "
                   "busiest GPU")
    return why


def evaluate(model: object, cluster: object, *, tp: int = 1, ep: int = 1, pp: int = 1, dp: int = 1,
             workload: str = "train", batch: int | None = None, seq: int | None = None, policy: object = None,
             label: str = "", knobs: dict | None = None) -> Candidate:
    """Price one factorization; picks micro-batch, remat, schedule and offload (the fastest
    setting that satisfies every rule, else the one with the least memory).

    Parameters
    ----------
    model : str, dict or ModelSpec
        As ``get_model`` takes it.
    cluster : str, dict or Cluster
        As ``get_cluster`` takes it.
    tp, ep, pp, dp : int
        The factorization.
    workload : str
        "train" or "decode".
    batch : int, optional
        Global batch (default the model's).
    seq : int, optional
        Sequence length (default the model's).
    policy : NumericPolicy or str, optional
        A NumericPolicy whose dtype is the compute dtype (None: the model's).
    label : str
        A name for the candidate.
    knobs : dict, optional
        Fix micro_batch, remat, schedule or offload instead of choosing.

    Returns
    -------
    Candidate
        The priced candidate.
    """
    m, c = get_model(model), get_cluster(cluster)
    for name, v in (("batch", batch), ("seq", seq), ("micro_batch", (knobs or {}).get("micro_batch"))):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} must be a positive int (or None for the model's default)")
    _validate(m, c, workload, tp * ep * pp * dp, (tp, ep, pp, dp))
    batch = batch or m.batch
    seq = seq or m.seq_len
    dtype = _policy_dtype(policy, m)
    if workload == "decode" and dtype != m.dtype:
        m = dataclasses.replace(m, dtype=dtype)        # inference keeps weights and KV in the policy dtype
    seqs = -(-batch // (dp * ep))
    best = None
    for lay in _settings(m, c, (tp, ep, pp, dp), workload, seqs, knobs or {}):
        n_micro = -(-seqs // lay.micro_batch)
        mem = memory_per_gpu(m, c, lay, workload=workload, batch=batch, seq=seq, n_micro=n_micro)
        bad = _check(m, c, lay, mem, workload, n_micro, batch)
        if bad and best is not None and (not best[4] or mem["total"] >= best[2]["total"]):
            continue                                   # cannot beat what we have: skip its timing
        t = step_time(m, c, lay, workload=workload, batch=batch, seq=seq, dtype=dtype)
        key = (bool(bad), t["total"] if not bad else mem["total"])
        if best is None or key < best[0]:
            best = (key, lay, mem, t, bad)
    assert best is not None                            # (_settings yields at least one)
    _, lay, mem, t, bad = best
    k = Candidate(tp, ep, pp, dp, not bad, mem["params_per_gpu"], mem, t, lay, _why(m, c, lay, mem, t), bad, label)
    k.launch = launch_command(k, m.name, batch)
    return k


def _settings(m: ModelSpec, c: Cluster, f: tuple, workload: str, seqs: int, knobs: dict):
    tp, ep, pp, dp = f
    if workload != "train":
        yield ParallelConfig(tp, ep, pp, dp, micro_batch=max(seqs, 1), **{k: v for k, v in knobs.items() if k == "remat"})
        return
    mbs = knobs.get("micro_batch")
    mbs = [mbs] if mbs else sorted({min(2 ** i, seqs) for i in range(0, int(math.log2(max(seqs, 1))) + 1)})
    remats = [knobs["remat"]] if "remat" in knobs else REMATS
    scheds = [knobs.get("schedule", "1f1b")] if pp == 1 or "schedule" in knobs else ["1f1b", "interleaved"]
    offloads = [knobs["offload"]] if "offload" in knobs else ([False, True] if c.host_tier_bytes else [False])
    for mb, r, s, o in itertools.product(mbs, remats, scheds, offloads):
        yield ParallelConfig(tp, ep, pp, dp, micro_batch=mb, remat=r, schedule=s, offload=o)


def _policy_dtype(policy, m: ModelSpec) -> str:
    if policy is None or getattr(policy, "dtype", None) is None:
        return m.dtype
    name = str(policy.dtype)
    return "fp8" if "float8" in name else {"bfloat16": "bf16", "float16": "fp16", "float32": "f32"}.get(name, m.dtype)


def _validate(m: ModelSpec, c: Cluster, workload: str, n: int, f: tuple) -> None:
    if workload not in ("train", "decode"):
        raise ValueError(f"workload={workload!r}; use 'train' or 'decode'")
    if any(not isinstance(x, int) or x < 1 for x in f):
        raise ValueError(f"mesh tp={f[0]} ep={f[1]} pp={f[2]} dp={f[3]}: every axis must be a positive integer")
    if n != c.n_gpus:
        raise ValueError(f"mesh tp={f[0]} x ep={f[1]} x pp={f[2]} x dp={f[3]} = {n} GPUs but cluster {c.name!r} has "
                         f"{c.n_gpus}; pick factors whose product is {c.n_gpus}")
    if f[1] > 1 and not m.n_experts:
        raise ValueError(f"mesh ep={f[1]} but model {m.name!r} has no experts; use ep=1 (fold it into dp)")
    if f[2] > m.n_layers:
        raise ValueError(f"mesh pp={f[2]} but model {m.name!r} has only {m.n_layers} layers")


def search(model: object = "llama3-70b", cluster: object = "nvl72", workload: str = "train",
           batch: int | None = None, seq: int | None = None, policy: object = None, *, require_feasible: bool = True,
           top: int | None = None) -> list[Candidate]:
    """Every factorization of the cluster's GPUs, best first.  Raises ValueError when none
    fits (with by how much and what would), unless ``require_feasible=False``.

    Parameters
    ----------
    model : str, dict or ModelSpec
        As ``get_model`` takes it.
    cluster : str, dict or Cluster
        As ``get_cluster`` takes it.
    workload : str
        "train" or "decode".
    batch : int, optional
        Global batch (default the model's).
    seq : int, optional
        Sequence length (default the model's).
    policy : NumericPolicy or str, optional
        A NumericPolicy whose dtype is the compute dtype (None: the model's).
    require_feasible : bool
        Raise when nothing fits.
    top : int, optional
        Keep the best ``top``.

    Returns
    -------
    list of Candidate
        Best first.
    """
    m, c = get_model(model), get_cluster(cluster)
    if workload not in ("train", "decode"):
        raise ValueError(f"workload={workload!r}; use 'train' or 'decode'")
    # tp's all-reduces run every layer: keep them inside a node (a --mesh may still ask for more)
    max_tp = min(m.n_heads, c.devices_per_node) if c.devices_per_node else m.n_heads
    fs = factorizations(c.n_gpus, moe=bool(m.n_experts), max_tp=max_tp, max_pp=m.n_layers)
    cands = [evaluate(m, c, tp=tp, ep=ep, pp=pp, dp=dp, workload=workload, batch=batch, seq=seq, policy=policy)
             for tp, ep, pp, dp in fs]
    cands.sort(key=lambda k: (not k.feasible, k.step_time["total"] if k.feasible else k.memory["total"]))
    if require_feasible and not cands[0].feasible:
        raise ValueError(_no_fit(m, c, cands[0], workload))
    return cands[:top] if top else cands


def _no_fit(m: ModelSpec, c: Cluster, least: Candidate, workload: str) -> str:
    over = least.memory["total"] - c.hbm_bytes
    per_param = 16 if workload == "train" else m.dtype_bytes
    need = m.total_params() * per_param
    gpus = math.ceil(need / (c.hbm_bytes * 0.8))
    msg = (f"model {m.name!r} ({m.total_params() / 1e9:.1f}B parameters) does not fit on cluster {c.name!r} "
           f"({c.n_gpus} x {c.hbm_bytes / GB:.0f} GB) for {workload}: the least memory is "
           f"{least.memory['total'] / GB:.1f} GB/GPU at {least.config.label()} "
           f"({over / GB:+.1f} GB vs HBM); broken rules: {'; '.join(least.violations)}. To fit: ")
    fixes = [f"about {gpus} GPUs of this kind (weights{' + gradients + AdamW state' if workload == 'train' else ''} "
             f"alone are {need / GB:.0f} GB)"]
    if workload == "train" and not c.host_tier_bytes:
        fixes.append("a host memory tier for the optimizer state (host_tier_bytes)")
    fixes.append("a smaller batch or sequence" + (" (KV cache)" if workload == "decode" else ""))
    if m.dtype_bytes > 1:
        fixes.append("a narrower dtype (fp8 weights)")
    return msg + ", or ".join(fixes)


def recipes(model: object = "sr-moe", cluster: object = "nvl72", workload: str = "train",
            batch: int | None = None, seq: int | None = None, policy: object = None) -> list[Candidate]:
    """The seed's recipes for this cluster (RECIPES) beside the planner's best, ranked like
    search; each is labelled.

    Parameters
    ----------
    model : str, dict or ModelSpec
        As ``get_model`` takes it.
    cluster : str, dict or Cluster
        As ``get_cluster`` takes it.
    workload : str
        "train" or "decode".
    batch : int, optional
        Global batch.
    seq : int, optional
        Sequence length.
    policy : NumericPolicy or str, optional
        A NumericPolicy whose dtype is the compute dtype (None: the model's).

    Returns
    -------
    list of Candidate
        Ranked like ``search``.
    """
    c, m = get_cluster(cluster), get_model(model)
    out = []
    for name, f in RECIPES.get(c.name, {}).items():
        if f[1] > 1 and not m.n_experts:
            f, name = (f[0], 1, f[2], f[3] * f[1]), f"{name} (ep folded into dp: dense model)"
        n = math.prod(f)
        if n == c.n_gpus:
            out.append(evaluate(model, c, tp=f[0], ep=f[1], pp=f[2], dp=f[3], workload=workload, batch=batch,
                                seq=seq, policy=policy, label=name))
            continue
        # Seed 000's recipe C multiplies to 144, not 72: priced as written on a 144-GPU
        # cluster of the same GPUs (marked infeasible here), beside the 72-GPU variants
        # that keep two of its three factors.
        big = dataclasses.replace(c, n_gpus=n, grid=())
        k = evaluate(model, big, tp=f[0], ep=f[1], pp=f[2], dp=f[3], workload=workload, batch=batch, seq=seq,
                     policy=policy, label=f"{name} as written")
        k.feasible = False
        k.violations.insert(0, f"tp*ep*pp*dp = {n}, not the cluster's {c.n_gpus} GPUs (as written in the seed)")
        out.append(k)
        for i in range(3):
            g = list(f)
            g[i] = g[i] * c.n_gpus // n if (g[i] * c.n_gpus) % n == 0 else 0
            if g[i] >= 1:
                out.append(evaluate(model, c, tp=g[0], ep=g[1], pp=g[2], dp=g[3], workload=workload, batch=batch,
                                    seq=seq, policy=policy, label=f"{name.split()[0]}' ({'tp ep pp'.split()[i]}="
                                    f"{g[i]} to fit {c.n_gpus})"))
    best = search(model, c, workload, batch, seq, policy, require_feasible=False)[0]
    best.label = "planner's best"
    out.append(best)
    out.sort(key=lambda k: (not k.feasible, k.step_time["total"] if k.feasible else k.memory["total"]))
    return out
