"""Spectral convolution (seed 001 §7.4): conv2d rewritten as fft → pointwise multiply → ifft.

A k×k convolution costs ``O(H·W·k²)`` per channel pair directly and ``O(H·W·log(HW))``
through the FFT, so the rewrite wins for large kernels (global filters, FNO layers).
Both inputs are zero-padded to ``H+kh-1 × W+kw-1`` so the circular convolution the FFT
computes equals the linear one; the output is then cropped to "full", "same" or "valid".
Deep-learning conv2d is a cross-correlation, so the filter is flipped before its FFT.
The same code runs on CuPy (cuFFT) through ``xp``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import register_kernel
from ._common import array_module, check_float, check_policy, check_stream, finish
from .numerics import NumericPolicy, result_dtype

__all__ = ["conv2d_fft", "conv2d_direct", "fft2d", "ifft2d", "PADDINGS"]

PADDINGS = ("full", "same", "valid")
_SPECTRAL_DTYPES = (np.float32, np.float64)


def _check_conv(op: str, x: Any, w: Any, padding: str) -> None:
    check_float(op, "x", x, _SPECTRAL_DTYPES)
    check_float(op, "w", w, _SPECTRAL_DTYPES)
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"{op}: x must be (N, C_in, H, W) and w (C_out, C_in, kh, kw); got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[1]} input channels but w {tuple(w.shape)} expects "
                         f"{w.shape[1]}")
    if padding not in PADDINGS:
        raise ValueError(f"{op}: padding={padding!r}; use one of {PADDINGS}")
    if padding == "valid" and (w.shape[2] > x.shape[2] or w.shape[3] > x.shape[3]):
        raise ValueError(f"{op}: a {w.shape[2]}x{w.shape[3]} filter is larger than the "
                         f"{x.shape[2]}x{x.shape[3]} image; 'valid' would be empty, use 'same'")


def _crop(y: Any, h: int, w: int, kh: int, kw: int, padding: str):
    if padding == "full":
        return y
    if padding == "same":        # centred like PyTorch's padding="same" (extra pad at the end)
        t, l = (kh - 1) // 2, (kw - 1) // 2
        return y[..., kh - 1 - t: kh - 1 - t + h, kw - 1 - l: kw - 1 - l + w]
    return y[..., kh - 1: h, kw - 1: w]


def conv2d_fft(x: Any, w: Any, bias: Any | None = None, *, padding: str = "same",
               out: Any | None = None, stream: Any | None = None, policy: NumericPolicy | None = None) -> Any:
    """conv2d (cross-correlation, stride 1) of ``x (N, Ci, H, W)`` with ``w (Co, Ci, kh, kw)`` via FFT.

    Parameters
    ----------
    x : array
        ``(N, Ci, H, W)``.
    w : array
        ``(Co, Ci, kh, kw)``.
    bias : array, optional
        ``(Co,)``.
    padding : str
        "same", "valid" or "full".
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).
    policy : NumericPolicy, optional
        Storage, accumulation and rounding (default: the op's own).

    Returns
    -------
    array
        ``(N, Co, H', W')``.
    """
    op = "conv2d_fft"
    _check_conv(op, x, w, padding)
    check_policy(op, policy)
    check_stream(op, stream)
    xp = array_module(x, w)
    n, ci, h, wd = x.shape
    co, _, kh, kw = w.shape
    fh, fw = h + kh - 1, wd + kw - 1
    xf = xp.fft.rfft2(x, s=(fh, fw))                                  # (N, Ci, fh, fw//2+1)
    wf = xp.fft.rfft2(w[..., ::-1, ::-1], s=(fh, fw))                 # flip: correlation
    yf = xp.einsum("nchw,ochw->nohw", xf, wf)                         # pointwise, summed over Ci
    y = _crop(xp.fft.irfft2(yf, s=(fh, fw)), h, wd, kh, kw, padding)
    if bias is not None:
        if tuple(bias.shape) != (co,):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({co},)")
        y = y + bias.reshape(1, co, 1, 1)
    return finish(op, y, out, result_dtype(np.result_type(x.dtype, w.dtype), policy))


def conv2d_direct(x: Any, w: Any, bias: Any | None = None, *, padding: str = "same") -> Any:
    """The direct sum over the filter taps: the oracle ``conv2d_fft`` is tested against.

    Parameters
    ----------
    x : array
        ``(N, Ci, H, W)``.
    w : array
        ``(Co, Ci, kh, kw)``.
    bias : array, optional
        ``(Co,)``.
    padding : str
        "same", "valid" or "full".

    Returns
    -------
    array
        ``(N, Co, H', W')``.
    """
    op = "conv2d_direct"
    _check_conv(op, x, w, padding)
    xp = array_module(x, w)
    n, ci, h, wd = x.shape
    co, _, kh, kw = w.shape
    xpad = xp.zeros((n, ci, h + 2 * (kh - 1), wd + 2 * (kw - 1)), np.result_type(x.dtype, w.dtype))
    xpad[:, :, kh - 1:kh - 1 + h, kw - 1:kw - 1 + wd] = x
    fh, fw = h + kh - 1, wd + kw - 1
    y = xp.zeros((n, co, fh, fw), xpad.dtype)
    for a in range(kh):
        for b in range(kw):
            y += xp.einsum("nchw,oc->nohw", xpad[:, :, a:a + fh, b:b + fw], w[:, :, a, b])
    y = _crop(y, h, wd, kh, kw, padding)
    return y if bias is None else y + bias.reshape(1, co, 1, 1)


def fft2d(x: Any, *, out: Any | None = None, stream: Any | None = None) -> Any:
    """2-D FFT over the last two dims (seed 002 §2.8's ``fft2d``).

    Parameters
    ----------
    x : array
        Real or complex input.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        Complex.
    """
    check_float("fft2d", "x", x, _SPECTRAL_DTYPES + (np.complex64, np.complex128))
    check_stream("fft2d", stream)
    y = array_module(x).fft.fft2(x)
    return finish("fft2d", y, out, y.dtype)


def ifft2d(x: Any, *, out: Any | None = None, stream: Any | None = None) -> Any:
    """Inverse 2-D FFT over the last two dims.

    Parameters
    ----------
    x : array
        Complex input.
    out : array, optional
        Receives the result.
    stream : stream, optional
        The stream the kernel runs on (default: the compute stream).

    Returns
    -------
    array
        Complex.
    """
    check_float("ifft2d", "x", x, (np.complex64, np.complex128))
    check_stream("ifft2d", stream)
    y = array_module(x).fft.ifft2(x)
    return finish("ifft2d", y, out, y.dtype)


for _name, _fn in (("conv2d_fft", conv2d_fft), ("conv2d", conv2d_fft), ("fft2d", fft2d),
                   ("ifft2d", ifft2d)):
    register_kernel(_name, "cpu", _fn)
