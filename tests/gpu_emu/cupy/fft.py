"""``cupy.fft``: NumPy's FFTs on device arrays (cuFFT's results up to rounding)."""
import numpy as np

from . import _bridge

__all__ = ["fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2",
           "rfftn", "irfftn", "hfft", "ihfft", "fftfreq", "rfftfreq", "fftshift", "ifftshift"]


def _wrap(name: str):
    np_func = getattr(np.fft, name)

    def function(*args, **kwargs):
        return _bridge.call_numpy(f"cupy.fft.{name}", np_func, args, kwargs)
    function.__name__ = name
    return function


for _name in __all__:
    if _name in ("fftfreq", "rfftfreq"):
        continue
    globals()[_name] = _wrap(_name)


def fftfreq(n, d=1.0):
    from ._creation import asarray
    return asarray(np.fft.fftfreq(n, d))


def rfftfreq(n, d=1.0):
    from ._creation import asarray
    return asarray(np.fft.rfftfreq(n, d))
