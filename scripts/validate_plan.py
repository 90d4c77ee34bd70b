"""Validate the planner (tessera_rt.plan) against scripts/train.py on CPU ranks.

    .venv/bin/python scripts/validate_plan.py [--steps 12] [--configs tp2,dp2,pp2,...] [--json F]

A configuration names its mesh axes, e.g. ``tp2dp2`` or ``pp2`` (omitted axes are 1);
``ep2`` trains MoE blocks (``--experts 4``, top-2, capacity factor 1.25) with experts over ep.  Each
configuration is one job: the calibration (op rates, the op mix's fixed cost, and
``dist.all_reduce`` alpha/beta per axis timed as a step meets it, the raw mpi4py
``Allreduce`` beside it), the train.py loop, three more steps under the profiler (the
measured time of the blocking collectives per step, for the per-term table), and the
calibration again (the machine is shared and its speed drifts: the two are averaged).
The planner predicts the step time from those rates and its own counts, and the per-rank
parameter and activation bytes from its memory model.  3-5 minutes for the default 12
configurations on the 2-core VM under load (not yet timed on a quiet one).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIGS = "tp1,tp2,dp2,tp3,dp3,tp4,tp2dp2,dp4,pp2,pp2dp2,ep2,ep2dp2"
EXPERTS = 4
CHUNKS = 3              # the steps run in chunks, the core shares measured before, between and after


def parse_config(text: str) -> dict:
    cfg = {"tp": 1, "dp": 1, "pp": 1, "ep": 1}
    parts = re.findall(r"(tp|dp|pp|ep)(\d+)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise SystemExit(f"validate_plan.py: bad configuration {text!r}; write axes and sizes, e.g. tp2dp2, pp2, ep2")
    cfg.update({a: int(b) for a, b in parts})
    return cfg


def _avg(a: dict, b: dict) -> dict:
    out = {}
    for k, v in a.items():
        out[k] = _avg(v, b[k]) if isinstance(v, dict) else (
            [(x + y) / 2 for x, y in zip(v, b[k])] if isinstance(v, list) and v and not isinstance(v[0], (list, str))
            else (v + b[k]) / 2 if isinstance(v, float) else v)
    return out


def _train_argv(c: dict, steps: int, out: str) -> list:
    argv = ["--tp", str(c["tp"]), "--dp", str(c["dp"]), "--pp", str(c["pp"]), "--steps", str(steps), "--no-plot",
            "--no-checkpoint", "--quiet", "--out", out]
    # a capacity factor pads every expert's part to a known size (dropless parts follow the routing)
    return argv + (["--ep", str(c["ep"]), "--experts", str(EXPERTS), "--capacity-factor", "1.25"] if c["ep"] > 1 else [])


def worker(a) -> None:
    sys.path.insert(0, str(HERE))
    from mpi4py import MPI

    from tessera_rt import dist, nn
    from tessera_rt.plan.calibrate import measure_collectives, measure_compute, measure_lockstep_share, measure_share
    from tessera_rt.plan.measure import local_bytes, traced_activation_bytes
    from tessera_rt.profiler import Profile

    import train

    c = parse_config(a.config)
    w = dist.init()
    names = (["pp"] if c["pp"] > 1 else []) + ["dp"] + (["ep"] if c["ep"] > 1 else []) + ["tp"]    # as train.py
    mesh = dist.Mesh(axes=names, shape={x: c[x] for x in names})
    axes = [x for x in names if c[x] > 1]
    axes += [tuple(axes)] if len(axes) > 1 else []

    def calibrate():
        return measure_compute(mesh=mesh), measure_collectives(mesh, axes)

    def shares():
        return measure_share(0.15), measure_lockstep_share(0.15)
    cal = [calibrate()]
    # the steps in chunks with the shares measured between them: the other jobs on a shared
    # machine come and go within a minute, and the shares are what they change most
    chunk = -(-a.steps // CHUNKS)
    between, times, cpu, wall = [shares()], [], 0.0, 0.0
    for _ in range(CHUNKS):
        targs = train.parse_args(_train_argv(c, chunk + 1, a.out + ".train"))
        w0, c0 = time.perf_counter(), time.process_time()
        res = train.train(targs)
        cpu, wall = cpu + time.process_time() - c0, wall + time.perf_counter() - w0
        times += res["step_times"][1:]                    # the first step of each chunk warms up
        between.append(shares())
    run_share = cpu / wall                                  # this rank's share of a core in the loop
    params = res["params"]          # after the steps: the optimizer's own arrays, not init-time views
    # three more steps under the profiler: the blocking collectives' time and the op count per step
    with Profile(print_table=False, nvtx=False) as prof:
        prof_res = train.train(train.parse_args(_train_argv(c, 3, a.out + ".prof")))
    blocking = sum(e["t1"] - e["t0"] for e in prof.events if e["cat"] == "collective" and not e["async"]) / 3
    n_ops = sum(1 for e in prof.events if e["cat"] == "op") / 3
    cal.append(calibrate())
    act = None
    if c["pp"] == 1:            # what one traced forward keeps (a pipeline keeps one per micro-batch in flight)
        text = train.load_text(targs.data)
        model = nn.Transformer(len(set(text)), targs.d_model, targs.heads, targs.layers, targs.seq, mesh=mesh,
                               moe=train.moe_config(targs))
        rng = np.random.default_rng(0)
        x, y = (rng.integers(0, model.vocab, (targs.batch, targs.seq)) for _ in range(2))
        act = traced_activation_bytes(model.loss, params, model.batch(x), model.batch(y))
    per_rank = MPI.COMM_WORLD.gather({"params": local_bytes(params), "activations": act, "run_share": run_share,
                                      "blocking_s": blocking, "ops": n_ops,
                                      "prof_step_s": float(np.median(prof_res["step_times"][1:]))}, root=0)
    steps = np.array(times)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, steps, op=MPI.MAX)        # the slowest rank sets the pace
    comp = _avg(cal[0][0], cal[1][0])
    comp["share"], comp["lockstep_share"] = (float(np.mean(v)) for v in zip(*between))
    comp["share_spread"] = [float(np.min(v)) for v in zip(*between)] + [float(np.max(v)) for v in zip(*between)]
    if w.rank == 0:
        Path(a.out).write_text(json.dumps({**c, "step_s": float(np.median(steps)), "compute": comp,
                                           "collectives": _avg(cal[0][1], cal[1][1]), "ranks": per_rank,
                                           "vocab": len(set(train.load_text(targs.data))),
                                           "microbatches": min(2 * c["pp"], targs.batch) if c["pp"] > 1 else 1}))


def predict(r: dict) -> dict:
    """The planner's prediction from the job's calibration."""
    import dataclasses

    from tessera_rt import plan
    from tessera_rt.plan.calibrate import cluster_from
    n = n_ranks(r)
    # every rank ran the calibration at once: the ranks' contention is in the share (cores=0)
    cluster = cluster_from(r["compute"], r["collectives"], n_gpus=n, cores=0)
    spec = dataclasses.replace(plan.get_model("char-moe" if r["ep"] > 1 else "char"), vocab=r["vocab"])
    seqs = -(-spec.batch // (r["dp"] * r["ep"]))
    lay = plan.ParallelConfig(tp=r["tp"], dp=r["dp"], pp=r["pp"], ep=r["ep"], micro_batch=-(-seqs // r["microbatches"]))
    t = plan.step_time(spec, cluster, lay, workload="train", batch=spec.batch, seq=spec.seq_len)
    mem = plan.memory_per_gpu(spec, cluster, lay, workload="train", batch=spec.batch, seq=spec.seq_len,
                              n_micro=r["microbatches"])
    return {"step_s": t["total"], "time": t, "params": mem["params"], "activations": mem["activations"],
            "activations_one_mb": mem["activations"] / min(r["pp"], r["microbatches"]) if r["pp"] > 1 else None}


def n_ranks(r: dict) -> int:
    return r["tp"] * r["dp"] * r["pp"] * r["ep"]


def row(r: dict) -> dict:
    pr = predict(r)
    t = pr["time"]
    ranks = r["ranks"]
    meas_a = max(b["activations"] for b in ranks) if ranks[0]["activations"] is not None else None
    peer, mine = r["collectives"]["peer"], r["collectives"]["all_reduce"]
    ratio = {k: (peer[k][0] + peer[k][1] * 65536) / (mine[k][0] + mine[k][1] * 65536) for k in mine}
    # the lockstep share prices the waits at the meetings as slower compute: split them out, so
    # the terms compare with the profile (blocking collectives' time includes the waits)
    comp = r["compute"]
    often = r["tp"] > 1 or r["ep"] > 1 or t.get("batch_gather", 0) > 0      # as plan.timing.step_time decides
    free = t["compute"] * (comp["lockstep_share"] / comp["share"]) if often else t["compute"]
    blocking_pred = (t["tp_comm"] + t["ep_comm"] + t["pp_comm"] + t.get("sync", 0.0) + t.get("batch_gather", 0.0)
                     + (t["compute"] - free))
    return {"config": {k: r[k] for k in ("tp", "dp", "pp", "ep")}, "measured_ms": r["step_s"] * 1e3,
            "predicted_ms": pr["step_s"] * 1e3, "err": pr["step_s"] / r["step_s"] - 1,
            "share_cal": r["compute"]["share"], "share_run": statistics.mean(b["run_share"] for b in ranks),
            "op_cost_us": r["compute"].get("op_overhead_s", 0) * 1e6,
            "compute_ms": t["compute"] * 1e3, "bubble_ms": t["pp_bubble"] * 1e3, "free_compute_ms": free * 1e3,
            "lockstep_share": comp.get("lockstep_share"), "share_spread": comp.get("share_spread"),
            "blocking_pred_ms": blocking_pred * 1e3,
            "blocking_meas_ms": statistics.mean(b["blocking_s"] for b in ranks) * 1e3,
            "rest_meas_ms": statistics.mean(b["prof_step_s"] - b["blocking_s"] for b in ranks) * 1e3,
            "ops_per_step": max(b["ops"] for b in ranks),
            "params_meas": max(b["params"] for b in ranks), "params_pred": pr["params"],
            "act_meas": meas_a, "act_pred": pr["activations"], "peer_ratio_64k": ratio}


def table(rows: list) -> str:
    out = ["| ranks | mesh | measured ms/step | predicted ms | error | core share free / lockstep / in run | op cost us "
           "| compute at the free share ms pred / meas | bubble ms | blocking collectives + waits ms pred / meas "
           "| params B/rank meas / pred | activations B/rank meas / pred | peer/tessera all_reduce 64 KiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        c = x["config"]
        mesh = " ".join(f"{k}={v}" for k, v in c.items() if v > 1) or "1 rank"
        rat = ", ".join(f"n={k}: {v:.2f}" for k, v in x["peer_ratio_64k"].items()) or "-"
        act = (f"{x['act_meas']:,} / {x['act_pred']:,.0f} ({x['act_pred'] / x['act_meas'] - 1:+.1%})"
               if x["act_meas"] else f"- / {x['act_pred']:,.0f}")
        out.append(f"| {int(np.prod(list(c.values())))} | {mesh} | {x['measured_ms']:.1f} | {x['predicted_ms']:.1f} | "
                   f"{x['err']:+.0%} | {x['share_cal']:.2f} / {x['lockstep_share']:.2f} / {x['share_run']:.2f} | "
                   f"{x['op_cost_us']:.1f} | {x['free_compute_ms']:.1f} / {x['rest_meas_ms']:.1f} | "
                   f"{x['bubble_ms']:.1f} | {x['blocking_pred_ms']:.1f} / "
                   f"{x['blocking_meas_ms']:.1f} | {x['params_meas']:,} / {x['params_pred']:,.0f} "
                   f"({x['params_pred'] / x['params_meas'] - 1:+.1%}) | {act} | {rat} |")
    med = statistics.median(abs(x["err"]) for x in rows)
    worst_b = max(max(abs(x["params_pred"] / x["params_meas"] - 1),
                      abs(x["act_pred"] / x["act_meas"] - 1) if x["act_meas"] else 0.0) for x in rows)
    errs = ", ".join(f"{x['err']:+.0%}" for x in rows)
    out.append(f"\nmedian |error| of step time: {med:.1%} over {len(rows)} configurations ({errs}); "
               f"worst bytes error {worst_b:.1%}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--configs", default=CONFIGS, help="comma-separated meshes: tp2dp2, pp2, ep2, ...")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the rows (and each job's raw measurements) here")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    exe = Path(sys.executable).parent / "tessera-run"
    rows, raw = [], []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in a.configs.split(","):
            c = parse_config(cfg)
            out = os.path.join(tmp, f"{cfg}.json")
            subprocess.run([str(exe), "-n", str(int(np.prod(list(c.values())))), str(Path(__file__).resolve()),
                            "--worker", "--config", cfg, "--steps", str(a.steps), "--out", out], check=True, timeout=600)
            raw.append(json.loads(Path(out).read_text()))
            rows.append(row(raw[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n" + table(rows) + f"\n({time.time() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
