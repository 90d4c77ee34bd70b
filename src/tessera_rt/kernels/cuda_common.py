"""Device helpers shared by the RawKernel sources, and the launcher plumbing around CuPy.

The tensor-core kernels use ``mma.sync.aligned.m16n8k16`` through inline PTX, whose
fragment layouts the PTX ISA documents (unlike WMMA's opaque fragments), so a kernel can
rescale accumulator rows in registers (the online softmax needs that) and feed an f32
accumulator straight back in as the A operand of the next MMA (P·V, FlashAttention-2).
For lane ``l``, ``g = l / 4`` and ``t = l % 4``:

* A (16x16, row-major): regs a0..a3 hold rows {g, g+8, g, g+8}, cols {2t, 2t, 2t+8, 2t+8} (+0/+1).
* B (16x8, "col"): regs b0, b1 hold k = 2t (+0/+1) and 2t+8 (+0/+1) of column n = g.
* C (16x8, f32): c0, c1 are row g, cols 2t, 2t+1; c2, c3 are row g+8.

CuPy is imported inside the launch helpers only.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["MAX_GRID_YZ", "MMA_HEADER", "HALF_IO", "get_function", "launch_stream", "device_key", "aligned", "is_aligned"]

# A kernel's I/O element type: ``in_t`` is __half when compiled with TS_HALF=1, else float;
# ``to_f``/``from_f`` convert to and from the f32 the kernel computes in.
HALF_IO = r"""
#include <cuda_fp16.h>
#if TS_HALF
typedef __half in_t;
__device__ __forceinline__ float to_f(in_t x) { return __half2float(x); }
__device__ __forceinline__ in_t from_f(float x) { return __float2half(x); }
#else
typedef float in_t;
__device__ __forceinline__ float to_f(in_t x) { return x; }
__device__ __forceinline__ in_t from_f(float x) { return x; }
#endif
"""

MMA_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef TS_BF16
#define TS_BF16 0
#endif
#if TS_BF16
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define TS_MMA_TYPE "bf16"
__device__ __forceinline__ elem2_t ts_pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float ts_float(elem_t x) { return __bfloat162float(x); }
__device__ __forceinline__ elem_t ts_elem(float x) { return __float2bfloat16(x); }
#else
typedef __half elem_t;
typedef __half2 elem2_t;
#define TS_MMA_TYPE "f16"
__device__ __forceinline__ elem2_t ts_pack(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float ts_float(elem_t x) { return __half2float(x); }
__device__ __forceinline__ elem_t ts_elem(float x) { return __float2half(x); }
#endif

__device__ __forceinline__ unsigned ts_u32(elem2_t v) { return *reinterpret_cast<unsigned*>(&v); }

// d += a * b for one m16n8k16 tile, f32 accumulators.
__device__ __forceinline__ void ts_mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef TS_CUDA_EMULATOR
  // the CPU emulation harness (tests/gpu_emu) computes the MMA from the PTX ISA's fragment tables
  ts_emu_mma_m16n8k16(d, a, b, TS_BF16);
#else
  asm volatile(
    "mma.sync.aligned.m16n8k16.row.col.f32." TS_MMA_TYPE "." TS_MMA_TYPE ".f32 "
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// A fragment of a 16x16 tile at `s` (row-major, leading dim `ld` elements, ld even).
__device__ __forceinline__ void ts_load_a(unsigned* a, const elem_t* s, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  a[0] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t);
  a[1] = *reinterpret_cast<const unsigned*>(s + (g + 8) * ld + 2 * t);
  a[2] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t + 8);
  a[3] = *reinterpret_cast<const unsigned*>(s + (g + 8) * ld + 2 * t + 8);
}

// B fragment of a 16(k)x8(n) tile stored n-major at `s` (element (k, n) at s[n * ld + k]).
__device__ __forceinline__ void ts_load_b(unsigned* b, const elem_t* s, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  b[0] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t);
  b[1] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t + 8);
}

// Two f32 C tiles (cols 0-7 and 8-15 of a 16x16 block) as the A fragment of the next MMA.
__device__ __forceinline__ void ts_c_to_a(unsigned* a, const float* c0, const float* c1) {
  a[0] = ts_u32(ts_pack(c0[0], c0[1]));
  a[1] = ts_u32(ts_pack(c0[2], c0[3]));
  a[2] = ts_u32(ts_pack(c1[0], c1[1]));
  a[3] = ts_u32(ts_pack(c1[2], c1[3]));
}

// Reductions over the 4 lanes that share a C row (lanes 4g .. 4g+3).
__device__ __forceinline__ float ts_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float ts_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
"""

MAX_GRID_YZ = 65535     # CUDA caps gridDim.y and gridDim.z here (gridDim.x at 2**31 - 1)

_FUNCS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def device_key() -> tuple[int, str]:
    """(device id, compute capability) of the current CuPy device: part of every cache key."""
    import cupy
    dev = cupy.cuda.Device()
    return dev.id, dev.compute_capability


def get_function(name: str, entry: str, config: dict, render: Callable[..., str],
                 dynamic_smem: int = 0, fast_math: bool = True):
    """The compiled ``entry`` of ``render(**config)``, cached by (name, config, device).

    ``config`` carries the dtype and tile, so the key is the convention's
    (name, dtype, tile, device).  Kernels asking for more than 48 KiB of dynamic shared
    memory get the opt-in attribute set once here.  ``fast_math=False`` compiles without
    ``--use_fast_math`` (exact ``expf``/``logf``: the f32 attention kernels).
    """
    import cupy
    key = (name, entry, tuple(sorted(config.items())), device_key())
    with _LOCK:
        fn = _FUNCS.get(key)
        if fn is None:
            options = ("-std=c++17", "--use_fast_math") if fast_math else ("-std=c++17",)
            module = cupy.RawModule(code=render(**config), options=options)
            fn = module.get_function(entry)
            _FUNCS[key] = fn
        if dynamic_smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < dynamic_smem:
            fn.max_dynamic_shared_size_bytes = dynamic_smem
    return fn


def launch_stream(stream: Any):
    """A CuPy stream context for ``stream`` (a runtime CudaStream, a CuPy stream, or None)."""
    import contextlib
    import cupy
    if stream is None:
        return contextlib.nullcontext()
    raw = getattr(stream, "raw", stream)
    if isinstance(raw, cupy.cuda.Stream):
        return raw
    if hasattr(stream, "ptr"):
        return cupy.cuda.ExternalStream(stream.ptr)
    raise TypeError(f"expected a CUDA stream, got {type(stream).__name__}")


def is_aligned(a: Any, nbytes: int) -> bool:
    """Does device array ``a`` start on an ``nbytes`` boundary (what a vector load needs)?"""
    return a.data.ptr % nbytes == 0


def aligned(a: Any, nbytes: int):
    """``a``, or an aligned copy where ``a`` is a view starting mid-word (e.g. ``x[1:]``).

    The kernels read two halves as one 32-bit word or eight as one 16-byte ``uint4``; on a
    GPU such a load from a misaligned address faults.  CuPy's allocations are 256-byte
    aligned, so a copy always is.  Call inside the launch's stream context.
    """
    return a if is_aligned(a, nbytes) else a.copy()
