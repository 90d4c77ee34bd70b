"""The DTensor type: a global tensor stored as one local piece per rank of a mesh (seed 002 §2.2).

Made by the constructors in ``dtensor`` (``dist.distribute``, ``dist.from_local``,
``dist.zeros``, ``dist.randn``, ...), which re-exports this type:

    X.to_local(); X.full_tensor(); X.redistribute(Rep); X.explain_redistribute(Rep)
    Y = X @ W;  Z = X + Y;  X.sum(axis=0);  X.T

Every op goes through ``dispatch`` (rule lookup, input redistribution, local kernel).
A DTensor is immutable in the sense that ops return new DTensors; ``to_local()`` hands out
the local array itself.

Interop with NumPy, CuPy and PyTorch (a DTensor is a global tensor, not this rank's array):

* ``np.sum/mean/max/min/amax/amin/transpose/reshape/dot/shape/ndim/size`` and the ufuncs
  ``np.add ... np.exp, np.matmul`` (see ``_UFUNCS``) run as DTensor ops and return DTensors;
  anything else (and ``out=``, ``dtype=``, ``where=``, ``np.add.reduce``...) raises a TypeError
  that names the function and says to use ``X.to_local()`` or ``X.full_tensor()``.
* ``np.asarray(X)``, ``torch.from_dlpack(X)``, ``cupy.from_dlpack(X)`` refuse (``__array__``,
  ``__dlpack__``, ``__dlpack_device__``): which array is meant, the piece or the whole, is
  the caller's choice: ``X.to_local()`` (this rank's piece, no copy) or ``X.full_tensor()``.
* ``pickle``/``copy.deepcopy`` keep (layout, global shape, dtype, mesh axes/sizes/ranks, this
  rank's piece).  Unpickling rebuilds the DTensor on the rank that pickled it, on a live Mesh
  with the same axes, sizes and ranks (one this process pickled from, or ``with mesh:``);
  on another rank, or with no such mesh, it raises (a piece is only valid where it was cut).
"""
from __future__ import annotations

import inspect

import numpy as np

from ...backend import get_backend
from ...dtypes import dtype_name, resolve_dtype
from ..comm.hooks import TRACE as _TRACE
from ..comm.mesh import Mesh
from ..comm.process_group import world
from .cost import on_change
from .entries import DISPATCH, INTEROP
from .layout import REPLICATE, Layout, as_layout
from .redistribute import RedistributionPlan, _fast_run, plan_redistribute


def _unpickle(*args):
    """Rebuild a pickled DTensor (``dist.tensor.interop``'s; this is the name pickles refer to)."""
    return INTEROP.unpickle(*args)


__all__ = ["DTensor", "TensorMeta", "meta_of"]


class TensorMeta:
    """Interned (layout, global shape, dtype, mesh): compared and hashed by identity, so a
    dispatcher cache key is a tuple of a few of these."""

    __slots__ = ("layout", "shape", "dtype", "mesh", "ndim", "redist", "last", "__weakref__")

    def __init__(self, layout: Layout, shape: tuple, dtype: np.dtype, mesh: Mesh):
        self.layout, self.shape, self.dtype, self.mesh, self.ndim = layout, shape, dtype, mesh, len(shape)
        # target spec (as the caller wrote it) -> (plan, the result's meta): X.redistribute's
        # repeat calls skip resolving the spec and looking the plan up (cleared with the plans)
        self.redist: dict = {}
        self.last: tuple | None = None          # (target spec, entry) of the last call: an `is` test

    def __repr__(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)} {self.layout!r}"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def last_target(self, layout, x: DTensor) -> tuple:
        """(plan, result meta) of ``x.redistribute(layout)``, from ``redist`` or made now;
        remembered as ``last``.  Bad specs raise here, on every call (nothing is cached)."""
        try:
            hit = self.redist.get(layout)
        except TypeError:                     # an unhashable spec: as_layout says what is wrong
            hit = None
        if hit is None:
            plan = x.explain_redistribute(layout)
            hit = (plan, meta_of(plan.dst, self.shape, self.dtype, self.mesh))
            if len(self.redist) >= _REDIST_MAX:
                self.redist.clear()
            try:
                self.redist[layout] = hit
            except TypeError:
                return hit
        self.last = (layout, hit)
        return hit


# interned metadata: (layout, shape, dtype, mesh) -> its one TensorMeta (cache; bounded by what exists)
_METAS: dict[tuple, TensorMeta] = {}
_REDIST_MAX = 64          # targets remembered per meta (a loop making new specs must not grow it)


def _clear_redist() -> None:
    for m in _METAS.values():
        m.redist.clear()
        m.last = None


on_change(_clear_redist)        # a new cost model may choose other plans


def meta_of(layout: Layout, shape: tuple, dtype, mesh: Mesh) -> TensorMeta:
    # keyed by the mesh object, not its equality: a DTensor's ``.mesh`` is the mesh it was made
    # on, never an equal one made earlier (the meta holds it, so its id is not reused)
    key = (layout, shape, dtype, id(mesh))
    m = _METAS.get(key)
    if m is None:
        m = _METAS[key] = TensorMeta(layout, tuple(shape), np.dtype(dtype), mesh)
    return m


class DTensor:
    """A distributed tensor: ``layout`` over ``mesh``, global ``shape``, this rank's piece."""

    __slots__ = ("_local", "_meta")
    __hash__ = None                   # == is elementwise

    def __init__(self, *args, **kwargs):
        raise TypeError("make a DTensor with dist.distribute, dist.from_local, dist.tensor, dist.zeros, "
                        "dist.rand or dist.randn")

    @staticmethod
    def _wrap(local, meta: TensorMeta) -> DTensor:
        t = _new(DTensor)
        t._local = local
        t._meta = meta
        return t

    # properties --------------------------------------------------------------
    layout = property(lambda self: self._meta.layout, doc="the resolved Layout")
    shape = property(lambda self: self._meta.shape, doc="the global shape")
    dtype = property(lambda self: self._meta.dtype)
    mesh = property(lambda self: self._meta.mesh)
    ndim = property(lambda self: self._meta.ndim)

    @property
    def size(self) -> int:
        return int(np.prod(self._meta.shape, dtype=np.int64))

    @property
    def placements(self):
        return self._meta.layout.placements(self._meta.mesh)

    def __len__(self) -> int:
        if not self._meta.shape:
            raise TypeError("len() of a 0-dim DTensor")
        return self._meta.shape[0]

    def __repr__(self) -> str:
        m = self._meta
        return (f"DTensor({dtype_name(m.dtype)}{list(m.shape)}, layout={m.layout!r}, mesh={m.mesh!r}, "
                f"local={list(self._local.shape)})")

    def __array__(self, *args, **kwargs):
        raise TypeError("a DTensor is not an array: call X.full_tensor() for the whole tensor on every "
                        "rank, or X.to_local() for this rank's piece")

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a DTensor is ambiguous; compare X.full_tensor() instead")

    # interop (module doc) ---------------------------------------------------------
    def __dlpack__(self, *args, **kwargs):
        raise TypeError(INTEROP.refusal(self, "DLPack export (torch/cupy/np.from_dlpack)", "from_dlpack"))

    def __dlpack_device__(self):
        raise TypeError(INTEROP.refusal(self, "DLPack export (torch/cupy/np.from_dlpack)", "from_dlpack"))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(type(a) is _TRACE.var for a in inputs):
            return NotImplemented                    # a traced operand records the op itself
        name = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        entry = INTEROP.ufuncs.get(ufunc.__name__)
        if method != "__call__" or entry is None or kwargs:
            what = (f"keyword(s) {sorted(kwargs)}" if kwargs and entry is not None and method == "__call__"
                    else "no DTensor rule")
            raise TypeError(INTEROP.refusal(self, f"{name} ({what})", name) + INTEROP.ufunc_hint)
        kind, op_name = entry
        if kind == "unary":
            return DISPATCH.unary(op_name, inputs[0])
        if kind == "matmul":
            return DISPATCH.matmul(*inputs)
        return DISPATCH.binary(op_name, *inputs)

    def __array_function__(self, func, types, args, kwargs):
        name = f"np.{func.__name__}"
        impl = INTEROP.functions.get(func.__name__)
        if impl is None or INTEROP.original.get(func.__name__) is not func:
            raise TypeError(INTEROP.refusal(self, f"{name} (no DTensor rule)", name) + INTEROP.func_hint)
        try:
            bound = inspect.signature(func).bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"{name} on a DTensor: {e}") from None
        return impl(name, bound)

    def __reduce__(self):
        m = self._meta
        INTEROP.meshes[(m.mesh.axes, m.mesh.sizes, m.mesh.devices)] = m.mesh
        local = self._local if isinstance(self._local, np.ndarray) else get_backend().to_host(self._local)
        return (_unpickle, (1, m.layout, m.shape, dtype_name(m.dtype),
                            (m.mesh.axes, m.mesh.sizes, m.mesh.devices), world().rank, local))

    # access --------------------------------------------------------------------
    def to_local(self) -> object:
        """This rank's piece (the array itself, not a copy).

        Returns
        -------
        array
            This rank's piece.
        """
        return self._local

    def full_tensor(self) -> object:
        """The whole tensor on every rank (the collectives its layout needs).

        Returns
        -------
        array
            The global array, the same on every rank.
        """
        return self.redistribute(REPLICATE(self._meta.ndim))._local

    def redistribute(self, layout: object, *, out: DTensor | None = None) -> DTensor:
        """This tensor in another layout (a spec or a Layout), moved one mesh axis per step.

        ``out=Y`` writes the result into Y's local piece and returns Y: a DTensor of the
        result's global shape, layout, mesh and dtype (say, an earlier result of the same
        call) whose piece is C-contiguous and shares no memory with this one.  A loop that
        keeps Y allocates nothing per call, as a hand-written exchange into buffers made once.

        Parameters
        ----------
        layout : Layout or spec
            The target layout.
        out : DTensor, optional
            Receives the result (see above).

        Returns
        -------
        DTensor
            The tensor in ``layout`` (``out`` when given).
        """
        m = self._meta
        last = m.last
        if last is not None and last[0] is layout:
            plan, out_meta = last[1]
        else:
            plan, out_meta = m.last_target(layout, self)
        if out is not None:                  # (run from this frame, as below: the check's site depth)
            loc = self._out_piece(plan, out_meta, out)
            if loc is not None:
                res = _fast_run(plan, self._local, 2, loc) if _fast_run is not None else NotImplemented
                if res is NotImplemented:
                    plan.run(self._local, loc)
            return out
        if not plan.steps:
            return self
        t = _new(DTensor)
        local = _fast_run(plan, self._local, 2) if _fast_run is not None else NotImplemented   # (2: RedistributionPlan.run's
        t._local = plan.run(self._local) if local is NotImplemented else local                 # caller)
        t._meta = out_meta
        return t

    def _out_piece(self, plan: RedistributionPlan, out_meta: TensorMeta, out):
        """``out``'s local piece for ``redistribute(out=out)`` (None when nothing is left to
        do), or a ValueError saying what out must be."""
        if type(out) is not DTensor or out._meta is not out_meta:
            got = repr(out) if type(out) is DTensor else type(out).__name__
            raise ValueError(f"DTensor.redistribute(out=...) on rank {world().rank}: out must be a DTensor "
                             f"{dtype_name(out_meta.dtype)}{list(out_meta.shape)} in layout {out_meta.layout!r} on "
                             f"{out_meta.mesh!r} (the result's), got {got}; pass the result of an earlier "
                             f"redistribute to the same layout, or dist.zeros(shape, layout=..., mesh=...)")
        if out is self and not plan.steps:       # already in place
            return None
        loc, xp = out._local, get_backend().xp
        shares = getattr(xp, "may_share_memory", None)       # (NumPy's and CuPy's: a bounds test)
        if not loc.flags.c_contiguous or (shares is not None and shares(loc, self._local)):
            why = "is not C-contiguous" if not loc.flags.c_contiguous else "shares memory with the input's piece"
            raise ValueError(f"DTensor.redistribute(out=...) on rank {world().rank}: out's local piece "
                             f"({dtype_name(loc.dtype)}{list(loc.shape)} of {out_meta!r}) {why}; pass a DTensor "
                             f"with a fresh C-contiguous piece of its own (dist.zeros(..., layout=...))")
        if not plan.steps:
            xp.copyto(loc, self._local)
            return None
        return loc

    def explain_redistribute(self, layout: object) -> RedistributionPlan:
        """The plan ``redistribute(layout)`` would run: its steps, what each rank sends, and
        each step's time as the registered cost model (``dist.cost``) predicts it.

        Parameters
        ----------
        layout : Layout or spec
            The target layout.

        Returns
        -------
        RedistributionPlan
            The plan (print it for the steps).
        """
        m = self._meta
        dst = as_layout(layout, m.shape, m.mesh)
        return plan_redistribute(m.shape, m.layout, dst, m.mesh, m.dtype)

    # ops (all through the dispatcher) ----------------------------------------------
    # A traced operand (autodiff's Var) takes over through its reflected operator, which
    # records the op; this is the one autodiff hook in DTensor's operators.
    def __add__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("add", self, o)
    def __radd__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("add", o, self)
    def __sub__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("sub", self, o)
    def __rsub__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("sub", o, self)
    def __mul__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("mul", self, o)
    def __rmul__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("mul", o, self)
    def __truediv__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("div", self, o)
    def __rtruediv__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("div", o, self)
    def __pow__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("pow", self, o)
    def __rpow__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("pow", o, self)
    def __matmul__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.matmul(self, o)
    def __rmatmul__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.matmul(o, self)
    def __neg__(self): return DISPATCH.unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return DISPATCH.unary("abs", self)
    def __lt__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("lt", self, o)
    def __le__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("le", self, o)
    def __gt__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("gt", self, o)
    def __ge__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("ge", self, o)
    def __eq__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return NotImplemented if type(o) is _TRACE.var else DISPATCH.binary("ne", self, o)  # type: ignore[override]

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> DTensor:
        """``op.sum(self, axis, keepdims)``: over a sharded dim, a pending reduction.

        Parameters
        ----------
        axis : int or tuple of int, optional
            The dims reduced; None: all.
        keepdims : bool
            Keep the reduced dims with length 1.

        Returns
        -------
        DTensor
            The sum.
        """
        return DISPATCH.reduce("sum", self, axis, keepdims)
    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> DTensor:
        """``op.mean(self, axis, keepdims)``: over a sharded dim, a pending reduction.

        Parameters
        ----------
        axis : int or tuple of int, optional
            The dims reduced; None: all.
        keepdims : bool
            Keep the reduced dims with length 1.

        Returns
        -------
        DTensor
            The mean.
        """
        return DISPATCH.reduce("mean", self, axis, keepdims)
    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> DTensor:
        """``op.max(self, axis, keepdims)``: over a sharded dim, a pending reduction.

        Parameters
        ----------
        axis : int or tuple of int, optional
            The dims reduced; None: all.
        keepdims : bool
            Keep the reduced dims with length 1.

        Returns
        -------
        DTensor
            The maximum.
        """
        return DISPATCH.reduce("max", self, axis, keepdims)
    def min(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> DTensor:
        """``op.min(self, axis, keepdims)``: over a sharded dim, a pending reduction.

        Parameters
        ----------
        axis : int or tuple of int, optional
            The dims reduced; None: all.
        keepdims : bool
            Keep the reduced dims with length 1.

        Returns
        -------
        DTensor
            The minimum.
        """
        return DISPATCH.reduce("min", self, axis, keepdims)

    def transpose(self, *axes: int | tuple[int, ...]) -> DTensor:
        """``op.transpose``: dims permuted (reversed without ``axes``), the layout with them.

        Parameters
        ----------
        *axes : int
            The new order, as ints or one tuple.

        Returns
        -------
        DTensor
            The permuted tensor.
        """
        return DISPATCH.transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else (axes or None))

    @property
    def T(self): return DISPATCH.transpose(self, None)

    def reshape(self, *shape: int | tuple[int, ...]) -> DTensor:
        """``op.reshape`` (see there for which shardings survive).

        Parameters
        ----------
        *shape : int
            The new global shape, as ints or one tuple.

        Returns
        -------
        DTensor
            The reshaped tensor.
        """
        return DISPATCH.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def astype(self, dtype: object) -> DTensor:
        """This tensor converted to ``dtype``, same layout.

        Parameters
        ----------
        dtype : str or dtype
            The target dtype.

        Returns
        -------
        DTensor
            The converted tensor.
        """
        return DISPATCH.unary("astype", self, resolve_dtype(dtype))

    def __getitem__(self, index):
        raise TypeError("DTensor indexing is not supported yet; index X.full_tensor() or X.to_local(), "
                        "or redistribute and slice the local piece")


_new = object.__new__
