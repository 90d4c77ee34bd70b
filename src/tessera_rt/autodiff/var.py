"""Traced values: ``Var`` (a value plus how it was made), the ``Tape`` that records them, and
the operators a traced value has (``x + y``, ``x @ w``, ``x.sum()``), which call the namespace
``tessera_rt.op`` registers on import (``register_ops``): autodiff sits below op.  The hook
that makes Vars (``differentiable``'s recording side) and the reverse sweep live in ``tape``
and ``engine``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..dist.comm.hooks import TRACE as STATE, differentiable

if TYPE_CHECKING:
    from .finish import Finisher

__all__ = ["Var", "Tape", "register_ops", "ops", "current_tape", "is_traced"]


class Tape:
    """The ops recorded by one ``ts.grad`` call, in program order (a topological order):
    ``nodes`` (the Vars), ``recording`` (False inside ``no_grad``).  Takes no parameters."""

    __slots__ = ("nodes", "recording", "parent")

    def __init__(self) -> None:
        self.nodes: list[Var] = []
        self.recording = True
        self.parent: Tape | None = None


class Var:
    """A traced value: ``value`` plus how it was made (``op``, plain ``args``/``kw``, parents).

    Parameters
    ----------
    value : Any
        The plain value (an array, a DTensor, a scalar).
    tape : Tape
        The trace it belongs to.
    op : str or None
        The op that made it (None: a leaf, one of the differentiated arguments).
    args : tuple
        The op's plain positional arguments (its VJP rule's residuals).
    kw : dict or None
        The op's keyword arguments.
    parents : tuple
        ``(argument position, Var)`` of each traced argument.
    """

    __slots__ = ("value", "tape", "op", "args", "kw", "parents", "grad", "uses", "leaf", "name", "finish")
    __array_ufunc__ = None               # ndarray (op) Var -> Var's reflected operator
    __array_priority__ = 1000
    __hash__ = object.__hash__

    def __init__(self, value: Any, tape: Tape, op: str | None = None, args: tuple = (), kw: dict | None = None,
                 parents: tuple = ()):
        self.value = value
        self.tape = tape
        self.op = op
        self.args = args
        self.kw = kw
        self.parents = parents           # ((arg position, Var), ...)
        self.grad = None
        self.uses = 0
        self.leaf = op is None
        self.name = None                 # a leaf's path in the argument pytree (for errors)
        self.finish: Finisher | None = None  # a leaf's hook when its gradient is complete

    # metadata --------------------------------------------------------------------
    shape = property(lambda self: tuple(self.value.shape))
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)
    layout = property(lambda self: self.value.layout)
    mesh = property(lambda self: self.value.mesh)
    size = property(lambda self: self.value.size)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"Var({self.op or 'leaf'}: {self.value!r})"

    def __array__(self, *a, **k):
        raise TypeError("a traced value (ts.grad is differentiating through it) cannot become a NumPy "
                        "array; call ts.detach(x) for its value without a gradient")

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a traced value depends on data the gradient cannot follow; "
                        "branch on ts.detach(x) instead")

    # operators: all go through op.* (whose hooks record) -------------------------
    def __add__(self, o): return _ops.add(self, o)
    def __radd__(self, o): return _ops.add(o, self)
    def __sub__(self, o): return _ops.sub(self, o)
    def __rsub__(self, o): return _ops.sub(o, self)
    def __mul__(self, o): return _ops.mul(self, o)
    def __rmul__(self, o): return _ops.mul(o, self)
    def __truediv__(self, o): return _ops.div(self, o)
    def __rtruediv__(self, o): return _ops.div(o, self)
    def __pow__(self, o): return _ops.pow(self, o)
    def __rpow__(self, o): return _ops.pow(o, self)
    def __matmul__(self, o): return _ops.matmul(self, o)
    def __rmatmul__(self, o): return _ops.matmul(o, self)
    def __neg__(self): return _ops.neg(self)
    def __pos__(self): return self
    def __abs__(self): return _ops.abs(self)
    def __lt__(self, o): return _ops.less(self, o)
    def __le__(self, o): return _ops.less_equal(self, o)
    def __gt__(self, o): return _ops.greater(self, o)
    def __ge__(self, o): return _ops.greater_equal(self, o)
    def __eq__(self, o): return _ops.equal(self, o)
    def __ne__(self, o): return _ops.not_equal(self, o)
    def __getitem__(self, index): return _ops.getitem(self, index)

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Var:
        """The sum over ``axis`` (``op.sum``), traced.

        Parameters
        ----------
        axis : int, tuple of int or None
            The axes to reduce (None: all).
        keepdims : bool
            Keep the reduced axes with length 1.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.sum(self, axis, keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Var:
        """The mean over ``axis`` (``op.mean``), traced.

        Parameters
        ----------
        axis : int, tuple of int or None
            The axes to reduce (None: all).
        keepdims : bool
            Keep the reduced axes with length 1.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.mean(self, axis, keepdims)

    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Var:
        """The maximum over ``axis`` (``op.max``), traced.

        Parameters
        ----------
        axis : int, tuple of int or None
            The axes to reduce (None: all).
        keepdims : bool
            Keep the reduced axes with length 1.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.max(self, axis, keepdims)

    def min(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Var:
        """The minimum over ``axis`` (``op.min``), traced.

        Parameters
        ----------
        axis : int, tuple of int or None
            The axes to reduce (None: all).
        keepdims : bool
            Keep the reduced axes with length 1.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.min(self, axis, keepdims)

    def astype(self, dtype: Any) -> Var:
        """This value converted to ``dtype`` (``op.astype``), traced.

        Parameters
        ----------
        dtype : str or dtype
            The target dtype.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.astype(self, dtype)

    def transpose(self, *axes) -> Var:
        """The transpose (``op.transpose``), traced.

        Parameters
        ----------
        *axes : int or tuple of int
            The permutation, as separate ints or one tuple (none: reverse the axes).

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int)
                               else (axes or None))

    @property
    def T(self): return _ops.transpose(self, None)

    def reshape(self, *shape) -> Var:
        """This value with a new shape (``op.reshape``), traced.

        Parameters
        ----------
        *shape : int or tuple of int
            The new shape, as separate ints or one tuple.

        Returns
        -------
        Var
            The traced result.
        """
        return _ops.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def redistribute(self, layout: Any) -> Var:
        """The traced DTensor in another layout (``DTensor.redistribute``; its VJP moves the
        gradient back).

        Parameters
        ----------
        layout : Layout or spec
            The target layout.

        Returns
        -------
        Var
            The traced result.
        """
        return _redistribute(self, layout)

    def full_tensor(self) -> Var:
        """The traced DTensor gathered to a full array on every rank (``DTensor.full_tensor``).

        Returns
        -------
        Var
            The traced full array.
        """
        return _full_tensor(self)

    def to_local(self) -> Var:
        """This rank's local piece of the traced DTensor (``DTensor.to_local``).

        Returns
        -------
        Var
            The traced local array.
        """
        return _to_local(self)


# --------------------------------------------------------------------------- Var's operators

class _NoOps:
    """What Var's operators call until the op layer registers itself."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"a traced value's operator (op.{name}) is tessera_rt.op's, which is not imported: "
                           "import tessera_rt (or tessera_rt.op) before differentiating")


_ops: Any = _NoOps()        # the op layer's namespace (op.add, op.sum, ...), set by register_ops


def register_ops(namespace: Any) -> None:
    """Give traced values their operators: ``x + y``, ``x @ w``, ``x.sum()``, ... call
    ``namespace.add``, ``namespace.matmul``, ``namespace.sum``, ... (``tessera_rt.op`` registers
    its ops module when it is imported; autodiff sits below op and does not import it).

    Parameters
    ----------
    namespace : module or object
        Has the op entry points by name (``add``, ``sub``, ``mul``, ``div``, ``pow``, ``matmul``,
        ``neg``, ``abs``, the comparisons, ``getitem``, the reductions, ``astype``,
        ``transpose``, ``reshape``), each wrapped with ``differentiable``.
    """
    global _ops
    _ops = namespace


def ops() -> Any:
    """The namespace traced values' operators call (see ``register_ops``).

    Returns
    -------
    module or object
        ``tessera_rt.op``'s ops once op is imported; before that, an object whose every
        attribute raises a RuntimeError saying what to import.
    """
    return _ops


# DTensor access as traced ops (Var.redistribute / full_tensor / to_local); their VJP rules
# are in dist_vjps, which autodiff's __init__ imports

@differentiable("redistribute")
def _redistribute(x, layout):
    return x.redistribute(layout)


@differentiable("full_tensor")
def _full_tensor(x):
    return x.full_tensor()


@differentiable("to_local")
def _to_local(x):
    return x.to_local()


def current_tape() -> Tape | None:
    """The tape ``ts.grad`` records on now.

    Returns
    -------
    Tape or None
        None outside ``ts.grad`` / ``ts.vjp``.
    """
    return STATE.tape


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a traced value (inside ``ts.grad``, one that depends on the arguments).

    Parameters
    ----------
    x : Any
        Any value.

    Returns
    -------
    bool
        True for a ``Var``.
    """
    return type(x) is Var
