"""``op.moe``: the mixture-of-experts layer over the ``ep`` mesh axis (seed 000 §2.2, §3.1,
§4.1, §10.1).

    ExpertE = dist.ShardSpec(partition=("experts",), mesh_axes=("ep",))
    moe = op.moe(num_experts=8, top_k=2, capacity_factor=1.25, d_model=64, d_ff=128, mesh=mesh,
                 experts_layout=ExpertE)
    params = moe.init(seed=0)       # global arrays; moe.shard(params) places them on the mesh
    y, aux = moe(params, x)         # x: DTensor (tokens, d_model), rows over ep (and dp)

The gate is ``op.*`` code (traced by ``ts.grad`` like any other): ``x @ gate`` in f32 (f64
for f64 inputs), optional noise, the router hook and the locality penalty, softmax.  The
experts run in the fused dispatch op (``dispatch.moe_ffn``).  ``aux`` computes its
statistics on first read with one small all_reduce over the token axes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import op
from ..autodiff.tape import Var, detach
from ..backend import get_backend
from ..dist.comm import collectives as C
from ..dist.comm.mesh import Mesh
from ..dist.comm.process_group import world
from ..dist.tensor.dtensor import DTensor, distribute, from_local
from ..dist.tensor.layout import ShardSpec
from ..dist.tensor.shard import dim_extent
from ..dtypes import resolve_dtype
from ..kernels.numerics import NumericPolicy
from .dispatch import TokenDispatcher, moe_ffn
from .routing import expert_ranges, gate_noise, remote_mask
from .staging import Clock, DispatchBuffers
from .transport import AllToAll

__all__ = ["MoE", "MoEAux", "GATES"]

GATES = ("topk_softmax", "topk_softmax_noisy")


def _rng(seed: int, name: str, shape: tuple, std: float) -> np.ndarray:
    key = sum(name.encode()) * 1000003 + len(name)
    return (np.random.default_rng([seed, key]).standard_normal(shape) * std).astype(np.float32)


class MoE:
    """A top-k routed SwiGLU mixture of experts; experts split over ``experts_layout``'s mesh
    axis by the array_split rule (E=8 over ep=3: 3, 3, 2).

    Parameters
    ----------
    num_experts : int
        Experts in all (E).
    top_k : int
        Experts each token is routed to.
    capacity_factor : float or None
        Slots per expert as a multiple of the even share ``tokens * top_k / E``; None: dropless (>=
        E / top_k never drops either).
    d_model : int
        The token width.
    d_ff : int
        An expert's hidden width.
    mesh : Mesh, optional
        None: plain arrays, one rank holds every expert.
    experts_layout : ShardSpec, optional
        Shards the experts dim over one mesh axis; default ``ShardSpec(partition=("experts",),
        mesh_axes=("ep",))``.
    gate : str
        One of ``GATES``: "topk_softmax" or "topk_softmax_noisy".
    quantize_fp8 : bool
        Send the dispatched and combined rows as FP8 (per-row scales).
    policy : NumericPolicy, optional
        A bf16 or fp16 dtype here is the dtype the backward's exchanged gradients take.
    noise_std : float, optional
        The noisy gate's standard deviation (default 1/E).
    seed : int
        The gate noise's seed.
    groups : list of int, optional
        A locality group id per ep position (the router regularizer's).
    """

    def __init__(self, num_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25, *,
                 d_model: int, d_ff: int, mesh: Mesh | None = None, experts_layout: ShardSpec | None = None,
                 gate: str = "topk_softmax", quantize_fp8: bool = False, policy: NumericPolicy | None = None,
                 noise_std: float | None = None, seed: int = 0, groups: list[int] | None = None):
        where = f"rank {world().rank}: op.moe(num_experts={num_experts}, top_k={top_k})"
        if int(num_experts) < 1 or not 1 <= int(top_k) <= int(num_experts):
            raise ValueError(f"{where}: top_k must be in 1..num_experts; lower top_k or add experts")
        if capacity_factor is not None and not float(capacity_factor) > 0:
            raise ValueError(f"{where}: capacity_factor={capacity_factor} must be > 0 (or None for dropless "
                             f"routing; >= num_experts/top_k = {num_experts / top_k:g} never drops)")
        if gate not in GATES:
            raise ValueError(f"{where}: gate={gate!r}; use one of {list(GATES)}")
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.d_model, self.d_ff = int(d_model), int(d_ff)
        self.mesh, self.gate, self.quantize_fp8, self.policy = mesh, gate, bool(quantize_fp8), policy
        self.noise_std = (1.0 / self.num_experts) if noise_std is None else float(noise_std)
        self.seed, self.step = int(seed), 0
        layout = experts_layout or ShardSpec(partition=("experts",), mesh_axes=("ep",))
        ax = layout.mesh_axes[0] if len(layout.mesh_axes) == 1 else None
        ax = ax[0] if isinstance(ax, tuple) and len(ax) == 1 else ax
        if not isinstance(ax, str) or layout.partition not in (("experts",), (0,)):
            raise ValueError(f"{where}: experts_layout={layout!r} must shard the experts dim over one mesh "
                             "axis: dist.ShardSpec(partition=('experts',), mesh_axes=('ep',))")
        self.axis = ax
        self.experts_layout = layout
        if mesh is not None and self.axis not in mesh.axes:
            raise ValueError(f"{where}: the mesh {mesh!r} has no axis {self.axis!r} for the experts "
                             f"(experts_layout={layout!r}); add it to the mesh or name one of {list(mesh.axes)}")
        self.ep_size = 1 if mesh is None else mesh.size(self.axis)
        self.ep_index = 0 if mesh is None else mesh.coordinate(self.axis)
        self.ranges = expert_ranges(self.num_experts, self.ep_size)
        self.buffers = DispatchBuffers()
        # the exchanges over the axis; another Transport subclass here changes how rows travel
        self.transport = AllToAll(self.axis, mesh, self.ep_size, self.ep_index)
        self.dispatcher = TokenDispatcher(self)
        self.router: Callable | None = None
        self.regularizer: dict | None = None
        self.prefetch = None
        self.groups = groups
        self.timings: dict | None = None        # phase -> seconds, when a dict (scripts/bench_moe.py)
        if groups is not None and len(groups) != self.ep_size:
            raise ValueError(f"{where}: groups={groups} must give one group id per {self.axis} position "
                             f"({self.ep_size})")

    def __repr__(self) -> str:
        return (f"op.moe(E={self.num_experts}, top_k={self.top_k}, cf={self.capacity_factor}, "
                f"{self.axis}={self.ep_size}, fp8={self.quantize_fp8})")

    # parameters -----------------------------------------------------------------
    def shapes(self) -> dict[str, tuple]:
        """The global shape of each parameter.

        Returns
        -------
        dict
            ``{"gate": (d, E), "w1": (E, d, f), "w3": (E, d, f), "w2": (E, f, d)}``.
        """
        e, d, f = self.num_experts, self.d_model, self.d_ff
        return {"gate": (d, e), "w1": (e, d, f), "w3": (e, d, f), "w2": (e, f, d)}

    def init(self, seed: int = 0, dtype: Any = "float32") -> dict:
        """Global parameters, the same values on any mesh.

        Parameters
        ----------
        seed : int
            Values depend only on (seed, name).
        dtype : str or dtype
            The parameters' dtype.

        Returns
        -------
        dict
            Global arrays by name.
        """
        d, f = self.d_model, self.d_ff
        dt = resolve_dtype(dtype)
        stds = {"gate": d ** -0.5, "w1": d ** -0.5, "w3": d ** -0.5, "w2": f ** -0.5}
        return {k: _rng(seed, k, s, stds[k]).astype(dt) for k, s in self.shapes().items()}

    def shard(self, params: dict) -> dict:
        """Place global parameters on the mesh: the gate replicated, the experts over ``ep``.

        Parameters
        ----------
        params : dict
            ``init``'s global arrays.

        Returns
        -------
        dict
            DTensors (arrays without a mesh).
        """
        if self.mesh is None:
            return dict(params)
        xp = get_backend().xp
        return {k: v if type(v) is DTensor else
                distribute(xp.asarray(v), layout=None if k == "gate" else self.experts_layout, mesh=self.mesh)
                for k, v in params.items()}

    def _placed(self, name: str, v):
        if type(detach(v)) is DTensor:
            return v
        if type(v) is Var:
            raise ValueError(f"rank {world().rank}: op.moe: params[{name!r}] is a traced array but x is a "
                             "DTensor; differentiate the placed parameters: params = moe.shard(params)")
        return self.shard({name: v})[name]

    # checks ---------------------------------------------------------------------
    def _check(self, params: dict, x) -> None:
        """Everything a rank can see alone, before any collective (same verdict on every rank)."""
        where = f"rank {world().rank}: op.moe({self.num_experts} experts over {self.axis}={self.ep_size})"
        if not isinstance(params, Mapping) or set(self.shapes()) - set(params):
            raise ValueError(f"{where}: params must be a dict with {sorted(self.shapes())}; use moe.init()")
        for k, want in self.shapes().items():
            got = tuple(detach(params[k]).shape)
            if got != want:
                raise ValueError(f"{where}: params[{k!r}] has shape {list(got)}, expected {list(want)} "
                                 f"(d_model={self.d_model}, d_ff={self.d_ff})")
            v = detach(params[k])
            if k != "gate" and type(v) is DTensor and self.ep_size > 1 and v.layout.dim_of(self.axis) != 0:
                raise ValueError(f"{where}: params[{k!r}] has layout {v.layout!r}; the experts dim must be "
                                 f"sharded over {self.axis!r} (moe.shard(params))")
        xv = detach(x)
        if xv.ndim != 2 or xv.shape[1] != self.d_model:
            raise ValueError(f"{where}: x has shape {list(xv.shape)}; expected (tokens, {self.d_model})")
        if type(xv) is DTensor:
            if xv.mesh != self.mesh:
                raise ValueError(f"{where}: x lives on {xv.mesh!r}, the layer on {self.mesh!r}")
            lay = xv.layout
            if lay.dims[1] or lay.partial:
                raise ValueError(f"{where}: x has layout {lay!r}; shard only its rows (tokens)")
            if self.ep_size > 1 and self.axis not in lay.dims[0]:
                raise ValueError(f"{where}: x has layout {lay!r}; its rows must be sharded over "
                                 f"{self.axis!r}: dist.ShardSpec(partition=('row',), mesh_axes=(..., "
                                 f"{self.axis!r}))")
        elif self.mesh is not None and self.ep_size > 1 and any(type(detach(v)) is DTensor for v in params.values()):
            raise ValueError(f"{where}: x is a plain array but params are DTensors; pass x as a DTensor")

    # helpers the dispatch reads ------------------------------------------------------
    def token_axes_besides_ep(self, x: Any) -> tuple:
        """The mesh axes other than ep that shard ``x``'s token dim.

        Parameters
        ----------
        x : DTensor or array
            The tokens.

        Returns
        -------
        tuple of str
            Empty for an array.
        """
        return tuple(a for a in x.layout.dims[0] if a != self.axis) if type(x) is DTensor else ()

    def grad_dtype(self, dt: Any) -> Any:
        """The dtype the backward's exchanged gradients take: the policy's when it is bf16 or fp16,
        else ``dt``.

        Parameters
        ----------
        dt : dtype
            The forward's dtype.

        Returns
        -------
        dtype
            The gradients' dtype.
        """
        pd = getattr(self.policy, "dtype", None)
        return pd if pd is not None and np.dtype(pd).name in ("bfloat16", "float16") else dt

    def group_ids(self) -> list[int]:
        """Locality group of each ep position: ``groups=`` or the host its rank runs on.

        Returns
        -------
        list of int
            One id per ep position.
        """
        if self.groups is not None:
            return list(self.groups)
        if self.mesh is None:
            return [0]
        seats = world().seats
        hosts: dict = {}
        return [hosts.setdefault(seats[r].host, len(hosts)) for r in self.mesh.group_ranks(self.axis)]

    def _rowwise(self, local: np.ndarray, like):
        """A (tokens, E) constant whose local piece is ``local``, laid out like ``like``."""
        xp = get_backend().xp
        local = xp.asarray(local)
        v = detach(like)
        if type(v) is DTensor:
            return from_local(xp.ascontiguousarray(local.astype(v.dtype)), layout=v.layout, mesh=v.mesh,
                              shape=v.shape, validate=False)
        return local.astype(v.dtype)

    def _row_slice(self, x) -> slice:
        v = detach(x)
        if type(v) is not DTensor:
            return slice(0, v.shape[0])
        axes = v.layout.dims[0]
        off, n = dim_extent(v.shape[0], tuple(v.mesh.size(a) for a in axes), tuple(v.mesh.coordinate(a) for a in axes))
        return slice(off, off + n)

    # the layer ----------------------------------------------------------------------
    def gate_logits(self, params: dict, x: Any) -> tuple[Any, Any]:
        """Router logits (tokens, E) and the locality penalty matrix (or None).

        Parameters
        ----------
        params : dict
            The layer's parameters.
        x : DTensor or array
            Tokens ``(tokens, d_model)``.

        Returns
        -------
        tuple
            ``(logits, penalty)``.
        """
        from ..dist.checks.determinism import is_deterministic
        dt = "float64" if np.dtype(detach(x).dtype) == np.float64 else "float32"
        logits = op.matmul(op.astype(x, dt), op.astype(params["gate"], dt))
        lv = detach(logits)
        t_local = lv.to_local().shape[0] if type(lv) is DTensor else lv.shape[0]
        if self.gate == "topk_softmax_noisy":
            # deterministic mode: noise is a function of (seed, step, global token) alone
            seed = self.seed if is_deterministic() else int(np.random.SeedSequence().generate_state(1)[0])
            rows = self._row_slice(x)
            noise = gate_noise(seed, self.step, (detach(x).shape[0], self.num_experts), rows, self.noise_std)
            logits = logits + self._rowwise(noise, logits)
        if self.router is not None:
            logits = self.router(logits, {"layer": self, "axis": self.axis, "ep_index": self.ep_index,
                                          "ranges": self.ranges, "step": self.step})
        penalty = None
        if self.regularizer is not None:
            mask = remote_mask(self.group_ids(), self.ranges, self.ep_index, self.num_experts)
            penalty = self._rowwise(np.broadcast_to(mask, (t_local, self.num_experts)), logits)
            logits = logits - penalty * self.regularizer["weight"] * self.regularizer["scale"]
        return logits, penalty

    def __call__(self, params: dict, x) -> tuple[Any, MoEAux]:
        self._check(params, x)
        if type(detach(x)) is DTensor:            # plain x: this rank's tokens, global weights
            params = {k: self._placed(k, v) for k, v in params.items()}
        clock = Clock(self)
        logits, penalty = self.gate_logits(params, x)
        probs = op.softmax(logits, axis=-1)
        clock.lap("gate")
        y, info = moe_ffn(x, probs, params["w1"], params["w3"], params["w2"], layer=self)
        self.step += 1
        if self.prefetch is not None:         # this rank's experts' received rows: their hotness
            self.prefetch.observe(info["counts"].sum(axis=0))
        return y, MoEAux(self, info, probs, logits, penalty, x)


class MoEAux(Mapping):
    """The layer's statistics, computed when first read (one all_reduce over the token axes
    for the counts; the losses are traced ``op.*`` code, differentiable under ``ts.grad``).

    ``load`` (E,) pairs the gate routed to each expert, ``dropped`` pairs over capacity,
    ``balance_loss`` Switch's ``E * sum_e f_e P_e``, ``z_loss`` ``mean(logsumexp(logits)^2)``,
    ``router_reg`` the locality regularizer (0 without one), ``remote_fraction`` the share of
    kept pairs sent outside their locality group, ``load_cv`` std/mean of ``load``.

    Parameters
    ----------
    layer : MoE
        The layer.
    info : dict
        The routing info of the call.
    probs : DTensor or array
        The gate probabilities.
    logits : DTensor or array
        The router logits.
    penalty : DTensor or array
        The locality regularizer's penalty (or None).
    x : DTensor or array
        The layer's input.
    """

    KEYS = ("load", "dropped", "balance_loss", "z_loss", "router_reg", "remote_fraction", "load_cv")

    def __init__(self, layer: MoE, info: dict, probs: Any, logits: Any, penalty: Any, x: Any):
        self._layer, self._info, self._probs, self._logits, self._penalty, self._x = \
            layer, info, probs, logits, penalty, x
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self.KEYS)

    def __iter__(self):
        return iter(self.KEYS)

    def _stats(self):
        if "_stats" not in self._cache:
            lay, r = self._layer, self._info["route"]
            e = lay.num_experts
            routed = np.asarray(get_backend().to_host(r.routed), dtype=np.float64)
            kept = np.asarray(get_backend().to_host(r.kept))
            idx = np.asarray(get_backend().to_host(r.idx)).reshape(-1)
            remote = remote_mask(lay.group_ids(), lay.ranges, lay.ep_index, e)[idx][kept].sum()
            v = np.concatenate([routed, [kept.size - kept.sum(), remote, kept.sum(), self._info["tokens"]]])
            xv = detach(self._x)
            if lay.mesh is not None:
                axes = xv.layout.dims[0] if type(xv) is DTensor else (lay.axis,)
                if axes:             # collectives take the backend's arrays
                    v = C.all_reduce(get_backend().xp.asarray(v), axes if len(axes) > 1 else axes[0], mesh=lay.mesh)
                    v = np.asarray(get_backend().to_host(v))
            self._cache["_stats"] = v
        return self._cache["_stats"]

    def _const(self, value: np.ndarray, like):
        """``value`` (the same on every rank) as an operand for ``like``: replicated if a DTensor."""
        v = detach(like)
        value = get_backend().xp.asarray(value.astype(v.dtype))
        return distribute(value, mesh=v.mesh) if type(v) is DTensor else value

    def __getitem__(self, key: str):
        if key in self._cache:
            return self._cache[key]
        e = self._layer.num_experts
        if key == "load":
            val = self._stats()[:e].astype(np.int64)
        elif key == "dropped":
            val = int(self._stats()[e])
        elif key == "remote_fraction":
            s = self._stats()
            val = float(s[e + 1] / max(s[e + 2], 1))
        elif key == "load_cv":
            load = self._stats()[:e]
            val = float(load.std() / max(load.mean(), 1e-12))
        elif key == "balance_loss":
            s = self._stats()
            frac = s[:e] / max(s[e + 3] * self._layer.top_k, 1)          # f_e: share of routed pairs
            pmean = op.mean(self._probs, axis=0)                          # P_e: mean gate probability
            val = op.sum(op.mul(pmean, self._const(frac * e, pmean)))
        elif key == "z_loss":
            m = detach(op.max(self._logits, axis=-1, keepdims=True))
            lse = op.add(op.log(op.sum(op.exp(op.sub(self._logits, m)), axis=-1)), op.reshape(m, (-1,)))
            val = op.mean(op.square(lse))
        elif key == "router_reg":
            reg = self._layer.regularizer
            if reg is None or self._penalty is None:
                val = 0.0
            else:                                   # expected share of remote routing, times weight
                val = op.mul(op.mean(op.sum(op.mul(self._probs, self._penalty), axis=-1)), reg["weight"])
        else:
            raise KeyError(f"aux has no {key!r}; keys: {list(self.KEYS)}")
        self._cache[key] = val
        return val
