"""Seconds per step for one layout: a roofline per op for compute, an alpha-beta model per
collective, the pipeline bubble per schedule, and overlap.

Collectives follow nccl-tests' conventions (doc/PERFORMANCE.md): ``size`` is the
all_reduce/reduce_scatter input, the all_gather output, the all_to_all per-rank buffer;
``busbw = algbw x factor`` with factor 2(n-1)/n for all_reduce and (n-1)/n for
all_gather, reduce_scatter and all_to_all, so the bandwidth term is
``size x factor / busbw`` whatever n is.  The latency term counts the algorithm's steps:
ring 2(n-1) (all_reduce) or n-1, tree 2 log2(n), line (seed 004's ring without the wrap)
the same steps as a ring, hierarchical a reduce_scatter inside groups of g, the
all_reduce across groups on size/g, an all_gather inside.  Calibrated clusters carry
measured (alpha, beta) per op and group size, used in place of the analytic terms.
"""
from __future__ import annotations

import math

from ..autodiff.buckets import grad_bucket_bytes
from .cluster import Cluster
from .memory import ParallelConfig, _ceil_div, _layer_act_elems, param_counts
from .specs import ModelSpec

__all__ = ["BUS_FACTOR", "collective_time", "compute_ops", "step_time", "ALGORITHMS", "duration", "param_tensors"]


def duration(seconds: float) -> str:
    """A time for people: ms below a second, else s; no exponents (1.2e+03 reads badly)."""
    if seconds == 0:
        return "0 ms"
    if seconds < 1:
        ms = seconds * 1e3
        return f"{ms:.3f} ms" if ms < 1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 100 else f"{seconds:.0f} s"

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
}
ALGORITHMS = ("ring", "tree", "line", "hierarchical")
_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "broadcast": 1, "send": 1}
# The optimizer's passes after the backward (outside the dispatcher: the profiler counts
# none).  CPU ranks go tensor by tensor: AdamW one fused pass each (kernels.multi_tensor ->
# cpu_fused.adamw_step), clip_grad_norm each one's sum of squares and in-place scale.  GPU
# ranks run multi-tensor kernels, a fixed number of launches a step for any tensor count:
# AdamW one per gradient dtype, clip four (the sum of squares and its total, the norm, the
# scale).  tests/plan count both.
OPT_OPS_PER_TENSOR = {"host": 3, "device": 0}
OPT_OPS_PER_STEP = {"host": 0, "device": 5}
# the vocab-parallel loss's small tp all-reduces (rows of one value): max, sum of
# exponentials and picked logit forward, one backward
LOSS_TP_ALL_REDUCES = 4
# all_to_alls per MoE block, training: dispatch and combine, forward and backward (the
# capacity-padded buffers need no counts exchange first); decode runs the forward's half
MOE_ALL_TO_ALLS = 4


def param_tensors(m: ModelSpec, layers: int, moe_layers: int) -> int:
    """Parameter tensors (what the optimizer steps one by one) of ``layers`` blocks, of which
    ``moe_layers`` are MoE, and of the parts outside them.

    Parameters
    ----------
    m : ModelSpec
        The model.
    layers, moe_layers : int
        Blocks, and how many of them are MoE.

    Returns
    -------
    int
        Per block two norms, q, k, v, o and w1, w3, w2 (an MoE block's stacked experts) and
        an MoE block's router; the embedding, the final norm, the head unless tied and the
        position table if learned.
    """
    return layers * 9 + moe_layers + 2 + int(not m.tied_embeddings) + int(m.learned_pos)


def _measured(cluster: Cluster, op: str, n: int):
    table = cluster.measured.get(op) or {}
    if not table:
        return None
    if str(n) in table:
        return tuple(table[str(n)])
    # the nearest measured group size, rescaled by the algorithm's step and bus factors
    near = min(table, key=lambda k: abs(int(k) - n))
    a, b = table[near]
    k = int(near)
    if k < 2 or n < 2:
        return None
    return a * (n - 1) / (k - 1), b * BUS_FACTOR[op](n) / BUS_FACTOR[op](k)


def collective_time(cluster: Cluster, op: str, size: float, n: int, *, span: int = 1,
                    algorithm: str | None = None) -> tuple[float, str]:
    """The time of one collective; without ``algorithm`` the fastest available one is picked, as
    NCCL's tuner does.

    Parameters
    ----------
    cluster : Cluster
        The cluster.
    op : str
        all_reduce, reduce_scatter, all_gather, all_to_all, ...
    size : float
        Bytes.
    n : int
        Ranks in the group.
    span : int
        How many ring axes (ring2d) the group crosses.
    algorithm : str, optional
        Force one (ring, tree, ...).

    Returns
    -------
    tuple of (float, str)
        Seconds and the algorithm.
    """
    if n <= 1 or size <= 0:
        return 0.0, "none"
    if op not in BUS_FACTOR:
        raise ValueError(f"collective_time: unknown op {op!r}; use one of {sorted(BUS_FACTOR)}")
    meas = _measured(cluster, op, n)
    if meas is not None and algorithm is None:
        a, b = meas
        return a + b * size, "measured"
    bw = cluster.link_bw * cluster.links * cluster.bw_efficiency
    fac = BUS_FACTOR[op](n)
    steps = _STEPS[op]
    ring = cluster.topology == "ring2d"
    if op == "all_to_all" and ring:
        fac *= max(1.0, n / 4)                  # a ring carries each message n/4 hops on average
    options = {"ring": steps * (n - 1) * cluster.alpha + size * fac / bw}
    if op in ("all_reduce", "broadcast") and not ring:
        # NCCL's tree: log-depth latency, lower bandwidth than a ring inside one domain
        # (seed 000 §3.6: tree for small payloads, ring for large)
        options["tree"] = 2 * math.ceil(math.log2(n)) * cluster.alpha + size * fac / (0.75 * bw)
    if ring:
        options["line"] = steps * (n - 1) * cluster.alpha + size * fac / bw * (n / max(n - 1, 1))
        if span > 1 and op == "all_reduce":
            g = cluster.grid[-1] if cluster.grid else n
            g = g if n % g == 0 and 1 < g < n else int(math.sqrt(n))
            rs, _ = collective_time(cluster, "reduce_scatter", size, g, algorithm="ring")
            ar, _ = collective_time(cluster, "all_reduce", size / g, n // g, algorithm="ring")
            options["hierarchical"] = 2 * rs + ar
            options["ring"] += size * fac / bw * (span - 1) * 0.5   # a flat ring over both axes: longer hops
    if algorithm is not None:
        if algorithm not in options:
            raise ValueError(f"collective_time: {algorithm!r} is not available for {op} on a {cluster.topology} "
                             f"cluster; choose from {sorted(options)}")
        return options[algorithm], algorithm
    best = min(options, key=options.__getitem__)
    return options[best], best


def _span(cluster: Cluster, lay: ParallelConfig, axis: str) -> int:
    """Ring axes a group crosses on ring2d: tp fills the inner ring (4) first, then the outer."""
    if cluster.topology != "ring2d" or not cluster.grid:
        return 1
    inner = cluster.grid[-1]
    n = getattr(lay, axis)
    return 1 if n <= inner or axis != "tp" else 2


def compute_ops(m: ModelSpec, lay: ParallelConfig, tokens: float, ctx: float, *, causal: float) -> list[tuple]:
    """Forward ops of one block on one GPU for ``tokens`` tokens attending to ``ctx``
    positions: (name, flops, bytes).  A roofline per op prices each."""
    b, d, hd, tp = m.dtype_bytes, m.d_model, m.head_dim, lay.tp
    qh = _ceil_div(m.n_heads, tp)
    kvh = _ceil_div(m.kv_heads, tp) if tp <= m.kv_heads else 1
    qkv_out = (qh + 2 * kvh) * hd
    ops = [
        ("qkv", 2 * tokens * d * qkv_out, b * (tokens * d + d * qkv_out + tokens * qkv_out)),
        ("attention", 4 * tokens * ctx * qh * hd * causal,
         b * (2 * tokens * qh * hd + 2 * kvh * hd * tokens * (1 if causal < 1 else ctx))),   # decode reads the cache
        ("o_proj", 2 * tokens * qh * hd * d, b * (tokens * qh * hd + qh * hd * d + tokens * d)),
        # norms, residual adds, activations, reshapes: each kept tensor written once, read once
        ("elementwise", 10 * tokens * d, 2 * b * tokens * _layer_act_elems(m, tp, False)),
    ]
    return ops


def _mlp_ops(m: ModelSpec, lay: ParallelConfig, tokens: float, moe: bool) -> list[tuple]:
    b, d, tp = m.dtype_bytes, m.d_model, lay.tp
    if not moe:
        f = _ceil_div(m.ffn_hidden, tp)
        return [("mlp_w13", 4 * tokens * d * f, b * (tokens * d + 2 * d * f + 2 * tokens * f)),
                ("mlp_w2", 2 * tokens * f * d, b * (tokens * f + f * d + tokens * d))]
    f = _ceil_div(m.f_expert, tp)
    slots = tokens * m.top_k * m.capacity_factor          # tokens this GPU's experts serve
    e_local = _ceil_div(m.n_experts, lay.ep)
    return [("router", 2 * tokens * d * m.n_experts, b * (tokens * d + d * m.n_experts) + 4 * tokens * m.n_experts),
            ("experts", 6 * slots * d * f, b * (e_local * 3 * d * f + 4 * slots * d + 3 * slots * f))]


_OP_CLASS = {"qkv": "gemm", "o_proj": "gemm", "mlp_w13": "gemm", "mlp_w2": "gemm", "router": "gemm",
             "experts": "gemm", "head": "gemm", "attention": "attention", "elementwise": "elementwise"}


def _roofline(cluster: Cluster, ops: list, dtype: str, slow: float, bwd: bool = False) -> float:
    """max(FLOPs / rate, bytes / bandwidth) per op; a calibrated rate for the op's class
    (cluster.op_rates, "<class>_bwd" for the backward) replaces the dtype's peak.  The
    backward of an op does twice its forward's FLOPs and moves twice its bytes."""
    peak, bw, rates = cluster.rate(dtype), cluster.hbm_bw, cluster.op_rates
    total = 0.0
    k = 2.0 if bwd else 1.0
    for name, fl, by in ops:
        fl, by = fl * k, by * k
        cls = _OP_CLASS.get(name, "")
        rate = ((rates.get(cls + "_bwd") if bwd else None) or rates.get(name) or rates.get(cls, 0) or peak)
        total += max(fl / rate if _OP_CLASS.get(name) != "elementwise" else 0.0, by / bw) * slow
    return total


def step_time(m: ModelSpec, cluster: Cluster, lay: ParallelConfig, *, workload: str, batch: int, seq: int,
              dtype: str | None = None) -> dict:
    """The breakdown in seconds: compute, tp_comm, ep_comm, pp_comm, pp_bubble, dp_comm,
    exposed (communication not hidden), total; plus counts that explain them.

    Parameters
    ----------
    m : ModelSpec
        The model.
    cluster : Cluster
        The cluster.
    lay : ParallelConfig
        The factorization.
    workload : str
        "train" or "decode".
    batch : int
        The global batch in sequences.
    seq : int
        The sequence length.
    dtype : str, optional
        Compute dtype (default the model's).

    Returns
    -------
    dict
        Seconds by part, the total, and the counts.
    """
    dtype = dtype or m.dtype
    train = workload == "train"
    # tessera_rt's reshape cannot merge a batch dim split unevenly over the data ranks (batch %
    # dp != 0): it gathers the batch there, every rank then runs all of it, and the gradients
    # come out whole (no dp all-reduce).  Profiled at dp=3, batch 8: 30 all_gathers per step
    # (m.uneven_gathers), no gradient all-reduce, 4-5x dp=4's step.  Seen for dense blocks
    # without pp; MoE and pipelines keep their own row layouts (not modelled)
    gathered = (train and lay.data_ranks > 1 and batch % lay.data_ranks != 0 and lay.pp == 1
                and not m.n_experts and bool(m.uneven_gathers))
    slow = 1.0
    if cluster.topology == "host":
        # CPU ranks share the cores with each other (n / cores) and with other jobs (share);
        # a calibrated share of n ranks that meet every few ms (measure_lockstep_share) prices
        # both as a step meets them: a descheduled rank stalls all the others.  Only where the
        # ranks meet inside the compute (tp all-reduces, ep all-to-alls, batch gathers); data
        # ranks meet at the step's end (their gradient all-reduces run beside the backward) and
        # pipeline stages once per micro-batch: the free share.  (Measured: the profiled waits
        # at dp=4 were 12 ms per step where the lockstep share would add 77.)
        often = lay.tp > 1 or (lay.ep > 1 and m.n_experts > 0) or gathered
        lock = (cluster.measured.get("lockstep_share") or {}).get(str(lay.n)) if often else None
        slow = 1.0 / max(lock, 1e-3) if lock else (
            (max(1.0, lay.n / cluster.cores) if cluster.cores else 1.0) / max(cluster.share, 1e-3))
    seqs = _ceil_div(batch, lay.data_ranks)
    if gathered:
        seqs = batch
    if train:
        mb = min(lay.micro_batch * (lay.data_ranks if gathered else 1), seqs)
        n_micro = _ceil_div(seqs, mb)
        tokens, ctx, causal = mb * seq, seq, 0.5
    else:
        n_micro = min(lay.pp, seqs) if lay.pp > 1 else 1
        mb = _ceil_div(seqs, n_micro)
        tokens, ctx, causal = mb, seq, 1.0
    layers = _ceil_div(m.n_layers, lay.pp)
    moe_layers = _ceil_div(m.n_moe_layers, lay.pp) if m.n_experts else 0
    fwd_layer = [compute_ops(m, lay, tokens, ctx, causal=causal) + _mlp_ops(m, lay, tokens, i < moe_layers)
                 for i in range(layers)]
    v_local = _ceil_div(m.vocab, lay.tp)
    b = m.dtype_bytes
    rep, voc, one = (tuple(m.act_outside) + (0.0,) * 3)[:3]
    head = [("head", 2 * tokens * m.d_model * v_local, b * (tokens * m.d_model + m.d_model * v_local)),
            ("elementwise", 0, 2 * b * tokens * (rep * m.d_model + voc * v_local + one))]
    fwd_math = sum(_roofline(cluster, ops, dtype, slow) for ops in fwd_layer) + _roofline(cluster, head, dtype, slow)
    over = cluster.op_overhead_s * slow
    fwd = fwd_math + (layers * m.ops_per_layer + m.ops_outside) * over
    if train:
        remat_layers = {"none": 0, "every": layers, "every_other": _ceil_div(layers, 2)}[lay.remat]
        recompute = sum(_roofline(cluster, fwd_layer[i], dtype, slow) for i in range(remat_layers))
        recompute += remat_layers * m.ops_per_layer * over
        # the backward does twice the forward's arithmetic (dgrad and wgrad per GEMM)
        bwd_math = (sum(_roofline(cluster, ops, dtype, slow, bwd=True) for ops in fwd_layer)
                    + _roofline(cluster, head, dtype, slow, bwd=True))
        bwd = bwd_math + (layers * m.bwd_ops_per_layer + m.bwd_ops_outside) * over + recompute
    else:
        bwd = 0.0
    per_mb = fwd + bwd
    compute = per_mb * n_micro
    p = param_counts(m, lay)
    if train:
        # AdamW: read/write params, grads, masters and moments (memory-bound), per tensor passes
        where = "host" if cluster.topology == "host" else "device"
        opt = (p["total"] * (2 * b + 2 * 12)) / cluster.hbm_bw * slow
        passes = param_tensors(m, layers, moe_layers) * OPT_OPS_PER_TENSOR[where] + OPT_OPS_PER_STEP[where]
        opt += passes * cluster.op_overhead_s * slow
        if lay.offload:
            opt += p["total"] * 2 * b / (cluster.host_tier_bw or cluster.hbm_bw / 10)
        compute += opt
    # communication --------------------------------------------------------------
    msg = tokens * m.d_model * b
    ar, tp_algo = collective_time(cluster, "all_reduce", msg, lay.tp, span=_span(cluster, lay, "tp"))
    small, _ = collective_time(cluster, "all_reduce", 4 * tokens, lay.tp, span=_span(cluster, lay, "tp"))
    if train:      # + the vocab-parallel loss's
        tp_comm = n_micro * ((layers * m.tp_ar_per_layer + m.tp_ar_outside) * ar + LOSS_TP_ALL_REDUCES * small)
    else:          # decode: the forward's half
        tp_comm = n_micro * ((layers * m.tp_ar_per_layer // 2 + 1) * ar)
    ep_comm, ep_algo = 0.0, "none"
    if m.n_experts and lay.ep > 1:
        a2a, ep_algo = collective_time(cluster, "all_to_all", msg * m.top_k * m.capacity_factor, lay.ep)
        ep_comm = n_micro * moe_layers * (MOE_ALL_TO_ALLS if train else MOE_ALL_TO_ALLS // 2) * a2a
    pp_comm = 0.0
    if lay.pp > 1:
        p2p, _ = collective_time(cluster, "send", msg, 2)
        pp_comm = n_micro * (2 if train else 1) * p2p
    dp_comm, dp_algo, gather = 0.0, "none", 0.0
    if gathered:          # the batch gathered at each reshape (all_gather sizes: the output), blocking
        g_d, g_f, g_v = m.uneven_gathers
        ag = lambda width: collective_time(cluster, "all_gather", tokens * width * b, lay.data_ranks)[0]
        gather = n_micro * (layers * (g_d * ag(m.d_model) + g_f * ag(_ceil_div(m.ffn_hidden, lay.tp)))
                            + g_v * ag(v_local))
    elif train and lay.data_ranks > 1:
        # gradient all-reduces are issued without waiting, so their latencies overlap: on
        # CPU ranks every one is in flight at once (one latency for all the bytes); GPUs
        # pay one latency per gradient bucket, at the cap the runtime would pick
        # (tessera_rt.autodiff.buckets: TESSERA_GRAD_BUCKET_MB or its default)
        dense_b = p["dense"] * b
        cap = grad_bucket_bytes(model_bytes=int(dense_b))
        buckets = 1 if cluster.topology == "host" else max(1, math.ceil(dense_b / cap))
        t_dense, dp_algo = collective_time(cluster, "all_reduce", dense_b / buckets, lay.data_ranks)
        dp_comm = buckets * t_dense
        if p["expert"] and lay.dp > 1:
            t_exp, _ = collective_time(cluster, "all_reduce", p["expert"] * b, lay.dp)
            dp_comm += t_exp
    sync = 0.0
    if train and lay.n > 1:
        # blocking, after the backward (nothing left to hide them behind): clip_grad_norm's one
        # float64 over every rank and the loss read over the data ranks (the profiler's count)
        sync = (collective_time(cluster, "all_reduce", 8, lay.n)[0]
                + collective_time(cluster, "all_reduce", 4, lay.data_ranks)[0])
        # and in each MoE block's forward the routing statistics the loss reads (MoEAux): the
        # experts' loads and 4 totals in float64 over the token axes, read on the host
        sync += n_micro * moe_layers * collective_time(cluster, "all_reduce", 8 * (m.n_experts + 4),
                                                       lay.data_ranks)[0]
    # the bubble: (pp-1) micro-batch slots idle per step (GPipe and 1F1B), / v when interleaved
    bubble = 0.0
    if lay.pp > 1:
        v = 2 if lay.schedule == "interleaved" else 1
        bubble = (lay.pp - 1) * per_mb / v
    ov = cluster.overlap
    exposed = (tp_comm + ep_comm) * (1 - ov) + pp_comm
    bwd_total = bwd * n_micro
    ov_dp = ov if cluster.dp_overlap is None else cluster.dp_overlap
    exposed += max(dp_comm * (1 - ov_dp), dp_comm - ov_dp * bwd_total) if dp_comm else 0.0
    exposed += sync + gather
    total = compute + bubble + exposed
    return {"compute": compute, "tp_comm": tp_comm, "ep_comm": ep_comm, "pp_comm": pp_comm, "pp_bubble": bubble,
            "dp_comm": dp_comm, "sync": sync, "batch_gather": gather, "exposed": exposed, "total": total, "n_micro": n_micro, "micro_batch": mb,
            "algorithms": {"tp": tp_algo, "ep": ep_algo, "dp": dp_algo}, "forward_per_microbatch": fwd,
            "per_microbatch": per_mb}
