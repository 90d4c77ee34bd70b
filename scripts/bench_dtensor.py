"""DTensor benchmarks: eager overhead per op, and redistribution against hand-written mpi4py.

    tessera-run -n 2 python scripts/bench_dtensor.py            # or: mpiexec -n 2 python ...
    mpiexec -n 2 python scripts/bench_dtensor.py --no-torch --json out.json

Part 1 times each DTensor op on small tensors (no communication) against the same op on
the local arrays (the kernel table for matmul/softmax/layernorm, NumPy for the rest); the
difference is the dispatcher's overhead (target: <= 10 us elementwise, <= 20 us matmul).
Part 2 times each redistribution against the same data movement written by hand with
mpi4py on COMM_WORLD (speed ratio = hand time / tessera time; target >= 0.9), their
repeats interleaved so both meet the same load on a shared machine; the hand-written side
makes its buffers once, so each case is also timed with ``redistribute(dst, out=Y)`` into a
kept result (the "out=" columns, against the same hand-written exchange).  When torch
imports, torch.distributed.tensor on gloo runs the same ops in the same process.
Times are medians over repeats of the slowest rank's mean per call (part 2 also gives the
minimum over its repeats, the figure least disturbed by other load on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from tessera_rt import dist, op
from tessera_rt.backend import get_backend, mapped_empty

COMM = MPI.COMM_WORLD


def timeit(fn, *, calls: int, repeats: int = 7, sync: bool = False) -> float:
    """Median over repeats of the slowest rank's mean µs per call."""
    for _ in range(max(3, calls // 10)):
        fn()
    per = []
    for _ in range(repeats):
        COMM.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = (time.perf_counter() - t0) / calls * 1e6
        per.append(COMM.allreduce(dt, op=MPI.MAX) if sync else dt)
    if not sync:
        return COMM.allreduce(statistics.median(per), op=MPI.MAX)
    return statistics.median(per)


def timeit_pair(fa, fb, *, calls: int, repeats: int = 9) -> tuple[float, float, float, float]:
    """timeit(sync=True) of two functions with their repeats interleaved (a, b, a, b, ...), so
    both meet the same load on a shared machine: (median of a, median of b, min of a, min of b)."""
    for f in (fa, fb):
        for _ in range(max(3, calls // 10)):
            f()
    per = ([], [])
    for _ in range(repeats):
        for f, out in zip((fa, fb), per):
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            out.append(COMM.allreduce((time.perf_counter() - t0) / calls * 1e6, op=MPI.MAX))
    return statistics.median(per[0]), statistics.median(per[1]), min(per[0]), min(per[1])


# --------------------------------------------------------------------------- part 1: overhead

def overhead_cases(mesh, n: int):
    xp = get_backend().xp
    kern = get_backend().kernel
    S0 = dist.ShardSpec((0,), ("tp",))
    S1 = dist.ShardSpec((1,), ("tp",))
    g = np.random.RandomState(0).randn(64 * n, 64).astype(np.float32)
    w = np.random.RandomState(1).randn(64, 64).astype(np.float32)
    A, B = dist.distribute(g, layout=S0, mesh=mesh), dist.distribute(g + 1, layout=S0, mesh=mesh)
    W, Wc = dist.distribute(w, mesh=mesh), dist.distribute(w, layout=S1, mesh=mesh)
    Xr = dist.distribute(w, mesh=mesh)
    a, b, wl, wc = A.to_local(), B.to_local(), W.to_local(), Wc.to_local()
    lnw = np.ones(64, np.float32)
    return [
        ("add", "S(0)+S(0)", "elementwise", lambda: A + B, lambda: xp.add(a, b)),
        ("mul scalar", "S(0)*2", "elementwise", lambda: A * 2.0, lambda: xp.multiply(a, 2.0)),
        ("neg", "-S(0)", "elementwise", lambda: -A, lambda: xp.negative(a)),
        ("exp", "exp S(0)", "elementwise", lambda: op.exp(A), lambda: xp.exp(a)),
        ("gt", "S(0)>S(0)", "elementwise", lambda: A > B, lambda: xp.greater(a, b)),
        ("sum(axis=1)", "S(0)", "elementwise", lambda: A.sum(axis=1), lambda: xp.sum(a, axis=1)),
        ("transpose", "S(0).T", "elementwise", lambda: A.T, lambda: xp.transpose(a)),
        ("matmul", "S(0)@R", "matmul", lambda: A @ W, lambda: kern("matmul")(a, wl)),
        ("matmul col-par", "R@S(1)", "matmul", lambda: Xr @ Wc, lambda: kern("matmul")(wl, wc)),
        ("matmul tiled", "S(0)@R tile", "matmul", lambda: op.matmul(A, W, tile_shape=(64, 64, 32)),
         lambda: kern("matmul")(a, wl, tile_shape=(64, 64, 32))),
        ("softmax", "S(0) axis=-1", "matmul", lambda: op.softmax(A), lambda: kern("softmax")(a, axis=-1)),
        ("layernorm", "S(0)", "matmul", lambda: op.layernorm(A, lnw), lambda: kern("layernorm")(a, lnw)),
    ]


def run_overhead(mesh, n, calls):
    rows = []
    for name, layout, family, dfn, lfn in overhead_cases(mesh, n):
        t_local = timeit(lfn, calls=calls)
        t_dt = timeit(dfn, calls=calls)
        target = 10.0 if family == "elementwise" else 20.0
        rows.append(dict(op=name, layout=layout, local_us=t_local, dtensor_us=t_dt,
                         overhead_us=t_dt - t_local, target_us=target))
    return rows


# --------------------------------------------------------------------------- part 2: redistribution

def _counts(length, n):
    return dist.split_sizes(length, n)


def hand_written(case: str, local, shape, n: int, rank: int):
    """The same movement written directly with mpi4py on NumPy buffers (the fixed-size MPI
    collective when the parts are equal, the -v form otherwise).  Its buffers are made once,
    on the kind of memory tessera's pool gives large outputs (``mapped_empty``)."""
    M, N = shape
    mt = MPI.FLOAT
    even = M % n == 0 and N % n == 0
    if even and case == "S(0)->R":
        out = mapped_empty((M, N), np.float32)
        return lambda: COMM.Allgather(local, out)
    if even and case == "P->S(0)":
        out = mapped_empty((M // n, N), np.float32)
        return lambda: COMM.Reduce_scatter_block(local, out, op=MPI.SUM)
    if case == "S(0)->R":
        rows = _counts(M, n)
        out = mapped_empty((M, N), np.float32)
        counts = [r * N for r in rows]
        displs = list(np.cumsum([0] + counts[:-1]))
        return lambda: COMM.Allgatherv(local, [out, counts, displs, mt])
    if case == "S(1)->R":
        cols = _counts(N, n)
        buf = mapped_empty(M * N, np.float32)
        counts = [c * M for c in cols]
        displs = list(np.cumsum([0] + counts[:-1]))
        out = mapped_empty((M, N), np.float32)
        offs = list(np.cumsum([0] + list(cols[:-1])))

        def run():
            if even:
                COMM.Allgather(local, buf)
            else:
                COMM.Allgatherv(local, [buf, counts, displs, mt])
            for j in range(n):
                out[:, offs[j]:offs[j] + cols[j]] = buf[displs[j]:displs[j] + counts[j]].reshape(M, cols[j])
        return run
    if case == "P->R":
        out = mapped_empty(local.shape, local.dtype)
        return lambda: COMM.Allreduce(local, out, op=MPI.SUM)
    if case == "P->S(0)":
        rows = _counts(M, n)
        out = mapped_empty((rows[rank], N), np.float32)
        return lambda: COMM.Reduce_scatter(local, out, [r * N for r in rows], op=MPI.SUM)
    if case == "S(0)->S(1)":
        rows, cols = _counts(M, n), _counts(N, n)
        coffs = list(np.cumsum([0] + list(cols[:-1])))
        m_me, n_me = rows[rank], cols[rank]
        send = mapped_empty(m_me * N, np.float32)
        scounts = [m_me * c for c in cols]
        sdispl = list(np.cumsum([0] + scounts[:-1]))
        rcounts = [r * n_me for r in rows]
        rdispl = list(np.cumsum([0] + rcounts[:-1]))
        out = mapped_empty((M, n_me), np.float32)

        def run():
            if even:                          # one vectorized copy packs every destination's columns
                send.reshape(n, m_me, n_me)[...] = local.reshape(m_me, n, n_me).transpose(1, 0, 2)
                COMM.Alltoall(send, out)
                return
            for j in range(n):               # pack each destination's columns contiguously
                send[sdispl[j]:sdispl[j] + scounts[j]].reshape(m_me, cols[j])[...] = \
                    local[:, coffs[j]:coffs[j] + cols[j]]
            COMM.Alltoallv([send, scounts, sdispl, mt], [out, rcounts, rdispl, mt])
        return run
    raise KeyError(case)


def run_redistribute(mesh, n, rank, sizes, calls):
    S0, S1 = dist.ShardSpec((0,), ("tp",)), dist.ShardSpec((1,), ("tp",))
    R, P = dist.ReplicateSpec(), dist.PartialSpec("sum", ("tp",))
    cases = [("S(0)->R", S0, R), ("S(1)->R", S1, R), ("P->R", P, R), ("P->S(0)", P, S0),
             ("S(0)->S(1)", S0, S1)]
    rows = []
    for shape in sizes:
        g = np.random.RandomState(2).randn(*shape).astype(np.float32)
        for name, src, dst in cases:
            X = dist.distribute(g, layout=src, mesh=mesh)
            plan = X.explain_redistribute(dst)
            hand = hand_written(name, np.ascontiguousarray(X.to_local()), shape, n, rank)
            t_ts, t_hand, min_ts, min_hand = timeit_pair(lambda: X.redistribute(dst), hand, calls=calls)
            Y = X.redistribute(dst)
            t_out, t_hand_out, _, _ = timeit_pair(lambda: X.redistribute(dst, out=Y), hand, calls=calls)
            rows.append(dict(case=name, shape=list(shape), bytes=int(g.nbytes), steps=list(plan.collectives),
                             tessera_us=t_ts, mpi4py_us=t_hand, ratio=t_hand / t_ts,
                             tessera_min_us=min_ts, mpi4py_min_us=min_hand, ratio_min=min_hand / min_ts,
                             tessera_out_us=t_out, ratio_out=t_hand_out / t_out))
    return rows


# --------------------------------------------------------------------------- part 3: choices by predicted time

def run_moves(n, sizes, calls):
    """Layout changes that take several one-axis steps, timed as those steps (before), as one
    direct all_to_all, and as the cost model chooses (after), interleaved in one run; and a
    matmul whose operand layouts conflict, decided by the old rule (larger operand wins) and
    by the model.  2x2 mesh at 4 ranks, 1-D otherwise."""
    from tessera_rt.dist.tensor import cost
    from tessera_rt.dist.tensor.layout import Layout
    from tessera_rt.dist.tensor.redistribute import plan_redistribute
    shape2 = {"x": 2, "y": 2} if n == 4 else {"x": n, "y": 1}
    mesh = dist.Mesh(axes=["x", "y"], shape=shape2)
    cases = [("swap", Layout((("x",), ("y",))), Layout((("y",), ("x",)))),
             ("S(0)@x.y->S(1)@x.y", Layout((("x", "y"), ())), Layout(((), ("x", "y")))),
             ("S(0)@x.y->S(0)@y.x", Layout((("x", "y"), ())), Layout((("y", "x"), ())))]
    rows = []
    for shape in sizes:
        g = np.random.RandomState(3).randn(*shape).astype(np.float32)
        for name, src, dst in cases:
            loc = np.ascontiguousarray(g[dist.local_slices(shape, src, mesh)])
            plans = {k: plan_redistribute(shape, src, dst, mesh, g.dtype, direct=d)
                     for k, d in (("steps", False), ("direct", True), ("model", None))}
            t = {k: timeit(lambda p=p: p.run(loc), calls=calls, sync=True) for k, p in plans.items()}
            rows.append(dict(case=name, shape=list(shape), steps=list(plans["steps"].collectives),
                             chosen="direct" if any("direct" in st.detail for st in plans["model"].steps) else "steps",
                             steps_us=t["steps"], direct_us=t["direct"], model_us=t["model"],
                             predicted_steps_us=plans["steps"].predicted_s * 1e6,
                             predicted_direct_us=plans["direct"].predicted_s * 1e6))
    mesh1 = dist.Mesh(axes=["x"], shape={"x": n})
    S1 = dist.ShardSpec((1,), ("x",))
    model_after = cost.get_cost_model()
    for m in (256, 1024):
        A = dist.distribute(np.random.RandomState(4).randn(m, m).astype(np.float32), layout=S1, mesh=mesh1)
        B = dist.distribute(np.random.RandomState(5).randn(m, m - m // 8).astype(np.float32), layout=S1, mesh=mesh1)
        for what, fn in (("matmul S(1)@S(1)", lambda: A @ B), ("  + full_tensor", lambda: (A @ B).full_tensor())):
            t = {}
            for _ in range(3):                               # interleaved: old, model, old, model, ...
                for k, model in (("old", _ZeroCost()), ("model", model_after)):
                    cost.set_cost_model(model)
                    t.setdefault(k, []).append(timeit(fn, calls=max(3, calls // 2), sync=True))
            cost.set_cost_model(model_after)
            rows.append(dict(case=what, shape=[m, m, m - m // 8], old_us=statistics.median(t["old"]),
                             model_us=statistics.median(t["model"])))
    return rows


def cost_model_name() -> str:
    from tessera_rt.dist.tensor import cost
    return cost.get_cost_model().name


class _ZeroCost:
    """Every choice ties, so dist's old rules decide (the "before" of part 3)."""
    name = "zero"

    def collective_time(self, op, size, n):
        return 0.0

    def copy_time(self, nbytes):
        return 0.0


def report_moves(rows, n) -> None:
    print(f"\n# choices by predicted time, {n} ranks, float32 (median us/call of the slowest rank; "
          "steps = one axis per step, direct = one all_to_all)")
    print(f"{'case':<22}{'shape':<18}{'steps':<24}{'steps':>9}{'direct':>9}{'model':>9}{'chosen':>8}"
          f"{'pred steps':>11}{'pred direct':>12}")
    for r in rows:
        if "steps_us" in r:
            print(f"{r['case']:<22}{str(tuple(r['shape'])):<18}{','.join(r['steps']) or '-':<24}"
                  f"{r['steps_us']:>9.1f}{r['direct_us']:>9.1f}{r['model_us']:>9.1f}{r['chosen']:>8}"
                  f"{r['predicted_steps_us']:>11.1f}{r['predicted_direct_us']:>12.1f}")
        else:
            print(f"{r['case']:<32}{str(tuple(r['shape'])):<20} old rule {r['old_us']:>9.1f}  model "
                  f"{r['model_us']:>9.1f}  ratio {r['old_us'] / r['model_us']:.2f}")
    sys.stdout.flush()


# --------------------------------------------------------------------------- torch peer

def torch_peer(n, rank, sizes, calls):
    try:
        import torch
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    except Exception as e:
        return {"error": f"torch unavailable: {type(e).__name__}: {e}"}
    torch.set_num_threads(1)
    port = COMM.bcast(29500 + (os.getpid() % 2000) if rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    tdist.init_process_group("gloo", rank=rank, world_size=n)
    tmesh = init_device_mesh("cpu", (n,))
    g = torch.from_numpy(np.random.RandomState(0).randn(64 * n, 64).astype(np.float32))
    w = torch.from_numpy(np.random.RandomState(1).randn(64, 64).astype(np.float32))
    A, B = distribute_tensor(g, tmesh, [Shard(0)]), distribute_tensor(g + 1, tmesh, [Shard(0)])
    W = distribute_tensor(w, tmesh, [Replicate()])
    a, b, wl = A.to_local(), B.to_local(), W.to_local()
    cases = [("add", lambda: A + B, lambda: a + b), ("mul scalar", lambda: A * 2.0, lambda: a * 2.0),
             ("neg", lambda: -A, lambda: -a), ("exp", lambda: A.exp(), lambda: a.exp()),
             ("sum(axis=1)", lambda: A.sum(dim=1), lambda: a.sum(dim=1)),
             ("matmul", lambda: A @ W, lambda: a @ wl),
             ("softmax", lambda: torch.softmax(A, dim=-1), lambda: torch.softmax(a, dim=-1))]
    over = []
    with torch.no_grad():
        for name, dfn, lfn in cases:
            tl, td = timeit(lfn, calls=max(50, calls // 4)), timeit(dfn, calls=max(50, calls // 4))
            over.append(dict(op=name, local_us=tl, dtensor_us=td, overhead_us=td - tl))
    redis = []
    place = {"S(0)": [Shard(0)], "S(1)": [Shard(1)], "R": [Replicate()], "P": [Partial()]}
    for shape in sizes:
        full = torch.from_numpy(np.random.RandomState(2).randn(*shape).astype(np.float32))
        for name in ("S(0)->R", "S(1)->R", "P->R", "P->S(0)", "S(0)->S(1)"):
            s, d = name.split("->")
            if s == "P":
                X = DTensor.from_local(full.clone(), tmesh, place["P"], run_check=False)
            else:
                X = distribute_tensor(full, tmesh, place[s])
            with torch.no_grad():
                t = timeit(lambda: X.redistribute(tmesh, place[d]).to_local(), calls=calls, sync=True)
            redis.append(dict(case=name, shape=list(shape), torch_us=t))
    tdist.destroy_process_group()
    return {"version": torch.__version__, "overhead": over, "redistribute": redis}


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per repeat (overhead)")
    ap.add_argument("--redis-calls", type=int, default=20, help="calls per repeat (redistribution)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument("--moves", action="store_true", help="only part 3: choices by predicted time")
    ap.add_argument("--calibrated", action="store_true",
                    help="part 3 with the planner's `local` calibration as the cost model (else dist's built-in)")
    args = ap.parse_args(argv)
    w = dist.init()
    n, rank = w.size, w.rank
    mesh = dist.Mesh(axes=["tp"], shape={"tp": n})
    sizes = [(256, 256), (1024, 1024), (2048, 2048)]
    res = {"ranks": n, "machine": f"{os.cpu_count()} CPU cores, backend {get_backend().name}"}
    if args.moves:
        if args.calibrated:
            from tessera_rt import plan
            res["cost_model"] = plan.use_calibrated("local").name
        res["moves"] = run_moves(n, sizes, args.redis_calls)
        if rank == 0:
            print(f"\ncost model: {cost_model_name()}")
            report_moves(res["moves"], n)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
        return 0
    res["overhead"] = run_overhead(mesh, n, args.calls)
    res["redistribute"] = run_redistribute(mesh, n, rank, sizes, args.redis_calls)
    if not args.no_torch:
        res["torch"] = torch_peer(n, rank, sizes, args.redis_calls)
    if rank == 0:
        report(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


def _fmt(row, key: str) -> str:
    return "-" if not row else f"{row[key]:.1f}"


def report(res) -> None:
    tor = res.get("torch", {})
    tover = {r["op"]: r for r in tor.get("overhead", [])}
    print(f"# DTensor eager overhead, {res['ranks']} ranks, {res['machine']}, float32 [64*n, 64] (median us/call)")
    print(f"{'op':<16}{'layout':<14}{'local':>9}{'DTensor':>10}{'overhead':>10}{'target':>8}  "
          f"{'torch DT ovh':>12}")
    for r in res["overhead"]:
        t = tover.get(r["op"])
        ok = "ok" if r["overhead_us"] <= r["target_us"] else "MISS"
        print(f"{r['op']:<16}{r['layout']:<14}{r['local_us']:>9.2f}{r['dtensor_us']:>10.2f}{r['overhead_us']:>10.2f}"
              f"{r['target_us']:>7.0f} {ok:<4}{_fmt(t, 'overhead_us'):>10}")
    tred = {(r["case"], tuple(r["shape"])): r for r in tor.get("redistribute", [])}
    print(f"\n# redistribution, {res['ranks']} ranks, float32 (median us/call of the slowest rank)")
    print(f"{'case':<12}{'shape':<14}{'MB':>6}{'steps':<18}{'tessera':>10}{'mpi4py':>10}{'ratio':>7}{'torch':>10}"
          f"{'min ts':>10}{'min mpi':>10}{'ratio':>7}{'out=':>10}{'ratio':>7}")
    for r in res["redistribute"]:
        t = tred.get((r["case"], tuple(r["shape"])))
        print(f"{r['case']:<12}{str(tuple(r['shape'])):<14}{r['bytes'] / 2**20:>6.1f} {','.join(r['steps']) or '-':<17}"
              f"{r['tessera_us']:>10.1f}{r['mpi4py_us']:>10.1f}{r['ratio']:>7.2f}"
              f"{_fmt(t, 'torch_us'):>10}{r['tessera_min_us']:>10.1f}{r['mpi4py_min_us']:>10.1f}{r['ratio_min']:>7.2f}"
              f"{r['tessera_out_us']:>10.1f}{r['ratio_out']:>7.2f}")
    if "error" in tor:
        print(f"\n(torch peer: {tor['error']})")
    elif tor:
        print(f"\n(torch {tor['version']} DTensor on gloo in the same run)")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
