"""The pipelined grouped GEMM (grouped_gemm_src) in the emulation harness, bit for bit.

Every launch here is the launcher's (grouped_gemm_cuda.grouped_launch): its tile, warps, copy
width, dynamic shared memory and grid, with the blocks run in a shuffled order.  The harness
computes each mma.sync as the PTX ISA's fragments say, in f32 in k order, so each output has
one exact answer: ``exact_gemm`` over the group's rows (the forward) or the group's rows as the
reduction (the weight gradient), continued over the second product for the sum form, rounded
once.  Outputs start as a 0xA5 pattern, so a row no block writes shows.  Planted bugs: a wrong
group boundary in the device scan, lost partial tiles, a missing or short cp.async wait, and
fragments read without .trans or with the wrong lane addresses.
"""
import ml_dtypes
import numpy as np
import pytest

from tessera_rt.kernels.grouped_gemm_cuda import grouped_tile, grouped_vec
from tessera_rt.kernels.grouped_gemm_src import grouped_smem_bytes, grouped_threads, grouped_tiles_m, render_grouped_mma

import cuda_emu as emu
from emu_helpers import NVRTC_OPTIONS, Device, needs_compiler, rnd
from test_cuda_emu_gemm import BARRIER, WAIT, _edit, _Ptr, exact_gemm

pytestmark = needs_compiler
BF16 = np.dtype(ml_dtypes.bfloat16)


def offsets(sizes):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def exact_grouped(pairs, off, trans=False):
    """sum over (x_i, w_i) of x_i[rows of g] @ w_i[g], one f32 accumulator in k order per output."""
    x0, w0 = pairs[0]
    n = w0.shape[1] if trans else w0.shape[2]
    y = np.zeros((x0.shape[0], n), np.float32)
    for g in range(len(off) - 1):
        lo, hi = off[g], off[g + 1]
        a = np.concatenate([x[lo:hi] for x, _ in pairs], axis=1)
        b = np.concatenate([np.swapaxes(w[g], 0, 1) if trans else w[g] for _, w in pairs], axis=0)
        y[lo:hi] = exact_gemm(a, b)
    return y


def exact_wgrad(x, dy, off):
    return np.stack([exact_gemm(x[off[g]:off[g + 1]].T, dy[off[g]:off[g + 1]]) for g in range(len(off) - 1)])


def _on(dev, t):
    """Is ``t`` (a view, maybe) inside one of the device's arrays?"""
    return any(d.ctypes.data <= t.ctypes.data < d.ctypes.data + max(d.nbytes, 1) for d in dev.arrays)


def run(a, b, off, *, mode="plain", wgrad=False, trans_w=False, a2=None, b2=None, out_f32=False, tile=None, vec=None,
        source_edit=None, dev=None, seed=None):
    """Launch ts_grouped_mma as grouped_launch does; returns C, or (C, C2) for mode "dual"."""
    dev = dev or Device()
    put = lambda t: None if t is None else (t if _on(dev, t) else dev.put(t))
    ga, gb, ga2, gb2, goff = (put(t) for t in (a, b, a2, b2, off))
    g = len(off) - 1
    if wgrad:
        rows, m, n, k = a.shape[0], a.shape[1], b.shape[1], a.shape[0]
        shape = (g, m, n)
    else:
        rows, k = a.shape
        n, m = (b.shape[1] if trans_w else b.shape[2]), rows
        shape = (rows, n)
    widths = (m, n) if wgrad else (k,) if trans_w else (k, n)
    vec = grouped_vec(widths, *(_Ptr(t) for t in (ga, gb, ga2, gb2) if t is not None)) if vec is None else vec
    dual = mode in ("dual", "swiglu")
    tile = tile or grouped_tile(rows, g, dual=dual, wgrad=wgrad, vec=vec)
    cfg = dict(BM=tile[0], BN=tile[1], BK=tile[2], mode=mode, wgrad=wgrad, trans_w=trans_w, vec=vec, out_f32=out_f32,
               dtype="bf16" if a.dtype == BF16 else "f16")
    src = render_grouped_mma(**cfg)
    if source_edit:
        src = source_edit(src)
    fn = emu.compile_module(src, NVRTC_OPTIONS, name="grouped_gemm").get_function("ts_grouped_mma")
    out_dt = np.float32 if out_f32 else a.dtype
    c = dev.empty(shape, out_dt)
    c2 = dev.empty(shape, out_dt) if mode == "dual" else None
    blocks = grouped_tiles_m(m, g, tile[0], wgrad) * -(-n // tile[1])
    null = np.uint64(0)
    args = [ga, gb, null if ga2 is None else ga2, null if gb2 is None else gb2, c, null if c2 is None else c2, goff,
            np.int32(g), np.int32(m), np.int32(n), np.int32(k)]
    buffers = [(t.ctypes.data, t.nbytes) for t in dev.arrays]
    fn.launch((blocks, 1, g if wgrad else 1), grouped_threads(**cfg), [dev.pack(v) for v in args],
              shared_mem=grouped_smem_bytes(**cfg), buffers=buffers, seed=seed)
    return (c, c2) if mode == "dual" else c


def same_bits(got, want32, dtype):
    want = want32.astype(dtype)
    bad = np.argwhere(got.view(np.uint8).reshape(got.shape + (-1,)) != want.view(np.uint8).reshape(want.shape + (-1,)))
    assert bad.size == 0, f"{len(bad)} bytes differ, first at {tuple(bad[0][:-1])}: got {got[tuple(bad[0][:-1])]}, " \
                          f"want {want[tuple(bad[0][:-1])]}"


# ragged groups: empty first / middle / last, one row, partial and whole tiles, several tiles
RAGGED = [0, 5, 200, 0, 129, 1, 0]


@pytest.mark.parametrize("tile", [(128, 128, 32), (64, 128, 32)])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
def test_forward_is_bit_exact(tile, trans_w):
    """K with a tail inside a k tile and more k tiles than stages, N with a column tail."""
    off = offsets(RAGGED)
    k, n = 7 * 32 + 24, tile[1] + 40
    x, w = rnd((int(off[-1]), k), seed=1), rnd((len(RAGGED), k, n), seed=2, scale=0.3)
    want = exact_grouped([(x, w)], off)
    wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    same_bits(run(x, wt if trans_w else w, off, trans_w=trans_w, tile=tile), want, np.float16)


@pytest.mark.parametrize("out_f32", [False, True], ids=["bf16", "f32-out"])
def test_bf16_and_small_groups(out_f32):
    """Groups averaging a few rows take the launcher's 64-row tiles; bf16, bf16 or f32 out."""
    sizes = [3, 0, 1, 7, 0, 2, 64, 0]
    off = offsets(sizes)
    x, w = rnd((int(off[-1]), 96), BF16, seed=3), rnd((len(sizes), 96, 72), BF16, seed=4, scale=0.3)
    assert grouped_tile(int(off[-1]), len(sizes), dual=False, wgrad=False) == (64, 128, 32)
    same_bits(run(x, w, off, out_f32=out_f32), exact_grouped([(x, w)], off), np.float32 if out_f32 else BF16)


def test_many_groups_cross_the_scans_32_group_steps():
    """70 groups (three steps of the warp scan), the first 40 empty save two, random sizes."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 40, 70)
    sizes[:40] = 0
    sizes[[7, 33]] = [1, 130]
    off = offsets(sizes)
    x, w = rnd((int(off[-1]), 32), seed=6), rnd((70, 32, 16), seed=7)
    same_bits(run(x, w, off, tile=(64, 128, 32)), exact_grouped([(x, w)], off), np.float16)


@pytest.mark.parametrize("tile", [(128, 128, 32), (64, 128, 32)])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
def test_sum_of_two_products_continues_one_accumulator(tile, trans_w):
    off = offsets([3, 0, 150, 18])
    r, k, n = int(off[-1]), 80, 136
    a1, a2 = rnd((r, k), seed=8), rnd((r, k), seed=9)
    w1, w2 = rnd((4, n, k), seed=10, scale=0.2), rnd((4, n, k), seed=11, scale=0.2)      # (N, K) each
    want = exact_grouped([(a1, w1), (a2, w2)], off, trans=True)
    if not trans_w:
        w1, w2 = (np.ascontiguousarray(np.swapaxes(w, 1, 2)) for w in (w1, w2))
    same_bits(run(a1, w1, off, trans_w=trans_w, a2=a2, b2=w2, mode="sum2", tile=tile), want, np.float16)


@pytest.mark.parametrize("tile", [(128, 128, 32), (64, 64, 32)])
def test_dual_and_swiglu(tile):
    off = offsets(RAGGED)
    r, k, n = int(off[-1]), 96, tile[1] + 24
    x, w1, w3 = rnd((r, k), seed=12), rnd((7, k, n), seed=13, scale=0.2), rnd((7, k, n), seed=14, scale=0.2)
    h1, h3 = exact_grouped([(x, w1)], off), exact_grouped([(x, w3)], off)
    c1, c3 = run(x, w1, off, b2=w3, mode="dual", tile=tile)
    same_bits(c1, h1, np.float16)
    same_bits(c3, h3, np.float16)
    got = run(x, w1, off, b2=w3, mode="swiglu", tile=tile, out_f32=True)
    np.testing.assert_allclose(got, h1 / (1 + np.exp(-h1)) * h3, rtol=1e-6, atol=1e-7)     # expf vs NumPy's exp


@pytest.mark.parametrize("dtype, out_f32", [(np.float16, False), (BF16, False), (np.float16, True)],
                         ids=["f16", "bf16", "f32-out"])
def test_weight_gradient_reduces_over_the_groups_rows(dtype, out_f32):
    """dw[g] = x[rows of g].T @ dy[rows of g]: rows starting mid k tile, a group over several k tiles
    (more than the stages), M and N tails, empty groups all zeros."""
    off = offsets([0, 37, 300, 0, 5, 0])
    r, m, n = int(off[-1]), 128 + 40, 128 + 24
    x, dy = rnd((r, m), dtype, seed=15), rnd((r, n), dtype, seed=16)
    want = exact_wgrad(x, dy, off)
    got = run(x, dy, off, wgrad=True, out_f32=out_f32)
    same_bits(got, want, np.float32 if out_f32 else dtype)
    assert not got[[0, 3, 5]].any()


def test_weight_gradient_dual_reads_x_once():
    off = offsets([10, 0, 70])
    x, dy, dy2 = rnd((80, 64), seed=17), rnd((80, 48), seed=18), rnd((80, 48), seed=19)
    d1, d2 = run(x, dy, off, wgrad=True, mode="dual", b2=dy2)
    same_bits(d1, exact_wgrad(x, dy, off), np.float16)
    same_bits(d2, exact_wgrad(x, dy2, off), np.float16)


@pytest.mark.parametrize("k, n, vec", [(100, 36, 4), (98, 38, 2), (99, 37, 1)])
@pytest.mark.parametrize("form", ["forward", "trans_w", "wgrad"])
def test_narrow_copies_for_widths_not_multiple_of_8(k, n, vec, form):
    off = offsets([0, 9, 70, 0, 2])
    r, g = int(off[-1]), 5
    if form == "wgrad":
        x, dy = rnd((r, k), seed=20), rnd((r, n), seed=21)
        assert grouped_vec((k, n)) == vec
        same_bits(run(x, dy, off, wgrad=True), exact_wgrad(x, dy, off), np.float16)
        return
    x, w = rnd((r, k), seed=22), rnd((g, k, n), seed=23, scale=0.3)
    want = exact_grouped([(x, w)], off)
    if form == "trans_w":       # only K is a copied row's width
        assert grouped_vec((k,)) == vec
        same_bits(run(x, np.ascontiguousarray(np.swapaxes(w, 1, 2)), off, trans_w=True), want, np.float16)
    else:
        assert grouped_vec((k, n)) == vec
        same_bits(run(x, w, off), want, np.float16)


def test_misaligned_operand_takes_narrower_copies():
    """x viewed 4 bytes into its buffer: 16-byte cp.async faults, the launcher's width (2) is exact."""
    off = offsets([20, 0, 20])
    x, w = rnd((40, 64), seed=24), rnd((3, 64, 48), seed=25)
    dev = Device()
    gx = dev.put(np.concatenate([np.zeros(2, np.float16), x.ravel()]))[2:].reshape(x.shape)
    assert grouped_vec((64, 48), _Ptr(gx)) == 2
    with pytest.raises(emu.MisalignedAccess, match="cp.async.cg.shared.global of 16 bytes"):
        run(gx, w, off, dev=dev, vec=8, tile=(64, 64, 32))
    same_bits(run(gx, w, off, dev=dev), exact_grouped([(x, w)], off), np.float16)


def test_no_groups_rows_and_block_order_do_not_matter():
    """All groups empty: every block returns and nothing is written; any block order, same bits."""
    off = offsets([0, 0, 0])
    x, w = np.zeros((0, 32), np.float16), rnd((3, 32, 24), seed=26)
    assert run(x, w, off).shape == (0, 24)
    off = offsets([50, 3, 90])
    x, w = rnd((143, 64), seed=27), rnd((3, 64, 40), seed=28)
    a, b = run(x, w, off, seed=1), run(x, w, off, seed=2)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ------------------------------------------------------------------------------ planted bugs

PLANTED_WRONG_NUMBERS = {
    # the warp scan skips one partner: running totals, so group boundaries, come out wrong
    "scan boundary": ("fwd", _edit("if (lane >= d) incl += v;", "if (lane > d) incl += v;")),
    # partial tiles dropped from each group's count: tail rows belong to no block
    "floor tiles": ("fwd", _edit("(hi - lo + bm - 1) / bm", "(hi - lo) / bm")),
    # a tile's first row counted from the step's start, not its group's first tile
    "row0 offset": ("fwd", _edit("(t - before - first) * bm", "(t - before) * bm")),
    # the gradient's x.T read without .trans: each lane gets m-rows where it needs k-pairs
    "A_KM without .trans": ("wgrad", _edit("ts_ldsm_x4_t(af[i], ", "ts_ldsm_x4(af[i], ")),
    # (N, K) weights: lanes 8-23 pass the wrong k half, so two of the four 8x8 matrices are wrong
    "B_NK k halves": ("trans", _edit("kk * 16 + ((lane >> 3) & 1) * 8));", "kk * 16 + ((lane >> 4) & 1) * 8));")),
    # the gradient's group rows start at the group before's
    "wgrad group rows": ("wgrad", _edit("j.k_lo = off[j.g];", "j.k_lo = off[j.g > 0 ? j.g - 1 : 0];")),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_WRONG_NUMBERS))
def test_planted_bugs_give_wrong_numbers(bug):
    form, edit = PLANTED_WRONG_NUMBERS[bug]
    off = offsets([2, 5, 150, 0, 37, 1, 0] if form == "fwd" else [0, 37, 90, 0, 5])
    r = int(off[-1])
    if form == "wgrad":
        x, dy = rnd((r, 72), seed=30), rnd((r, 40), seed=31)
        want, got = exact_wgrad(x, dy, off), run(x, dy, off, wgrad=True, source_edit=edit)
    else:
        x, w = rnd((r, 96), seed=32), rnd((len(off) - 1, 96, 72), seed=33)
        wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
        want = exact_grouped([(x, w)], off)
        got = run(x, wt if form == "trans" else w, off, trans_w=form == "trans", tile=(64, 128, 32), source_edit=edit)
    got = got.astype(np.float64)
    assert not np.array_equal(got, want.astype(np.float16))
    assert np.nanmax(np.where(np.isfinite(got), np.abs(got - want), np.inf)) > 0.5


# the main loop is the tile GEMM's, line for line: its WAIT and BARRIER lines are planted the same way
@pytest.mark.parametrize("form", ["forward", "wgrad"])
@pytest.mark.parametrize("bug, edit, errors", [
    ("no wait", _edit(WAIT, "    // (wait dropped)\n"), emu.AsyncCopyError),
    ("wait one group short", _edit(WAIT, "    ts_cp_async_wait<STAGES - 1>();\n"), emu.AsyncCopyError),
    ("no barrier", _edit(BARRIER, "    // (barrier dropped)"), (emu.RaceError, emu.AsyncCopyError)),
])
def test_planted_pipeline_bugs_fail_in_the_harness(form, bug, edit, errors):
    off = offsets([0, 70, 0, 130])
    r = int(off[-1])
    with pytest.raises(errors, match=r"kernel ts_grouped_mma block"):
        if form == "wgrad":
            run(rnd((r, 64), seed=34), rnd((r, 72), seed=35), off, wgrad=True, source_edit=edit)
        else:
            run(rnd((r, 160), seed=36), rnd((4, 160, 72), seed=37), off, source_edit=edit)
