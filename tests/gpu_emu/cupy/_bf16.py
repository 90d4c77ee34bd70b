"""CuPy 14.2 calls on bfloat16 (and float16) arrays: which run, in what dtype, which fail.

``dispatch`` is asked first by every cupy function and ndarray method; it returns
``NotImplemented`` where NumPy's own behaviour (with ml_dtypes) is CuPy's.  What it models,
each read from CuPy v14.2.0's source (see ``_dtypes14`` for the ufunc rules):

* ufuncs on bfloat16 (``ufunc_call``): CuPy's loop choice, float32 math rounded once in a
  bfloat16 loop, a wider loop's dtype where there is none (``divmod`` -> float32,
  ``float_power`` -> float64), TypeError where no loop takes bfloat16 (``gcd``, bitwise ops);
* reductions of float16/bfloat16: ``_reductions16``; GEMMs: ``_core._routines_linalg``;
* ``where`` (any dtype: its loops are ``'?ee->e', '?ff->f', ...`` with no bfloat16 one, so a
  bfloat16 ``where`` returns float32; a non-bool condition is cast first, one more launch),
  ``tril``/``triu`` (a ``tri`` mask, then that ``where``), ``clip`` (loops ``eee->e``,
  ``fff->f``: float32 for bfloat16; a ``None`` bound stays ``None`` for a dtype of kind 'V' and
  is refused), ``around``/``round`` (``cupy_round`` has no bfloat16 loop: float32);
* refused on bfloat16: sorting (thrust has no bfloat16: ``sort``, ``argsort``, ``unique``,
  ``percentile``, ``quantile``, and ``partition``/``argpartition`` when they fall back to a
  sort), FFTs (cupy#9630), ``einsum`` of two operands (CuPy 14.2's batched matmul, see
  ``_core._routines_linalg``); any other function not listed in ``SAME_AS_NUMPY`` raises
  StandinLimitation until someone reads its CuPy source and adds it here.
"""
from __future__ import annotations

import numpy as np

from . import _bridge, _counters
from ._dtypes14 import (
    BF16,
    BF16_UFUNCS,
    F32,
    NOTE,
    guess_loop,
    in_types,
    is_16bit_float,
    is_bf16,
    loops_from,
    ufunc_loops,
    wrong_type,
)
from ._errors import StandinLimitation
from ._reductions16 import REDUCTIONS

__all__ = ["dispatch", "ufunc_call", "note_implicit_casts", "has_bf16"]


def _arrays(values):
    from ._ndarray import ndarray
    for v in values:
        if isinstance(v, (ndarray, np.generic)):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _arrays(v)


def has_bf16(values) -> bool:
    return BF16 is not None and any(is_bf16(v.dtype) for v in _arrays(values))


def _has_16bit(values) -> bool:
    from ._ndarray import ndarray
    return any(isinstance(v, ndarray) and is_16bit_float(v.dtype) for v in _arrays(values))


# -- ufuncs ------------------------------------------------------------------------------

def _note_casts(name: str, operands, loop_in, outs=(), loop_out=()) -> None:
    from ._ndarray import ndarray
    for x, t in zip(operands, loop_in):
        if isinstance(x, ndarray) and x.dtype != t:
            _counters.note_cast(f"{x.dtype}->{t} (operand of cupy.{name})")
    for o, t in zip(outs, loop_out):
        if isinstance(o, ndarray) and o.dtype != t:
            _counters.note_cast(f"{t}->{o.dtype} (output of cupy.{name})")


def note_implicit_casts(np_ufunc, name: str, operands, out) -> None:
    """Count the operands a (non-bfloat16) ufunc reads as, or writes to, another dtype."""
    from ._ndarray import ndarray
    if not any(isinstance(x, ndarray) for x in operands):
        return
    spec = tuple(type(x) if type(x) in (int, float, complex) else np.dtype(bool) if type(x) is bool
                 else np.dtype(x.dtype) for x in operands)
    try:
        resolved = np_ufunc.resolve_dtypes(spec + (None,) * np_ufunc.nout)
    except (TypeError, ValueError):
        return
    outs = out if isinstance(out, tuple) else (() if out is None else (out,))
    _note_casts(name, operands, resolved[:np_ufunc.nin], outs, resolved[np_ufunc.nin:])


def _check_out_cast(name: str, from_dt, to_dt, casting: str) -> None:
    # cupy/_core/_dtype.pyx _raise_if_invalid_cast(out_type, out.dtype, casting, "output operand")
    if casting == "same_kind" and from_dt.kind == to_dt.kind or np.can_cast(from_dt, to_dt, casting):
        return
    raise TypeError(f"Cannot cast output operand from {from_dt!r} to {to_dt!r} according to the rule "
                    f"'{casting}' (cupy.{name})")


def ufunc_call(uf, args, kwargs):
    """``uf(*args, **kwargs)`` with a bfloat16 operand, as CuPy 14.2 runs it."""
    np_uf, name, nin = uf._np, uf.__name__, uf.nin
    kwargs = dict(kwargs)
    operands, out = args[:nin], args[nin:] or kwargs.pop("out", None)
    if isinstance(out, tuple) and len(out) == 1:
        out = out[0]
    dtype, casting = kwargs.pop("dtype", None), kwargs.pop("casting", "same_kind")
    if kwargs:
        raise StandinLimitation(f"cupy.{name} on bfloat16 with {sorted(kwargs)}: not modelled")
    loop = guess_loop(ufunc_loops(np_uf, np_uf.__name__ in BF16_UFUNCS), operands, dtype)
    if loop is None:
        raise wrong_type(name, in_types(operands))
    loop_in, loop_out, twin = loop
    outs = out if isinstance(out, tuple) else (() if out is None else (out,))
    for o, t in zip(outs, loop_out):
        _check_out_cast(name, t, o.dtype, casting)
    _note_casts(name, operands, loop_in, outs, loop_out)
    # a bfloat16 loop computes in float and rounds once (cupy/bfloat16.cuh)
    compute = tuple(F32 if is_bf16(t) else t for t in loop_in + loop_out)

    def run(*ops, out=None):
        if twin and np_uf is np.nextafter:      # one bfloat16 ulp: not float32's, rounded back
            res = np_uf(*(np.asarray(x).astype(BF16) for x in ops))
        else:
            conv = [np.asarray(x).astype(t) if isinstance(x, (np.ndarray, np.generic)) else x
                    for x, t in zip(ops, compute)]
            res = np_uf(*conv, signature=compute)
        res = tuple(np.asarray(r).astype(t) for r, t in zip(res if isinstance(res, tuple) else (res,), loop_out))
        if out is None:
            return res if len(res) > 1 else res[0]
        for o, r in zip(out if isinstance(out, tuple) else (out,), res):
            np.copyto(o, r, casting="unsafe")
        return out
    return _bridge.call_numpy(f"cupy.{name}", run, operands, {} if out is None else {"out": out})


# -- functions that are small kernels of their own -----------------------------------------

_WHERE_LOOPS = loops_from(("???->?", "?bb->b", "?BB->B", "?hh->h", "?HH->H", "?ii->i", "?II->I",
                           "?ll->l", "?LL->L", "?qq->q", "?QQ->Q", "?ee->e", "?ff->f", "?dd->d",
                           "?FF->F", "?DD->D"))
_CLIP_LOOPS = loops_from(("???->?", "bbb->b", "BBB->B", "hhh->h", "HHH->H", "iii->i", "III->I",
                          "lll->l", "LLL->L", "qqq->q", "QQQ->Q", "eee->e", "fff->f", "ddd->d"))


def _run_loop(name: str, loops, operands, np_func):
    """A CuPy elementwise kernel over ``operands`` with CuPy's loop choice (``np_func`` given
    the operands already converted to the loop's dtypes)."""
    loop = guess_loop(loops, operands)
    if loop is None:
        raise wrong_type(name, in_types(operands))
    _note_casts(name, operands, loop[0])

    def run(*ops):
        conv = [np.asarray(x).astype(t) if isinstance(x, (np.ndarray, np.generic)) else t.type(x)
                for x, t in zip(ops, loop[0])]
        return np.asarray(np_func(*conv)).astype(loop[1][0])
    return _bridge.call_numpy(f"cupy.{name}", run, operands, {})


def where(condition, x=None, y=None):
    from ._ndarray import ndarray
    if x is None and y is None:
        return NotImplemented            # nonzero (a sync), handled by the caller
    if x is None or y is None:
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    if not isinstance(condition, ndarray):
        raise _bridge.refuse(condition)
    if condition.dtype != np.bool_:
        condition = condition.astype(np.bool_)      # cupy: condition.astype('?', copy=False)
    return _run_loop("where", _WHERE_LOOPS, (condition, x, y), np.where)


def _tri_masked(name: str, m, k: int):
    # cupy/_creation/matrix.py: mask = tri(*m.shape[-2:], k=k, dtype=bool) (one kernel), then
    # where(mask, m, m.dtype.type(0)) for tril, where(mask, zero, m) with k - 1 for triu
    mask = np.tri(*m.shape[-2:], k=k, dtype=np.bool_)
    mask = _bridge.host_to_device("cupy.tri", mask if name == "tril" else ~mask, op_class="kernel")
    return _run_loop("where", _WHERE_LOOPS, (mask, m, m.dtype.type(0)), np.where)


def tril(m, k=0):
    return _tri_masked("tril", m, k)


def triu(m, k=0):
    return _tri_masked("triu", m, k - 1)


def clip(a, a_min=None, a_max=None, out=None, **kwargs):
    if out is not None or kwargs or not is_bf16(a.dtype):
        return NotImplemented
    for bound in (a_min, a_max):
        if bound is None:    # _ndarray_clip fills None bounds only for kinds 'f', 'i', 'u'
            raise TypeError(f"Unsupported type {type(None)} {NOTE}: cupy.clip of bfloat16 passes a None "
                            "bound to its kernel (dtype kind 'V' gets no -inf/inf); give both bounds")
    return _run_loop("clip", _CLIP_LOOPS, (a, a_min, a_max), np.clip)


def around(a, decimals=0, out=None):
    if out is not None or not is_bf16(a.dtype):
        return NotImplemented
    _counters.note_cast(f"{a.dtype}->float32 (operand of cupy.round: no bfloat16 loop)")
    return _bridge.call_numpy("cupy.round", lambda x: np.round(x.astype(F32), decimals), (a,), {})


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    # cupy_is_close has loops 'eeee?->?', 'ffff?->?', ...: bfloat16 is compared in float32
    ops = [x for x in (a, b)]
    _note_casts("isclose", ops, (F32, F32))
    return _bridge.call_numpy("cupy.isclose", lambda x, y: np.isclose(
        np.asarray(x).astype(F32), np.asarray(y).astype(F32), rtol, atol, equal_nan), (a, b), {})


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return isclose(a, b, rtol, atol, equal_nan).all()


def _float32_then_bf16(name: str):
    """A bfloat16 loop CuPy has (sinc, angle, nan_to_num): float math rounded once."""
    np_func = getattr(np, name)

    def function(x, *args, **kwargs):
        return _bridge.call_numpy(f"cupy.{name}", lambda v: np.asarray(np_func(
            v.astype(F32), *args, **kwargs)).astype(BF16), (x,), {})
    return function


def _sort_refused(name: str):
    def function(a, *args, **kwargs):
        # cupy/cuda/thrust.pyx: common._get_dtype_id has no bfloat16
        raise NotImplementedError(f"Sorting arrays with dtype '{a.dtype}' is not supported {NOTE}: "
                                  f"cupy.{name} sorts with thrust, which CuPy 14.2 builds for no bfloat16")
    return function


def _partition_sorts(a, kth, axis, arg: bool) -> bool:
    """Whether cupy/_core/_routines_sorting.pyx's (arg)partition falls back to a full sort."""
    axis = -1 if axis is None else axis
    length = a.shape[axis] if a.ndim else 1
    kths = (kth,) if isinstance(kth, (int, np.integer)) else tuple(kth)
    max_k = max([k + length if k < 0 else k for k in kths] + [0])
    max_k = max(32, 1 << int(max_k).bit_length())
    sz = 512
    while sz > 0 and length // sz < max_k + 32 * 4:
        sz //= 2
    sz *= a.size // max(length, 1)
    return length < 32 or max_k >= 1024 or (sz < 1 if arg else sz <= 32)


def _partition(name: str):
    def function(a, kth, axis=-1, **kwargs):
        if _partition_sorts(a, kth, axis, name == "argpartition"):
            _sort_refused(name)(a)
        return NotImplemented
    return function


def _refused(name: str, why: str):
    def function(*args, **kwargs):
        raise StandinLimitation(f"cupy.{name} of bfloat16: {why}")
    return function


BF16_FUNCTIONS = {
    "clip": clip, "around": around, "round": around, "isclose": isclose, "allclose": allclose,
    "sort": _sort_refused("sort"), "argsort": _sort_refused("argsort"), "unique": _sort_refused("unique"),
    "percentile": _sort_refused("percentile"), "quantile": _sort_refused("quantile"),
    "partition": _partition("partition"), "argpartition": _partition("argpartition"),
    "sinc": _float32_then_bf16("sinc"), "angle": _float32_then_bf16("angle"),
    "nan_to_num": _float32_then_bf16("nan_to_num"),
    "median": _refused("median", "not modelled (a partition or sort, then a mean: read "
                                 "cupy/_core/_routines_statistics.pyx _median and add it to _bf16.py)"),
}
# what NumPy with ml_dtypes does as CuPy 14.2 does on bfloat16 (data movement; exact reductions;
# loops that read bfloat16 as float32 and return bool/int; scans and elementwise compositions
# of bfloat16 loops, each op rounding once on both)
SAME_AS_NUMPY = frozenset((
    "reshape", "ravel", "transpose", "moveaxis", "swapaxes", "rollaxis", "squeeze", "expand_dims",
    "broadcast_to", "broadcast_arrays", "atleast_1d", "atleast_2d", "atleast_3d", "concatenate",
    "stack", "vstack", "hstack", "dstack", "column_stack", "split", "array_split", "flip", "fliplr",
    "flipud", "roll", "rot90", "tile", "repeat", "pad", "diagonal", "diag", "take", "take_along_axis",
    "compress", "extract", "nonzero", "argwhere", "flatnonzero", "copy", "meshgrid", "max", "min",
    "amax", "amin", "nanmax", "nanmin", "ptp", "argmax", "argmin", "nanargmax", "nanargmin", "all",
    "any", "count_nonzero", "array_equal", "cumsum", "cumprod", "diff", "real", "imag", "fix",
    "outer", "kron", "cross", "fill", "put", "view", "flatten", "astype", "conj", "conjugate",
))
ALWAYS = {"where": where, "tril": tril, "triu": triu}


def dispatch(name: str, args: tuple, kwargs: dict):
    """The modelled call's result, or NotImplemented for NumPy's own behaviour."""
    if name in ALWAYS:
        return ALWAYS[name](*args, **kwargs)
    values = (args, tuple(kwargs.values()))
    if name in REDUCTIONS and args and _has_16bit(args[:1]):
        return REDUCTIONS[name](*args, **kwargs)
    from ._core import _routines_linalg
    if name in _routines_linalg.FUNCTIONS:
        return _routines_linalg.FUNCTIONS[name](*args, **kwargs)
    if not has_bf16(values):
        return NotImplemented
    if name in BF16_FUNCTIONS:
        return BF16_FUNCTIONS[name](*args, **kwargs)
    if name in SAME_AS_NUMPY:
        return NotImplemented
    raise StandinLimitation(f"cupy.{name} on bfloat16: the CuPy stand-in has not modelled what CuPy 14.2 "
                            "does here; read its source and add it to tests/gpu_emu/cupy/_bf16.py")
