"""One MoE layer, forward + backward over ep, beside a hand-written mpi4py Alltoallv dispatch.

    tessera-run -n 2 scripts/bench_moe.py [--tokens 4096] [--d-model 256] [--d-ff 512] [--experts 8]
    tessera-run -n 4 scripts/bench_moe.py

Both sides compute the same thing on the same tokens and weights: gate (x @ gate, softmax,
top-k, renormalize), dispatch to the experts' ranks, SwiGLU experts, return, weighted
combine, then the backward pass to x, the gate and the expert weights (the gate's gradient
all-reduced over ep, as training needs).  tessera_rt runs ``op.moe`` under ``ts.grad``
(dropless routing: a counts exchange and two payload all_to_alls each way).  The peer is
plain NumPy and mpi4py: an Alltoall of per-expert counts, Alltoallv of the sorted rows, one
matmul per local expert on its exact rows, Alltoallv back, and the hand-derived backward.
Times are medians over repetitions (the two sides interleaved) of the slowest rank; ratio = peer time / tessera_rt
time (>= 1: tessera_rt is as fast).  The phase split is tessera_rt's host clock per phase
(``layer.timings``).  The FP8 line compares the bytes the payload all_to_alls send
(trace records) with and without ``quantize_fp8=True``.
"""
from __future__ import annotations

import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import statistics
import time

import numpy as np
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, op
from tessera_rt.dist.tensor.shard import split_offsets, split_sizes


def _silu_parts(h):
    s = 1.0 / (1.0 + np.exp(-h))
    return h * s, s


class Peer:
    """A hand-written expert-parallel MoE layer on NumPy + mpi4py (forward and backward)."""

    def __init__(self, comm, params, k: int):
        self.comm, self.k = comm, k
        n, me = comm.Get_size(), comm.Get_rank()
        e = params["gate"].shape[1]
        self.lo = split_offsets(e, n)
        self.ne = split_sizes(e, n)
        lo, hi = self.lo[me], self.lo[me] + self.ne[me]
        self.gate = params["gate"]
        self.w1, self.w3, self.w2 = (np.ascontiguousarray(params[w][lo:hi]) for w in ("w1", "w3", "w2"))

    def _a2av(self, rows, send_rows, recv_rows):
        d = rows.shape[1]
        out = np.empty((int(sum(recv_rows)), d), rows.dtype)
        sc, rc = [c * d for c in send_rows], [c * d for c in recv_rows]
        self.comm.Alltoallv([rows, (sc, np.cumsum([0] + sc[:-1]))], [out, (rc, np.cumsum([0] + rc[:-1]))])
        return out

    def step(self, x, gy):
        comm, k, n = self.comm, self.k, self.comm.Get_size()
        t, d = x.shape
        e = self.gate.shape[1]
        logits = x @ self.gate
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        idx = np.argsort(-p, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(p, idx, 1)
        denom = top.sum(1, keepdims=True)
        w = top / denom
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        cnt = np.bincount(flat, minlength=e)
        send_rows = [int(cnt[lo:lo + ne].sum()) for lo, ne in zip(self.lo, self.ne)]
        nle = self.w1.shape[0]
        mine = np.concatenate([cnt[lo:lo + ne] for lo, ne in zip(self.lo, self.ne)])
        rcnt = np.empty(n * nle, np.int64)
        comm.Alltoallv([mine.astype(np.int64), (list(self.ne), list(self.lo))],
                       [rcnt, ([nle] * n, [i * nle for i in range(n)])])
        rcnt = rcnt.reshape(n, nle)
        recv_rows = [int(v) for v in rcnt.sum(1)]
        recv = self._a2av(np.ascontiguousarray(x[order // k]), send_rows, recv_rows)
        owner = np.repeat(np.tile(np.arange(nle), n), rcnt.reshape(-1))       # local expert of each row
        eorder = np.argsort(owner, kind="stable")
        xs = recv[eorder]
        bounds = np.concatenate([[0], np.cumsum(rcnt.sum(0))])
        out = np.empty_like(xs)
        saved = []
        for j in range(nle):
            xe = xs[bounds[j]:bounds[j + 1]]
            h1, h3 = xe @ self.w1[j], xe @ self.w3[j]
            act, sig = _silu_parts(h1)
            out[bounds[j]:bounds[j + 1]] = (act * h3) @ self.w2[j]
            saved.append((xe, h1, h3, act, sig))
        back_send = np.empty_like(out)
        back_send[eorder] = out
        back = self._a2av(back_send, recv_rows, send_rows)
        o = np.empty((t * k, d), x.dtype)
        o[order] = back
        y = (o.reshape(t, k, d) * w[:, :, None]).sum(1)
        # backward
        gw = (o.reshape(t, k, d) * gy[:, None, :]).sum(2)
        gtop = (gw - (gw * w).sum(1, keepdims=True)) / denom
        gp = np.zeros_like(p)
        np.put_along_axis(gp, idx, gtop, 1)
        glogits = p * (gp - (gp * p).sum(1, keepdims=True))
        ggate = x.T @ glogits
        comm.Allreduce(MPI.IN_PLACE, ggate)
        gsend = (gy[:, None, :] * w[:, :, None]).reshape(t * k, d)[order]
        grecv = self._a2av(np.ascontiguousarray(gsend), send_rows, recv_rows)[eorder]
        dxs = np.empty_like(grecv)
        gws = []
        for j in range(nle):
            g = grecv[bounds[j]:bounds[j + 1]]
            xe, h1, h3, act, sig = saved[j]
            gws.append((act * h3).T @ g)
            da = g @ self.w2[j].T
            dh3 = da * act
            dh1 = da * h3 * sig * (1 + h1 * (1 - sig))
            gws.append((xe.T @ dh1, xe.T @ dh3))
            dxs[bounds[j]:bounds[j + 1]] = dh1 @ self.w1[j].T + dh3 @ self.w3[j].T
        dsend = np.empty_like(dxs)
        dsend[eorder] = dxs
        dback = self._a2av(dsend, recv_rows, send_rows)
        dxo = np.empty((t * k, d), x.dtype)
        dxo[order] = dback
        dx = dxo.reshape(t, k, d).sum(1) + glogits @ self.gate.T
        return y, dx, ggate


def timed(fns, reps: int, comm) -> list[float]:
    """Median time of each function (slowest rank), the functions interleaved rep by rep so
    that load from other processes falls on both sides alike."""
    for fn in fns:
        fn()                                            # warm up (buffers, communicators)
    out = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            out[i].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return [statistics.median(o) for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="global tokens per step")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dist.init()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = dist.Mesh(axes=["ep"], shape={"ep": n})
    rows = dist.ShardSpec(partition=("row",), mesh_axes=("ep",))
    layer = op.moe(num_experts=a.experts, top_k=a.top_k, capacity_factor=None, d_model=a.d_model, d_ff=a.d_ff,
                   mesh=mesh)
    params = layer.init(0)
    rng = np.random.default_rng(1)
    xg = rng.standard_normal((a.tokens, a.d_model)).astype(np.float32)
    gg = rng.standard_normal((a.tokens, a.d_model)).astype(np.float32)
    X, G = (dist.distribute(v, layout=rows, mesh=mesh) for v in (xg, gg))
    P = layer.shard(params)

    def objective(p, x):
        return op.sum(op.mul(layer(p, x)[0], G))
    step = ts.grad(objective, argnums=(0, 1))
    peer = Peer(comm, params, a.top_k)
    xl, gl = X.to_local(), G.to_local()
    # the two sides agree before anything is timed
    grads = step(P, X)
    y_peer, dx_peer, ggate_peer = peer.step(xl, gl)
    y_ts = layer(P, X)[0].to_local()
    assert np.allclose(y_ts, y_peer, rtol=1e-4, atol=1e-4), "tessera_rt and the peer disagree on y"
    assert np.allclose(grads[1].to_local(), dx_peer, rtol=1e-3, atol=1e-3), "disagree on dx"
    assert np.allclose(grads[0]["gate"].to_local(), ggate_peer, rtol=1e-3, atol=1e-3), "disagree on dgate"

    t_ts, t_peer = timed([lambda: step(P, X), lambda: peer.step(xl, gl)], a.reps, comm)
    layer.timings = {}
    for _ in range(a.reps):
        step(P, X)
    phases = {k: v / a.reps for k, v in layer.timings.items()}
    layer.timings = None
    wire = {}
    for fp8 in (False, True):
        lay = op.moe(num_experts=a.experts, top_k=a.top_k, capacity_factor=None, d_model=a.d_model,
                     d_ff=a.d_ff, mesh=mesh, quantize_fp8=fp8)
        with dist.trace_collectives() as log:
            lay(P, X)
        wire[fp8] = comm.allreduce(sum(r.bytes_sent for r in log.records if r.dtype != "int64"))
    if rank == 0:
        print(f"# MoE layer fwd+bwd, ep={n}, {a.tokens} tokens, d_model={a.d_model}, d_ff={a.d_ff}, "
              f"E={a.experts}, top_k={a.top_k}, dropless, f32, CPU ranks")
        print(f"{'impl':>10} {'ms/step':>9} {'tokens/s':>10} {'ratio':>6}")
        print(f"{'tessera_rt':>10} {t_ts * 1e3:9.2f} {a.tokens / t_ts:10.0f} {t_peer / t_ts:6.2f}")
        print(f"{'mpi4py':>10} {t_peer * 1e3:9.2f} {a.tokens / t_peer:10.0f} {1.0:6.2f}")
        total = sum(phases.values())
        print("phase split (rank 0, ms/step): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items())
              + f" (sum {total * 1e3:.2f})")
        print(f"FP8 wire: {wire[True]} B vs {wire[False]} B f32 per forward (all ranks): "
              f"{wire[True] / max(wire[False], 1):.3f}x, {wire[False] - wire[True]} B saved")


if __name__ == "__main__":
    main()
