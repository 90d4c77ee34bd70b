"""The emulation harness's TF32 tensor-core instructions: cvt.rna.tf32.f32 and mma.sync m16n8k8 .tf32.

The conversion is checked bit for bit against an independent NumPy model (round to nearest,
ties away from zero, to 10 mantissa bits; subnormals, overflow, infinities and NaN included).
The MMA is checked against NumPy through test kernels that load the fragments by the PTX ISA's
table (directly, and by ldmatrix from f32 rows in shared memory); planted fragment mistakes
must give numbers the comparison rejects.  An operand passed without the cvt is truncated to
its top 19 bits, as sm_80/sm_90 tensor cores read it; 3xTF32 (hi = tf32(x),
lo = tf32(x - hi), three MMAs) is f32-accurate where one TF32 MMA is not; and the optional
truncating summation model (the A100's, after Fasi et al. 2021) sums as its NumPy model does.
"""
import numpy as np
import pytest

from tessera_rt.kernels.cuda_common import MMA_HEADER

from emu_helpers import Device, build, needs_compiler

pytestmark = needs_compiler

TF32_SOURCE = r"""
extern "C" __global__ void tf32_cvt(const float* x, unsigned* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = ts_tf32(x[i]);
}

// One warp: C (16x8) = A (16x8, row-major) @ B (8x8, row-major [k][n]) + C, K steps of 8 along
// A's rows of lda = 8 K (A is 16 x 8K, B 8K x 8).  mode: 0 the ISA's fragments, converted by
// cvt.rna; 1 a1/a2 swapped (rows and columns confused); 2 B read transposed (b0 = B[g][t]);
// 3 no cvt (raw f32 bits); 4 3xTF32; 5 A by ldmatrix.x4 from f32 rows in shared memory.
extern "C" __global__ void tf32_mma(const float* A, const float* B, float* C, int ksteps, int mode) {
  __shared__ __align__(16) float sA[16 * 12];          // 16 rows of 8 floats, padded to 12 (48 bytes)
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3, lda = 8 * ksteps;
  float d[4];
  for (int r = 0; r < 4; ++r) d[r] = C[(g + (r >> 1) * 8) * 8 + 2 * t + (r & 1)];
  for (int ks = 0; ks < ksteps; ++ks) {
    const float* a = A + ks * 8;
    const float* b = B + ks * 64;
    float af[4] = {a[g * lda + t], a[(g + 8) * lda + t], a[g * lda + t + 4], a[(g + 8) * lda + t + 4]};
    float bf[2] = {b[t * 8 + g], b[(t + 4) * 8 + g]};
    if (mode == 1) { const float x = af[1]; af[1] = af[2]; af[2] = x; }
    if (mode == 2) { bf[0] = b[g * 8 + t]; bf[1] = b[g * 8 + t + 4]; }
    if (mode == 5) {
      __syncthreads();
      for (int i = lane; i < 128; i += 32) sA[(i / 8) * 12 + i % 8] = a[(i / 8) * lda + i % 8];
      __syncthreads();
      unsigned r[4];
      ts_ldsm_x4(r, sA + (lane & 15) * 12 + (lane >> 4) * 4);   // f32 rows: 4 per 16-byte ldmatrix row
      for (int i = 0; i < 4; ++i) af[i] = __uint_as_float(r[i]);
    }
    unsigned ua[4], ub[2];
    if (mode == 4) {
      unsigned la[4], lb[2];
      for (int i = 0; i < 4; ++i) ts_split_tf32(af[i], ua[i], la[i]);
      for (int i = 0; i < 2; ++i) ts_split_tf32(bf[i], ub[i], lb[i]);
      ts_mma_3xtf32(d, ua, la, ub, lb);
      continue;
    }
    for (int i = 0; i < 4; ++i) ua[i] = mode == 3 ? __float_as_uint(af[i]) : ts_tf32(af[i]);
    for (int i = 0; i < 2; ++i) ub[i] = mode == 3 ? __float_as_uint(bf[i]) : ts_tf32(bf[i]);
    ts_mma_tf32(d, ua, ub);
  }
  for (int r = 0; r < 4; ++r) C[(g + (r >> 1) * 8) * 8 + 2 * t + (r & 1)] = d[r];
}
"""


@pytest.fixture(scope="module")
def tf32_module():
    return build("#define TS_BF16 0\n" + MMA_HEADER + TF32_SOURCE, "tf32_test")


def rna_model(x: np.ndarray) -> np.ndarray:
    """tf32(x) by arithmetic, not bits: the nearest multiple of the tf32 quantum (2^(e-11) for
    x = m 2^e, m in [0.5, 1); 2^-136 for f32 subnormals), ties away from zero, as f32."""
    x64 = x.astype(np.float64)
    _, e = np.frexp(x64)
    quantum = np.maximum(np.ldexp(1.0, e - 11), 2.0 ** -136)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.sign(x64) * np.floor(np.abs(x64) / quantum + 0.5) * quantum
        r = np.where(np.isfinite(x64), r, x64)
        return r.astype(np.float32)


def special_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    base = base[(base & 0x7f800000) != 0x7f800000]                   # finite
    tie = (base & ~np.uint32(0x1fff)) | np.uint32(0x1000)             # exactly half a tf32 ulp
    below, above = tie - np.uint32(1), tie + np.uint32(1)
    edges = np.array([0, 0x80000000, 0x00000001, 0x00001000, 0x00000fff, 0x807fffff, 0x7f7fffff, 0xff7fffff,
                      0x7f7fefff, 0x7f7ff000, 0x3f800000, 0x3f801000, 0x3f803000, 0x7f800000, 0xff800000],
                     np.uint32)
    return np.concatenate([base, tie, below, above, edges]).view(np.float32)


def test_cvt_rna_tf32_rounds_to_nearest_ties_away(tf32_module):
    x = special_values()
    dev = Device()
    out = dev.empty(x.shape, np.uint32)
    dev.launch(tf32_module.get_function("tf32_cvt"), 1, 128, dev.put(x), out, np.int32(x.size))
    assert not (out & 0x1fff).any()                                  # the low 13 bits are zero
    np.testing.assert_array_equal(out.view(np.float32), rna_model(x))
    assert out.view(np.float32)[x == np.float32(1 + 2**-11)][0] == np.float32(1 + 2**-10)   # a tie goes away from 0
    nan = np.array([np.nan, -np.nan, np.uint32(0x7f800001).view(np.float32)], np.float32)
    dev.launch(tf32_module.get_function("tf32_cvt"), 1, 32, dev.put(nan), out, np.int32(3))
    assert np.isnan(out[:3].view(np.float32)).all()


def tf32_trunc(x):
    return (x.view(np.uint32) & np.uint32(0xffffe000)).view(np.float32)


def run_mma(mod, a, b, c, mode):
    dev = Device()
    out = dev.put(c)
    dev.launch(mod.get_function("tf32_mma"), 1, 32, dev.put(a), dev.put(b), out, np.int32(a.shape[1] // 8),
               np.int32(mode))
    return out.astype(np.float64)


def operands(ksteps=1, seed=1):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((16, 8 * ksteps)).astype(np.float32), rng.standard_normal((8 * ksteps, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    return a, b, c


@pytest.mark.parametrize("mode", [0, 5], ids=["table", "ldmatrix"])
def test_mma_m16n8k8_tf32_matches_numpy(tf32_module, mode):
    """The fragments the ISA documents, loaded directly or by ldmatrix.x4 from f32 rows (one f32
    per lane per 16-byte row of four), give the product of the tf32-rounded operands."""
    a, b, c = operands(ksteps=2)
    want = rna_model(a).astype(np.float64) @ rna_model(b).astype(np.float64) + c
    np.testing.assert_allclose(run_mma(tf32_module, a, b, c, mode), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [1, 2], ids=["a1-a2 swapped", "B transposed"])
def test_planted_fragment_bugs_give_wrong_numbers(tf32_module, mode):
    a, b, c = operands()
    want = rna_model(a).astype(np.float64) @ rna_model(b).astype(np.float64) + c
    assert np.abs(run_mma(tf32_module, a, b, c, mode) - want).max() > 0.1


def test_unconverted_f32_operands_are_truncated(tf32_module):
    """Raw f32 bits in a .tf32 register: the tensor core uses the top 19 (sign, exponent, 10
    mantissa bits), i.e. truncation toward zero; the emulated sum is sequential f32, so the
    model below is bit-exact."""
    a, b, c = operands()
    got = run_mma(tf32_module, a, b, c, 3).astype(np.float32)
    at, bt = tf32_trunc(a).astype(np.float64), tf32_trunc(b).astype(np.float64)
    want = c.copy()
    for k in range(8):
        want = (want + (at[:, k:k + 1] * bt[k:k + 1, :]).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    rounded = run_mma(tf32_module, a, b, c, 0)
    assert not np.array_equal(got, rounded.astype(np.float32))


def test_3xtf32_is_f32_accurate_where_one_tf32_mma_is_not(tf32_module):
    a, b, c = operands(ksteps=8, seed=3)                  # K = 64, as an attention head
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    scale = np.abs(exact).max()
    err3 = np.abs(run_mma(tf32_module, a, b, c, 4) - exact).max() / scale
    err1 = np.abs(run_mma(tf32_module, a, b, c, 0) - exact).max() / scale
    assert err3 < 1e-6 and err1 > 1e-4, (err3, err1)


def truncating_model(a, b, c):
    """The A100 summation model, from NumPy: per output and per group of four k, c and the exact
    products aligned to the largest (each truncated toward zero at its f32 ulp), summed, and the
    sum truncated toward zero to f32."""
    a64, b64 = rna_model(a).astype(np.float64), rna_model(b).astype(np.float64)
    out = c.astype(np.float32).copy()
    for i in range(16):
        for j in range(8):
            acc = out[i, j]
            for k0 in range(0, a.shape[1], 4):
                terms = np.array([acc] + [a64[i, k] * b64[k, j] for k in range(k0, k0 + 4)], np.float64)
                nz = terms[terms != 0]
                if nz.size == 0:
                    continue
                ulp = np.ldexp(1.0, int(np.max(np.frexp(nz)[1])) - 1 - 23)     # frexp: x = m 2^e, m in [0.5, 1)
                total = float(np.sum(np.trunc(terms / ulp) * ulp))
                r = np.float32(total)
                if abs(float(r)) > abs(total):
                    r = np.nextafter(r, np.float32(0))
                acc = r
            out[i, j] = acc
    return out


def test_the_truncating_summation_model(tf32_module):
    """set_tf32_accumulation("truncate"): each group of four k summed as the model above says, bit
    for bit; biased toward zero where every product is positive; "nearest" restored after."""
    a, b, c = operands(ksteps=2, seed=5)
    before = tf32_module.set_tf32_accumulation("truncate")
    try:
        got = run_mma(tf32_module, a, b, c, 0).astype(np.float32)
        pos = run_mma(tf32_module, np.abs(a), np.abs(b), np.abs(c), 0)
    finally:
        assert tf32_module.set_tf32_accumulation(before) == "truncate"
    np.testing.assert_array_equal(got, truncating_model(a, b, c))
    exact = rna_model(np.abs(a)).astype(np.float64) @ rna_model(np.abs(b)).astype(np.float64) + np.abs(c)
    assert (pos <= exact).all() and (pos < exact).any()
    nearest = run_mma(tf32_module, a, b, c, 0).astype(np.float32)
    assert not np.array_equal(nearest, got)
    with pytest.raises(ValueError, match="tf32 accumulation"):
        tf32_module.set_tf32_accumulation("stochastic")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32_helpers_compile_to_the_real_ptx(arch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from tessera_rt.kernels.compile import nvrtc_compile, ptxas_resources
    ptx = nvrtc_compile("#define TS_BF16 0\n" + MMA_HEADER + TF32_SOURCE, "tf32_test.cu", arch)
    for instr in ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32",
                  "ldmatrix.sync.aligned.m8n8.x4.shared.b16"):
        assert instr in ptx, instr
    assert set(ptxas_resources(ptx, arch)) == {"tf32_cvt", "tf32_mma"}
