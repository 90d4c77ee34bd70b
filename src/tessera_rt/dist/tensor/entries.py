"""What DTensor's operators and protocols call from the modules above the type.

``dtensor_type`` defines DTensor, and the modules that make DTensors import it, so it cannot
import them: ``dist.tensor.dispatch`` registers its op entry points (``use_dispatcher``:
binary, unary, reduce, matmul, reshape, transpose) and ``dist.tensor.interop`` the NumPy,
DLPack, pickle and ``distribute`` helpers (``use_interop``), each on import (dist/__init__
imports both).  The two objects here hold them, one typed slot each; a slot read before its
registration raises, naming what to import.
"""
from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...backend import Backend
    from ..comm.mesh import Mesh

__all__ = ["DispatchEntries", "InteropParts", "DISPATCH", "INTEROP", "use_dispatcher", "use_interop"]


# a DTensor: dtensor_type imports this module, so the hints here cannot name the class (even
# under TYPE_CHECKING, which would close an import circle)
_DTensor = Any


def _unset(owner: str, part: str):
    def missing(*args, **kw):
        raise RuntimeError(f"DTensor's {part} is {owner}'s, which registers it when imported: import tessera_rt.dist")
    return missing


class DispatchEntries:
    """The dispatcher's entry points DTensor's operators call (``DISPATCH``; ``use_dispatcher``
    fills them).  Until then each raises, naming what to import."""
    __slots__ = ("binary", "unary", "reduce", "matmul", "reshape", "transpose")
    binary: Callable[[str, Any, Any], _DTensor]              # (op, a, b)
    unary: Callable[..., _DTensor]                           # (op, x, param=None)
    reduce: Callable[..., _DTensor]                          # (op, x, axis=None, keepdims=False)
    matmul: Callable[..., _DTensor]                          # (a, b, tile_shape=None, policy=None)
    reshape: Callable[[Any, Any], _DTensor]                  # (x, shape)
    transpose: Callable[[Any, Any], _DTensor]                # (x, perm or None)

    def __init__(self) -> None:
        for n in self.__slots__:
            setattr(self, n, _unset("dist.tensor.dispatch", n))


class InteropParts:
    """What DTensor's NumPy, DLPack and pickle protocols and ``dist.distribute`` call
    (``INTEROP``; ``use_interop`` fills them): the refusal message, the ufunc and function
    tables with their hints, the live meshes by (axes, sizes, devices), the unpickler and the
    global-array check."""
    __slots__ = ("refusal", "ufuncs", "ufunc_hint", "functions", "original", "func_hint", "meshes", "unpickle",
                 "as_global")
    refusal: Callable[[_DTensor, str, str], str]             # (x, what, call) -> the TypeError's message
    ufuncs: dict[str, tuple[str, str]]                      # ufunc name -> (kind, DTensor op)
    ufunc_hint: str
    functions: dict[str, Callable[[str, dict], Any]]        # NumPy function name -> impl(name, bound args)
    original: dict[str, Callable[..., Any]]                 # name -> the NumPy function itself
    func_hint: str
    meshes: MutableMapping[tuple, Mesh]                     # (axes, sizes, devices) -> a live Mesh
    unpickle: Callable[..., _DTensor]
    as_global: Callable[[Any, Backend], Any]                # (value, backend) -> the global array

    def __init__(self) -> None:
        for n in ("refusal", "unpickle", "as_global"):
            setattr(self, n, _unset("dist.tensor.interop", n))
        self.ufuncs, self.functions, self.original, self.meshes = {}, {}, {}, {}
        self.ufunc_hint = self.func_hint = ""


DISPATCH = DispatchEntries()
INTEROP = InteropParts()


def use_dispatcher(*, binary: Callable[[str, Any, Any], _DTensor], unary: Callable[..., _DTensor],
                   reduce: Callable[..., _DTensor], matmul: Callable[..., _DTensor],
                   reshape: Callable[[Any, Any], _DTensor], transpose: Callable[[Any, Any], _DTensor]) -> None:
    """``dist.tensor.dispatch``'s op entry points, which DTensor's operators call (every one)."""
    d = DISPATCH
    d.binary, d.unary, d.reduce, d.matmul, d.reshape, d.transpose = binary, unary, reduce, matmul, reshape, transpose


def use_interop(*, refusal: Callable[[_DTensor, str, str], str], ufuncs: dict[str, tuple[str, str]], ufunc_hint: str,
                functions: dict[str, Callable[[str, dict], Any]], original: dict[str, Callable[..., Any]],
                func_hint: str, meshes: MutableMapping[tuple, Mesh], unpickle: Callable[..., _DTensor],
                as_global: Callable[[Any, Backend], Any]) -> None:
    """``dist.tensor.interop``'s helpers (every one), which DTensor's NumPy/pickle protocols call."""
    io = INTEROP
    io.refusal, io.ufuncs, io.ufunc_hint, io.functions, io.original = refusal, ufuncs, ufunc_hint, functions, original
    io.func_hint, io.meshes, io.unpickle, io.as_global = func_hint, meshes, unpickle, as_global
