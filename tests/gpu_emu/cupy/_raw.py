"""``cupy.RawModule`` / ``RawKernel`` over the CUDA emulation harness (``cuda_emu``).

Arguments are packed exactly as CuPy 14.2 packs them (cupy/cuda/function.pyx ``_pointer``,
then cupy/_core/_scalar.pyx ``CScalar``): a device array passes its data pointer (the first 8
bytes of its CArray struct, all a ``T*`` parameter reads); ``None`` a null pointer; a NumPy
scalar of any dtype its own bytes (bfloat16: 2); a Python bool as ``numpy.bool_`` (one byte:
CuPy 13 packed it as int64, so an ``int`` parameter given ``True`` now reads 3 bytes of
garbage), int as int64 (uint64 from 2**63), float as float64, complex as complex128; a size-1
``numpy.ndarray`` its element's bytes; a larger ``numpy.ndarray`` is refused.  Launch limits are CUDA's, raised as the driver raises them.
"""
from __future__ import annotations

import re
import struct

import numpy as np

from . import _bridge, _capture, _tracker
from ._ndarray import ndarray
from .cuda.driver import CUDA_ERROR_INVALID_VALUE, CUDADriverError
from .cuda.memory import MemoryPointer
from .cuda.stream import resolve_stream

__all__ = ["RawModule", "RawKernel", "Kernel", "set_emulator", "pack_arg"]

MAX_BLOCK_DIMS = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID_DIMS = (2 ** 31 - 1, 65535, 65535)
DEFAULT_DYNAMIC_SMEM = 48 * 1024          # without the opt-in attribute
MAX_DYNAMIC_SMEM_OPTIN = 227 * 1024       # sm_90's sharedMemPerBlockOptin

_emulator = None


def set_emulator(module):
    """Use ``module`` (with ``compile_module``) instead of ``cuda_emu``; returns the previous
    one.  For tests of the stand-in itself, before the harness exists."""
    global _emulator
    previous, _emulator = _emulator, module
    return previous


def _get_emulator():
    if _emulator is not None:
        return _emulator
    try:
        import cuda_emu
    except ImportError as exc:
        raise RuntimeError("cupy.RawModule needs the CUDA emulation harness (tests/gpu_emu/cuda_emu, "
                           f"imported as `cuda_emu`), which is not importable: {exc}") from None
    return cuda_emu


def pack_arg(x) -> bytes:
    """One kernel argument as the bytes cuLaunchKernel would get (function.pyx ``_pointer``)."""
    if x is None:
        return bytes(8)
    if isinstance(x, ndarray):
        return struct.pack("<Q", x.data.ptr)
    if isinstance(x, MemoryPointer):
        return struct.pack("<Q", x.ptr)
    if isinstance(x, np.ndarray):
        if x.size == 1:
            return x.tobytes()
        raise TypeError(f"You are trying to pass a numpy.ndarray of shape {x.shape} as a kernel "
                        "parameter. Only numpy.ndarrays of size one can be passed by value. If you "
                        "meant to pass a pointer to __global__ memory, you need to pass a "
                        "cupy.ndarray instead.")
    if isinstance(x, np.generic):
        return x.tobytes()
    # _scalar.pyx numpy_dtype_from_pyscalar: by exact type, bool first
    if type(x) is bool:
        return np.bool_(x).tobytes()
    if type(x) is int:
        return (np.uint64(x) if x >= 2 ** 63 else np.int64(x)).tobytes()
    if type(x) is float:
        return np.float64(x).tobytes()
    if type(x) is complex:
        return np.complex128(x).tobytes()
    raise TypeError(f"Unsupported type {type(x)}")


def _pointer_params_written(code: str, entry: str) -> list[bool] | None:
    """Per parameter of ``entry``: False for ``const T*`` (read only), True otherwise; None if
    the signature cannot be found (then every pointer argument counts as written)."""
    match = re.search(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                      + re.escape(entry) + r"\s*\(([^)]*)\)", code)
    if match is None:
        return None
    params = [p.strip() for p in match.group(1).split(",") if p.strip()]
    return [not ("*" in p and re.match(r"^(const\b|\w+\s+const\b)", p)) for p in params]


class Kernel:
    """A kernel of a RawModule: ``kernel(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, module: RawModule, name: str):
        self.module = module
        self.name = name
        self._max_dynamic_smem = DEFAULT_DYNAMIC_SMEM
        self._emu_fn = None
        self._written = _pointer_params_written(module.code, name)

    @property
    def kernel(self):
        if self._emu_fn is None:
            self._emu_fn = self.module._compiled().get_function(self.name)
        return self._emu_fn

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic_smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        if not 0 <= int(nbytes) <= MAX_DYNAMIC_SMEM_OPTIN:
            raise CUDADriverError(CUDA_ERROR_INVALID_VALUE,
                                  f"max_dynamic_shared_size_bytes={nbytes} > {MAX_DYNAMIC_SMEM_OPTIN} (sm_90 opt-in limit)")
        self._max_dynamic_smem = int(nbytes)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        # function.pyx: Function.__call__(self, tuple grid, tuple block, args, ...)
        for what, dims in (("grid", grid), ("block", block)):
            if not isinstance(dims, tuple):
                raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got {type(dims).__name__})")
        grid = tuple(max(1, int(g)) for g in (grid + (1, 1))[:3])     # CuPy clamps to >= 1
        block = tuple(max(1, int(b)) for b in (block + (1, 1))[:3])
        self._check_limits(grid, block, int(shared_mem))
        packed = [pack_arg(a) for a in args]
        s = resolve_stream(stream)
        cap = _capture.capture_of(s._state)
        if cap is not None:             # a kernel node: launched (on the memory as it is then) by each replay
            kernel, smem = self.kernel, int(shared_mem)

            def run(_state, kernel=kernel, grid=grid, block=block, packed=packed, smem=smem):
                kernel.launch(grid, block, packed, shared_mem=smem, buffers=_bridge.live_buffers())
            cap.add(f"RawKernel {self.name}", "kernel", 0, list(self._accesses(args)), run, s._state)
            return
        _tracker.record_op(f"RawKernel {self.name}", s._state, self._accesses(args))
        self.kernel.launch(grid, block, packed, shared_mem=int(shared_mem), buffers=_bridge.live_buffers())

    def _check_limits(self, grid, block, shared_mem) -> None:
        problems = []
        if any(b > m for b, m in zip(block, MAX_BLOCK_DIMS)) or block[0] * block[1] * block[2] > MAX_THREADS_PER_BLOCK:
            problems.append(f"block {block} exceeds {MAX_BLOCK_DIMS} / {MAX_THREADS_PER_BLOCK} threads")
        if any(g > m for g, m in zip(grid, MAX_GRID_DIMS)):
            problems.append(f"grid {grid} exceeds {MAX_GRID_DIMS}")
        if shared_mem > self._max_dynamic_smem:
            problems.append(f"shared_mem={shared_mem} > max_dynamic_shared_size_bytes={self._max_dynamic_smem}"
                            " (set the attribute first to opt in above 48 KiB)")
        if problems:
            raise CUDADriverError(CUDA_ERROR_INVALID_VALUE, f"launch of {self.name}: " + "; ".join(problems))

    def _accesses(self, args):
        for i, a in enumerate(args):
            if isinstance(a, ndarray):
                written = True if self._written is None or i >= len(self._written) else self._written[i]
                yield from _bridge.accesses((a,), written)


class RawModule:
    """``RawModule(code=..., options=(), ...)``: compiled by the emulator on first use."""

    def __init__(self, *, code: str | None = None, path: str | None = None, options: tuple = (),
                 backend: str = "nvrtc", translate_cucomplex: bool = False,
                 enable_cooperative_groups: bool = False, name_expressions=None, jitify: bool = False):
        if (code is None) == (path is None):
            raise TypeError("Exactly one of `code` and `path` keyword arguments must be given.")
        if path is not None:
            with open(path) as f:
                code = f.read()
        if not isinstance(code, str):
            raise TypeError(f"Argument 'code' has incorrect type (expected str, got {type(code).__name__})")
        if not isinstance(options, tuple):
            raise TypeError(f"Argument 'options' has incorrect type (expected tuple, got {type(options).__name__})")
        self.code = code
        self.options = options
        self.backend = backend
        self._module = None

    def _compiled(self):
        if self._module is None:
            self._module = _get_emulator().compile_module(self.code, options=self.options,
                                                          name=f"rawmodule_{abs(hash(self.code)):x}")
        return self._module

    def get_function(self, name: str) -> Kernel:
        kernel = Kernel(self, name)
        kernel.kernel        # compile now: a bad source or name fails here, as in CuPy
        return kernel


def RawKernel(code: str, name: str, options: tuple = (), **kwargs) -> Kernel:
    """``cupy.RawKernel(code, name, options)``: one kernel of a one-kernel module."""
    return RawModule(code=code, options=options, **kwargs).get_function(name)
