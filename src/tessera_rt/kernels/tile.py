"""A small Tessera-style tile API on numba.cuda (seed 002 §2.1-2.6), so users write tile kernels the seeds' way.

    from tessera_rt.kernels import tile

    @tile.kernel
    def saxpy(x, y, alpha):
        i = tile.linear_id()
        if i < x.size:
            y[i] = alpha * x[i] + y[i]

    saxpy.launch(n, x, y, alpha)          # grid from n and the group size

``linear_id()`` is the global lane index, ``group_id()``/``lane_id()``/``group_size()`` the
tile group (CUDA block) coordinates, ``shared_alloc(shape, dtype)`` the group's shared
buffer (``tshared.alloc``; shape and dtype must be constants), ``barrier()`` is
``tbarrier()``, ``load``/``store`` are ``tile.load``/``tile.store``.  On a GPU (and for
``compile_ptx``) each call is inlined into the kernel; under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, chosen when this module is imported) they are plain Python
over the simulator's per-kernel state, so tile kernels run on a CPU-only machine.

``numba.cuda`` is loaded when the first tile kernel is compiled or launched (``cuda_target``),
not when this module is: it costs every process that imports tessera_rt a quarter of a second,
and a CPU-only program never launches a tile kernel.
"""
from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numba

__all__ = ["SIMULATOR", "cuda_target", "numba_ptx", "numba_stream", "SimulatorStream", "linear_id", "group_id", "lane_id", "group_size", "num_groups", "shared_alloc",
           "barrier", "tbarrier", "load", "store", "kernel", "TileKernel"]

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
# numba.cuda once cuda_target() has loaded it (the overloads below read it as a global)
cuda: Any


def linear_id():
    """Global index of this lane: group_id() * group_size() + lane_id()."""
    return _sim().grid(1)


def group_id():
    """Index of this tile group (CUDA block) in the launch."""
    return _sim().blockIdx.x


def lane_id():
    """Index of this lane within its tile group (CUDA thread index)."""
    return _sim().threadIdx.x


def group_size():
    return _sim().blockDim.x


def num_groups():
    return _sim().gridDim.x


def barrier():
    """tbarrier(): every lane of the group waits here; shared-memory writes become visible."""
    _sim().syncthreads()


tbarrier = barrier


def shared_alloc(shape, dtype):
    """The group's shared buffer of constant ``shape`` and Numba ``dtype`` (seed: ``tshared.alloc``)."""
    ctx = _sim()
    # The simulator keys shared arrays by the line that allocates them; key by our caller's.
    caller = sys._getframe(1)
    key = ("tessera_rt.tile", caller.f_code.co_filename, caller.f_lineno)
    allocs = ctx.shared._allocations
    if key not in allocs:
        import numpy as np
        from numba.core import types as ntypes
        dt = numba.np.numpy_support.as_dtype(dtype) if isinstance(dtype, ntypes.Type) else np.dtype(dtype)
        allocs[key] = np.empty(shape, dt)
    return allocs[key]


def load(array, index):
    """tile.load(X, index=i): one element of a global array."""
    return array[index]


def store(array, index, value):
    """tile.store(Y, index=i, value=v)."""
    array[index] = value


def _sim():
    from numba.cuda.simulator.kernel import _get_kernel_context
    ctx = _get_kernel_context()
    if ctx is None:
        raise RuntimeError("tile API functions can only be called inside a tile kernel launch")
    return ctx


def cuda_target():
    """``numba.cuda``, loaded (and, on the CUDA target, the tile API's inlined overloads
    registered) the first time a tile kernel is compiled or launched."""
    global cuda
    if "cuda" in globals():
        return cuda
    from numba import cuda as numba_cuda
    cuda = numba_cuda
    if not SIMULATOR:
        _register_overloads()
    return cuda


def __getattr__(name: str):
    if name == "cuda":                   # tile.cuda: numba.cuda, loaded on first use
        return cuda_target()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_overloads() -> None:
    # On the CUDA target each API function is an inlined overload of the CUDA intrinsic (the
    # implementations read ``cuda`` from this module's globals when they compile).
    from numba.cuda import types as nt
    from numba.cuda.core.errors import TypingError
    from numba.cuda.extending import overload

    def _inline(fn: Callable) -> Callable:
        return overload(fn, target="cuda", inline="always", prefer_literal=True)

    @_inline(linear_id)
    def _linear_id():
        return lambda: cuda.grid(1)

    @_inline(group_id)
    def _group_id():
        return lambda: cuda.blockIdx.x

    @_inline(lane_id)
    def _lane_id():
        return lambda: cuda.threadIdx.x

    @_inline(group_size)
    def _group_size():
        return lambda: cuda.blockDim.x

    @_inline(num_groups)
    def _num_groups():
        return lambda: cuda.gridDim.x

    @_inline(barrier)
    def _barrier():
        return lambda: cuda.syncthreads()

    @_inline(shared_alloc)
    def _shared_alloc(shape, dtype):
        if isinstance(shape, nt.IntegerLiteral):
            n = shape.literal_value
        elif isinstance(shape, nt.BaseTuple) and all(isinstance(t, nt.IntegerLiteral) for t in shape):
            n = tuple(t.literal_value for t in shape)
        else:
            raise TypingError(f"tile.shared_alloc: shape must be a constant int or tuple of ints, got {shape}")
        if not isinstance(dtype, (nt.NumberClass, nt.DType)):
            raise TypingError(f"tile.shared_alloc: dtype must be a Numba type such as numba.float32, got {dtype}")
        dt = dtype.dtype

        def impl(shape, dtype):
            return cuda.shared.array(n, dt)
        return impl

    @_inline(load)
    def _load(array, index):
        return lambda array, index: array[index]

    @_inline(store)
    def _store(array, index, value):
        def impl(array, index, value):
            array[index] = value
        return impl


class TileKernel:
    """A tile kernel: ``kernel[grid, block](...)`` as in Numba, plus ``launch(n, ...)`` and ``inspect_ir``."""

    def __init__(self, fn: Callable, group_size: int = 128, **jit_options: Any):
        self.py_func = fn
        self.group_size = group_size
        self._jit_options = jit_options
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getattr__(self, name: str):
        # the Numba dispatcher, made on first use (numba.cuda loads then: cuda_target)
        if name != "_jit":
            raise AttributeError(name)
        self._jit = cuda_target().jit(**self._jit_options)(self.py_func)
        return self._jit

    def __getitem__(self, config):
        """``kernel[grid, block]`` (or ``[grid, block, stream]``): always on an explicit stream."""
        grid, block, *rest = config
        stream = rest[0] if rest else None
        launch = self._jit[(grid, block, numba_stream(stream)) + tuple(rest[1:])]
        # the simulator takes CuPy arrays as they are (and has no external streams)
        return launch if SIMULATOR else _UnsyncedLaunch(launch)

    def configure(self, grid, block, stream: Any = None):
        """The launchable kernel for ``grid`` x ``block`` on ``stream`` (default: CuPy's current)."""
        return self[grid, block, stream]

    def launch(self, n: int, *args: Any, group_size: int | None = None, stream: Any = None):
        """Run with enough groups of ``group_size`` lanes to give every one of ``n`` items a lane."""
        gs = group_size or self.group_size
        groups = max(1, (int(n) + gs - 1) // gs)
        return self.configure(groups, gs, stream)(*args)

    def inspect_ir(self, level: str = "tile", signature: str | None = None, arch: str = "sm_90") -> str:
        """The Python tile source ("tile"/"source") or its PTX ("target"/"ptx"; needs ``signature``)."""
        import inspect
        if level in ("tile", "source"):
            return inspect.getsource(self.py_func)
        if level in ("target", "ptx"):
            if signature is None:
                raise ValueError("inspect_ir('ptx') needs a signature, e.g. 'void(float32[:], float32[:], float32)'")
            return numba_ptx(self.py_func, signature, arch)
        raise ValueError(f"inspect_ir: level={level!r}; use 'tile'/'source' or 'target'/'ptx'")


class _UnsyncedLaunch:
    """A configured Numba launch that passes CUDA-array-interface arguments (CuPy arrays) as
    Numba device views made with ``sync=False``.  Left to Numba (numba-cuda 0.30), each array
    is imported per launch through DLPack or, lacking it, through the interface with a host
    synchronization of its stream; the launch is already ordered on CuPy's stream
    (``numba_stream``), so neither the exchange nor a synchronization is needed."""

    __slots__ = ("_launch",)

    def __init__(self, launch):
        self._launch = launch

    def __call__(self, *args):
        return self._launch(*(_device_view(a) for a in args))


def _device_view(a: Any) -> Any:
    desc = getattr(a, "__cuda_array_interface__", None)
    if desc is None or getattr(a, "__cuda_memory__", False):      # a scalar, or Numba's own
        return a
    return cuda_target().from_cuda_array_interface(desc, owner=a, sync=False)


class SimulatorStream:
    """What a launch gets for a stream under the CUDA simulator, which runs every launch at
    once and has no external streams: the pointer is kept so tests can see which stream a
    launch was ordered on."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def numba_stream(stream: Any = None):
    """The Numba stream a launch runs on: ``stream`` (a runtime CudaStream, a CuPy stream, or
    Numba's own), else CuPy's current stream.

    Numba's default is stream 0, the legacy default stream.  tessera_rt's compute stream is
    a non-blocking CuPy stream, which does not synchronize with stream 0, so a kernel left on
    stream 0 could still be running when CuPy reads its output: always launch on CuPy's
    stream.  Without CuPy in the process there is nothing to order against (stream 0).
    """
    raw = getattr(stream, "raw", stream)
    ptr = getattr(raw, "ptr", None)
    if stream is None:
        cupy = sys.modules.get("cupy")
        if cupy is None:
            return 0
        ptr = cupy.cuda.get_current_stream().ptr
    if ptr is None:
        return stream                  # already a Numba stream
    return SimulatorStream(ptr) if SIMULATOR else cuda_target().external_stream(ptr)


def kernel(fn: Callable | None = None, *, group_size: int = 128, **jit_options: Any):
    """Decorator making a Python function a :class:`TileKernel` (``@tile.kernel`` or ``@tile.kernel(group_size=256)``)."""
    if fn is None:
        return lambda f: TileKernel(f, group_size, **jit_options)
    return TileKernel(fn, group_size, **jit_options)


_NUMBA_LOCK = threading.Lock()


@contextmanager
def _target_cc(cc: tuple[int, int]):
    """Let Numba compile device functions for ``cc`` with no driver present.

    ``numba.cuda.compile_ptx`` takes ``cc`` but compiles called device functions for the
    current device, which needs a driver; point that lookup at the requested target.
    """
    import numba.cuda.dispatcher as disp
    orig = disp.get_current_device
    disp.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        disp.get_current_device = orig


def numba_ptx(fn: Callable | Any, signature: str, arch: str = "sm_80") -> str:
    """PTX of a Python tile kernel (or a ``cuda.jit`` dispatcher) for ``arch``, no GPU needed."""
    cuda = cuda_target()               # (the tile API's overloads registered)
    py = getattr(fn, "py_func", fn)
    cc = (int(arch.split("_")[1][:-1]), int(arch.split("_")[1][-1]))
    with _NUMBA_LOCK, _target_cc(cc):
        ptx, _ = cuda.compile_ptx(py, signature, cc=cc)
    return ptx
