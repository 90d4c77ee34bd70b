"""How much of f32's precision f32 programs keep on the GPU, and what each kernel ran in.

One process-wide switch, as ``torch.set_float32_matmul_precision``:

* ``"highest"`` (the default): f32 means f32.  GEMMs on f32 operands run cuBLAS in f32
  (``CUBLAS_COMPUTE_32F``), and f32 attention runs as f32 GEMMs around an f32 softmax;
* ``"high"``: f32 GEMMs may use TF32 tensor cores (inputs rounded to 10 mantissa bits, f32
  accumulation: about 1e-3 relative error per product); attention stays f32 (its batched
  GEMMs have no TF32 mode in CuPy);
* ``"medium"``: f32 GEMMs and attention round their operands to bf16 (8 mantissa bits) for
  the bf16 tensor cores, accumulate in f32 and return f32.

Nothing ever drops to fp16 behind the program's back: fp16's narrow range needs loss
scaling (``optim.DynamicLossScaler``), which a program chooses by holding fp16 tensors.  On
the CPU f32 stays f32 whatever the setting (NumPy's BLAS has no reduced-precision f32 GEMM).
``TESSERA_F32_MATMUL_PRECISION`` sets the starting level.

Kernels say what they ran in through ``note(op, precision)``; a listener (the profiler)
counts the notes, so a profile names the precision of every kernel it saw.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

__all__ = ["set_float32_matmul_precision", "get_float32_matmul_precision", "float32_matmul_precision",
           "PRECISIONS", "note", "add_listener", "remove_listener", "f32_compute"]

PRECISIONS = ("highest", "high", "medium")
# what an f32 GEMM computes in at each level (the name ``note`` records)
_F32_COMPUTE = {"highest": "f32", "high": "tf32", "medium": "bf16"}


def _check(level: str) -> str:
    if level not in PRECISIONS:
        raise ValueError(f"float32 matmul precision {level!r}: use 'highest' (f32), 'high' (TF32 tensor "
                         "cores) or 'medium' (bf16 tensor cores)")
    return level


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

_LISTENERS: list[Callable[[str, str], None]] = []


def add_listener(fn: Callable[[str, str], None]) -> None:
    """Call ``fn(op, precision)`` for every kernel that notes its precision (the profiler)."""
    _LISTENERS.append(fn)


def remove_listener(fn: Callable[[str, str], None]) -> None:
    if fn in _LISTENERS:
        _LISTENERS.remove(fn)


def note(op: str, precision: str) -> None:
    """A kernel of ``op`` ran in ``precision`` ("f32", "tf32", "bf16", "f16", "f64").  With no
    listener this is one list check."""
    if _LISTENERS:
        for fn in tuple(_LISTENERS):
            fn(op, precision)
