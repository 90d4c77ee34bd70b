"""The emulation harness's sm_80 data movement: ldmatrix and cp.async, each with planted bugs.

ldmatrix is checked against the PTX ISA's fragment table and, independently, by feeding
mma.sync (whose fragments the harness already takes from the ISA) and comparing the product
with NumPy.  cp.async is checked for what a GPU guarantees and no more: the copied bytes are
visible to the issuing thread only after its cp.async.wait_group retires their group, and to
other threads only after a barrier following that; zero-fill past src-size; alignment and
bounds.  Each misuse a kernel could make (a wrong lane address, a missing .trans, a missing
wait or commit, an off-by-one wait count, a refill while others read) must fail, either as a
harness error or as numbers the comparison rejects.
"""
import ml_dtypes
import numpy as np
import pytest

from tessera_rt.kernels.cuda_common import MMA_HEADER

import cuda_emu as emu
from emu_helpers import Device, build, needs_compiler, rnd

pytestmark = needs_compiler

LDMATRIX_SOURCE = r"""
#define LDP 24    // padded shared rows (48 bytes): each row 16-byte aligned, rows on distinct banks

// One warp.  M holds four 8x8 b16 matrices, matrix-major.  Lane l passes row l % 8 of matrix
// l / 8 (for `bad_lane`, the next row instead: a planted wrong address) and writes the
// registers it receives to out[4 l ..].
extern "C" __global__ void ldsm_probe(const unsigned short* M, unsigned* out, int num, int trans, int bad_lane) {
  __shared__ __align__(16) unsigned short s[32 * LDP];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) s[(i / 8) * LDP + i % 8] = M[i];
  __syncthreads();
  const int row = lane == bad_lane ? (lane + 1) % 32 : lane;
  const unsigned short* p = s + row * LDP;
  unsigned r[4] = {0u, 0u, 0u, 0u};
  if (num == 4) { if (trans) ts_ldsm_x4_t(r, p); else ts_ldsm_x4(r, p); }
  else if (num == 2) { if (trans) ts_ldsm_x2_t(r, p); else ts_ldsm_x2(r, p); }
  else { if (trans) ts_ldsm_x1_t(r, p); else ts_ldsm_x1(r, p); }
  for (int i = 0; i < 4; ++i) out[4 * lane + i] = r[i];
}

// One warp: C (16x16 f32) = A (16x16, row-major) @ B (16x16, row-major [k][n]), fragments by
// ldmatrix: A with x4, B (two n8 tiles) with x4.trans.  mode 1: A's lanes address rows l % 8
// (rows 8-15 never read); mode 2: B without .trans; mode 3: B by two x2.trans.
extern "C" __global__ void ldsm_mma(const elem_t* A, const elem_t* B, float* C, int mode) {
  __shared__ __align__(16) elem_t sA[16 * LDP];
  __shared__ __align__(16) elem_t sB[16 * LDP];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 256; i += 32) {
    sA[(i / 16) * LDP + i % 16] = A[i];
    sB[(i / 16) * LDP + i % 16] = B[i];
  }
  __syncthreads();
  unsigned a[4], b[4];
  const int arow = mode == 1 ? lane % 8 : lane % 16;
  ts_ldsm_x4(a, sA + arow * LDP + (lane / 16) * 8);
  const elem_t* pb = sB + (lane % 16) * LDP + (lane / 16) * 8;
  if (mode == 2) ts_ldsm_x4(b, pb);
  else if (mode == 3) { ts_ldsm_x2_t(b, sB + (lane % 16) * LDP); ts_ldsm_x2_t(b + 2, sB + (lane % 16) * LDP + 8); }
  else ts_ldsm_x4_t(b, pb);
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
  ts_mma(d0, a, b);
  ts_mma(d1, a, b + 2);
  for (int h = 0; h < 4; ++h) {
    const int row = g + (h >> 1) * 8, col = 2 * t + (h & 1);
    C[row * 16 + col] = d0[h];
    C[row * 16 + 8 + col] = d1[h];
  }
}

// ldmatrix from an address outside shared memory / misaligned inside it.
extern "C" __global__ void ldsm_bad_address(const unsigned short* M, unsigned* out, int misalign) {
  __shared__ __align__(16) unsigned short s[32 * LDP];
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * LDP; i += 32) s[i] = 0;
  __syncthreads();
  unsigned r[4];
  if (misalign) ts_ldsm_x4(r, s + lane * LDP + (lane == 5 ? 4 : 0));
  else ts_ldsm_x4(r, lane == 9 ? (const void*)(M + 8 * lane) : (const void*)(s + lane * LDP));
  out[lane] = r[0];
}
"""


@pytest.fixture(scope="module")
def ldsm_module():
    return build("#define TS_BF16 0\n" + MMA_HEADER + LDMATRIX_SOURCE, "ldmatrix_test")


def ldmatrix_model(m: np.ndarray, num: int, trans: bool) -> np.ndarray:
    """The PTX ISA's ldmatrix fragment table: lane l, register i holds row l // 4, elements
    2 (l % 4) and +1 of matrix i (of its transpose with .trans), the lower in the low half."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for i in range(num):
            mi = m[i].T if trans else m[i]
            out[lane, i] = int(mi[r, c]) | (int(mi[r, c + 1]) << 16)
    return out


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_gives_the_ptx_fragment_table(ldsm_module, num, trans):
    m = np.random.default_rng(num + 2 * trans).integers(0, 2**16, (4, 8, 8), dtype=np.uint16)
    dev = Device()
    out = dev.empty((32, 4), np.uint32)
    dev.launch(ldsm_module.get_function("ldsm_probe"), 1, 32, dev.put(m.reshape(-1)), out, np.int32(num),
               np.int32(trans), np.int32(-1))
    want = ldmatrix_model(m, num, trans)
    np.testing.assert_array_equal(out[:, :num], want[:, :num])
    assert (out[:, num:] == 0).all()          # registers past .num untouched


def test_ldmatrix_ignores_addresses_of_lanes_past_its_matrices(ldsm_module):
    """.x1 uses lanes 0-7's addresses, .x2 lanes 0-15's: a wrong address elsewhere changes nothing,
    in a used lane it moves the row (the planted wrong lane address)."""
    m = np.random.default_rng(5).integers(0, 2**16, (4, 8, 8), dtype=np.uint16)
    dev = Device()
    gm, out = dev.put(m.reshape(-1)), dev.empty((32, 4), np.uint32)
    fn = ldsm_module.get_function("ldsm_probe")
    for num, bad in ((1, 20), (2, 16)):
        dev.launch(fn, 1, 32, gm, out, np.int32(num), np.int32(0), np.int32(bad))
        np.testing.assert_array_equal(out[:, :num], ldmatrix_model(m, num, False)[:, :num])
    dev.launch(fn, 1, 32, gm, out, np.int32(4), np.int32(0), np.int32(13))    # lane 13: row 5 of matrix 1
    want = ldmatrix_model(m, 4, False)
    assert not np.array_equal(out, want)
    assert (out[:, [0, 2, 3]] == want[:, [0, 2, 3]]).all() and (out[20:24, 1] != want[20:24, 1]).any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_ldmatrix_feeds_mma_exactly(dtype):
    """A via x4, B via x4.trans (or two x2.trans) from row-major tiles: the product NumPy gives;
    the planted bugs (A rows addressed l % 8; B loaded without .trans) give other numbers."""
    module = build(f"#define TS_BF16 {int(dtype is ml_dtypes.bfloat16)}\n" + MMA_HEADER + LDMATRIX_SOURCE,
                   "ldmatrix_test")
    a, b = rnd((16, 16), dtype, seed=1), rnd((16, 16), dtype, seed=2)
    want = a.astype(np.float64) @ b.astype(np.float64)
    dev = Device()
    ga, gb = dev.put(a), dev.put(b)
    results = {}
    for mode in range(4):
        c = dev.empty((16, 16), np.float32)
        dev.launch(module.get_function("ldsm_mma"), 1, 32, ga, gb, c, np.int32(mode))
        results[mode] = c.astype(np.float64)
    for mode in (0, 3):
        np.testing.assert_allclose(results[mode], want, rtol=1e-6, atol=1e-5)
    for mode in (1, 2):                         # wrong lane addresses / missing .trans
        assert np.abs(results[mode] - want).max() > 0.5, mode


def test_ldmatrix_address_must_be_aligned_shared_memory(ldsm_module):
    dev = Device()
    gm, out = dev.put(np.zeros(1024, np.uint16)), dev.empty(32, np.uint32)
    fn = ldsm_module.get_function("ldsm_bad_address")
    with pytest.raises(emu.OutOfBounds, match=r"ldmatrix.x4 in kernel ldsm_bad_address .* lane 9 supplies row address "
                                              r"0x[0-9a-f]+ \(row 1 of matrix 1\), which is not in the block's shared"):
        dev.launch(fn, 1, 32, gm, out, np.int32(0))
    with pytest.raises(emu.MisalignedAccess, match=r"misaligned 16-byte read .* thread \(5,0,0\)"):
        dev.launch(fn, 1, 32, gm, out, np.int32(1))


CP_ASYNC_SOURCE = r"""
// 64 threads; thread t copies the 16 bytes src[16 t ..] into shared chunk t by cp.async, then
// writes chunk `t ^ swap` back to dst[16 t ..].  `mode` plants the protocol's mistakes.
extern "C" __global__ void async_roundtrip(const unsigned char* src, unsigned char* dst, int mode, int src_bytes,
                                           int src_offset) {
  __shared__ __align__(16) unsigned char s[64 * 16];
  const int t = threadIdx.x;
  const unsigned char* g = src + 16 * t + src_offset;
  unsigned char* d = s + 16 * t;
  int swap = 0;
  switch (mode) {
    case 0:                                   // the protocol: copy, commit, wait, barrier
      ts_cp_async<16>(d, g, src_bytes); ts_cp_async_commit(); ts_cp_async_wait<0>(); __syncthreads(); swap = 1; break;
    case 1:                                   // no wait: the barrier alone does not retire the copy
      ts_cp_async<16>(d, g, src_bytes); ts_cp_async_commit(); __syncthreads(); break;
    case 2:                                   // wait_group without commit_group: the copy is in no group
      ts_cp_async<16>(d, g, src_bytes); ts_cp_async_wait<0>(); __syncthreads(); break;
    case 3:                                   // waited, but no barrier before reading a neighbour's chunk
      ts_cp_async<16>(d, g, src_bytes); ts_cp_async_commit(); ts_cp_async_wait<0>(); swap = 1; break;
    case 4:                                   // 4-byte .ca copies
      for (int i = 0; i < 16; i += 4) ts_cp_async<4>(d + i, g + i, src_bytes < i ? 0 : min(4, src_bytes - i));
      ts_cp_async_wait_all(); __syncthreads(); break;
    case 5:                                   // 8-byte .ca copies, two groups, wait_group 0
      ts_cp_async<8>(d, g, min(8, src_bytes)); ts_cp_async_commit();
      ts_cp_async<8>(d + 8, g + 8, max(0, src_bytes - 8)); ts_cp_async_commit();
      ts_cp_async_wait<0>(); __syncthreads(); break;
    case 6:                                   // two groups, wait_group 1: only the first is retired
    case 7:
      ts_cp_async<8>(d, g, 8); ts_cp_async_commit();
      ts_cp_async<8>(d + 8, g + 8, 8); ts_cp_async_commit();
      ts_cp_async_wait<1>(); __syncthreads();
      if (mode == 6) {                        // reads the retired half only
        *reinterpret_cast<uint2*>(dst + 16 * t) = *reinterpret_cast<const uint2*>(d);
        return;
      }
      break;
    case 8:                                   // a refill while another thread may still read the chunk
      ts_cp_async<16>(d, g, 16); ts_cp_async_commit(); ts_cp_async_wait<0>(); __syncthreads();
      *reinterpret_cast<uint4*>(dst + 16 * t) = *reinterpret_cast<const uint4*>(s + 16 * (t ^ 1));
      ts_cp_async<16>(d, g, 16); ts_cp_async_commit(); ts_cp_async_wait<0>();
      return;
    case 9:                                   // a second copy into a chunk whose first is in flight
      ts_cp_async<16>(d, g, 16); ts_cp_async_commit(); ts_cp_async<16>(d, g, 16); break;
  }
  *reinterpret_cast<uint4*>(dst + 16 * t) = *reinterpret_cast<const uint4*>(s + 16 * (t ^ swap));
}
"""


@pytest.fixture(scope="module")
def async_module():
    return build("#define TS_BF16 0\n" + MMA_HEADER + CP_ASYNC_SOURCE, "cp_async_test")


def roundtrip(async_module, mode, src_bytes=16, src_offset=0, nbytes=1024):
    dev = Device()
    src = dev.put(np.random.default_rng(mode).integers(0, 256, nbytes, dtype=np.uint8))
    dst = dev.empty(1024, np.uint8)
    dev.launch(async_module.get_function("async_roundtrip"), 1, 64, src, dst, np.int32(mode), np.int32(src_bytes),
               np.int32(src_offset))
    return src, dst


@pytest.mark.parametrize("mode", [0, 4, 5])
@pytest.mark.parametrize("src_bytes", [16, 5, 0])
def test_cp_async_copies_and_zero_fills_past_src_size(async_module, mode, src_bytes):
    src, dst = roundtrip(async_module, mode, src_bytes)
    want = src.reshape(64, 16).copy()
    want[:, src_bytes:] = 0
    if mode == 0:
        want = want[np.arange(64) ^ 1]        # mode 0 reads the neighbour's chunk after the barrier
    np.testing.assert_array_equal(dst.reshape(64, 16), want)


def test_cp_async_wait_group_retires_all_but_the_newest_groups(async_module):
    src, dst = roundtrip(async_module, 6)
    np.testing.assert_array_equal(dst.reshape(64, 2, 8)[:, 0], src.reshape(64, 2, 8)[:, 0])
    with pytest.raises(emu.AsyncCopyError, match=r"cp.async not waited for in kernel async_roundtrip .* thread "
                                                 r"\((\d+),0,0\) reads 16 bytes at __shared__ async_roundtrip::s \+\d+ .*"
                                                 r"the cp.async that thread \(\1,0,0\) issued into it is in flight"):
        roundtrip(async_module, 7)


@pytest.mark.parametrize("mode, error, match", [
    (1, emu.AsyncCopyError, r"thread \((\d+),0,0\) reads 16 bytes .* that thread \(\1,0,0\) issued into it is in flight"),
    (2, emu.AsyncCopyError, r"no cp.async.wait_group/wait_all retired its group"),
    (3, emu.RaceError, r"\(write-after-read\) .* thread \(1,0,0\) writes 16 bytes at __shared__ async_roundtrip::s \+16"
                       r" .* which thread \(0,0,0\) read"),
    (8, emu.RaceError, r"race \((write-after-read|read-after-write)\) .* 16 bytes at __shared__ async_roundtrip::s"),
    (9, emu.AsyncCopyError, r"thread \(0,0,0\) issues a cp.async that writes 16 bytes .* in flight"),
])
def test_cp_async_misuse_fails(async_module, mode, error, match):
    """A read before the wait (mode 1), a wait on an uncommitted copy (2), a read of another
    thread's copy without a barrier (3), a refill while a neighbour reads (8), two copies in
    flight into one chunk (9)."""
    with pytest.raises(error, match=match):
        roundtrip(async_module, mode)


def test_cp_async_alignment_and_bounds(async_module):
    with pytest.raises(emu.MisalignedAccess, match=r"misaligned cp.async.cg.shared.global of 16 bytes .* src 0x[0-9a-f]+ "
                                                   r"% 16 = 8"):
        roundtrip(async_module, 0, src_offset=8, nbytes=1040)
    with pytest.raises(emu.OutOfBounds, match=r"out-of-bounds read of 16 bytes .* the access ends 16 bytes past its end"):
        roundtrip(async_module, 0, nbytes=1008)
    roundtrip(async_module, 0, src_bytes=0, nbytes=1008)     # src-size 0 reads nothing: the last row may lie past the end


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_instruction_helpers_compile_to_the_real_ptx(arch):
    """The same test kernels through NVRTC and ptxas: the helpers' inline PTX is what runs on a GPU."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from tessera_rt.kernels.compile import nvrtc_compile, ptxas_resources
    ptx = nvrtc_compile("#define TS_BF16 0\n" + MMA_HEADER + LDMATRIX_SOURCE + CP_ASYNC_SOURCE, "sm80_test.cu", arch)
    for instr in ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                  "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
                  "cp.async.cg.shared.global", "cp.async.ca.shared.global", "cp.async.commit_group",
                  "cp.async.wait_group 1", "cp.async.wait_all"):
        assert instr in ptx, instr
    assert set(ptxas_resources(ptx, arch)) == {"ldsm_probe", "ldsm_mma", "ldsm_bad_address", "async_roundtrip"}
