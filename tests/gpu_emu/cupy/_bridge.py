"""Calling NumPy on stand-in arrays the way CuPy would run a kernel.

``call_numpy`` is the one path every array function and method takes: unwrap arguments
(refusing host arrays as CuPy's ``_preprocess_args`` does), run NumPy on the arrays' pool
memory, put fresh results in pool memory allocated on the current stream (0-d results stay
0-d device arrays, as CuPy returns them), and record the op on the current stream with the
bytes it read and wrote.
"""
from __future__ import annotations

import numpy as np

from . import _capture, _tracker
from ._dtypes14 import check_kernel_dtypes
from .cuda import memory as _memory
from .cuda.stream import current_stream_state, get_current_stream


def refuse(x):
    # cupy/_core/_kernel.pyx _preprocess_arg: "raise TypeError('Unsupported type %s' % type(arg))"
    return TypeError(f"Unsupported type {type(x)}")


def is_host_array(x) -> bool:
    return isinstance(x, np.ndarray)


def unwrap(x, reads: list, writes: list | None = None):
    """``x`` with stand-in arrays replaced by their NumPy views (noted in ``reads`` or ``writes``);
    NumPy arrays refused.  Lists and tuples are walked (sequences of arrays)."""
    from ._ndarray import ndarray
    if isinstance(x, ndarray):
        (reads if writes is None else writes).append(x)
        return x._a
    if isinstance(x, np.ndarray):
        raise refuse(x)
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(i, reads, writes) for i in x)
    return x


def byte_range(a: np.ndarray) -> tuple[int, int]:
    """[lo, hi) device addresses a strided view spans."""
    lo = hi = a.__array_interface__["data"][0]
    for n, s in zip(a.shape, a.strides):
        if s >= 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + a.itemsize


def accesses(arrays, write: bool):
    for x in arrays:
        mem = x.data.mem
        if x.size and mem.segment is not None:
            lo, hi = byte_range(x._a)
            yield mem, lo, hi, write


def record(kind: str, reads=(), writes=(), state=None, op_class: str = "kernel", nbytes: int = 0) -> None:
    """Record an op on ``state`` (default: the current stream) reading/writing these arrays;
    ``op_class`` (kernel, h2d, d2h) and ``nbytes`` are what the counters see."""
    state = current_stream_state() if state is None else state
    _tracker.record_op(kind, state, [*accesses(reads, False), *accesses(writes, True)], op_class, nbytes)


def implicit_sync(kind: str) -> None:
    """A CuPy call that reads a count back before it can size its result (``nonzero``, boolean
    masks, ``unique``, ...): a small device->host copy and a wait for the current stream."""
    stream = get_current_stream()
    cap = _capture.capture_of(stream._state)
    if cap is not None:
        _capture.refuse(cap, f"{kind}, which reads a count back to the host (a synchronous copy)")
    record(f"{kind} (count to the host)", state=stream._state, op_class="d2h", nbytes=8)
    stream._synchronize(kind)


def new_device_array(shape, dtype, order: str = "C"):
    from ._ndarray import ndarray
    return ndarray(shape, dtype, order=order)


def owner_of(res: np.ndarray, inputs):
    """The input whose allocation ``res`` (a NumPy result) points into, if any: a view."""
    if res.size == 0:
        return None
    addr = res.__array_interface__["data"][0]
    for x in inputs:
        mem = x.data.mem
        if mem.segment is not None and mem.ptr <= addr < mem.ptr + mem.size:
            return x
    return None


def wrap_result(res, inputs, fresh: list, views: list, fill: bool = True):
    """A NumPy result as stand-in arrays: the input itself, a view of an input's memory, or
    a fresh pool allocation holding a copy (appended to ``fresh``; left unfilled when not
    ``fill``: a captured op's output, written only when the graph runs)."""
    from ._ndarray import ndarray
    if isinstance(res, np.ndarray):
        for x in inputs:
            if res is x._a:
                return x
        owner = owner_of(res, inputs)
        if owner is not None:
            view = ndarray._view_of(res, owner)
            views.append(view)
            return view
        out = new_device_array(res.shape, res.dtype, order="F" if res.flags.f_contiguous
                               and not res.flags.c_contiguous else "C")
        if fill:
            out._a[...] = res
        fresh.append(out)
        return out
    if isinstance(res, np.generic):
        return wrap_result(np.asarray(res), inputs, fresh, views, fill)
    if isinstance(res, (tuple, list)):
        return type(res)(wrap_result(r, inputs, fresh, views, fill) for r in res)
    return res


def call_numpy(kind: str, fn, args: tuple, kwargs: dict, check_dtypes: bool = True):
    """Run ``fn`` (a NumPy callable) on stand-in arrays as a device op on the current stream."""
    reads: list = []
    writes: list = []
    out = kwargs.get("out")
    if out is not None:
        kwargs = dict(kwargs)
        kwargs["out"] = unwrap(out, reads, writes)
    np_args = unwrap(args, reads)
    np_kwargs = {k: (v if k == "out" else unwrap(v, reads)) for k, v in kwargs.items()}
    if check_dtypes:
        check_kernel_dtypes(kind, reads + writes)
    state = current_stream_state()
    cap = _capture.capture_of(state)
    if cap is not None:
        return _capture.deferred_numpy(cap, state, kind, fn, np_args, np_kwargs, reads, writes, check_dtypes,
                                       wrap_result, accesses, check_kernel_dtypes)
    with np.errstate(all="ignore"):   # GPU kernels raise no floating-point warnings
        res = fn(*np_args, **np_kwargs)
    fresh: list = []
    views: list = []
    result = wrap_result(res, reads + writes, fresh, views)
    if check_dtypes:
        check_kernel_dtypes(kind, fresh)
    if fresh or writes:
        record(kind, reads, writes + fresh)
    # else: only views came back (reshape, transpose, ...): no memory was touched
    return result


def host_to_device(kind: str, host: np.ndarray, dst=None, state=None, op_class: str = "h2d"):
    """Copy a host array into ``dst`` (or a fresh device array) as an op on ``state``;
    ``op_class="kernel"`` for data CuPy makes on the device (arange, random, ...)."""
    state = current_stream_state() if state is None else state
    cap = _capture.capture_of(state)
    if cap is not None:
        return _captured_h2d(cap, kind, host, dst, state, op_class)
    if dst is None:
        dst = new_device_array(host.shape, host.dtype)
    dst._a[...] = host
    record(kind, (), (dst,), state, op_class, host.nbytes)
    return dst


def _captured_h2d(cap, kind: str, host: np.ndarray, dst, state, op_class: str):
    """A host->device copy in a capture: from pinned memory a memcpy node that reads the host
    buffer at each launch; data CuPy makes on the device (arange, ...) a constant of the graph;
    from pageable memory refused, as CUDA refuses it."""
    from .cuda.pinned_memory import is_pinned
    pinned = is_pinned(host)
    if op_class == "h2d" and not pinned:
        _capture.refuse(cap, f"{kind} from pageable host memory (copy from pinned memory: "
                             "cupy.cuda.alloc_pinned_memory)")
    if dst is None:
        dst = new_device_array(host.shape, host.dtype)
    src, target = (host if pinned else host.copy()), dst._a

    def run(launch_state, src=src, target=target):
        target[...] = src
        if pinned:
            _tracker.watch_pinned_source(launch_state, src, kind)
    _capture.add_copy(cap, state, kind, op_class, host.nbytes, list(accesses((dst,), True)), run)
    return dst


def device_to_host(kind: str, src, state) -> np.ndarray:
    record(kind, (src,), (), state, "d2h", src.nbytes)
    return np.array(src._a, copy=True)


def live_buffers() -> list[tuple[int, int]]:
    # the bytes each allocation asked for: a kernel running into the pool's rounding is caught
    return [(m.ptr, m.requested) for m in _memory.live_allocations()]
