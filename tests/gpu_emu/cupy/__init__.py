"""A strict, NumPy-backed stand-in for the part of CuPy tessera_rt uses (tests only).

Put ``tests/gpu_emu`` first on ``sys.path`` and ``import cupy`` gets this package; it never
imports the real CuPy.  It models CuPy 14.2: arrays live in a model of CuPy's stream-ordered
memory pool, every device operation is recorded on a stream, and ``StreamOrderError``
reports what would race on a GPU (see ``_tracker``).  Where CuPy refuses something (implicit
host conversion, host arrays passed to device functions, dtypes without kernels), this
refuses it the same way; bfloat16 runs where CuPy 14.2 has loops, in the dtype and precision
it has them (``_dtypes14``, ``_bf16``, ``_reductions16``, ``_core._routines_linalg``).
``cupy.testing.count_device_work()`` counts what a GPU would pay: launches, syncs, copies,
casts (``_counters``).
"""
# ruff: noqa: F401  (this module is CuPy's namespace: what it imports, it exports)
import numpy as _np

from . import _core, _ndarray, cuda, fft, random, testing
from ._creation import (
    arange,
    array,
    asanyarray,
    asarray,
    ascontiguousarray,
    asfortranarray,
    asnumpy,
    empty,
    empty_like,
    eye,
    from_dlpack,
    full,
    full_like,
    get_array_module,
    identity,
    linspace,
    ones,
    ones_like,
    zeros,
    zeros_like,
)
from ._errors import StandinLimitation, StreamOrderError
from ._functions import build_namespace as _build_namespace, ufunc
from ._ndarray import ndarray
from ._raw import RawKernel, RawModule
from .cuda import get_default_memory_pool

__tessera_standin__ = True
__version__ = "14.2.0+standin"

globals().update(_build_namespace())
_ndarray._install_operators()

# NumPy's scalar types and constants, as CuPy re-exports them
for _name in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64", "complex64", "complex128", "intp", "uintp",
              "byte", "ubyte", "short", "ushort", "intc", "uintc", "longlong", "ulonglong",
              "half", "single", "double", "csingle", "cdouble", "generic", "number", "integer",
              "signedinteger", "unsignedinteger", "inexact", "floating", "complexfloating",
              "newaxis", "pi", "e", "inf", "nan", "euler_gamma"):
    globals()[_name] = getattr(_np, _name)
bool = _np.bool_  # cupy.bool is numpy.bool_
del _name


def is_available() -> bool:
    return cuda.is_available()


def show_config() -> None:
    print(f"CuPy stand-in {__version__} (NumPy {_np.__version__}); no GPU is used")
