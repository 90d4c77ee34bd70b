"""What ``ndarray.__getitem__``/``__setitem__`` cost and refuse, as cupy/_core/_routines_indexing.pyx
does it: host index arrays are copied in (``core.array(indices)``), a boolean mask reads its
count back (a sync, counted by the caller), and a host value may be assigned through index
arrays (copied in with ``core.array(value, dtype=a.dtype)``) but not through basic indices,
where ``_scatter_op`` calls ``fill(value)``, which takes scalars only."""
from __future__ import annotations

import numpy as np

from . import _bridge, _counters
from ._dtypes14 import NOTE


class SetItem:
    """``a[key] = value`` as a NumPy callable with an ``out=`` (so the target is a write)."""

    def __init__(self, key):
        self.key = key

    def __call__(self, value, out):
        out[self.key] = value
        return out


def as_tuple(key):
    return key if isinstance(key, tuple) else (key,)


def is_basic(key) -> bool:
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer))
               and not isinstance(k, (bool, np.bool_)) for k in as_tuple(key))


def has_mask(np_key) -> bool:
    return any(isinstance(k, np.ndarray) and k.dtype == np.bool_ for k in as_tuple(np_key))


def copy_host_indices(key) -> None:
    for k in as_tuple(key):
        if isinstance(k, (np.ndarray, list)):
            _bridge.record("index (host->device copy)", op_class="h2d", nbytes=np.asarray(k).nbytes)


def setitem_value(target, np_key, value):
    """``value`` as the kernel of ``target[np_key] = value`` gets it."""
    from ._ndarray import ndarray
    if isinstance(value, (np.ndarray, list, tuple)):
        if is_basic(np_key):
            if np.ndim(value) != 0:
                raise ValueError(f"non-scalar numpy.ndarray cannot be used for fill {NOTE}: a[basic index] = "
                                 "host array; copy it in first (cupy.asarray, or .set on a contiguous view)")
            return np.asarray(value)[()]
        return _bridge.host_to_device("ndarray.__setitem__ (host->device copy)",
                                      np.ascontiguousarray(value, dtype=target.dtype))
    if isinstance(value, ndarray) and value.dtype != target.dtype:
        _counters.note_cast(f"{value.dtype}->{target.dtype} (ndarray.__setitem__)")
    return value
