"""CuPy 14.2's GEMMs (cupy/_core/_routines_linalg.pyx): compute types, TF32, 16-bit operands.

* ``dot``/``tensordot``/``inner``/2-D ``matmul`` (``tensordot_core``): the operands are
  promoted (``numpy.promote_types``: bfloat16 with float16 raises) and cast with ``astype``
  (a launch and a cast each); an operand neither C- nor F-contiguous is copied; then one cuBLAS
  ``gemmEx`` with ``CUBLAS_COMPUTE_32F`` for float16/bfloat16/float32: float32 accumulation and
  one rounding to the output dtype.  When the output is one element (vector x vector) CuPy runs
  ``_tensordot_core_mul_sum`` instead, a reduction in the output dtype: 16-bit products summed
  in 16 bits (a tree here, as the block reduction);
* TF32: ``get_compute_type(float32)`` is ``COMPUTE_TYPE_TF32`` after ``set_compute_type`` or,
  on first use, when ``CUPY_TF32`` > 0; ``tensordot_core_v11`` then asks cuBLAS for
  ``CUBLAS_COMPUTE_32F_FAST_TF32``.  Modelled by rounding both float32 operands to TF32 (10
  explicit mantissa bits, to nearest with ties away from zero, as ``cvt.rna.tf32.f32``) before a
  float32 product, so a test sees TF32's error;
* ``matmul`` with ndim > 2 (the batched path): float16 is computed in float32 (operands cast,
  result copied back) without TF32 (gemmStridedBatchedEx gets no TF32 math mode), and
  **bfloat16 fails**: its dtype char 'E' is not in 'efdFD', so CuPy 14.2 sends it to the
  integer GEMM, whose kernel lookup raises ``TypeError: data type 'E' not understood`` (fixed
  upstream after 14.2, cupy commit cd86906f3).  ``einsum`` of two operands contracts through
  that batched matmul, so a bfloat16 ``einsum`` fails the same way.
"""
from __future__ import annotations

import os

import numpy as np

from .. import _bridge, _counters
from .._dtypes14 import F32, NOTE, is_16bit_float, is_bf16
from .._reductions16 import tree_sum

COMPUTE_TYPE_TBD, COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_PEDANTIC = 0, 1, 2
COMPUTE_TYPE_FP16, COMPUTE_TYPE_FP32, COMPUTE_TYPE_FP64 = 3, 4, 5
COMPUTE_TYPE_BF16, COMPUTE_TYPE_TF32 = 6, 7
_NAMES = {0: "COMPUTE_TYPE_TBD", 1: "COMPUTE_TYPE_DEFAULT", 2: "COMPUTE_TYPE_PEDANTIC",
          3: "COMPUTE_TYPE_FP16", 4: "COMPUTE_TYPE_FP32", 5: "COMPUTE_TYPE_FP64",
          6: "COMPUTE_TYPE_BF16", 7: "COMPUTE_TYPE_TF32"}
_compute_types = [COMPUTE_TYPE_TBD] * 4        # bfloat16, float16, float32, float64


def to_compute_type_index(dtype) -> int:
    dt = np.dtype(dtype)
    if dt.char == "e":
        return 1
    if dt.char in "fF":
        return 2
    if dt.char in "dD":
        return 3
    if is_bf16(dt):
        return 0
    raise TypeError(f"dtype is not supported: {dtype}")


def set_compute_type(dtype, compute_type) -> None:
    # the stand-in device is sm_90: BF16/TF32 are accepted (CuPy warns below sm_80)
    if compute_type not in _NAMES:
        raise ValueError(f"Unknown compute type: {compute_type}")
    _compute_types[to_compute_type_index(dtype)] = compute_type


def get_compute_type(dtype) -> int:
    index = to_compute_type_index(dtype)
    if _compute_types[index] == COMPUTE_TYPE_TBD:
        tf32 = np.dtype(dtype).char in "fF" and int(os.getenv("CUPY_TF32", "0")) > 0
        set_compute_type(dtype, COMPUTE_TYPE_TF32 if tf32 else COMPUTE_TYPE_DEFAULT)
    return _compute_types[index]


def compute_type_to_str(compute_type):
    return _NAMES.get(compute_type, compute_type)


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (1+8+10 bits), to nearest, ties away from zero
    (complex64: each part)."""
    if np.iscomplexobj(x):
        return (round_to_tf32(x.real) + 1j * round_to_tf32(x.imag)).astype(np.complex64)
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits)
    return rounded.astype(np.uint32).view(F32).reshape(np.shape(x))


def _operand(x, name: str):
    from .._ndarray import ndarray
    if not isinstance(x, ndarray):
        raise _bridge.refuse(x)
    return x


def _cast(x, dtype, name: str):
    """``a.astype(dtype, copy=False)`` in tensordot_core: a launch (and a cast) if needed."""
    return x if x.dtype == dtype else x.astype(dtype)


def _gemm(name: str, np_func, a, b, dtype, extra=(), tf32_ok=True, out=None):
    """One cuBLAS call on operands already in ``dtype``: float32 accumulation for 16-bit and
    float32, TF32 operands when asked for; into ``out`` (C-contiguous, of ``dtype``) when given."""
    tf32 = tf32_ok and dtype.char in "fF" and get_compute_type(dtype) == COMPUTE_TYPE_TF32
    for x in (a, b):        # _mat_to_cublas_contiguous: a strided (not C/F) operand is copied
        if x.ndim == 2 and not (x.flags.c_contiguous or x.flags.f_contiguous):
            _bridge.call_numpy(f"{name} (operand copy)", np.ascontiguousarray, (x,), {})

    def run(x, y):
        if is_16bit_float(dtype):
            return np.asarray(np_func(x.astype(F32), y.astype(F32), *extra)).astype(dtype)
        if tf32:
            return np.asarray(np_func(round_to_tf32(x), round_to_tf32(y), *extra)).astype(dtype)
        return np_func(x, y, *extra)
    what = "TF32" if tf32 else "32F" if dtype.char in "efF" or is_bf16(dtype) else "64F"
    if out is not None:
        def run_into(x, y, out):
            out[...] = np.asarray(run(x, y)).reshape(out.shape)
            return out
        return _bridge.call_numpy(f"{name} (cuBLAS gemmEx, COMPUTE_{what})", run_into, (a, b), {"out": out})
    return _bridge.call_numpy(f"{name} (cuBLAS gemmEx, COMPUTE_{what})", run, (a, b), {})


def _mul_sum(name: str, a, b, dtype):
    """``_tensordot_core_mul_sum``: a one-element product, reduced in the output dtype."""
    for x in (a, b):
        if x.dtype != dtype:
            _counters.note_cast(f"{x.dtype}->{dtype} (operand of {name})")

    def run(x, y):
        if is_16bit_float(dtype):
            p = (x.astype(F32).ravel() * y.astype(F32).ravel()).astype(dtype)
            return tree_sum(p, None, dtype)
        return np.asarray(np.dot(x.ravel().astype(dtype), y.ravel().astype(dtype)))
    return _bridge.call_numpy(f"{name} (_tensordot_core_mul_sum)", run, (a, b), {})


def _writes_into(out, a, b, dtype) -> bool:
    """CuPy writes the GEMM straight into ``out`` when it is C-contiguous, of the computed
    dtype and shares no memory with an operand (matmul's ``c = out``; dot's output check)."""
    return (out is not None and out.flags.c_contiguous and out.dtype == dtype
            and not any(np.shares_memory(out._a, x._a) for x in (a, b)))


def _finish(result, out, shape):
    result = result.reshape(shape) if result.shape != shape else result
    if out is None:
        return result
    from .._functions import copyto
    copyto(out, result, casting="unsafe")
    return out





def dot(a, b, out=None):
    a, b = _operand(a, "dot"), _operand(b, "dot")
    if a.ndim == 0 or b.ndim == 0:
        import cupy
        return cupy.multiply(a, b, out=out)
    dtype = np.promote_types(a.dtype, b.dtype)
    if not (dtype.kind in "fc" or is_bf16(dtype)):
        return NotImplemented                 # integer GEMMs: NumPy's result is CuPy's
    k = a.shape[-1]
    if k != (b.shape[-2] if b.ndim > 1 else b.shape[0]):
        raise ValueError("Axis dimension mismatch")
    shape = a.shape[:-1] + (b.shape[:-2] + b.shape[-1:] if b.ndim > 1 else ())
    n, m = (a.size // k if k else 0), (b.size // k if k else 0)
    if n == 1 and m == 1:
        return _finish(_mul_sum("cupy.dot", a, b, dtype), out, shape)
    a2, b2 = _cast(a, dtype, "dot"), _cast(b, dtype, "dot")
    if _writes_into(out, a, b, dtype):
        return _gemm("cupy.dot", np.dot, a2, b2, dtype, out=out)
    return _finish(_gemm("cupy.dot", np.dot, a2, b2, dtype), out, shape)


def matmul(a, b, out=None, **kwargs):
    a, b = _operand(a, "matmul"), _operand(b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("Scalar operands are not allowed, use '*' instead")
    if kwargs:
        from .._errors import StandinLimitation
        raise StandinLimitation(f"cupy.matmul with {sorted(kwargs)}: not modelled by the CuPy stand-in")
    if max(a.ndim, b.ndim) <= 2:
        return dot(a, b, out)
    ret = np.promote_types(a.dtype, b.dtype)
    if is_bf16(ret):
        raise TypeError(f"data type 'E' not understood {NOTE}: CuPy 14.2's batched matmul (ndim > 2) "
                        "takes bfloat16 (char 'E') for an integer type and looks up an integer GEMM "
                        "kernel for it (fixed after 14.2, cupy cd86906f3); loop over 2-D matmuls, "
                        "or reshape to 2-D where the batch is a plain row block")
    if ret.kind not in "fc":
        return NotImplemented
    dtype = F32 if ret.char == "e" else ret
    # ascontiguousarray(a, dtype): a batched operand is copied unless C-contiguous in dtype
    a2, b2 = (x if x.dtype == dtype and x.flags.c_contiguous else _contiguous(x, dtype) for x in (a, b))
    if dtype == ret and _writes_into(out, a, b, dtype):
        return _gemm("cupy.matmul", np.matmul, a2, b2, dtype, tf32_ok=False, out=out)
    c = _gemm("cupy.matmul", np.matmul, a2, b2, dtype, tf32_ok=False)
    if dtype != ret:
        c = c.astype(ret)                 # elementwise_copy(c, out): a launch and a cast
    return _finish(c, out, c.shape)


def _contiguous(x, dtype):
    import cupy
    if x.dtype != dtype:
        _counters.note_cast(f"{x.dtype}->{dtype} (operand of cupy.matmul)")
    return cupy.ascontiguousarray(x, dtype=dtype)


def tensordot(a, b, axes=2):
    a, b = _operand(a, "tensordot"), _operand(b, "tensordot")
    dtype = np.promote_types(a.dtype, b.dtype)
    if not (dtype.kind in "fc" or is_bf16(dtype)) or a.ndim == 0 or b.ndim == 0:
        return NotImplemented
    a2, b2 = _cast(a, dtype, "tensordot"), _cast(b, dtype, "tensordot")
    return _gemm("cupy.tensordot", np.tensordot, a2, b2, dtype, extra=(axes,))


def inner(a, b):
    a, b = _operand(a, "inner"), _operand(b, "inner")
    if a.ndim == 0 or b.ndim == 0 or not (np.promote_types(a.dtype, b.dtype).kind in "fc"
                                          or is_bf16(np.promote_types(a.dtype, b.dtype))):
        return NotImplemented
    return tensordot(a, b, axes=([a.ndim - 1], [b.ndim - 1]))


def vdot(a, b):
    a, b = _operand(a, "vdot"), _operand(b, "vdot")
    if a.size != b.size:
        raise ValueError("Axis dimension mismatch")
    dtype = np.promote_types(a.dtype, b.dtype)
    if not is_16bit_float(dtype):
        return NotImplemented
    return _mul_sum("cupy.vdot", a.ravel(), b.ravel(), dtype).reshape(())


def einsum(*operands, **kwargs):
    from .._ndarray import ndarray
    arrays = [x for x in operands if isinstance(x, ndarray)]
    if len(arrays) >= 2 and any(is_bf16(x.dtype) for x in arrays):
        raise TypeError(f"data type 'E' not understood {NOTE}: cupy.einsum contracts two operands with "
                        "a batched (3-D) cupy.matmul, which CuPy 14.2 cannot run on bfloat16")
    return NotImplemented


FUNCTIONS = {"dot": dot, "matmul": matmul, "tensordot": tensordot, "inner": inner, "vdot": vdot,
             "einsum": einsum}
