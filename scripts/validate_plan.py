"""Validate the planner (tessera_rt.plan) against scripts/train.py on CPU ranks.

    .venv/bin/python scripts/validate_plan.py [--steps 12] [--configs 1x1,2x1,...]

For each (tp x dp) configuration one job runs, on the same ranks and in the same minute:
the calibration (op rates, the eager op cost, dist.all_reduce alpha/beta per group and the
raw mpi4py Allreduce beside it), the train.py loop, and the calibration again (the machine
is shared, so its speed drifts; the two are averaged).  The planner then predicts the step
time from those rates alone (op counts, FLOPs, bytes and collectives of the `char` preset),
and the per-rank parameter and activation bytes from its memory model; the table compares
them with the measured ones.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = "1x1,2x1,1x2,3x1,1x3,4x1,2x2,1x4"        # tp x dp


def _avg(a: dict, b: dict) -> dict:
    out = {}
    for k, v in a.items():
        out[k] = _avg(v, b[k]) if isinstance(v, dict) else (
            [(x + y) / 2 for x, y in zip(v, b[k])] if isinstance(v, list) and v and not isinstance(v[0], (list, str))
            else (v + b[k]) / 2 if isinstance(v, float) else v)
    return out


def worker(a) -> None:
    sys.path.insert(0, str(HERE))
    import train
    from mpi4py import MPI

    from tessera_rt import dist, nn
    from tessera_rt.plan.calibrate import measure_collectives, measure_compute
    from tessera_rt.plan.measure import local_bytes, traced_activation_bytes

    w = dist.init()
    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": a.dp, "tp": a.tp})
    axes = ["tp", "dp", ("dp", "tp")]
    cal = [(measure_compute(mesh=mesh), measure_collectives(mesh, axes))]
    targs = train.parse_args(["--tp", str(a.tp), "--dp", str(a.dp), "--steps", str(a.steps), "--no-plot",
                              "--no-checkpoint", "--quiet", "--out", a.out + ".train"])
    import time
    w0, c0 = time.perf_counter(), time.process_time()
    res = train.train(targs)
    run_share = (time.process_time() - c0) / (time.perf_counter() - w0)     # this rank's share of a core
    params = res["params"]          # after the steps: the optimizer's own arrays, not init-time views
    cal.append((measure_compute(mesh=mesh), measure_collectives(mesh, axes)))
    # bytes on this rank: the parameters train.py holds, and what one traced forward keeps
    text = train.load_text(targs.data)
    model = nn.Transformer(len(set(text)), targs.d_model, targs.heads, targs.layers, targs.seq, mesh=mesh)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, model.vocab, (targs.batch, targs.seq)) for _ in range(2))
    act = traced_activation_bytes(model.loss, params, model.batch(x), model.batch(y))
    per_rank = MPI.COMM_WORLD.gather({"params": local_bytes(params), "activations": act, "run_share": run_share},
                                     root=0)
    steps = np.array(res["step_times"][2:])
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, steps, op=MPI.MAX)        # the slowest rank sets the pace
    if w.rank == 0:
        comp = _avg(cal[0][0], cal[1][0])
        coll = _avg(cal[0][1], cal[1][1])
        Path(a.out).write_text(json.dumps({"tp": a.tp, "dp": a.dp, "step_s": float(np.median(steps)),
                                           "compute": comp, "collectives": coll, "bytes": per_rank,
                                           "vocab": model.vocab}))


def predict(r: dict, share: float | None = None) -> dict:
    """The planner's prediction from the job's calibration; ``share`` replaces the core
    share measured by the calibration (before and after the loop) with another one."""
    import dataclasses

    from tessera_rt import plan
    from tessera_rt.plan.calibrate import cluster_from
    n = r["tp"] * r["dp"]
    comp = dict(r["compute"], **({"share": share} if share else {}))
    # every rank ran the calibration at once: the ranks' contention is in the share (cores=0)
    cluster = cluster_from(comp, r["collectives"], n_gpus=n, cores=0)
    spec = dataclasses.replace(plan.get_model("char"), vocab=r["vocab"])
    lay = plan.Layout(tp=r["tp"], dp=r["dp"], micro_batch=-(-spec.batch // r["dp"]))
    t = plan.step_time(spec, cluster, lay, workload="train", batch=spec.batch, seq=spec.seq_len)
    mem = plan.memory_per_gpu(spec, cluster, lay, workload="train", batch=spec.batch, seq=spec.seq_len)
    return {"step_s": t["total"], "time": t, "params": mem["params"], "activations": mem["activations"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--configs", default=CONFIGS, help="tp x dp pairs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    exe = Path(sys.executable).parent / "tessera-run"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in a.configs.split(","):
            tp, dp = (int(v) for v in cfg.split("x"))
            out = os.path.join(tmp, f"{cfg}.json")
            subprocess.run([str(exe), "-n", str(tp * dp), str(Path(__file__).resolve()), "--worker", "--tp", str(tp),
                            "--dp", str(dp), "--steps", str(a.steps), "--out", out], check=True, timeout=600)
            r = json.loads(Path(out).read_text())
            pr = predict(r)
            in_run = statistics.mean(b["run_share"] for b in r["bytes"])
            pr_run = predict(r, share=in_run)
            meas_p = max(b["params"] for b in r["bytes"])
            meas_a = max(b["activations"] for b in r["bytes"])
            peer = r["collectives"]["peer"]
            mine = r["collectives"]["all_reduce"]
            ratio = {k: (peer[k][0] + peer[k][1] * 65536) / (mine[k][0] + mine[k][1] * 65536) for k in mine}
            rows.append({"tp": tp, "dp": dp, "measured_ms": r["step_s"] * 1e3, "predicted_ms": pr["step_s"] * 1e3,
                         "err": pr["step_s"] / r["step_s"] - 1, "params_meas": meas_p, "params_pred": pr["params"],
                         "share_cal": r["compute"]["share"], "share_run": in_run,
                         "predicted_run_share_ms": pr_run["step_s"] * 1e3,
                         "err_run_share": pr_run["step_s"] / r["step_s"] - 1,
                         "act_meas": meas_a, "act_pred": pr["activations"],
                         "compute_ms": pr["time"]["compute"] * 1e3,
                         "comm_ms": (pr["time"]["tp_comm"] + pr["time"]["dp_comm"]) * 1e3,
                         "peer_ratio_64k": ratio})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| ranks | mesh | measured ms/step | core share: calibration / run | predicted ms (calibration share) "
          "| error | predicted ms (run share) | error | predicted compute / comm ms "
          "| params B/rank meas / pred | activations B/rank meas / pred | peer/tessera all_reduce 64 KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        rat = ", ".join(f"n={k}: {v:.2f}" for k, v in x["peer_ratio_64k"].items()) or "-"
        print(f"| {x['tp'] * x['dp']} | tp={x['tp']} dp={x['dp']} | {x['measured_ms']:.1f} | {x['share_cal']:.2f} / "
              f"{x['share_run']:.2f} | {x['predicted_ms']:.1f} | {x['err']:+.0%} | {x['predicted_run_share_ms']:.1f} | "
              f"{x['err_run_share']:+.0%} | {x['compute_ms']:.1f} / {x['comm_ms']:.1f} | {x['params_meas']:,} / "
              f"{x['params_pred']:,.0f} ({x['params_pred'] / x['params_meas'] - 1:+.1%}) | {x['act_meas']:,} / "
              f"{x['act_pred']:,.0f} ({x['act_pred'] / x['act_meas'] - 1:+.1%}) | {rat} |")
    med = statistics.median(abs(x["err"]) for x in rows)
    med_run = statistics.median(abs(x["err_run_share"]) for x in rows)
    worst_b = max(max(abs(x["params_pred"] / x["params_meas"] - 1), abs(x["act_pred"] / x["act_meas"] - 1))
                  for x in rows)
    print(f"\nmedian |error| of step time: {med:.1%} with the calibration's core share, {med_run:.1%} with the "
          f"share measured during the run, over {len(rows)} configurations; worst bytes error {worst_b:.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
