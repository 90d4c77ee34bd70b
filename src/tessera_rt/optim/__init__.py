"""Optimizers with f32 master weights, global-norm clipping and dynamic loss scaling
(seed 000 §3.4: numerics; §10.3: the mixed-precision training policy).

    opt = optim.AdamW(params, lr=3e-3, weight_decay=0.1)     # f32 masters for bf16/fp16 params
    scaler = optim.DynamicLossScaler()                        # for fp16 (bf16 rarely needs it)
    loss, grads = ts.value_and_grad(lambda p: scaler.scale(loss_fn(p)))(params)
    grads, finite = scaler.unscale(grads)
    grads, norm = optim.clip_grad_norm(grads, 1.0)
    params = opt.step(params, grads) if finite else params
    scaler.update(finite)

A step whose loss or gradients went non-finite (inf/nan, without loss scaling) should stop
the run rather than train on and save NaN weights; ``check_finite`` does it on scalars every
rank already agrees on (Megatron's ``check_for_nan_in_loss_and_grad``):

    grads, norm = optim.clip_grad_norm(grads, 1.0)
    optim.check_finite(loss=float(loss), norm=norm, grads=grads, step=step)   # NonFiniteError

Parameters, gradients and optimizer state are pytrees of arrays or DTensors; the state
of a DTensor parameter has the parameter's layout, so every update is local (no
communication).  ``step`` returns the new parameters (in the parameters' dtype) and keeps
the f32 masters, so low-precision rounding never accumulates into the weights.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import op
from .autodiff.engine import tree_flatten, tree_unflatten
from .dist.tensor.dtensor import DTensor
from .dtypes import dtype_name
from .kernels._common import array_module
from .kernels.cpu_fused import adamw_step

__all__ = ["Optimizer", "SGD", "AdamW", "clip_grad_norm", "global_norm", "DynamicLossScaler", "NonFiniteError",
           "check_finite", "non_finite_leaves"]

_F32 = np.dtype(np.float32)


def _local(x):
    """The array behind a leaf: a DTensor's local piece, or the array itself."""
    return x.to_local() if type(x) is DTensor else x


def _f32(x):
    """An f32 copy (the master): a new array / DTensor, never an alias of the parameter."""
    if x.dtype == _F32:
        return op.mul(x, 1.0) if type(x) is DTensor else x.astype(_F32, copy=True)
    return op.astype(x, "float32")


def _zeros(x):
    if type(x) is DTensor:
        from .dist.tensor.dtensor import zeros
        return zeros(x.shape, layout=x.layout, mesh=x.mesh, dtype="float32")
    return array_module(x).zeros(x.shape, _F32)


def _agree(values: list, mesh, op_name: str) -> float:
    """Sum (or max) 0-d values kept on the device, then reduce them over every axis of
    ``mesh`` in one all-reduce of one float64: one host sync, however many leaves."""
    from .dist.tensor import dtensor_collectives as dc
    xp = array_module(*values)
    buf = xp.stack([xp.asarray(v, dtype=np.float64) for v in values])
    buf = (buf.sum() if op_name == "sum" else buf.max()).reshape(1)
    axis = mesh.axes if len(mesh.axes) > 1 else mesh.axes[0]
    return float(dc.all_reduce(buf, axis=axis, mesh=mesh, op=op_name)[0])


def _check_grads(where: str, params: list, grads: list, paths: list) -> None:
    if len(params) != len(grads):
        raise ValueError(f"{where}: {len(grads)} gradients for {len(params)} parameters; pass the pytree "
                         "ts.grad returned for these parameters")
    for p, g, path in zip(params, grads, paths):
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{where}: gradient {path} has shape {tuple(g.shape)}, parameter {tuple(p.shape)}")
        if type(p) is DTensor and (type(g) is not DTensor or g.layout != p.layout):
            raise ValueError(f"{where}: gradient {path} has layout {getattr(g, 'layout', 'array')!r}, "
                             f"parameter {p.layout!r}; ts.grad returns it in the parameter's layout")
        if np.dtype(g.dtype).kind != "f" and np.dtype(g.dtype).name != "bfloat16":
            raise TypeError(f"{where}: gradient {path} has dtype {dtype_name(g.dtype)}")


class Optimizer:
    """Holds f32 masters and per-parameter state; ``step(params, grads)`` -> new params.

    Parameters
    ----------
    params : pytree
        The parameters (nested dicts/lists of DTensors or arrays, f32/bf16/fp16); the masters
        are f32 copies of them.
    lr : float
        The learning rate.
    """

    def __init__(self, params: Any, lr: float):
        leaves, self._paths, self._struct = tree_flatten(params)
        for p, path in zip(leaves, self._paths):
            name = np.dtype(p.dtype).name
            if np.dtype(p.dtype).kind != "f" and name != "bfloat16" or "float8" in name:
                raise TypeError(f"{type(self).__name__}: parameter {path} has dtype {name}; optimizers update "
                                "f32/bf16/fp16 parameters (keep fp8 as a quantized copy of a bf16/f32 weight)")
        self.lr = float(lr)
        self.masters = [_f32(p) for p in leaves]
        self.t = 0
        self._tmp: dict = {}              # array module -> two f32 scratch buffers (see _temps)

    def step(self, params: Any, grads: Any) -> Any:
        """One update: new parameters from ``grads`` (the masters update in f32; the result is cast
        to each parameter's dtype).

        Parameters
        ----------
        params : pytree
            The current parameters (their structure, dtypes and layouts).
        grads : pytree
            Gradients of the same structure, shapes and layouts.

        Returns
        -------
        pytree
            The new parameters.
        """
        p_leaves, _, _ = tree_flatten(params)
        g_leaves, _, _ = tree_flatten(grads)
        where = f"{type(self).__name__}.step"
        _check_grads(where, p_leaves, g_leaves, self._paths)
        self.t += 1
        out = []
        for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
            g32 = g if g.dtype == _F32 else op.astype(g, "float32")
            self.masters[i] = self._update(i, self.masters[i], g32)
            m = self.masters[i]
            out.append(m if p.dtype == _F32 else op.astype(m, p.dtype))
        return tree_unflatten(self._struct, out)

    def _update(self, i: int, w, g):
        raise NotImplementedError

    def _temps(self, w):
        """Two f32 buffers shaped like ``w``: views of two buffers the size of the largest
        parameter, made on the first step, so a step allocates nothing."""
        xp = array_module(w)
        bufs = self._tmp.get(xp)
        if bufs is None:
            n = max(int(_local(x).size) for x in self.masters)
            bufs = self._tmp[xp] = (xp.empty(n, _F32), xp.empty(n, _F32))
        return tuple(b[:w.size].reshape(w.shape) for b in bufs)

    # per-parameter state lists beside the masters (AdamW's moments, SGD's momentum buffers)
    _slots: tuple = ()

    def state_dict(self) -> dict:
        """{"t": steps taken, "masters": f32 masters, and each slot (e.g. "m", "v")}, the
        trees in the parameters' structure: what a resumed run needs to continue exactly.

        Returns
        -------
        dict
            The state.
        """
        # copies: the next step updates the live state in place
        out = {"t": self.t, "masters": tree_unflatten(self._struct, [_f32(w) for w in self.masters])}
        out.update({k: tree_unflatten(self._struct, [_f32(x) for x in getattr(self, k)]) for k in self._slots})
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s values (e.g. ``dist.load``'s, on another mesh): the
        trees must have the parameters' structure, shapes and layouts.

        Parameters
        ----------
        state : dict
            ``state_dict()``'s form.
        """
        where = f"{type(self).__name__}.load_state_dict"
        lists = {}
        for k in ("masters",) + self._slots:
            if k not in state:
                raise KeyError(f"{where}: the state has no {k!r} (it has {sorted(state)})")
            leaves, paths, _ = tree_flatten(state[k])
            if paths != self._paths:
                raise ValueError(f"{where}: {k!r} has the leaves {' '.join(paths) or '(none)'}, the parameters "
                                 f"{' '.join(self._paths)}; pass the state_dict() of an optimizer of these parameters")
            for w, x, path in zip(self.masters, leaves, paths):
                if tuple(x.shape) != tuple(w.shape) or np.dtype(x.dtype) != _F32:
                    raise ValueError(f"{where}: {k}{path} is {dtype_name(x.dtype)}{list(x.shape)}, the optimizer "
                                     f"keeps float32{list(w.shape)}")
            lists[k] = [_f32(x) for x in leaves]        # owned: the steps update them in place
        self.t = int(state["t"])
        for k, v in lists.items():
            setattr(self, k, v)


class SGD(Optimizer):
    """``w -= lr * (g + wd*w)``, with heavy-ball ``momentum`` (buffer ``b = m*b + g``).

    Parameters
    ----------
    params : pytree
        The parameters.
    lr : float
        The learning rate.
    momentum : float
        ``m``; 0: plain SGD.
    weight_decay : float
        ``wd``.
    """

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, lr)
        self.momentum, self.wd = float(momentum), float(weight_decay)
        self.bufs = [_zeros(m) if momentum else None for m in self.masters]
        self._slots = ("bufs",) if momentum else ()

    def _update(self, i, w, g):
        # in place, the out-of-place formula's operations in its order (as AdamW's)
        w, g = _local(w), _local(g)
        xp = array_module(w)
        t1 = self._temps(w)[0]
        if self.wd:
            g = xp.add(g, xp.multiply(w, self.wd, out=t1), out=t1)
        if self.momentum:
            b = _local(self.bufs[i])
            g = xp.add(xp.multiply(b, self.momentum, out=b), g, out=b)
        xp.subtract(w, xp.multiply(g, self.lr, out=t1), out=w)
        return self.masters[i]


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), state in f32.

    Parameters
    ----------
    params : pytree
        The parameters.
    lr : float
        The learning rate.
    betas : tuple of float
        The first and second moments' decay.
    eps : float
        Added to the second moment's square root.
    weight_decay : float
        Decoupled: ``w -= lr * wd * w``.
    """
    _slots = ("m", "v")

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, lr)
        self.b1, self.b2 = float(betas[0]), float(betas[1])
        self.eps, self.wd = float(eps), float(weight_decay)
        self.m = [_zeros(w) for w in self.masters]
        self.v = [_zeros(w) for w in self.masters]

    def _update(self, i, w, g):
        # In place on the local pieces (a parameter's state has its layout, so the update is
        # local): the out-of-place formula's operations in its order, so the same bits.
        b1, b2, lr = self.b1, self.b2, self.lr
        w, g, m, v = _local(w), _local(g), _local(self.m[i]), _local(self.v[i])
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        # on the CPU one fused pass (cpu_fused.adamw_step), the same bits as the formula below
        if adamw_step(w, g, m, v, b1=b1, b2=b2, c1=c1, c2=c2, eps=self.eps,
                      decay=1 - lr * self.wd if self.wd else None, lr=lr):
            return self.masters[i]
        xp = array_module(w)
        t1, t2 = self._temps(w)
        xp.multiply(m, b1, out=m)
        xp.add(m, xp.multiply(g, 1 - b1, out=t1), out=m)                 # m = b1 m + (1 - b1) g
        xp.multiply(xp.multiply(g, g, out=t1), 1 - b2, out=t1)
        xp.add(xp.multiply(v, b2, out=v), t1, out=v)                     # v = b2 v + (1 - b2) g^2
        xp.add(xp.sqrt(xp.multiply(v, 1.0 / c2, out=t2), out=t2), self.eps, out=t2)
        xp.divide(xp.multiply(m, 1.0 / c1, out=t1), t2, out=t1)          # the step direction
        if self.wd:
            xp.multiply(w, 1 - lr * self.wd, out=w)
        xp.subtract(w, xp.multiply(t1, lr, out=t1), out=w)
        return self.masters[i]


# --------------------------------------------------------------------------- global norm

def _mesh_weight(g: DTensor) -> float:
    """1 / (number of ranks holding each element): replicas count once in the global sum."""
    sharded = set(g.layout.sharded_axes)
    n = 1
    for a, s in zip(g.mesh.axes, g.mesh.sizes):
        if a not in sharded:
            n *= s
    return 1.0 / n


_CHUNK = 1 << 20
_SQUARES: dict = {}          # array module -> an f64 buffer of up to _CHUNK elements


def _sum_squares(x):
    """``sum(float64(x) ** 2)`` as a 0-d array on x's device, squared chunk by chunk into
    one f64 buffer kept per array module (no per-call copies of x in f64)."""
    xp = array_module(x)
    flat = x.reshape(-1)
    buf = _SQUARES.get(xp)
    if buf is None or buf.size < min(flat.size, _CHUNK):
        buf = _SQUARES[xp] = xp.empty(min(flat.size, _CHUNK), np.float64)
    total = None
    for i in range(0, max(flat.size, 1), _CHUNK):
        part = flat[i:i + _CHUNK]
        sq = buf[:part.size]
        sq[...] = part                            # widen, then square in place (no cast buffers)
        xp.multiply(sq, sq, out=sq)
        total = xp.sum(sq) if total is None else total + xp.sum(sq)
    return total


def global_norm(grads: Any) -> float:
    """The L2 norm of all gradients together, the same on every rank.  Each rank sums the
    squares of its local pieces (weighted so replicated elements count once) and one
    all-reduce of a single float64 over each mesh adds them up.

    Parameters
    ----------
    grads : pytree
        DTensors and arrays.

    Returns
    -------
    float
        The norm.
    """
    # The squares are summed where the gradients live (on the GPU: no copy to the host).
    leaves, _, _ = tree_flatten(grads)
    local_total = 0.0
    meshes: dict = {}
    for g in leaves:
        if type(g) is DTensor:
            if g.layout.partial:
                g = g.redistribute(g.layout.with_partial(()))
            meshes.setdefault(g.mesh, []).append(_sum_squares(g.to_local()) * _mesh_weight(g))
        else:
            local_total += float(_sum_squares(g))
    for mesh, squares in meshes.items():
        local_total += _agree(squares, mesh, "sum")
    return math.sqrt(local_total)


def clip_grad_norm(grads: Any, max_norm: float, norm: float | None = None, error_if_nonfinite: bool = False,
                   in_place: bool = False) -> tuple[Any, float]:
    """``(grads * min(1, max_norm / norm), norm)`` with the global norm across all shards.

    Parameters
    ----------
    grads : pytree
        DTensors and arrays.
    max_norm : float
        The largest norm kept.
    norm : float, optional
        The global norm if already known (default: ``global_norm(grads)``).
    error_if_nonfinite : bool
        Raise ``NonFiniteError`` when the norm is inf or nan.
    in_place : bool
        Scale the gradients themselves where that changes nothing else (the others are
        scaled into new arrays), allocating nothing: for a training loop that drops the
        unclipped gradients anyway.

    Returns
    -------
    tuple
        The clipped gradients (``grads`` itself when the norm is within ``max_norm`` or not
        finite) and the norm before clipping.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    norm = global_norm(grads) if norm is None else norm
    if error_if_nonfinite:
        check_finite(norm=norm, grads=grads)
    if not math.isfinite(norm) or norm <= max_norm:
        return grads, norm
    leaves, _, struct = tree_flatten(grads)
    scale = max_norm / (norm + 1e-6)
    owned = _owned([_local(g) for g in leaves]) if in_place else [False] * len(leaves)
    out = []
    for g, own in zip(leaves, owned):
        if own:
            x = _local(g)
            array_module(x).multiply(x, scale, out=x)
            out.append(g)
        else:
            out.append(op.mul(g, scale))
    return tree_unflatten(struct, out), norm


def _owned(arrays: list) -> list[bool]:
    """Which arrays can be scaled in place: writeable (not a broadcast view) and sharing no
    memory with another leaf (the add rule hands both operands the same cotangent), so
    scaling one scales nothing else.  NumPy views of one buffer whose bytes do not overlap
    (the gradients of one all-reduce bucket) are each their own."""
    def root(x):
        while getattr(x, "base", None) is not None:
            x = x.base
        return id(x)
    roots = [root(x) for x in arrays]
    groups: dict = {}
    for i, r in enumerate(roots):
        groups.setdefault(r, []).append(i)
    ok = [getattr(getattr(x, "flags", None), "writeable", True) for x in arrays]
    for idx in groups.values():
        if len(idx) == 1:
            continue
        if not all(type(arrays[i]) is np.ndarray and arrays[i].flags.c_contiguous for i in idx):
            for i in idx:                # (other arrays: the buffer is shared, leave it alone)
                ok[i] = False
            continue
        spans = sorted((arrays[i].ctypes.data, arrays[i].ctypes.data + arrays[i].nbytes, i) for i in idx)
        for (s0, e0, i), (s1, e1, j) in zip(spans, spans[1:]):
            if s1 < e0:                  # overlapping bytes: scaling one would scale the other
                ok[i] = ok[j] = False
    return ok


# --------------------------------------------------------------------------- non-finite steps

class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step are inf or nan (``check_finite``).

    Parameters
    ----------
    message : str
        The error message.
    reason : str
        Which value was not finite (loss, norm).
    step : int, optional
        The training step.
    rank : int, optional
        The rank raising it.
    what : str
        What was searched for the first bad leaf ("gradient", ...).
    first : str, optional
        The path of this rank's first non-finite leaf, or None.
    count, total : int
        How many of how many elements hold inf/nan.
    """

    def __init__(self, message: str, *, reason: str = "", step: int | None = None, rank: int | None = None,
                 what: str = "gradient", first: str | None = None, count: int = 0, total: int = 0):
        super().__init__(message)
        self.reason, self.step, self.rank, self.what = reason, step, rank, what
        self.first, self.count, self.total = first, count, total


def non_finite_leaves(tree: Any) -> list[str]:
    """The paths of the leaves of ``tree`` whose local pieces (this rank's) hold inf or nan:
    one pass over every leaf, for after a step was found non-finite or before a save.

    Parameters
    ----------
    tree : pytree
        DTensors and arrays.

    Returns
    -------
    list of str
        The leaves' paths, e.g. ``"['blocks'][0]['attn']['wq']"``.
    """
    leaves, paths, _ = tree_flatten(tree)
    bad = []
    for x, path in zip(leaves, paths):
        a = _local(x)
        if np.dtype(a.dtype).kind in "iub":
            continue
        xp = array_module(a)
        if not bool(xp.isfinite(a).all()):
            bad.append(path)
    return bad


def _rank():
    from .dist.comm.process_group import is_initialized, world
    return world().rank if is_initialized() else None


def check_finite(loss: Any = None, norm: Any = None, *, grads: Any = None, step: int | None = None,
                 what: str = "gradient") -> None:
    """Raise ``NonFiniteError`` if ``loss`` or ``norm`` is inf or nan.

    Pass scalars every rank agrees on (the reduced loss, the global gradient norm that
    ``clip_grad_norm`` / ``global_norm`` / ``Pipeline.grad_norm`` return), so every rank
    stops at the same step; the check costs only those scalars.  Call it before
    ``opt.step``, so the non-finite update never reaches the weights.  With
    ``DynamicLossScaler``, check only steps it did not skip.

    Parameters
    ----------
    loss, norm : float, optional
        The scalars checked.
    grads : pytree, optional
        Searched only when one is not finite, to name the first leaf holding inf/nan (this
        rank's pieces).
    step : int, optional
        The step, for the message.
    what : str
        What ``grads`` are, for the message.
    """
    bad = [f"the {name} is {v}" for name, v in (("loss", loss), (f"{what} norm", norm))
           if v is not None and not math.isfinite(float(v))]
    if not bad:
        return
    rank = _rank()
    at = f"step {step}: " if step is not None else ""
    on = f" on rank {rank}" if rank is not None else ""
    first, count, total = None, 0, 0
    found = ""
    if grads is not None:
        paths = non_finite_leaves(grads)
        count, total = len(paths), len(tree_flatten(grads)[1])
        first = paths[0] if paths else None
        found = (f"; the first non-finite {what}{on} is {first or '(the root)'} ({count} of {total} hold inf/nan)"
                 if paths else f"; every {what}{on} is finite")
    reason = " and ".join(bad)
    raise NonFiniteError(
        f"{at}{reason}{found}: stopped before this step's update. Lower the learning rate, "
        "clip the gradients (optim.clip_grad_norm), or for fp16 scale the loss (optim.DynamicLossScaler)",
        reason=reason, step=step, rank=rank, what=what, first=first, count=count, total=total)


# --------------------------------------------------------------------------- loss scaling

class DynamicLossScaler:
    """Multiply the loss by ``scale`` so fp16 gradients do not underflow; after a step
    with an inf/nan gradient (on any rank) skip it and halve the scale; after
    ``growth_interval`` clean steps double it.

    Parameters
    ----------
    init_scale : float
        The first scale.
    growth_factor : float
        The scale's factor after ``growth_interval`` clean steps.
    backoff_factor : float
        The scale's factor after a skipped step.
    growth_interval : int
        Clean steps between growths.
    min_scale : float
        The scale never goes below it.
    """

    def __init__(self, init_scale: float = 2.0 ** 15, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 200, min_scale: float = 1.0):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and init_scale > 0):
            raise ValueError("DynamicLossScaler: need growth_factor > 1, 0 < backoff_factor < 1, init_scale > 0")
        self.scale_value = float(init_scale)
        self.growth, self.backoff = float(growth_factor), float(backoff_factor)
        self.interval, self.min_scale = int(growth_interval), float(min_scale)
        self.good_steps = 0
        self.skipped = 0

    def scale(self, loss: Any) -> Any:
        """``loss * scale`` (differentiate this one).

        Parameters
        ----------
        loss : DTensor or array
            The loss.

        Returns
        -------
        DTensor or array
            The scaled loss.
        """
        return op.mul(loss, self.scale_value)

    def unscale(self, grads: Any) -> tuple[Any, bool]:
        """``(grads / scale, finite)``; ``finite`` is agreed by every rank (one all-reduce).

        Parameters
        ----------
        grads : pytree
            Gradients of the scaled loss.

        Returns
        -------
        tuple
            ``(grads / scale, finite)``.
        """
        leaves, _, struct = tree_flatten(grads)
        inv = 1.0 / self.scale_value
        out = [op.mul(g if np.dtype(g.dtype) == _F32 else op.astype(g, "float32"), inv) for g in leaves]
        # one flag per leaf, computed on the device; one host sync for all of them
        flags = [array_module(_local(g)).logical_not(array_module(_local(g)).isfinite(_local(g)).all())
                 for g in out]
        mesh = next((g.mesh for g in out if type(g) is DTensor), None)
        if mesh is not None:
            bad = _agree(flags, mesh, "max")
        else:
            bad = float(max((float(f) for f in flags), default=0.0))
        return tree_unflatten(struct, out), bad == 0.0

    def update(self, finite: bool) -> None:
        """After a step: grow the scale after ``growth_interval`` finite steps, shrink it (and count
        a skip) after a non-finite one.

        Parameters
        ----------
        finite : bool
            ``unscale``'s flag (skip the optimizer step when False).
        """
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.interval:
                self.scale_value *= self.growth
                self.good_steps = 0
        else:
            self.skipped += 1
            self.good_steps = 0
            self.scale_value = max(self.scale_value * self.backoff, self.min_scale)

    def state_dict(self) -> dict:
        """The scale and its counters (JSON values), for a resumed run to continue with.

        Returns
        -------
        dict
            ``scale``, ``good_steps``, ``skipped``.
        """
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s values.

        Parameters
        ----------
        state : dict
            ``state_dict()``'s form.
        """
        self.scale_value = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
