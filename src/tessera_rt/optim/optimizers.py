"""The optimizers: f32 masters and per-parameter state, updated locally in each parameter's
layout (SGD with momentum, AdamW)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import op
from ..autodiff.engine import tree_flatten, tree_unflatten
from ..backend import array_module, get_backend
from ..dist.tensor.dtensor import DTensor
from ..dtypes import dtype_name

_F32 = np.dtype(np.float32)


def _local(x):
    """The array behind a leaf: a DTensor's local piece, or the array itself."""
    return x.to_local() if type(x) is DTensor else x


def _fresh_like(p):
    """A new parameter of ``p``'s shape, dtype and layout (its values written by the caller)."""
    if type(p) is DTensor:
        from ..dist.tensor.dtensor import zeros
        return zeros(p.shape, layout=p.layout, mesh=p.mesh, dtype=p.dtype)
    return array_module(p).empty(p.shape, p.dtype)


def _f32(x):
    """An f32 copy (the master): a new array / DTensor, never an alias of the parameter."""
    if x.dtype == _F32:
        return op.mul(x, 1.0) if type(x) is DTensor else x.astype(_F32, copy=True)
    return op.astype(x, "float32")


def _zeros(x):
    if type(x) is DTensor:
        from ..dist.tensor.dtensor import zeros
        return zeros(x.shape, layout=x.layout, mesh=x.mesh, dtype="float32")
    return array_module(x).zeros(x.shape, _F32)


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

    def step(self, params: Any, grads: Any, grad_scale: Any = None) -> Any:
        """One update: new parameters from ``grads`` (see ``Optimizer.step``).  Every parameter
        updates in one multi-tensor pass per gradient dtype (``adamw_multi`` of the kernel
        table: one GPU launch for all the f32 gradients, a fused pass per tensor on the CPU),
        in place on the masters and moments.

        Parameters
        ----------
        params : pytree
            The current parameters (their structure, dtypes and layouts).
        grads : pytree
            Gradients of the same structure, shapes and layouts (f32, bf16 or fp16: they are
            read as they are, not widened into copies).
        grad_scale : array, optional
            A 0-d f32 device scale every gradient is multiplied by first (e.g. clipping's,
            kept on the device).

        Returns
        -------
        pytree
            The new parameters.
        """
        p_leaves, _, _ = tree_flatten(params)
        g_leaves, _, _ = tree_flatten(grads)
        _check_grads(f"{type(self).__name__}.step", p_leaves, g_leaves, self._paths)
        self.t += 1
        ws, gs = [_local(w) for w in self.masters], [_local(g) for g in g_leaves]
        # low-precision parameters of their gradient's dtype come out of the same pass
        fresh = [_fresh_like(p) if p.dtype != _F32 and p.dtype == g.dtype else None for p, g in zip(p_leaves, g_leaves)]
        get_backend().kernel("adamw_multi", like=ws[0] if ws else None)(
            ws, gs, [_local(m) for m in self.m], [_local(v) for v in self.v],
            lr=self.lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.wd, step=self.t,
            grad_scale=grad_scale, outs=[None if f is None else _local(f) for f in fresh])
        out = [m if p.dtype == _F32 else f if f is not None else op.astype(m, p.dtype)
               for p, m, f in zip(p_leaves, self.masters, fresh)]
        return tree_unflatten(self._struct, out)
