"""``cupy.testing``: the NumPy assertions on device arrays (copied to the host first, as
CuPy's own do)."""
import numpy as _np

from ._ndarray import ndarray as _ndarray

__all__ = ["assert_allclose", "assert_array_equal"]


def _host(a):
    return a.get() if isinstance(a, _ndarray) else a


def assert_allclose(actual, desired, rtol=1e-7, atol=0, err_msg="", verbose=True):
    _np.testing.assert_allclose(_host(actual), _host(desired), rtol=rtol, atol=atol, err_msg=err_msg,
                                verbose=verbose)


def assert_array_equal(x, y, err_msg="", verbose=True, strict=False):
    _np.testing.assert_array_equal(_host(x), _host(y), err_msg=err_msg, verbose=verbose, strict=strict)
