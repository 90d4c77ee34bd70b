"""How much of f32's precision f32 programs keep on the GPU, and what each kernel ran in.

One process-wide switch, as ``torch.set_float32_matmul_precision``:

* ``"highest"`` (the default): f32 means f32.  GEMMs on f32 operands run cuBLAS in f32
  (``CUBLAS_COMPUTE_32F``), and f32 attention runs the f32 flash kernels in 3xTF32 (each
  operand split into two TF32 parts, three tensor-core products: f32-accurate, see
  ``flash_f32_cuda``);
* ``"high"``: f32 GEMMs may use TF32 tensor cores (inputs rounded to 10 mantissa bits, f32
  accumulation: about 1e-3 relative error per product), and so does attention (the same
  kernels with one TF32 product);
* ``"medium"``: f32 GEMMs and attention round their operands to bf16 (8 mantissa bits) for
  the bf16 tensor cores, accumulate in f32 and return f32.

Nothing ever drops to fp16 behind the program's back: fp16's narrow range needs loss
scaling (``optim.DynamicLossScaler``), which a program chooses by holding fp16 tensors.  On
the CPU f32 stays f32 whatever the setting (NumPy's BLAS has no reduced-precision f32 GEMM).
``TESSERA_F32_MATMUL_PRECISION`` sets the starting level.

Kernels say what they ran in through ``note(op, precision, provider=...)``; a listener (the
profiler, ``TESSERA_DEBUG=kernels``) counts the notes, so a profile names the precision and
the provider (``kernels.providers``: cuDNN, cuBLASLt, cuBLAS or the project's own kernel) of
every kernel it saw.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["set_float32_matmul_precision", "get_float32_matmul_precision", "float32_matmul_precision",
           "PRECISIONS", "note", "add_listener", "remove_listener", "f32_compute", "own_kernel_of"]

PRECISIONS = ("highest", "high", "medium")
# what an f32 GEMM computes in at each level (the name ``note`` records)
_F32_COMPUTE = {"highest": "f32", "high": "tf32", "medium": "bf16"}


def _check(level: str) -> str:
    if level not in PRECISIONS:
        raise ValueError(f"float32 matmul precision {level!r}: use 'highest' (f32), 'high' (TF32 tensor "
                         "cores) or 'medium' (bf16 tensor cores)")
    return level


# the process's float32 matmul precision (set_float32_matmul_precision; TESSERA_F32_MATMUL_PRECISION)
_LEVEL = [_check(os.environ.get("TESSERA_F32_MATMUL_PRECISION", "highest").strip().lower() or "highest")]


def set_float32_matmul_precision(level: str) -> None:
    """Set how f32 GEMMs and f32 attention compute on the GPU (see the module doc).

    Parameters
    ----------
    level : {"highest", "high", "medium"}
        f32, TF32 or bf16 tensor cores.
    """
    _LEVEL[0] = _check(level)


def get_float32_matmul_precision() -> str:
    """The current level: "highest", "high" or "medium".

    Returns
    -------
    str
        The level.
    """
    return _LEVEL[0]


@contextlib.contextmanager
def float32_matmul_precision(level: str) -> Iterator[None]:
    """``with float32_matmul_precision("high"):`` the level for a block, restored after.

    Parameters
    ----------
    level : {"highest", "high", "medium"}
        The level inside the block.

    Returns
    -------
    context manager
        Sets the level on entry and restores the previous one on exit.
    """
    before = _LEVEL[0]
    _LEVEL[0] = _check(level)
    try:
        yield
    finally:
        _LEVEL[0] = before


def f32_compute() -> str:
    """What an f32 GEMM computes in now: "f32", "tf32" or "bf16"."""
    return _F32_COMPUTE[_LEVEL[0]]


# --------------------------------------------------------------------------- the record

# who hears note() (add_listener / remove_listener): the profiler, TESSERA_DEBUG=kernels
_LISTENERS: list[Callable[[str, str, str | None, str | None], None]] = []
# while a provider dispatcher runs the project's own kernel (``providers.dispatch``): op -> why
# the vendor providers declined; a note for that op without a provider is the own kernel's
_FALLBACK = threading.local()


def _takes_provider(fn: Callable) -> bool:
    """Does ``fn`` accept ``(op, precision, provider, why)``?  Listeners written for the
    two-argument record (``fn(op, precision)``) keep working: they are called with two."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 4


def add_listener(fn: Callable) -> None:
    """Call ``fn(op, precision, provider, why)`` for every kernel that notes its precision (the
    profiler, ``TESSERA_DEBUG=kernels``); a two-argument ``fn(op, precision)`` gets those two."""
    _LISTENERS.append(fn if _takes_provider(fn) else _TwoArgs(fn))


def remove_listener(fn: Callable) -> None:
    for entry in tuple(_LISTENERS):
        if entry == fn or getattr(entry, "fn", None) == fn:
            _LISTENERS.remove(entry)


class _TwoArgs:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, op: str, precision: str, provider: str | None, why: str | None) -> None:
        self.fn(op, precision)


@contextlib.contextmanager
def own_kernel_of(op: str, why: str | None) -> Iterator[list]:
    """Inside the block, notes for ``op`` that name no provider are the project's own kernel,
    chosen because ``why`` (the providers' reasons; None: no provider serves ``op``).  Yields
    a one-item list: ``[True]`` once such a note was made."""
    stack = getattr(_FALLBACK, "stack", None)
    if stack is None:
        stack = _FALLBACK.stack = []
    entry: list[Any] = [op, why, False]
    stack.append(entry)
    noted = [False]
    try:
        yield noted
    finally:
        stack.pop()
        noted[0] = entry[2]


def note(op: str, precision: str, provider: str | None = None, why: str | None = None) -> None:
    """A kernel of ``op`` ran in ``precision`` ("f32", "tf32", "bf16", "f16", "fp8", "f64"),
    by ``provider`` ("cudnn", "cublaslt", "cublas", "own"; None: not said) and, when the
    project's own kernel ran where a provider might have, ``why`` (the providers' reasons).
    With no listener this is one list check."""
    if not _LISTENERS:
        return
    if provider is None:
        stack = getattr(_FALLBACK, "stack", None)
        if stack:
            for entry in reversed(stack):
                if entry[0] == op:
                    provider, why, entry[2] = "own", entry[1], True
                    break
    for fn in tuple(_LISTENERS):
        fn(op, precision, provider, why)
