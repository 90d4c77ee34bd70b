"""The CUDA emulation harness (tests/gpu_emu/cuda_emu) and, through it, every RawKernel source.

No GPU here: the CUDA C sources run on the host (one fiber per CUDA thread, mma.sync from
the PTX ISA's fragment tables) with every memory access checked.  These tests prove the
harness itself (barriers, shuffles, mma, the race/alignment/bounds checks, launch limits),
that it catches a wrong fragment layout, and run the real kernels against the NumPy
references.
"""
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu_emu"))

import tessera_rt.kernels as K
from tessera_rt.kernels.compile import registered_sources
from tessera_rt.kernels.cuda_common import MMA_HEADER
from tessera_rt.kernels.numerics import tolerance
from tessera_rt.kernels.rows_cuda import render_fp8, render_rows

import cuda_emu as emu
from emu_helpers import Device, build, needs_compiler, rnd

pytestmark = needs_compiler


# ------------------------------------------------------------------------------ the harness itself

HARNESS_SOURCE = r"""
#include <cuda_fp16.h>
extern "C" __global__ void reverse(const float* x, float* y, int n, int sync) {
  __shared__ float s[1024];
  const int t = threadIdx.x;
  if (t >= n) return;                       // exited threads count as arrived at __syncthreads
  s[t] = x[t];
  if (sync) __syncthreads();
  y[t] = s[n - 1 - t];
}

extern "C" __global__ void butterfly(const float* x, float* y) {
  float v = x[threadIdx.x];
  for (int w = 16; w > 0; w >>= 1) v += __shfl_xor_sync(0xffffffffu, v, w);
  y[threadIdx.x] = v + 0.5f * __shfl_down_sync(0xffffffffu, v, 1) + __shfl_sync(0xffffffffu, v, 3) * 0.f;
}

extern "C" __global__ void shfl_after_exit(float* y, int live) {
  if ((int)threadIdx.x >= live) return;
  y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

extern "C" __global__ void split_warp(float* y) {
  if (threadIdx.x < 16) __syncthreads();
  else y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

extern "C" __global__ void partial_mask(float* y) {
  y[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.f, 1);
}

extern "C" __global__ void load_u4(const float* x, float* y, int offset_floats) {
  const uint4 v = *reinterpret_cast<const uint4*>(x + offset_floats);
  y[0] = __uint_as_float(v.x + v.y + v.z + v.w);
}

extern "C" __global__ void load_u32(const __half* h, unsigned* y, int offset_halves) {
  y[0] = *reinterpret_cast<const unsigned*>(h + offset_halves);
}

extern "C" __global__ void read_at(const float* x, float* y, long long i) {
  y[0] = x[i];
}

extern "C" __global__ void dynamic_reverse(const float* x, float* y, int n, int extra) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  s[t] = x[t];
  __syncthreads();
  y[t] = s[n - 1 - t + extra];
}

extern "C" __global__ void block_order(int* order, int* count, float* chain) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  order[*count] = b;                        // a race on a GPU; here blocks run one at a time
  *count += 1;
  chain[b] = b == 0 ? 0.f : chain[b - 1] + 1.f;   // planted bug: reads the previous block's write
}

extern "C" __global__ void convert(const float* x, unsigned short* f16, unsigned short* bf16, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  f16[i] = __half_as_ushort(__float2half(x[i]));
  bf16[i] = __float2bfloat16(x[i]).__x;
}
"""


@pytest.fixture(scope="module")
def harness():
    return build("#include <cuda_bf16.h>\n" + HARNESS_SOURCE, "harness")


def test_barrier_reverses_through_shared_memory_and_exited_threads_count_as_arrived(harness):
    dev = Device()
    x, y = dev.put(np.arange(128, dtype=np.float32)), dev.empty(128, np.float32)
    dev.launch(harness.get_function("reverse"), 1, 128, x, y, np.int32(128), np.int32(1))
    np.testing.assert_array_equal(y, x[::-1])
    y[...] = -1
    dev.launch(harness.get_function("reverse"), 1, 128, x, y, np.int32(40), np.int32(1))   # 88 threads exit first
    np.testing.assert_array_equal(y[:40], x[:40][::-1])
    assert (y[40:] == -1).all()


def test_blocks_run_in_a_shuffled_order(harness):
    """Every block runs once, in an order shuffled per launch (reproducible from the seed), so
    the planted bug -- block b reading what block b-1 wrote -- shows; in 0..n order it passed."""
    dev, fn, n = Device(), harness.get_function("block_order"), 24

    def run(**seed):
        order, count, chain = dev.empty(n, np.int32), dev.put(np.zeros(1, np.int32)), dev.empty(n, np.float32)
        fn.launch((4, 3, 2), 1, [dev.pack(a) for a in (order, count, chain)],
                  buffers=[(a.ctypes.data, a.nbytes) for a in dev.arrays], **seed)
        assert count[0] == n and sorted(order) == list(range(n))
        return order.tolist(), chain.copy()

    first, chain = run(seed=7)
    assert first != list(range(n))
    assert not np.array_equal(chain, np.arange(n, dtype=np.float32))
    assert run(seed=7)[0] == first and run(seed=8)[0] != first
    assert run()[0] != run()[0]                 # by default each launch takes a new seed


def test_shuffles_butterfly_sum(harness):
    dev = Device()
    x, y = dev.put(rnd(64, np.float32)), dev.empty(64, np.float32)
    dev.launch(harness.get_function("butterfly"), 1, 64, x, y)
    sums = x.reshape(2, 32).astype(np.float64).sum(1).repeat(32)
    down = np.where(np.arange(64) % 32 == 31, sums, np.roll(sums, -1))   # lane 31's source is past the warp
    np.testing.assert_allclose(y, sums + 0.5 * down, rtol=1e-5)


def test_warp_collective_divergence_and_deadlock(harness):
    dev = Device()
    y = dev.empty(64, np.float32)
    with pytest.raises(emu.BarrierDivergence, match=r"shfl_after_exit block \(0,0,0\) warp 0: thread \(20,0,0\) exited while "
                                                r"lanes 0-19 wait at __shfl_xor_sync"):
        dev.launch(harness.get_function("shfl_after_exit"), 1, 32, y, np.int32(20))
    with pytest.raises(emu.BarrierDivergence, match=r"warp 1: the warp has only 8 threads"):
        dev.launch(harness.get_function("shfl_after_exit"), 1, 40, y, np.int32(40))
    with pytest.raises(emu.Deadlock, match=r"lanes 0-15 at __syncthreads\(\) lanes 16-31 at __shfl_xor_sync"):
        dev.launch(harness.get_function("split_warp"), 1, 32, y)
    with pytest.raises(emu.Unsupported, match="unsupported mask 0xffff"):
        dev.launch(harness.get_function("partial_mask"), 1, 32, y)


def test_launch_arguments_and_limits_are_checked(harness):
    dev = Device()
    x, y = dev.put(np.zeros(128, np.float32)), dev.empty(128, np.float32)
    fn = harness.get_function("reverse")
    assert fn.param_sizes == (8, 8, 4, 4)
    with pytest.raises(emu.LaunchError, match=r"reverse: parameter 2 `int n` is 4 bytes .* passed 8 bytes"):
        dev.launch(fn, 1, 128, x, y, np.int64(128), np.int32(1))
    with pytest.raises(emu.LaunchError, match="takes 4 parameters"):
        dev.launch(fn, 1, 128, x, y, np.int32(128))
    with pytest.raises(emu.LaunchError, match=r"grid.y = 70000 is outside CUDA's range \[1, 65535\]"):
        dev.launch(fn, (1, 70000), 128, x, y, np.int32(128), np.int32(1))
    with pytest.raises(emu.LaunchError, match="block .32, 33, 1. has 1056 threads, more than 1024"):
        dev.launch(fn, 1, (32, 33), x, y, np.int32(128), np.int32(1))
    with pytest.raises(emu.LaunchError, match="block.z = 65"):
        dev.launch(fn, 1, (1, 1, 65), x, y, np.int32(128), np.int32(1))
    with pytest.raises(emu.LaunchError, match="dynamic shared memory"):
        dev.launch(fn, 1, 128, x, y, np.int32(128), np.int32(1), shared_mem=228 * 1024)


def test_shared_memory_race_is_detected_and_barrier_fixes_it(harness):
    dev = Device()
    x, y = dev.put(np.arange(64, dtype=np.float32)), dev.empty(64, np.float32)
    # thread 31 reads s[32] before thread 32 (run after it, with no barrier between) writes it
    with pytest.raises(emu.RaceError, match=r"\(write-after-read\) in kernel reverse block \(0,0,0\): thread "
                                            r"\(32,0,0\) writes 4 bytes at __shared__ reverse::s \+128 .*"
                                            r"which thread \(31,0,0\) read with no __syncthreads"):
        dev.launch(harness.get_function("reverse"), 1, 64, x, y, np.int32(64), np.int32(0))
    dev.launch(harness.get_function("reverse"), 1, 64, x, y, np.int32(64), np.int32(1))


def test_misaligned_and_out_of_bounds_accesses(harness):
    dev = Device()
    x, y = dev.put(np.arange(16, dtype=np.float32)), dev.empty(4, np.float32)
    dev.launch(harness.get_function("load_u4"), 1, 1, x, y, np.int32(4))
    with pytest.raises(emu.MisalignedAccess, match=r"misaligned 16-byte read .*address % 16 = 8.* load_u4"):
        dev.launch(harness.get_function("load_u4"), 1, 1, x, y, np.int32(2))
    h, u = dev.put(np.zeros(8, np.float16)), dev.empty(1, np.uint32)
    with pytest.raises(emu.MisalignedAccess, match="misaligned 4-byte read"):
        dev.launch(harness.get_function("load_u32"), 1, 1, h, u, np.int32(1))
    dev.launch(harness.get_function("read_at"), 1, 1, x, y, np.int64(15))
    with pytest.raises(emu.OutOfBounds, match=r"read of 4 bytes .* read_at block \(0,0,0\) thread \(0,0,0\).*"
                                              r"\(64 bytes\), the access ends 4 bytes past its end"):
        dev.launch(harness.get_function("read_at"), 1, 1, x, y, np.int64(16))
    fn = harness.get_function("dynamic_reverse")
    out = dev.empty(16, np.float32)
    dev.launch(fn, 1, 16, x, out, np.int32(16), np.int32(0), shared_mem=64)
    np.testing.assert_array_equal(out, x[::-1])
    with pytest.raises(emu.OutOfBounds, match="dynamic shared memory is 64 bytes"):
        dev.launch(fn, 1, 16, x, out, np.int32(16), np.int32(1), shared_mem=64)


def test_f16_bf16_conversions_round_like_the_hardware(harness):
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, 65504, 65519.99, 65520, 1e9, -np.inf, np.inf, 6e-8, 2.98e-8, 3e-8, 1e-40,
                         6.1e-5, 1 + 2**-11, 1 + 3 * 2**-11, 3.3895314e38, 3.4e38], np.float32)
    x = np.concatenate([specials, -specials, rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 4000)])
    x = x.astype(np.float32)
    dev = Device()
    gx, f16, bf16 = dev.put(x), dev.empty(x.size, np.uint16), dev.empty(x.size, np.uint16)
    dev.launch(harness.get_function("convert"), (x.size + 127) // 128, 128, gx, f16, bf16, np.int32(x.size))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f16, x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(bf16, x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ------------------------------------------------------------------------------ mma.sync

MMA_TEST_SOURCE = r"""
// One warp: C = C0 + A @ B for a 16x16 A (row-major) and a 16x8 B given n-major (Bt = B^T),
// through shared memory with padded rows, as the kernels stage their tiles.
#define LD 24
extern "C" __global__ void mma_tile(const elem_t* A, const elem_t* Bt, float* C) {
  __shared__ __align__(16) elem_t sA[16 * LD];
  __shared__ __align__(16) elem_t sB[8 * LD];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 256; i += 32) sA[(i / 16) * LD + i % 16] = A[i];
  for (int i = lane; i < 128; i += 32) sB[(i / 16) * LD + i % 16] = Bt[i];
  __syncthreads();
  unsigned a[4], b[2];
  ts_load_a(a, sA, LD, lane);
  ts_load_b(b, sB, LD, lane);
  float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  ts_mma(d, a, b);
  C[g * 8 + 2 * t] = d[0];
  C[g * 8 + 2 * t + 1] = d[1];
  C[(g + 8) * 8 + 2 * t] = d[2];
  C[(g + 8) * 8 + 2 * t + 1] = d[3];
}
"""


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_mma_m16n8k16_matches_numpy(dtype):
    bf16 = dtype is ml_dtypes.bfloat16
    module = build(f"#define TS_BF16 {int(bf16)}\n" + MMA_HEADER + MMA_TEST_SOURCE, "mma_test")
    a, b, c0 = rnd((16, 16), dtype, seed=1), rnd((16, 8), dtype, seed=2), rnd((16, 8), np.float32, seed=3)
    dev = Device()
    c = dev.put(c0)
    dev.launch(module.get_function("mma_tile"), 1, 32, dev.put(a), dev.put(np.ascontiguousarray(b.T)), c)
    want = c0 + a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_wrong_fragment_layout_is_caught():
    """Swapping A registers 1 and 2 in ts_load_a (rows g+8 <-> cols +8) must break the product."""
    right = "a[1] = *reinterpret_cast<const unsigned*>(s + (g + 8) * ld + 2 * t);"
    wrong = "a[2] = *reinterpret_cast<const unsigned*>(s + g * ld + 2 * t + 8);"
    src = "#define TS_BF16 0\n" + MMA_HEADER + MMA_TEST_SOURCE
    assert right in src and wrong in src
    swapped = src.replace(right, "@1@").replace(wrong, right.replace("a[1]", "a[2]")).replace(
        "@1@", wrong.replace("a[2]", "a[1]"))
    a, b = rnd((16, 16), seed=1), rnd((16, 8), seed=2)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for source, ok in ((src, True), (swapped, False)):
        dev = Device()
        c = dev.put(np.zeros((16, 8), np.float32))
        dev.launch(build(source, "mma_test").get_function("mma_tile"), 1, 32, dev.put(a),
                   dev.put(np.ascontiguousarray(b.T)), c)
        assert np.allclose(c, want, rtol=1e-5, atol=1e-5) == ok


# ------------------------------------------------------------------------------ real kernels

@pytest.mark.parametrize("mode", ["softmax", "rmsnorm"])
def test_row_kernel_matches_reference(mode, request):
    fn = build(render_rows(mode=mode, io="f16"), "rows").get_function("ts_rows")
    x, w = rnd((3, 300), scale=3), rnd((300,), seed=5)
    dev = Device()
    y = dev.empty(x.shape, np.float16)
    weight = dev.put(w) if mode == "rmsnorm" else None
    seconds = dev.launch(fn, x.shape[0], 256, dev.put(x), y, weight, None, np.int32(x.shape[1]), np.float32(1e-6))
    request.node.user_properties.append(("emulation_seconds", seconds))
    x64 = x.astype(np.float64)
    want = K.softmax(x64) if mode == "softmax" else K.rmsnorm(x64, w.astype(np.float64), eps=1e-6)
    rtol, atol = tolerance(np.float16)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=rtol * 4, atol=atol * 8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_quantize_bits_match_ml_dtypes(fmt, request):
    e5m2 = fmt == "e5m2"
    fp8, fmax = (ml_dtypes.float8_e5m2, 57344.0) if e5m2 else (ml_dtypes.float8_e4m3fn, 448.0)
    fn = build(render_fp8(), "fp8").get_function("ts_fp8_quant")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(3000) * 10.0 ** rng.integers(-8, 6, 3000)).astype(np.float32)
    x[:4] = [fmax * 3, -fmax * 3, np.inf, -np.inf]          # saturate
    scale = np.array([1.5], np.float32)
    dev = Device()
    q = dev.empty(x.shape, np.uint8)
    # one row of 3000, 16-byte reads (32 lanes of 4 floats, 8 rows a block), a given scale
    seconds = dev.launch(fn, (24, 1), 256, dev.put(x), dev.put(scale), None, np.int32(0), None, q, np.int64(1),
                         np.int32(x.size), np.int32(1), np.int32(32), np.float32(fmax), np.int32(e5m2), np.int32(0),
                         np.uint64(0))
    request.node.user_properties.append(("emulation_seconds", seconds))
    want = np.clip(x / scale[0], -fmax, fmax).astype(fp8).view(np.uint8)
    np.testing.assert_array_equal(q, want)


def test_fp8_stochastic_rounding_picks_a_neighbour_without_bias():
    fn = build(render_fp8(), "fp8").get_function("ts_fp8_quant")
    x = np.full(20000, 1.0 + 1 / 32, np.float32)            # a quarter of the way from 1 to 1.125
    dev = Device()
    q = dev.empty(x.shape, np.uint8)
    dev.launch(fn, (157, 1), 256, dev.put(x), dev.put(np.ones(1, np.float32)), None, np.int32(0), None, q,
               np.int64(1), np.int32(x.size), np.int32(1), np.int32(32), np.float32(448.0), np.int32(0), np.int32(1),
               np.uint64(3))
    vals = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert set(np.unique(vals)) == {1.0, 1.125}
    np.testing.assert_allclose(vals.mean(), 1 + 1 / 32, rtol=3e-3)


# ------------------------------------------------------------------------------ every registered source

@pytest.mark.parametrize("name", sorted(registered_sources()))
def test_every_registered_source_compiles(name):
    src = registered_sources()[name]
    for cfg in src.configs:
        module = build(src.render(**cfg), name)
        assert set(src.entries) <= set(module.entries), cfg
        for entry in src.entries:
            assert module.get_function(entry).param_sizes
        assert module.static_smem_bytes <= emu.MAX_STATIC_SMEM
