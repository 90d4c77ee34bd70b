"""``cupy.testing``: the NumPy assertions on device arrays (copied to the host first, as
CuPy's own do), and, stand-in only, ``count_device_work``: what a GPU would pay for the work
run inside a ``with`` block (see ``_counters.DeviceWork`` for every field)::

    with cupy.testing.count_device_work() as work:
        step()
    assert work.launches <= 40 and work.syncs == 1, work.report()

``work.launches`` (kernels, cuBLAS, RawKernels, fills, device copies, NCCL collectives),
``work.syncs`` (host waits: synchronize calls, blocking ``get``/``float(x)``/``item``, counts
read back by ``nonzero``/masks), ``work.h2d``/``work.d2h`` (copies, ``*_bytes``),
``work.casts`` (``astype`` and implicit operand/output conversions), ``work.by_kind`` /
``syncs_by_kind`` / ``casts_by_kind`` / ``launch_sites`` (Counters) and ``work.report()``.
A view, reshape or basic slice is no launch.  Counters nest and count every thread's work.
"""
import numpy as _np

from ._counters import DeviceWork, count_device_work
from ._ndarray import ndarray as _ndarray

__all__ = ["assert_allclose", "assert_array_equal", "count_device_work", "DeviceWork"]


def _host(a):
    return a.get() if isinstance(a, _ndarray) else a


def assert_allclose(actual, desired, rtol=1e-7, atol=0, err_msg="", verbose=True):
    _np.testing.assert_allclose(_host(actual), _host(desired), rtol=rtol, atol=atol, err_msg=err_msg,
                                verbose=verbose)


def assert_array_equal(x, y, err_msg="", verbose=True, strict=False):
    _np.testing.assert_array_equal(_host(x), _host(y), err_msg=err_msg, verbose=verbose, strict=strict)
