"""What DTensor's operators and protocols call from the modules above the type.

``dtensor_type`` defines DTensor, and the modules that make DTensors import it, so it cannot
import them: ``dist.tensor.dispatch`` registers its op entry points (``use_dispatcher``:
binary, unary, reduce, matmul, reshape, transpose) and ``dist.tensor.interop`` the NumPy,
DLPack, pickle and ``distribute`` helpers (``use_interop``), each on import (dist/__init__
imports both).  The two objects here hold them, one typed slot each; a slot read before its
registration raises, naming what to import.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DispatchEntries", "InteropParts", "DISPATCH", "INTEROP", "use_dispatcher", "use_interop"]


def _unset(owner: str, part: str):
    def missing(*args, **kw):
        raise RuntimeError(f"DTensor's {part} is {owner}'s, which registers it when imported: import tessera_rt.dist")
    return missing


class DispatchEntries:
    """The dispatcher's entry points DTensor's operators call (``DISPATCH``; ``use_dispatcher``
    fills them).  Until then each raises, naming what to import."""
    __slots__ = ("binary", "unary", "reduce", "matmul", "reshape", "transpose")

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

    def __init__(self) -> None:
        for n in ("refusal", "unpickle", "as_global"):
            setattr(self, n, _unset("dist.tensor.interop", n))
        self.ufuncs, self.functions, self.original, self.meshes = {}, {}, {}, {}
        self.ufunc_hint = self.func_hint = ""


DISPATCH = DispatchEntries()
INTEROP = InteropParts()


def use_dispatcher(*, binary: Callable, unary: Callable, reduce: Callable, matmul: Callable, reshape: Callable,
                   transpose: Callable) -> None:
    """``dist.tensor.dispatch``'s op entry points, which DTensor's operators call (every one)."""
    d = DISPATCH
    d.binary, d.unary, d.reduce, d.matmul, d.reshape, d.transpose = binary, unary, reduce, matmul, reshape, transpose


def use_interop(*, refusal: Callable, ufuncs: dict, ufunc_hint: str, functions: dict, original: dict,
                func_hint: str, meshes: Any, unpickle: Callable, as_global: Callable) -> None:
    """``dist.tensor.interop``'s helpers (every one), which DTensor's NumPy/pickle protocols call."""
    io = INTEROP
    io.refusal, io.ufuncs, io.ufunc_hint, io.functions, io.original = refusal, ufuncs, ufunc_hint, functions, original
    io.func_hint, io.meshes, io.unpickle, io.as_global = func_hint, meshes, unpickle, as_global
