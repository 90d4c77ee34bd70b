"""Reductions over float16/bfloat16 as CuPy 14.2 runs them.

NumPy with ml_dtypes adds bfloat16 values in bfloat16, rounding at every step (the sum of
1000 ones is 256).  CuPy's sum/prod/mean kernels give their 16-bit loops a float accumulator
(``bf16_loop(code=(None, None, None, 'float'))`` and ``('e->e', (..., 'float'))`` in
cupy/_core/_routines_math.pyx, _routines_statistics.pyx) and round once.  A stand-in more
exact than the GPU could hide a bug, one less exact would fail code that works, so this
matches CuPy, kernel for kernel:

* ``sum``/``prod``/``nansum``/``nanprod``: one kernel, float32 accumulation;
* ``nanmean``: its float16 loop accumulates in ``nanmean_st<half>`` (float16 adds); its
  bfloat16 loop swaps that struct for ``float``, which ``my_nanmean(a, b)``/``a.value`` cannot
  use, so it cannot compile on a GPU (read from the source, not run): refused here;
* ``mean`` without ``dtype`` (cupy/_core/_routines_statistics.pyx ``_ndarray_mean``): a float32
  mean kernel then ``astype`` back (two launches, one cast); with a 16-bit ``dtype``, the
  16-bit loop then a same-dtype ``astype`` copy (two launches);
* ``var``/``std`` (``_var``): ``mean(dtype=a.dtype, keepdims=True)`` (two launches), then
  ``_var_core_*``: ``(x - mean)**2`` in the array's dtype (each op rounded to it), summed in
  the output dtype: float16 for float16 (a tree of float16 adds, as the block reduction), and
  float64 for bfloat16: ``_var`` picks ``_var_core_float64`` for any dtype but float16/float32,
  so CuPy 14.2's ``var``/``std`` of bfloat16 return float64.  ``std`` adds a sqrt kernel.
"""
from __future__ import annotations

import numpy as np

from . import _bridge
from ._dtypes14 import F16, F32, F64, is_16bit_float
from ._errors import StandinLimitation

__all__ = ["REDUCTIONS", "tree_sum"]


def tree_sum(x: np.ndarray, axis, dtype, keepdims=False) -> np.ndarray:
    """Sum over ``axis`` adding pairs level by level in ``dtype`` (each add rounded to it, as a
    GPU block reduction does): error ~log2(n) roundings, not n as a sequential loop's."""
    axes = tuple(range(x.ndim)) if axis is None else tuple(
        a % x.ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
    kept = [a for a in range(x.ndim) if a not in axes]
    out_shape = tuple(1 if a in axes else x.shape[a] for a in range(x.ndim)) if keepdims else \
        tuple(x.shape[a] for a in kept)
    y = np.transpose(x, kept + list(axes)).reshape(tuple(x.shape[a] for a in kept) + (-1,))
    y = y.astype(dtype)
    n = y.shape[-1]
    if n == 0:
        return np.zeros(out_shape, dtype)
    width = 1 << (n - 1).bit_length()
    if width != n:
        y = np.concatenate([y, np.zeros(y.shape[:-1] + (width - n,), dtype)], axis=-1)
    while y.shape[-1] > 1:
        half = y.shape[-1] // 2
        y = (y[..., :half].astype(F32) + y[..., half:].astype(F32)).astype(dtype)
    return y.reshape(out_shape)


def _no_extras(name: str, kwargs: dict) -> None:
    if kwargs:
        raise StandinLimitation(f"cupy.{name} on a 16-bit array with {sorted(kwargs)}: not modelled "
                                "by the CuPy stand-in")


def _f32_reduction(name: str):
    """sum, prod, nansum, nanprod: one kernel with a float32 accumulator."""
    np_func = getattr(np, name)

    def reduction(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
        result_dtype = np.dtype(a.dtype if dtype is None else dtype)
        if not is_16bit_float(result_dtype):
            return NotImplemented            # a 32/64-bit result: NumPy's own loop is CuPy's
        _no_extras(name, kwargs)

        def run(x, out=None):
            r = np.asarray(np_func(x.astype(F32), axis=axis, keepdims=keepdims)).astype(result_dtype)
            if out is None:
                return r
            np.copyto(out, r, casting="unsafe")
            return out
        return _bridge.call_numpy(f"cupy.{name}", run, (a,), {} if out is None else {"out": out})
    reduction.__name__ = name
    return reduction


def mean(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    if dtype is not None and not is_16bit_float(dtype):
        return NotImplemented
    _no_extras("mean", kwargs)
    final = np.dtype(a.dtype if dtype is None else dtype)

    def run(x, out=None):
        r = np.asarray(np.mean(x.astype(F32), axis=axis, keepdims=keepdims))
        r = r if dtype is None else r.astype(final)      # the 16-bit loop rounds in the kernel
        if out is None:
            return r
        np.copyto(out, r, casting="unsafe")
        return out
    if out is not None:                  # the kernel writes ``out``; no astype after it
        return _bridge.call_numpy("cupy.mean", run, (a,), {"out": out})
    return _bridge.call_numpy("cupy.mean", run, (a,), {}).astype(final)


def nanmean(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    if dtype is not None or out is not None or kwargs:
        raise StandinLimitation("cupy.nanmean of a 16-bit array with dtype/out: not modelled by the CuPy "
                                "stand-in")
    if a.dtype != F16:
        raise StandinLimitation(
            f"cupy.nanmean of {a.dtype}: CuPy 14.2's bfloat16 loop gives the nanmean_st<T> reduction a "
            "plain float accumulator, which its code cannot use (a compile error on a real GPU, read "
            "from cupy/_core/_routines_statistics.pyx); use nansum / a count of non-NaNs")

    def run(x):
        valid = ~np.isnan(x)
        total = tree_sum(np.where(valid, x, np.float16(0)), axis, F16, keepdims)
        return (total.astype(F32) / np.sum(valid, axis=axis, keepdims=keepdims)).astype(F16)
    return _bridge.call_numpy("cupy.nanmean", run, (a,), {})


def _var(name: str, a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    if dtype is not None:
        return NotImplemented
    _no_extras(name, kwargs)
    axes = tuple(range(a.ndim)) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    items = int(np.prod([a.shape[ax] for ax in axes], dtype=np.int64))
    div = max(items - ddof, 0)
    alpha = 1.0 / div if div else np.nan
    m = mean(a, axis=axes, dtype=a.dtype, keepdims=True)
    acc = F16 if a.dtype == F16 else F64          # _var_core_float16, else _var_core_float64

    def core(x, mu):
        d = (x.astype(F32) - mu.astype(F32)).astype(x.dtype)     # x - mean in the array's dtype
        sq = (d.astype(F32) * d.astype(F32)).astype(x.dtype)     # my_norm(d) = d * d, likewise
        if acc == F16:
            s = tree_sum(sq, axes, F16, keepdims)
            return (np.float32(alpha) * s.astype(F32)).astype(F16)
        return alpha * np.sum(sq.astype(F64), axis=axes, keepdims=keepdims)
    kind = "cupy_var_core_float16" if acc == F16 else "cupy_var_core_float64"
    result = _bridge.call_numpy(kind, core, (a, m), {})
    if name == "std":
        import cupy
        result = cupy.sqrt(result)
    if out is not None:
        from ._functions import copyto
        copyto(out, result, casting="unsafe")
        return out
    return result


def var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    return _var("var", a, axis, dtype, out, ddof, keepdims, **kwargs)


def std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    return _var("std", a, axis, dtype, out, ddof, keepdims, **kwargs)


def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    # cupy: a.diagonal(offset, axis1, axis2).sum(-1, dtype, out): a view, then the sum kernel
    return REDUCTIONS["sum"](a.diagonal(offset, axis1, axis2), -1, dtype, out)


def average(a, axis=None, weights=None, returned=False, *, keepdims=False):
    if weights is not None or returned:
        raise StandinLimitation("cupy.average with weights (or returned=True) of a 16-bit array is "
                                "not modelled by the CuPy stand-in")
    return mean(a, axis=axis, keepdims=keepdims)


# by function (and method) name: run when an operand is float16 or bfloat16
REDUCTIONS = {name: _f32_reduction(name) for name in ("sum", "prod", "nansum", "nanprod")}
REDUCTIONS.update(mean=mean, nanmean=nanmean, var=var, std=std, trace=trace, average=average)
