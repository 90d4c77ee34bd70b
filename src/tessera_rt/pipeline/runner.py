"""``dist.Pipeline``: one training step of a stage-split model over the ``pp`` axis.

    mesh = dist.Mesh(axes=["pp", "dp", "tp"], shape={"pp": 2, "dp": 1, "tp": 2})
    model = nn.Transformer(vocab, d_model, n_heads, n_layers, seq_len, mesh=mesh)
    params = model.init(seed=0)                  # this rank's stage only
    pipe = dist.Pipeline(model, mesh=mesh, axis="pp", microbatches=8, schedule="1f1b")
    loss, grads = pipe.value_and_grad(params, x, y)   # x, y: the global (B, S) batch
    pipe.stats()

Each stage runs its schedule (pipeline/schedules) on its stage mesh: a forward is
``ts.vjp`` of the stage's function (its pullback kept until the backward), a backward runs
the pullback with the received output gradient.  Boundary tensors travel as non-blocking
``dist.send``/``dist.recv`` along ``pp`` on their own stream role (``pp``), ordered against
compute with events by the collectives layer; a receive is posted two actions before it is
needed, so a stage computes micro-batch i+1 while i travels.  A backward sends its input's
gradient before it computes the weight gradients of its matmuls (``vjp``'s
``weights_later``), so the stage upstream starts its backward while those run.  Raw (un-reduced) gradients
accumulate over micro-batches; the all-reduce of a chunk's gradients over dp/tp starts the
moment its last backward is done and is waited for at the end of the step.

The model protocol (nn.Transformer implements it): ``stage_plan`` (pipeline.stages),
``split_params``/``join_params``, ``stage_forward(p, vs, h, targets)``, ``stage_boundary(rows)``,
``batch(tokens)``, ``seq_len`` and ``dtype``.  A non-last stage may return ``(activation,
aux)``, a scalar loss term of its own (an MoE block's balance loss): its backward seeds
``aux`` with the micro-batch's weight in the batch mean alongside the received activation
gradient, and the reported loss adds every stage's terms (the per-stage sums travel in the
all_gather over pp that the stats make anyway).  The step computes the gradient of
``sum_mb rows_mb / batch * loss(micro-batch mb)``, which for losses that are means over
tokens (cross-entropy) is the batch mean, and for MoE balance losses is the per-micro-batch
loss that gradient accumulation on one rank computes.
"""
from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from .. import runtime as rt
from ..autodiff import reduce_grads, vjp
from ..dist.comm import collectives as C, p2p
from ..dist.comm.hooks import note
from ..dist.comm.mesh import Mesh
from ..dist.comm.process_group import world
from ..dist.tensor import dtensor_collectives as DC
from ..dist.tensor.dtensor import DTensor, full, zeros
from ..dist.tensor.layout import as_layout
from ..dist.tensor.shard import split_sizes
from ..nn.transformer import Transformer
from .schedules import check_link_order, layout_problems, schedule_for
from .stats import PipelineStats, record_spans

__all__ = ["Pipeline", "ROLE"]

ROLE = "pp"          # the stream role of stage-boundary sends and receives
# Receives are posted this many actions before they are needed (MPI on the CPU: an early
# Irecv blocks nothing).  On the GPU, send/recv run in order on the pp stream (NCCL groups
# them): a receive queued early would hold back the sends queued after it, which its
# sender may be waiting for, so there each receive is queued when it is needed.
LOOKAHEAD = 2


def _ensure_role() -> None:
    m = rt.stream_map()
    if ROLE not in m:
        rt.set_stream_map({ROLE: max(m.values()) + 1})      # a stream of its own


def _xp():
    from ..backend import get_backend
    return get_backend().xp


def _on_device(a: np.ndarray):
    return _xp().asarray(a)


def _to_host(a) -> np.ndarray:
    from ..backend import get_backend
    return np.asarray(get_backend().to_host(a))


def _accumulate(acc, g):
    """acc + g leaf by leaf, in place where the pieces allow (the same layout, writeable)."""
    if acc is None:
        return g
    if isinstance(acc, dict):
        return {k: _accumulate(acc[k], g[k]) for k in acc}
    if isinstance(acc, list):
        return [_accumulate(a, b) for a, b in zip(acc, g)]
    if type(acc) is DTensor and type(g) is DTensor and acc.layout == g.layout \
            and getattr(acc.to_local().flags, "writeable", True):
        acc.to_local()[...] += g.to_local()
        return acc
    if type(acc) is not DTensor and getattr(getattr(acc, "flags", None), "writeable", True) \
            and type(acc) is type(g) and acc.shape == g.shape and acc.dtype == g.dtype:
        acc += g
        return acc
    from .. import op
    return op.add(acc, g)


class Pipeline:
    """A pipelined ``value_and_grad`` over the ``axis`` of ``mesh`` (see the module doc).

    Parameters
    ----------
    model : nn.Transformer
        A model built on a mesh with the pipeline axis (it has a ``stage_plan``).
    mesh : Mesh, optional
        Default: the model's stage plan's mesh.
    axis : str
        The pipeline axis.
    microbatches : int
        Micro-batches per step (the batch splits evenly).
    schedule : str
        "gpipe", "1f1b" or "interleaved".
    """

    def __init__(self, model: Transformer, mesh: Mesh | None = None, axis: str = "pp", microbatches: int = 1,
                 schedule: str = "1f1b"):
        plan = getattr(model, "stage_plan", None)
        mesh = mesh if mesh is not None else getattr(plan, "mesh", None)
        rank = world().rank
        if mesh is None or axis not in mesh.axes:
            raise ValueError(f"rank {rank}: dist.Pipeline needs a mesh with a {axis!r} axis (got {mesh!r}); "
                             f"e.g. dist.Mesh(axes=[{axis!r}, 'dp'], shape={{{axis!r}: 2, 'dp': 1}})")
        self.schedule_fn = schedule_for(schedule)
        if isinstance(microbatches, bool) or not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
            raise ValueError(f"rank {rank}: dist.Pipeline(microbatches={microbatches!r}) must be an int >= 1")
        if plan is None or plan.mesh != mesh or plan.axis != axis:
            raise ValueError(f"rank {rank}: dist.Pipeline: the model was not split over {axis!r} of {mesh!r}; "
                             f"build it with that mesh (nn.Transformer(..., mesh=mesh)) so each rank holds its stage")
        if schedule == "interleaved":
            if plan.virtual < 2:
                raise ValueError(f"rank {rank}: schedule='interleaved' needs virtual stages: build the model with "
                                 "nn.Transformer(..., virtual_stages=2) (or more)")
            # the layers were split by the StagePlan already (stage_of= may be uneven): the rules left
            bad = layout_problems(n_layers=plan.n_virtual, pp=plan.pp, microbatches=int(microbatches),
                                  schedule=schedule, virtual=plan.virtual)
            if bad:
                raise ValueError(f"rank {rank}: {'; '.join(bad)}")
        elif plan.virtual > 1:
            raise ValueError(f"rank {rank}: the model has virtual_stages={plan.virtual}: use "
                             f"schedule='interleaved' (or build it with virtual_stages=1 for {schedule!r})")
        self.model, self.mesh, self.axis, self.plan = model, mesh, axis, plan
        self.microbatches, self.schedule = int(microbatches), schedule
        self.stage = plan.stage
        self.actions = self.schedule_fn(plan.pp, self.stage, self.microbatches, plan.virtual)
        # Boundary messages carry no tag (NCCL has none): activations and gradients that share
        # a link (pp=2 interleaved) pair up because both ends issue them in the same order.
        check_link_order(schedule, plan.pp, self.microbatches, plan.virtual, self.schedule_fn)
        _ensure_role()
        mesh.group(axis)                       # made now, on every rank at once (collective)
        self._stats: PipelineStats | None = None
        self.timeline: list = []

    # ------------------------------------------------------------------ checks
    def _check(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """Bad input raises here, on every rank, before anything is sent; then the stages
        compare what they will send and receive (one small all_gather along pp)."""
        rank, m = world().rank, self.microbatches
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or y.shape != x.shape:
            raise ValueError(f"rank {rank}: Pipeline.value_and_grad takes x and y of shape (batch, seq_len); "
                             f"got {list(x.shape)} and {list(y.shape)}")
        if x.shape[1] != self.model.seq_len:
            raise ValueError(f"rank {rank}: Pipeline: sequence length {x.shape[1]} != the model's seq_len "
                             f"{self.model.seq_len}")
        if m > x.shape[0]:
            raise ValueError(f"rank {rank}: Pipeline(microbatches={m}) is larger than the batch ({x.shape[0]} "
                             f"sequences); use microbatches <= {x.shape[0]}")
        k = getattr(self.model, "rows_multiple", 1)
        sizes = split_sizes(x.shape[0], m)
        if any(r % k for r in sizes):
            raise ValueError(f"rank {rank}: Pipeline: {m} micro-batches of the batch of {x.shape[0]} have "
                             f"{sorted(set(sizes))} sequences, but the model's MoE blocks shard each micro-batch's "
                             f"tokens over dp x ep = {k} ranks and need a multiple of {k}; use a batch of "
                             f"microbatches x {k} * n sequences (e.g. {m * k}), or fewer micro-batches")
        shape, dtype, _ = self.model.stage_boundary(1)
        sig = (x.shape[0], x.shape[1], m, zlib.crc32(self.schedule.encode()), zlib.crc32(str(np.dtype(dtype)).encode()),
               shape[2], zlib.crc32(repr(self.plan.layers).encode()))
        mine = np.array((self.stage,) + sig, dtype=np.int64)
        every = _to_host(C.all_gather(_on_device(mine), axis=self.axis, mesh=self.mesh)).reshape(self.plan.pp, -1)
        names = ["batch", "seq_len", "microbatches", "schedule", "dtype", "d_model", "layer split"]
        ranks = self.mesh.group_ranks(self.axis)
        for s in range(self.plan.pp):
            if tuple(every[s, 1:]) != sig:
                diff = [n for n, a, b in zip(names, every[s, 1:], sig) if a != b]
                raise ValueError(
                    f"rank {rank} (stage {self.stage}) and rank {ranks[s]} (stage {s}) disagree on {diff}: the "
                    f"boundary tensors they exchange along {self.axis!r} would not match (this rank: batch "
                    f"{list(x.shape)}, {m} microbatches, {self.schedule!r}, {np.dtype(dtype).name}); give every "
                    "rank the same model, batch and Pipeline arguments")
        return x, y

    # ------------------------------------------------------------------ boundaries
    def _post_recv(self, key, rows):
        kind, c, mb = key
        vs = self.plan.chunks[c]
        src = self.plan.rank_of(vs - 1 if kind == "F" else vs + 1)
        if src == self.stage:
            return                                   # a virtual stage of this rank hands it over
        shape, dtype, spec = self.model.stage_boundary(rows)
        smesh = self.model.mesh
        t = zeros(shape, layout=spec, mesh=smesh, dtype=dtype) if smesh is not None else _xp().zeros(shape, dtype)
        buf = t.to_local() if smesh is not None else t
        work = p2p.recv(buf, src, axis=self.axis, mesh=self.mesh, async_op=True, role=ROLE)
        self._recvs[key] = (work, t)

    def _take(self, key):
        if key in self._handed:
            return self._handed.pop(key)
        work, t = self._recvs.pop(key)
        kind, c, mb = key
        vs = self.plan.chunks[c]
        src = vs - 1 if kind == "F" else vs + 1
        what = "activation" if kind == "F" else "gradient"
        peer = self.mesh.group(self.axis).ranks[src % self.plan.pp]
        # named in the watchdog's report if this wait hangs
        with note(f"pipeline stage {vs} waits for the {what} of micro-batch {mb} from stage {src} (rank {peer})"):
            work.wait()
        return t

    def _send(self, t, kind: str, dst_vs: int, mb: int) -> None:
        shape, dtype, spec = self.model.stage_boundary(t.shape[0])
        if type(t) is DTensor:
            like = as_layout(spec, shape, t.mesh) if tuple(t.shape) == shape else t.layout
            if t.layout != like:
                t = t.redistribute(like)             # the receiver's layout (a gradient may still be pending over tp)
        dst = self.plan.rank_of(dst_vs)
        if tuple(t.shape) != shape or np.dtype(t.dtype) != np.dtype(dtype):
            vs = dst_vs - 1 if kind == "F" else dst_vs + 1
            what = "activation" if kind == "F" else "gradient"
            raise ValueError(
                f"rank {world().rank} (stage {vs}) would send the {what} of micro-batch {mb} as "
                f"{np.dtype(t.dtype).name}{list(t.shape)} to rank {self.mesh.group(self.axis).ranks[dst]} "
                f"(stage {dst_vs}), which receives {np.dtype(dtype).name}{list(shape)} (model.stage_boundary): "
                "the bytes would be misread; make the stage return what stage_boundary describes")
        if dst == self.stage:
            self._handed[(kind, dst_vs // self.plan.pp, mb)] = t
            return
        work = DC.send(t, dst, axis=self.axis, mesh=self.mesh, async_op=True, role=ROLE)
        self._sends.append(work)

    # ------------------------------------------------------------------ the step
    def value_and_grad(self, params: dict, x: Any, y: Any) -> tuple[float, dict]:
        """(loss, grads): the mean loss over the whole batch (on every rank) and this
        rank's gradients, in its parameters' layouts (the same tree as ``params``).

        Parameters
        ----------
        params : dict
            This rank's parameters (``model.init``).
        x : numpy.ndarray
            The global input batch ``(B, S)``, the same on every rank.
        y : numpy.ndarray
            The targets ``(B, S)``.

        Returns
        -------
        tuple
            ``(loss, grads)``.
        """
        x, y = self._check(x, y)
        model, plan, m = self.model, self.plan, self.microbatches
        rows = split_sizes(x.shape[0], m)
        offs = np.concatenate([[0], np.cumsum(rows)]).astype(int)
        last_vs = plan.n_virtual - 1
        chunks = model.split_params(params)
        acts = self.actions
        last_b = {c: max(i for i, a in enumerate(acts) if a[0] == "B" and a[1] == c) for c in range(plan.virtual)}
        need = [(i, a) for i, a in enumerate(acts) if not (a[0] == "F" and plan.chunks[a[1]] == 0)
                and not (a[0] == "B" and plan.chunks[a[1]] == last_vs)]
        self._recvs: dict = {}
        self._sends: list = []
        self._handed: dict = {}
        live, acc, losses, spans = {}, [None] * plan.virtual, {}, []
        reductions: list[Any] = [None] * plan.virtual
        auxes = {}                                       # (chunk, mb) -> a non-last stage's own loss term
        peak, posted, busy = 0, 0, 0.0
        from ..backend import get_backend
        ahead = 0 if get_backend().is_gpu else LOOKAHEAD
        t_start = time.perf_counter()
        for i, (kind, c, mb) in enumerate(acts):
            key = (kind, c, mb)
            while posted < len(need) and need[posted][0] <= i + ahead:
                a = need[posted][1]
                self._post_recv(a, rows[a[2]])
                posted += 1
            vs = plan.chunks[c]
            sl = slice(offs[mb], offs[mb + 1])
            h = self._take(key) if key in self._recvs or key in self._handed else None
            t0 = time.perf_counter()
            if kind == "F":
                tg = model.batch(y[sl]) if vs == last_vs else None
                if vs == 0:
                    tokens = model.batch(x[sl])
                    out, pb = vjp(lambda p: model.stage_forward(p, 0, tokens, tg), chunks[c], reduce=False)
                else:
                    out, pb = vjp(lambda p, a: model.stage_forward(p, vs, a, tg), chunks[c], h, reduce=False)
                live[key[1:]] = pb
                peak = max(peak, len(live))
                if vs == last_vs:
                    losses[mb] = out
                else:
                    if type(out) is tuple:               # (activation, this stage's loss term)
                        out, auxes[(c, mb)] = out
                    self._send(out, "F", vs + 1, mb)
            else:
                pb = live.pop(key[1:])
                w = rows[mb] / x.shape[0]                # d(batch mean)/d(micro-batch mean)
                if vs == last_vs:
                    ct = self._weight(w, losses[mb])
                else:
                    ct = (h, self._weight(w, auxes[(c, mb)])) if (c, mb) in auxes else h
                if vs != 0:                              # the input's gradient goes upstream first
                    grads, weights = pb(ct, weights_later=True)
                    self._send(grads[1], "B", vs - 1, mb)
                    acc[c] = _accumulate(acc[c], weights())
                else:
                    acc[c] = _accumulate(acc[c], pb(ct)[0])
            t1 = time.perf_counter()
            busy += t1 - t0
            spans.append((kind, c, mb, t0, t1))
            if kind == "B" and i == last_b[c]:           # this chunk's gradients are complete
                reductions[c] = reduce_grads(chunks[c], acc[c])
                spans.append(("R", c, -1, t1, time.perf_counter()))
        t_end = time.perf_counter()
        for w in self._sends:
            w.wait()
        self._sends = []
        grads = model.join_params([r.wait() for r in reductions])
        loss = self._loss(list(losses.items()) + [(mb, v) for (_, mb), v in auxes.items()], rows, x.shape[0])
        return self._finish_stats(loss, busy, t_end - t_start, peak, spans, t_start).loss, grads

    @staticmethod
    def _weight(w: float, like):
        """The scalar cotangent ``w`` for the loss value ``like`` (a DTensor on the stage mesh)."""
        if type(like) is DTensor:
            return full((), w, mesh=like.mesh, dtype=like.dtype)
        return _xp().asarray(w, like.dtype)

    def _loss(self, values: list, rows, batch: int) -> float:
        """This rank's share of the batch's loss: its (micro-batch, value) pairs weighted by
        the micro-batches' rows (the last stage's losses, other stages' own terms)."""
        total = 0.0
        for mb, val in sorted(values, key=lambda t: t[0]):
            v = val.full_tensor() if type(val) is DTensor else val
            total += float(_to_host(v)) * rows[mb] / batch
        return total

    def _finish_stats(self, loss: float, busy: float, wall: float, peak: int, spans: list,
                      t_start: float) -> PipelineStats:
        mine = np.array([loss, busy, wall, peak], dtype=np.float64)
        every = _to_host(C.all_gather(_on_device(mine), axis=self.axis, mesh=self.mesh)).reshape(self.plan.pp, 4)
        self.timeline = [(k, c, mb, t0 - t_start, t1 - t_start) for k, c, mb, t0, t1 in spans]
        self._stats = PipelineStats(schedule=self.schedule, pp=self.plan.pp, microbatches=self.microbatches,
                                    virtual=self.plan.virtual, loss=float(every[:, 0].sum()), busy=every[:, 1].tolist(),
                                    wall=every[:, 2].tolist(), peak_live=[int(p) for p in every[:, 3]])
        record_spans(self.stage, spans)
        return self._stats

    def grad_norm(self, grads: dict) -> float:
        """The global L2 norm of the whole model's gradients (every stage's), on every rank:
        pass it to ``optim.clip_grad_norm(grads, max_norm, norm=...)``.

        Parameters
        ----------
        grads : dict
            This rank's gradients (``value_and_grad``'s).

        Returns
        -------
        float
            The norm.
        """
        from ..optim import global_norm
        sq = np.array([global_norm(grads) ** 2], dtype=np.float64)
        return float(np.sqrt(_to_host(C.all_reduce(_on_device(sq), axis=self.axis, mesh=self.mesh))[0]))

    def stats(self) -> PipelineStats:
        """The last step's per-stage busy/idle time, bubble fraction and peak live activations.

        Returns
        -------
        PipelineStats
            The last step's figures.
        """
        if self._stats is None:
            raise ValueError(f"rank {world().rank}: Pipeline.stats(): no step has run yet; call value_and_grad first")
        return self._stats
