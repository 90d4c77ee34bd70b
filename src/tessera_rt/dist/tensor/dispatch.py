"""The eager dispatcher: every DTensor op runs through ``dispatch``.

    unwrap -> look up the op's rule -> redistribute inputs -> local kernel -> wrap

The decision (target layouts, redistribution plans, local function, output metadata) is
cached on (op, static params, each argument's interned metadata or scalar kind), so after
the first call an op costs a dict lookup, the plans it needs, and the local kernel.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ...backend import get_backend
from ..checks import determinism
from ..comm.hooks import SEAM as _SEAM
from ..comm.process_group import world
from . import reduction_rules  # noqa: F401  (registers matmul's, the reductions', norms' and attention's rules)
from .cost import on_change
from .dtensor_type import DTensor, TensorMeta, meta_of
from .entries import use_dispatcher
from .redistribute import plan_redistribute
from .rules import RULES, ConstKind, RuleError, ScalarKind

__all__ = [
    "dispatch", "binary", "unary", "reduce", "matmul", "transpose", "reshape", "softmax", "layernorm",
    "rmsnorm", "explain", "clear_cache", "Decision", "OP_WATCHERS",
]

_SCALAR_TYPES = (int, float, complex, bool)
OP_WATCHERS = _SEAM.op_watchers  # profiler / NVTX hooks (op_begin, op_end); empty: one list check per op
# SEAM.metas: the default agreement check's record while it is on, else None (filled by
# consistency.configure): each op notes its DTensor arguments' metadata there, inline (a
# hook through OP_WATCHERS cost ~3 us an op, 12-14% of a toy transformer step)

# caches of the dispatcher: interned argument kinds (scalar, constant) and the decision per
# (op, params, kinds); clear_cache empties the decisions (a cost model or mode change)
_SCALAR_KINDS: dict = {}
_CONST_KINDS: dict = {}
_CACHE: dict = {}


class Decision:
    """What one (op, argument metadata) does: plans per argument and the local function."""

    __slots__ = ("op", "plans", "fn", "layout", "shape", "mesh", "_metas", "simple", "strategy", "_array_type",
                 "arg_metas")

    def __init__(self, op, plans, fn, layout, shape, mesh, strategy, arg_metas=()):
        self.op, self.plans, self.fn, self.layout, self.shape, self.mesh = op, plans, fn, layout, shape, mesh
        self.simple = all(p is None for p in plans)
        self._metas: dict = {}
        self.strategy = strategy
        self._array_type = get_backend().xp.ndarray
        # (id of the mesh, metadata) of each DTensor argument: the decision is cached on them
        self.arg_metas = arg_metas

    def run(self, args):
        if OP_WATCHERS:
            return _profiled(self, args)
        check = _SEAM.metas
        if check is not None:               # the default check is on: note the arguments
            metas = check.metas
            for mid, m in self.arg_metas:
                on = metas.get(mid)
                if on is None:
                    metas[mid] = {m}
                elif len(on) < 16:
                    on.add(m)
        if self.simple:
            out = self.fn(*[a._local if type(a) is DTensor else a for a in args])
        else:
            locs = []
            for a, p in zip(args, self.plans):
                if type(a) is DTensor:
                    locs.append(a._local if p is None else p.run(a._local))
                else:
                    locs.append(a)
            out = self.fn(*locs)
        m = self._metas.get(out.dtype)
        if m is None:
            m = self._metas[out.dtype] = meta_of(self.layout, self.shape, out.dtype, self.mesh)
        if type(out) is not self._array_type:
            out = get_backend().xp.asarray(out)       # NumPy gives 0-dim results as scalars
        t = _new(DTensor)
        t._local = out
        t._meta = m
        return t

    def __repr__(self) -> str:
        ins = ", ".join("-" if p is None else " then ".join(s.kind for s in p.steps) or "-" for p in self.plans)
        return f"Decision({self.op}: inputs [{ins}] -> {self.layout!r} {list(self.shape)})"


_new = object.__new__


def _profiled(dec: Decision, args):
    hooks = tuple(OP_WATCHERS)
    for h in hooks:
        h.op_begin(dec, args)
    out = None
    OP_WATCHERS.clear()                    # the op itself runs unhooked (its collectives are hooked)
    try:
        out = dec.run(args)
    finally:
        if OP_WATCHERS:                    # hooks added while the op ran (a profile entered inside it)
            OP_WATCHERS[:] = [h for h in hooks if h not in OP_WATCHERS] + OP_WATCHERS
        else:
            OP_WATCHERS[:] = hooks
        for h in reversed(hooks):
            h.op_end(dec, args, out)
    return out


def _kind(a):
    t = type(a)
    if t is DTensor:
        return a._meta
    k = _SCALAR_KINDS.get(t)
    if k is not None:
        return k
    if t in _SCALAR_TYPES or isinstance(a, np.generic):
        k = _SCALAR_KINDS[t] = ScalarKind(t)
        return k
    if a is None:
        return _const(None)
    backend = get_backend()
    if backend.is_array(a) or isinstance(a, np.ndarray):
        if a.ndim == 0:
            return _SCALAR_KINDS.setdefault(("0d", a.dtype), ScalarKind(a.dtype))
        return _const(tuple(a.shape))
    raise TypeError(f"rank {world().rank}: DTensor ops take DTensors, scalars and arrays; got "
                    f"{type(a).__name__}")


def _const(shape):
    k = _CONST_KINDS.get(shape)
    if k is None:
        k = _CONST_KINDS[shape] = ConstKind(shape)
    return k


def _decide(op: str, params: tuple, kinds: tuple) -> Decision:
    metas = [k for k in kinds if isinstance(k, TensorMeta)]
    if not metas:
        raise TypeError(f"{op}: no DTensor argument")
    mesh = metas[0].mesh
    for m in metas[1:]:
        if m.mesh is not mesh and m.mesh != mesh:
            raise RuleError(f"rank {world().rank}: {op}: operands live on different meshes ({mesh!r} with "
                            f"devices {list(mesh.devices)[:8]} and {m.mesh!r} with devices "
                            f"{list(m.mesh.devices)[:8]}); redistribute onto one mesh first")
    try:
        rule = RULES[op]
    except KeyError:
        raise NotImplementedError(f"no sharding rule for DTensor op {op!r}; rules exist for "
                                  f"{sorted(RULES)}") from None
    strat = rule(op, kinds, params)
    plans = []
    for k, tgt in zip(kinds, strat.inputs):
        if isinstance(k, TensorMeta) and tgt is not None and tgt != k.layout:
            tgt.validate(k.shape, mesh, what=f"{op} input layout")
            plans.append(plan_redistribute(k.shape, k.layout, tgt, mesh, k.dtype))
        else:
            plans.append(None)
    strat.out_layout.validate(strat.out_shape, mesh, what=f"{op} output layout")
    return Decision(op, tuple(plans), strat.local, strat.out_layout, tuple(strat.out_shape), mesh, strat,
                    tuple((id(k.mesh), k) for k in kinds if isinstance(k, TensorMeta)))


def decision(op: str, params: tuple, args: tuple) -> Decision:
    kinds = tuple(_kind(a) for a in args)
    key = (op, params) + kinds
    dec = _CACHE.get(key)
    if dec is None:
        dec = _CACHE[key] = _decide(op, params, kinds)
    return dec


def dispatch(op: str, params: tuple, args: tuple) -> DTensor:
    """Run ``op`` on ``args`` (DTensors, scalars, constant arrays) with static ``params``."""
    return decision(op, params, args).run(args)


def explain(op: str, params: tuple, args: tuple) -> Decision:
    """The cached decision for an op call (its plans say which collectives it issues)."""
    return decision(op, params, args)


def compute_region(name: str) -> contextlib.AbstractContextManager:
    """A context that marks kernel work outside the dispatcher as compute in every profile
    recording now (autodiff's flash-attention rules call their kernels on the local pieces),
    so the profiler's tables show it and the overlap ratio counts it.

    Parameters
    ----------
    name : str
        The region's name in the tables and the trace.

    Returns
    -------
    context manager
        ``region(name)`` of the recording profiles, or a no-op context when none records.
    """
    profs = [p for p in OP_WATCHERS if hasattr(p, "region")]
    if not profs:
        return contextlib.nullcontext()
    if len(profs) == 1:
        return profs[0].region(name)
    stack = contextlib.ExitStack()
    for p in profs:
        stack.enter_context(p.region(name))
    return stack


def clear_cache() -> None:
    _CACHE.clear()


on_change(clear_cache)          # decisions are priced by the cost model: a new model, new decisions
determinism.on_change(clear_cache)      # and made for the deterministic mode or not


# --------------------------------------------------------------------------- op entry points

def binary(op: str, a, b) -> DTensor:
    ka = a._meta if type(a) is DTensor else _kind(a)
    kb = b._meta if type(b) is DTensor else _kind(b)
    dec = _CACHE.get((op, (), ka, kb))
    if dec is None:
        dec = _CACHE[(op, (), ka, kb)] = _decide(op, (), (ka, kb))
    return dec.run((a, b))


def unary(op: str, x, param: Any = None) -> DTensor:
    params = () if param is None else (param,)
    return dispatch(op, params, (x,))


def reduce(op: str, x, axis=None, keepdims: bool = False) -> DTensor:
    if isinstance(axis, list):
        axis = tuple(axis)
    return dispatch(op, (axis, bool(keepdims)), (x,))


def matmul(a, b, tile_shape=None, policy=None) -> DTensor:
    if tile_shape is not None:
        tile_shape = tuple(int(t) for t in tile_shape)
    ka = a._meta if type(a) is DTensor else _kind(a)
    kb = b._meta if type(b) is DTensor else _kind(b)
    params = (tile_shape, policy)
    key = ("matmul", params, ka, kb)
    dec = _CACHE.get(key)
    if dec is None:
        dec = _CACHE[key] = _decide("matmul", params, (ka, kb))
    return dec.run((a, b))


def transpose(x, perm=None) -> DTensor:
    return dispatch("transpose", (None if perm is None else tuple(perm),), (x,))


def reshape(x, shape) -> DTensor:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    return dispatch("reshape", (shape,), (x,))


def softmax(x, axis: int = -1, policy=None) -> DTensor:
    return dispatch("softmax", (int(axis), policy), (x,))


def layernorm(x, weight=None, bias=None, eps: float = 1e-5, policy=None) -> DTensor:
    return dispatch("layernorm", (float(eps), policy), (x, weight, bias))


def rmsnorm(x, weight=None, eps: float = 1e-6, policy=None) -> DTensor:
    return dispatch("rmsnorm", (float(eps), policy), (x, weight))


use_dispatcher(binary=binary, unary=unary, reduce=reduce, matmul=matmul, reshape=reshape, transpose=transpose)
