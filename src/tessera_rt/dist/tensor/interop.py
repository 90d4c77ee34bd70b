"""DTensor interop with NumPy (``__array_function__``/``__array_ufunc__``), DLPack and pickle,
and what ``dist.distribute`` accepts; the rules are in dtensor_type.py's module doc.  DTensor's
dunder methods call these; kept apart so dtensor_type.py stays about the tensor itself."""
from __future__ import annotations

import weakref

import numpy as np

from ...backend import get_backend
from ...dtypes import dtype_name, resolve_dtype
from ..comm.mesh import current_mesh
from ..comm.process_group import world
from . import dispatch as _d
from .dtensor_type import DTensor, meta_of
from .entries import use_interop
from .layout import Layout

__all__: list[str] = []


def _refusal(x: DTensor, what: str, call: str) -> str:
    return (f"rank {world().rank}: {what} is not defined for a DTensor ({dtype_name(x.dtype)}{list(x.shape)} "
            f"{x.layout!r} over {x.mesh!r}; this rank's piece is {list(x._local.shape)}): it is a global tensor, "
            f"not this rank's array. Call {call} on X.to_local() for this rank's piece (no copy), or on "
            "X.full_tensor() for the whole tensor on every rank (collectives)")


_UFUNC_HINT = ("; DTensors take np.add/subtract/multiply/divide/power/maximum/minimum, comparisons, "
               "np.negative/absolute/exp/log/sqrt/tanh/sin/cos/square and np.matmul, without out=/where=/dtype=")
_FUNC_HINT = "; DTensors take np.sum/mean/max/min/amax/amin, np.transpose/reshape/dot and np.shape/ndim/size"
_UFUNCS = {**{u: ("binary", o) for u, o in (
    ("add", "add"), ("subtract", "sub"), ("multiply", "mul"), ("divide", "div"), ("true_divide", "div"),
    ("power", "pow"), ("maximum", "maximum"), ("minimum", "minimum"), ("less", "lt"), ("less_equal", "le"),
    ("greater", "gt"), ("greater_equal", "ge"), ("equal", "eq"), ("not_equal", "ne"))},
    **{u: ("unary", o) for u, o in (
        ("negative", "neg"), ("absolute", "abs"), ("exp", "exp"), ("log", "log"), ("sqrt", "sqrt"),
        ("tanh", "tanh"), ("sin", "sin"), ("cos", "cos"), ("square", "square"))},
    "matmul": ("matmul", "matmul")}


def _only(name: str, bound: dict, allowed: tuple) -> None:
    extra = [k for k, v in bound.items() if k not in allowed and v is not None and v is not np._NoValue]
    if extra:
        raise TypeError(f"rank {world().rank}: {name} on a DTensor takes {list(allowed[1:])} only, got {extra}; "
                        "cast with X.astype(dtype) first, or use X.to_local()/X.full_tensor() for the rest")


def _reduction(op: str):
    def impl(name: str, b: dict):
        _only(name, b, ("a", "axis", "keepdims"))
        keep = b.get("keepdims", False)
        return _d.reduce(op, b["a"], b.get("axis"), False if keep is np._NoValue else bool(keep))
    return impl


def _dot(name: str, b: dict):
    a, c = b["a"], b["b"]
    if b.get("out") is not None or any(getattr(v, "ndim", 2) not in (1, 2) for v in (a, c)):
        raise TypeError(f"rank {world().rank}: {name} on DTensors takes 1-d or 2-d operands and no out=; "
                        "use X @ Y (np.matmul) for batched products")
    return _d.matmul(a, c)


def _transpose(name: str, b: dict):
    return _d.transpose(b["a"], b.get("axes"))


def _reshape(name: str, b: dict):
    _only(name, b, ("a", "newshape", "shape", "order", "copy"))
    if b.get("order", "C") != "C":
        raise TypeError(f"rank {world().rank}: {name} on a DTensor supports order='C' only")
    shape = b.get("shape", b.get("newshape"))
    return _d.reshape(b["a"], shape)


_FUNCTIONS = {"sum": _reduction("sum"), "mean": _reduction("mean"), "max": _reduction("max"),
              "amax": _reduction("max"), "min": _reduction("min"), "amin": _reduction("min"),
              "dot": _dot, "transpose": _transpose, "reshape": _reshape,
              "shape": lambda n, b: b["a"].shape, "ndim": lambda n, b: b["a"].ndim,
              "size": lambda n, b: b["a"].size if b.get("axis") is None else b["a"].shape[b["axis"]]}
# the NumPy functions themselves: a same-named function from elsewhere gets no rule
_ORIGINAL = {k: getattr(np, k) for k in _FUNCTIONS if hasattr(np, k)}
_MESHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _unpickle(version: int, layout: Layout, shape: tuple, dtype: str, mesh_sig: tuple, rank: int, local):
    """Rebuild a pickled DTensor (see the module doc for where that is possible)."""
    here = world().rank
    what = f"a pickled DTensor {dtype}{list(shape)} {layout!r} over axes {dict(zip(mesh_sig[0], mesh_sig[1]))}"
    if here != rank:
        raise ValueError(f"rank {here}: {what} holds rank {rank}'s piece, so it can only be unpickled on rank "
                         f"{rank}; to send a tensor to another rank, pickle X.full_tensor() or X.to_local() "
                         "(an array) instead")
    mesh = _MESHES.get(mesh_sig)
    cur = current_mesh()
    if mesh is None and cur is not None and (cur.axes, cur.sizes, cur.devices) == tuple(mesh_sig):
        mesh = cur
    if mesh is None:
        raise ValueError(f"rank {here}: {what}: no live Mesh with those axes and ranks {list(mesh_sig[2])[:8]} "
                         "in this process; make the same dist.Mesh and unpickle inside `with mesh:`")
    local = get_backend().xp.asarray(local)
    return DTensor._wrap(local, meta_of(layout, tuple(shape), resolve_dtype(dtype), mesh))


def _as_global(value, backend):
    """The global array ``distribute`` cuts, or a TypeError naming what was given instead."""
    if type(value) is DTensor:
        raise TypeError(f"rank {world().rank}: dist.distribute got a DTensor ({value!r}); use "
                        "X.redistribute(layout) to change its layout")
    ok = backend.is_array(value) or isinstance(value, (np.ndarray, np.generic, int, float, complex, list, tuple))
    g = backend.xp.asarray(value) if ok else None
    if g is None or g.dtype.kind in "OUSMm" or g.dtype.fields is not None:
        got = type(value).__name__ + (f" of dtype {g.dtype}" if g is not None else "")
        raise TypeError(f"rank {world().rank}: dist.distribute takes a numeric array (the same global array on "
                        f"every rank: NumPy/CuPy, or a number or nested list of numbers), got a {got}; "
                        "make it one with np.asarray(..., dtype=np.float32)")
    return g


use_interop(refusal=_refusal, ufuncs=_UFUNCS, ufunc_hint=_UFUNC_HINT, functions=_FUNCTIONS, original=_ORIGINAL,
            func_hint=_FUNC_HINT, meshes=_MESHES, unpickle=_unpickle, as_global=_as_global)
