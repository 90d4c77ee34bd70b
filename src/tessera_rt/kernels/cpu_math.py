"""A vectorizable ``exp`` for the fused CPU kernels (Numba).

Numba lowers ``np.exp`` on a scalar to a libm call, which keeps LLVM from vectorizing the
loop around it (there is no SVML here), and NumPy's own SIMD ``exp`` needs a pass of its
own over memory.  ``fast_exp`` inside a ``@kernel`` loop is Cephes' ``expf`` written with
plain arithmetic and one bit cast, so the loop vectorizes and the exponential fuses with
the work around it: f32 results within 1 ulp of the correctly rounded value (NumPy's: 2),
with NumPy's special values (exp(-inf) = 0, overflow to inf, denormals, NaN kept).  f64
keeps ``np.exp`` (the oracle's precision).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["fast_exp", "exp_inplace"]


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 ``bits`` (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


_F = np.float32


@njit(inline="always", fastmath={"contract", "nsz"}, error_model="numpy")
def _pow2(k):
    """2**k for an integer-valued f32 k in [-126, 127], built from the exponent bits."""
    return _f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))


@njit(inline="always", fastmath={"contract", "nsz"}, error_model="numpy")
def _expf(x):
    # the clamp keeps 2**n in reach (exp(-104) rounds to 0, exp(89) overflows to inf); min and
    # max keep a NaN, which then runs through the arithmetic (selects would stop vectorizing)
    c = min(max(x, _F(-105.0)), _F(89.0))
    n = np.floor(c * _F(1.44269504088896341) + _F(0.5))
    r = c - n * _F(0.693359375) - n * _F(-2.12194440e-4)      # x - n ln2 in two parts (Cody-Waite)
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    p = p * r * r + r + _F(1.0)
    # 2**n as two factors, so denormal results (n < -126) and overflow round as they should.
    # Below n = -150 the result is 0: zeroed before the last factor, because a multiply whose
    # result underflows takes a microcode assist on x86 (~20x slower) and a causal softmax
    # has half its scores masked to -inf
    h = np.floor(n * _F(0.5))
    keep = _F(1.0) if n > _F(-150.5) else _F(0.0)
    return p * _pow2(h) * keep * _pow2(n - h)


def fast_exp(x):
    """``exp(x)`` inside Numba kernels (see the module doc); ``np.exp`` in Python."""
    return np.exp(x)


@overload(fast_exp, inline="always")
def _fast_exp(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return lambda x: _expf(x)
    return lambda x: np.exp(x)


@njit(cache=True, fastmath={"contract", "nsz"}, error_model="numpy")
def _exp_flat(a):
    for i in range(a.size):
        a[i] = fast_exp(a[i])


def exp_inplace(a: np.ndarray) -> np.ndarray:
    """``a = exp(a)`` in place: ``fast_exp`` for contiguous f32, NumPy's ``exp`` otherwise."""
    if a.dtype == np.float32 and a.flags.c_contiguous:
        _exp_flat(a.reshape(-1))
        return a
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(a, out=a)
