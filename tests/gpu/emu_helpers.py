"""Helpers of the emulation-harness tests: direct launches of CUDA C sources on the host.

``Device`` hands out 256-byte aligned host arrays (CuPy's alignment) and packs arguments as
the CuPy stand-in does; ``build`` compiles a source with the options the launchers give NVRTC.
"""
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu_emu"))

import cuda_emu as emu


def _compiler_missing() -> str | None:
    try:
        emu.compiler()
    except emu.CompileError as e:
        return str(e)
    return None


_NO_COMPILER = _compiler_missing()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no usable C++20 g++: {_NO_COMPILER}")

NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")
_MMA_ASM = re.compile(r'(\n[ \t]*asm volatile\(\s*"mma\.sync.*?\);)', re.S)


def emulated(src: str) -> str:
    """``src`` with ts_mma's inline PTX behind ``#ifdef TS_CUDA_EMULATOR`` (the lead's MMA_HEADER edit)."""
    if "TS_CUDA_EMULATOR" in src:
        return src
    out, n = _MMA_ASM.subn(lambda m: "\n#ifdef TS_CUDA_EMULATOR\n  ts_emu_mma_m16n8k16(d, a, b, TS_BF16);\n#else"
                                     + m.group(1) + "\n#endif", src)
    assert n <= 1
    return out


def build(src: str, name: str = "kernel") -> emu.Module:
    return emu.compile_module(emulated(src), NVRTC_OPTIONS, name=name)


class Device:
    """Device memory for direct launches: 256-byte aligned host arrays (like CuPy's), and the
    packing the CuPy stand-in does (array -> 8-byte pointer, NumPy scalar -> its bytes)."""

    def __init__(self):
        self.arrays: list[np.ndarray] = []

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.full(nbytes + 256, 0xA5, np.uint8)        # a pattern, not zeros: unwritten output shows
        start = -raw.ctypes.data % 256
        arr = raw[start:start + nbytes].view(dtype).reshape(shape)
        self.arrays.append(arr)
        return arr

    def put(self, a: np.ndarray) -> np.ndarray:
        arr = self.empty(a.shape, a.dtype)
        arr[...] = a
        return arr

    @staticmethod
    def pack(value) -> bytes:
        if value is None:
            return bytes(8)
        if isinstance(value, np.ndarray):
            return np.uint64(value.ctypes.data).tobytes()
        assert isinstance(value, np.generic), f"pass NumPy scalars, got {type(value).__name__}"
        return value.tobytes()

    def launch(self, fn: emu.Function, grid, block, *args, shared_mem: int = 0) -> float:
        """Run ``fn``; returns the emulation time in seconds."""
        buffers = [(a.ctypes.data, a.nbytes) for a in self.arrays]
        t0 = time.perf_counter()
        fn.launch(grid, block, [self.pack(a) for a in args], shared_mem=shared_mem, buffers=buffers)
        return time.perf_counter() - t0


def rnd(shape, dtype=np.float16, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)
