"""The pipelined tile GEMM (gemm_tile_cuda) in the emulation harness, bit for bit.

The harness computes each mma.sync as the PTX ISA's fragments say, accumulating the 16
products of a slice in f32 in k order, so a GEMM whose warps walk K in order has one exact
answer: an f32 accumulator per output, ``acc += a[m, k] * b[k, n]`` for k ascending (products of
two f16/bf16 numbers are exact in f32), rounded once to the output type.  ``exact_gemm`` computes
that in NumPy, and every result here must equal it in every bit -- which a wrong swizzle, lane
address, .trans, stage index or zero-fill would not.  The pipeline's protocol mistakes (a missing
or short cp.async wait, a refill before the barrier) must fail in the harness.
"""
import ml_dtypes
import numpy as np
import pytest

import tessera_rt.kernels as K
from tessera_rt.kernels.gemm_cuda import gemm_vec
from tessera_rt.kernels.gemm_tile_cuda import (
    DUAL_CONFIGS,
    GEMM_CONFIGS,
    gemm_grid,
    gemm_smem_bytes,
    gemm_threads,
    render_gemm,
)

import cuda_emu as emu
from emu_helpers import NVRTC_OPTIONS, Device, needs_compiler, rnd

pytestmark = needs_compiler
BF16 = np.dtype(ml_dtypes.bfloat16)


def exact_gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """f32 accumulation in k order of exact products: the emulated tensor cores' answer."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    acc = np.zeros(np.broadcast_shapes(a.shape[:-1], b.shape[:-2] + (1,))[:-1] + (a.shape[-2], b.shape[-1]),
                   np.float32)
    for k in range(a.shape[-1]):
        acc += a32[..., :, k:k + 1] * b32[..., k:k + 1, :]
    return acc


def run_gemm(a, b, tile, *, b2=None, out_dtype=None, dual_out=False, source_edit=None, smem_delta=0, vec=None):
    """Launch ts_gemm as gemm_cuda.tile_gemm does (grid, block, dynamic shared memory, vec);
    returns C, or (C, C2) with ``dual_out``."""
    dual = b2 is not None
    elem = "bf16" if a.dtype == BF16 else "f16"
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    *batch, m, k = a.shape
    n = b.shape[-1]
    nb = int(np.prod(batch)) if batch else 1
    dev = Device()
    ga, gb = dev.put(a), dev.put(b)
    gb2 = dev.put(b2) if dual else gb
    vec = gemm_vec(k, n, *(_Ptr(x) for x in (ga, gb, gb2))) if vec is None else vec
    src = render_gemm(*tile, dtype=elem, out_f32=out_dtype == np.float32, dual=dual, dual_out=dual_out, vec=vec)
    if source_edit:
        src = source_edit(src)
    fn = emu.compile_module(src, NVRTC_OPTIONS, name="tile_gemm").get_function("ts_gemm")
    c = dev.empty(tuple(batch) + (m, n), out_dtype)
    c2 = dev.empty(tuple(batch) + (m, n), out_dtype) if dual_out else c
    dev.launch(fn, gemm_grid(m, n, tile, nb), gemm_threads(tile, dual), ga, gb, gb2, c, c2, np.int32(m), np.int32(n),
               np.int32(k), np.int64(m * k if a.ndim > 2 else 0), np.int64(k * n if b.ndim > 2 else 0),
               np.int64(m * n), shared_mem=gemm_smem_bytes(*tile, dual=dual) + smem_delta)
    return (c, c2) if dual_out else c


class _Ptr:
    """A host array seen as a device array by gemm_vec (``.data.ptr``)."""

    def __init__(self, a):
        self.data = type("P", (), {"ptr": a.ctypes.data})()


def _exact(got, want32, out_dtype):
    np.testing.assert_array_equal(got.view(np.uint8), want32.astype(out_dtype).view(np.uint8))


@pytest.mark.parametrize("tile", sorted(GEMM_CONFIGS))
def test_every_config_is_bit_exact(tile):
    """Ragged M, N and K (a K tail inside a k tile, more k tiles than stages), f16."""
    m, k, n = tile[0] + 37, 7 * tile[2] + 24, tile[1] + 40
    a, b = rnd((m, k), seed=1), rnd((k, n), seed=2)
    _exact(run_gemm(a, b, tile), exact_gemm(a, b), np.float16)


@pytest.mark.parametrize("dtype, out", [(np.float16, np.float32), (BF16, None), (BF16, np.float32)],
                         ids=["f16-f32", "bf16-bf16", "bf16-f32"])
def test_dtypes_and_batches(dtype, out):
    a, b = rnd((3, 70, 96), dtype, seed=3), rnd((3, 96, 88), dtype, seed=4)
    want = exact_gemm(a, b)
    _exact(run_gemm(a, b, (64, 64, 32), out_dtype=out), want, np.dtype(out or dtype))
    b1 = rnd((96, 88), dtype, seed=5)                   # a matrix shared by every batch entry
    _exact(run_gemm(a, b1, (128, 64, 32), out_dtype=out), exact_gemm(a, b1), np.dtype(out or dtype))


@pytest.mark.parametrize("k, n, vec", [(200, 72, 8), (100, 36, 4), (98, 38, 2), (99, 37, 1)])
def test_narrow_copies_for_widths_not_multiple_of_8(k, n, vec):
    """K and N pick the copy width: 16-, 8-, 4-byte cp.async, or plain loads for odd widths."""
    a, b = rnd((45, k), seed=6), rnd((k, n), seed=7)
    assert gemm_vec(k, n) == vec
    _exact(run_gemm(a, b, (64, 64, 32)), exact_gemm(a, b), np.float16)


def test_misaligned_operands_take_narrower_copies():
    """A view starting 4 bytes into its buffer is read in place with 4-byte copies."""
    a, b = rnd((40, 64), seed=8), rnd((64, 48), seed=9)
    dev = Device()
    ga = dev.put(np.concatenate([np.zeros(2, np.float16), a.ravel()]))[2:].reshape(a.shape)
    assert gemm_vec(64, 48, _Ptr(ga)) == 2
    with pytest.raises(emu.MisalignedAccess, match="cp.async.cg.shared.global of 16 bytes"):
        _run_with(dev, ga, b, vec=8)
    np.testing.assert_array_equal(_run_with(dev, ga, b, vec=2), exact_gemm(a, b).astype(np.float16))


def _run_with(dev, ga, b, vec):
    m, k, n = ga.shape[0], ga.shape[1], b.shape[1]
    tile = (64, 64, 32)
    fn = emu.compile_module(render_gemm(*tile, vec=vec), NVRTC_OPTIONS, name="tile_gemm").get_function("ts_gemm")
    gb, c = dev.put(b), dev.empty((m, n), np.float16)
    dev.launch(fn, gemm_grid(m, n, tile), gemm_threads(tile), ga, gb, gb, c, c, np.int32(m), np.int32(n), np.int32(k),
               np.int64(0), np.int64(0), np.int64(m * n), shared_mem=gemm_smem_bytes(*tile))
    return c


@pytest.mark.parametrize("tile", sorted(DUAL_CONFIGS))
def test_dual_forms(tile):
    """DUAL_OUT writes both products exactly; the SwiGLU epilogue is silu(x@w1) * (x@w3) of them."""
    x, w1, w3 = rnd((tile[0] + 5, 96)), rnd((96, tile[1] + 24), seed=3, scale=0.2), rnd((96, tile[1] + 24), seed=4, scale=0.2)
    h1, h3 = exact_gemm(x, w1), exact_gemm(x, w3)
    c1, c3 = run_gemm(x, w1, tile, b2=w3, dual_out=True)
    _exact(c1, h1, np.float16)
    _exact(c3, h3, np.float16)
    got = run_gemm(x, w1, tile, b2=w3, out_dtype=np.float32)
    np.testing.assert_allclose(got, h1 / (1 + np.exp(-h1)) * h3, rtol=1e-6, atol=1e-7)     # expf vs NumPy's exp
    want64 = K.swiglu(x.astype(np.float64), w1.astype(np.float64), w3.astype(np.float64))
    np.testing.assert_allclose(run_gemm(x, w1, tile, b2=w3).astype(np.float64), want64, rtol=2e-2, atol=2e-2)


def test_dynamic_shared_memory_is_what_the_formula_says():
    """Every stage is used once K has more tiles than stages: 16 bytes less is out of bounds."""
    a, b = rnd((70, 160), seed=1), rnd((160, 72), seed=2)
    with pytest.raises(emu.OutOfBounds, match=r"destination is not inside the block's shared memory \(0 static \+ "
                                              r"32752 dynamic bytes\)"):
        run_gemm(a, b, (64, 64, 32), smem_delta=-16)


# ------------------------------------------------------------------------------ planted bugs

def _edit(old, new):
    def edit(src):
        assert src.count(old) == 1, old
        return src.replace(old, new)
    return edit


PLANTED_WRONG_NUMBERS = {
    # ldmatrix for B without .trans: each lane gets k-rows where it needs n-columns
    "B without .trans": _edit("ts_ldsm_x4_t(bf, ", "ts_ldsm_x4(bf, "),
    # A read unswizzled while cp.async wrote it swizzled
    "A read unswizzled": _edit("ts_swz<BK / 8>(wm0 + i * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)",
                               "(wm0 + i * 16 + (lane & 15)) * BK + kk * 16 + (lane >> 4) * 8"),
    # lanes 8-15 pass rows 0-7 again: A's rows 8-15 never reach the fragments
    "A lane rows": _edit("wm0 + i * 16 + (lane & 15), kk", "wm0 + i * 16 + (lane & 7), kk"),
    # the n halves of a B pair swapped
    "B pair order": _edit("ts_mma(acc[b][i][j], af[i], bf);", "ts_mma(acc[b][i][j], af[i], bf + 2);"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_WRONG_NUMBERS))
def test_planted_fragment_bugs_give_wrong_numbers(bug):
    a, b = rnd((70, 96), seed=1), rnd((96, 72), seed=2)
    want = exact_gemm(a, b).astype(np.float16)
    got = run_gemm(a, b, (64, 64, 32), source_edit=PLANTED_WRONG_NUMBERS[bug])
    assert not np.array_equal(got, want)
    assert np.abs(got.astype(np.float64) - want).max() > 0.5


WAIT = "    ts_cp_async_wait<STAGES - 2>();       // tile kt landed for this thread (groups 1..kt+1 retired) ...\n"
BARRIER = "    __syncthreads();                      // ... and for every thread"
REFILL = "    load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);   // refill tile kt-1's stage\n"


@pytest.mark.parametrize("bug, edit, errors", [
    ("no wait", _edit(WAIT, "    // (wait dropped)\n"), emu.AsyncCopyError),
    ("wait one group short", _edit(WAIT, "    ts_cp_async_wait<STAGES - 1>();\n"), emu.AsyncCopyError),
    ("no barrier", _edit(BARRIER, "    // (barrier dropped)"), (emu.RaceError, emu.AsyncCopyError)),
    ("refill before the barrier", lambda src: _edit(WAIT, REFILL + WAIT)(_edit(REFILL, "")(src)),
     (emu.RaceError, emu.AsyncCopyError)),
])
def test_planted_pipeline_bugs_fail_in_the_harness(bug, edit, errors):
    a, b = rnd((70, 160), seed=1), rnd((160, 72), seed=2)
    with pytest.raises(errors, match=r"kernel ts_gemm block"):
        run_gemm(a, b, (64, 64, 32), source_edit=edit)
