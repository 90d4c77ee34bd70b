"""``cupy.fft``: NumPy's FFTs on device arrays (cuFFT's results up to rounding)."""
import numpy as np

from . import _bridge
from ._bf16 import has_bf16
from ._errors import StandinLimitation

__all__ = ["fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2",
           "rfftn", "irfftn", "hfft", "ihfft", "fftfreq", "rfftfreq", "fftshift", "ifftshift"]


def _wrap(name: str):
    np_func = getattr(np.fft, name)

    def function(*args, **kwargs):
        if has_bf16(args):
            # cupy/fft/_fft.py _output_dtype sends bfloat16 to complex128 through a cast no test
            # covers; cupy#9630 lists FFTs as unsupported for bfloat16
            raise StandinLimitation(f"cupy.fft.{name} of bfloat16: CuPy 14.2 has no bfloat16 FFT "
                                    "(cupy#9630); cast to float32 first")
        return _bridge.call_numpy(f"cupy.fft.{name}", np_func, args, kwargs)
    function.__name__ = name
    return function


fft, ifft, fft2, ifft2, fftn, ifftn = (_wrap(n) for n in ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn"))
rfft, irfft, rfft2, irfft2, rfftn, irfftn = (_wrap(n) for n in ("rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn"))
hfft, ihfft, fftshift, ifftshift = (_wrap(n) for n in ("hfft", "ihfft", "fftshift", "ifftshift"))


def fftfreq(n, d=1.0):
    return _bridge.host_to_device("cupy.fft.fftfreq", np.fft.fftfreq(n, d), op_class="kernel")


def rfftfreq(n, d=1.0):
    return _bridge.host_to_device("cupy.fft.rfftfreq", np.fft.rfftfreq(n, d), op_class="kernel")
