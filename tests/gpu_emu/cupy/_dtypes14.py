"""CuPy 14.2's dtype rules: which dtypes have kernels, and which loop a ufunc runs.

Read from CuPy v14.2.0's source:

* a kernel needs a C type for every array it touches (cupy/_core/_scalar.pyx
  ``get_typename``): the NumPy types ``?bhilqBHILQefdFD``, ``bfloat16`` (cupy/bfloat16.cuh,
  enabled when ml_dtypes imports and NumPy >= 2.1.2) and plain void/structured bytes.  Anything
  else (the fp8 types) raises ``ValueError("Unsupported dtype ...")``; so does creating such an
  array other than as a view or over a given ``memptr`` (cupy/_core/_dtype.pyx
  ``check_supported_dtype``, called by ``ndarray.__init__``);
* a ufunc runs the first of its loops that every input casts to safely (``numpy.can_cast``),
  a Python scalar being *weak*: accepted when ``numpy.result_type(type(x)(0), loop_type)`` is
  the loop's type, unless it is of a higher kind than every array (cupy/_core/_kernel.pyx
  ``_guess_routine_from_in_types``, ``_check_should_use_weak_scalar``).  ml_dtypes' bfloat16
  is no ``numpy.floating``, so its kind scores above float, and with ml_dtypes 0.6
  ``result_type(0.0, bfloat16)`` is float64: ``bf16_array * 0.5`` runs the float32 loop and
  returns float32 on a real GPU (and in NumPy), while ``bf16_array * 2`` stays bfloat16;
* the bfloat16 loop of a ufunc (``cupy._util.bf16_loop``) sits right after its float16 twin
  and computes in float (cupy/bfloat16.cuh converts, computes, rounds once).  Ufuncs without
  one run a wider loop (``divmod``: float32) or none (``gcd``, bitwise ops: TypeError).
"""
from __future__ import annotations

import functools

import numpy as np

try:
    if np.lib.NumpyVersion(np.__version__) < "2.1.2":
        raise ImportError("CuPy 14 enables bfloat16 only with NumPy >= 2.1.2")
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None

# dtype chars CuPy 14's kernels have C types for (cupy/_core/_dtype.pyx ``all_type_chars``),
# bfloat16 aside (its char 'E' is ml_dtypes', unknown to numpy.dtype)
KERNEL_DTYPE_CHARS = frozenset("?bhilqBHILQefdFD")
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
NOTE = "(CuPy stand-in, modelling CuPy 14.2: on a real GPU this call fails)"

# ufuncs with a bfloat16 loop in CuPy 14.2 (cupy/_core/_routines_{math,logic}.pyx,
# cupy/_math/*.py, cupy/_logic/*.py: every ``*bf16_loop(...)``), by NumPy name
BF16_UFUNCS = frozenset((
    "add", "subtract", "multiply", "divide", "floor_divide", "remainder", "fmod", "power",
    "negative", "positive", "absolute", "sign", "exp", "exp2", "expm1", "log", "log2", "log10",
    "log1p", "sqrt", "cbrt", "square", "reciprocal", "sin", "cos", "tan", "arcsin", "arccos",
    "arctan", "arctan2", "sinh", "cosh", "tanh", "arcsinh", "arccosh", "arctanh", "hypot",
    "maximum", "minimum", "fmax", "fmin", "equal", "not_equal", "less", "less_equal", "greater",
    "greater_equal", "logical_and", "logical_or", "isfinite", "isinf", "isnan", "signbit",
    "copysign", "floor", "ceil", "trunc", "rint", "conjugate", "deg2rad", "rad2deg", "modf",
    "frexp", "ldexp", "logaddexp", "logaddexp2", "heaviside", "nextafter",
))


def is_bf16(dt) -> bool:
    return BF16 is not None and np.dtype(dt) == BF16


def is_16bit_float(dt) -> bool:
    return np.dtype(dt) == F16 or is_bf16(dt)


def has_c_type(dt) -> bool:
    dt = np.dtype(dt)
    if dt.char in KERNEL_DTYPE_CHARS or is_bf16(dt):
        return True
    # plain void / structured bytes: CuPy moves them (cupy::UnstructuredVoid, StructView)
    return dt.type is np.void and dt.subdtype is None and dt.itemsize > 0 and not dt.hasobject


def unsupported(dt, what: str) -> ValueError:
    # CuPy's own message first ("Unsupported dtype float8_e4m3fn"), so code matching it matches here
    return ValueError(f"Unsupported dtype {np.dtype(dt)} {NOTE}: CuPy 14.2 has no C type for it, so "
                      f"{what} cannot run; move its bytes as a view of a supported dtype (uint8/uint16)")


def check_creatable(dt) -> None:
    if not has_c_type(dt):
        raise unsupported(dt, "an array of it cannot be allocated (only viewed)")


def check_kernel_dtypes(kind: str, arrays) -> None:
    for x in arrays:
        if not has_c_type(x.dtype):
            raise unsupported(x.dtype, kind)


def wrong_type(name: str, in_types) -> TypeError:
    # cupy/_core/_kernel.pyx: 'Wrong type (%s) of arguments for %s' % (dtype, name)
    return TypeError(f"Wrong type ({tuple(in_types)}) of arguments for cupy_{name} {NOTE}: no loop of "
                     f"cupy.{name} takes these dtypes")


@functools.cache
def ufunc_loops(np_ufunc: np.ufunc, bf16: bool) -> tuple:
    """CuPy's loops for ``np_ufunc``: NumPy's own for the kernel dtypes (the same order CuPy
    lists them), each float16 loop followed by its bfloat16 twin when ``bf16``.  Each loop is
    ``(in_dtypes, out_dtypes, is_bf16_twin)``."""
    loops = []
    for sig in np_ufunc.types:
        ins, outs = sig.split("->")
        if not set(ins + outs) <= KERNEL_DTYPE_CHARS:
            continue
        loops.append((tuple(np.dtype(c) for c in ins), tuple(np.dtype(c) for c in outs), False))
        if bf16 and BF16 is not None and "e" in ins:
            twin = lambda chars: tuple(BF16 if c == "e" else np.dtype(c) for c in chars)
            loops.append((twin(ins), twin(outs), True))
    return tuple(loops)


def loops_from(sigs) -> tuple:
    """Loops written as CuPy writes them ('?ee->e', ...), for its non-ufunc kernels."""
    return tuple((tuple(np.dtype(c) for c in s.split("->")[0]),
                  tuple(np.dtype(c) for c in s.split("->")[1]), False) for s in sigs)


def operand_type(x):
    """(dtype, weak type or False) as cupy/_core/_scalar.pyx ``CScalar`` sees an operand."""
    typ = type(x)
    if typ is bool:
        return np.dtype(np.bool_), False
    if typ is float:
        return F64, float
    if typ is complex:
        return np.dtype(np.complex128), complex
    if typ is int:
        return np.dtype(np.uint64 if x >= 2 ** 63 else np.int64), int
    return np.dtype(x.dtype), False


def _kind_score(t) -> int:
    if issubclass(t, np.bool_):
        return 0
    if issubclass(t, (np.integer, int)):
        return 1
    if issubclass(t, (np.inexact, float, complex)):
        return 2
    return 3        # unknown types (bfloat16) score above float: weak Python floats stay weak


def _use_weak(in_types, weaks) -> bool:
    scalar_kinds = [_kind_score(w) for w in weaks if w]
    array_kinds = [_kind_score(t.type) for t, w in zip(in_types, weaks) if not w]
    return bool(scalar_kinds and array_kinds) and max(array_kinds) >= max(scalar_kinds)


def guess_loop(loops, operands, dtype=None):
    """The loop CuPy runs for ``operands`` (or the one whose outputs are all ``dtype``), or None."""
    if dtype is not None:
        dtype = np.dtype(dtype)
        return next((loop for loop in loops if all(t == dtype for t in loop[1])), None)
    in_types, weaks = zip(*(operand_type(x) for x in operands))
    if not _use_weak(in_types, weaks):
        weaks = (False,) * len(in_types)
    for loop in loops:
        for it, ot, weak in zip(in_types, loop[0], weaks):
            if np.can_cast(it, ot):
                continue
            if not weak:
                break
            try:
                if np.result_type(weak(0), ot) != ot:
                    break
            except TypeError:
                break
        else:
            return loop
    return None


def in_types(operands) -> tuple:
    return tuple(operand_type(x)[0] for x in operands)
