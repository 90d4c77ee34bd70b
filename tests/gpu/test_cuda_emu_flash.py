"""The flash attention kernels (flash_cuda) in the emulation harness against the NumPy reference.

Launched as attention_cuda launches them (grids, blocks, dynamic shared memory, strides), at
sizes where every edge shows: ragged query and key tails, grouped-query heads, Sq != Sk with
the causal diagonal aligned at the end, rows that see no key, f16 and bf16, head dims 64 and
128, and heads read in place from a (B, S, H*D) projection.  The pipeline's and the
fragments' planted bugs must fail: as a harness error, or as numbers the comparison rejects.
"""
import ml_dtypes
import numpy as np
import pytest

from tessera_rt.kernels.flash_cuda import render_flash

import cuda_emu as emu
from emu_helpers import Device, build, needs_compiler, rnd
from flash_launch import backward, check, forward, reference

pytestmark = needs_compiler
BF16 = np.dtype(ml_dtypes.bfloat16)


def module(d, dtype, edit=None):
    src = render_flash(d, "bf16" if dtype == BF16 else "f16")
    return build(edit(src) if edit else src, "flash_attention")


CASES = [  # b, h, hkv, sq, sk, d, causal, dtype
    (1, 4, 2, 150, 90, 64, True, np.float16),      # GQA, Sq > Sk: the first 60 queries see no key
    (2, 2, 1, 70, 200, 64, False, np.float16),     # Sk > Sq, ragged tails, several K/V tiles
    (1, 2, 2, 130, 130, 128, True, np.float16),    # head dim 128, two query blocks
    (1, 4, 1, 45, 77, 128, True, BF16),
    (1, 2, 1, 200, 150, 64, True, BF16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}k{c[4]}d{c[5]}"
                         f"{'c' if c[6] else ''}-{np.dtype(c[7]).name}")
def test_forward_and_backward_match_the_reference(case):
    b, h, hkv, sq, sk, d, causal, dtype = case
    q, k, v, do = (rnd(s, dtype, seed=i) for i, s in enumerate(((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d),
                                                                (b, h, sq, d)), 1))
    mod = module(d, np.dtype(dtype))
    dev = Device()
    gq, gk, gv, gdo = (dev.put(t) for t in (q, k, v, do))
    o, lse = forward(dev, mod, gq, gk, gv, causal)
    wo, wl, wgrads = reference(q, k, v, do, causal)
    tol = 1e-2 if dtype == np.float16 else 4e-2
    check(o, wo, tol)
    check(lse, wl, 1e-3)
    grads = backward(dev, mod, gq, gk, gv, o, gdo, lse, causal)
    for got, want in zip(grads, wgrads):
        check(got, want, 3 * tol)
    again = backward(dev, mod, gq, gk, gv, o, gdo, lse, causal)
    for x, y in zip(grads, again):                     # no atomics: the same bits, whatever the block order
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


def test_heads_read_in_place_from_a_projection():
    """q, k, v as (B, S, H, D) memory seen as (B, H, S, D): O and dQ in q's layout, dK/dV in k's."""
    b, h, hkv, s, d = 2, 4, 2, 70, 64
    mod = module(d, np.dtype(np.float16))
    dev = Device()
    host = [rnd((b, s, n, d), seed=i) for i, n in enumerate((h, hkv, hkv, h), 1)]
    gq, gk, gv, gdo = (dev.put(t).transpose(0, 2, 1, 3) for t in host)
    o, lse = forward(dev, mod, gq, gk, gv, True)
    assert o.strides == gq.strides
    q, k, v, do = (t.transpose(0, 2, 1, 3) for t in host)
    wo, wl, wgrads = reference(q, k, v, do, True)
    check(o, wo, 1e-2)
    for got, want in zip(backward(dev, mod, gq, gk, gv, o, gdo, lse, True), wgrads):
        check(got, want, 3e-2)


# ------------------------------------------------------------------------------ planted bugs

def _edit(old, new, count=1):
    def edit(src):
        assert src.count(old) == count, old
        return src.replace(old, new)
    return edit


def run_case(edit):
    q, k, v, do = rnd((1, 2, 100, 64), seed=1), rnd((1, 1, 140, 64), seed=2), rnd((1, 1, 140, 64), seed=3), \
        rnd((1, 2, 100, 64), seed=4)
    mod = module(64, np.dtype(np.float16), edit)
    dev = Device()
    gq, gk, gv, gdo = (dev.put(t) for t in (q, k, v, do))
    o, lse = forward(dev, mod, gq, gk, gv, False)
    grads = backward(dev, mod, gq, gk, gv, o, gdo, lse, False)
    wo, _, wgrads = reference(q, k, v, do, False)
    return [(o, wo)] + list(zip(grads, wgrads))


def test_the_unedited_case_passes():
    for got, want in run_case(None):
        check(got, want, 3e-2)


WRONG_NUMBERS = {
    # P V with V loaded without .trans: lanes get key rows where they need head-dim columns
    "V without .trans": _edit("ts_ldsm_x4_t(bf, s + ts_swz<DCH>(k0 + ts_arow(lane), j * 8 + ts_acol(lane)));",
                              "ts_ldsm_x4(bf, s + ts_swz<DCH>(k0 + ts_arow(lane), j * 8 + ts_acol(lane)));"),
    # S = Q K^T reading K with the A pattern: the n halves and k halves of the pair swap
    "K lane pattern": _edit("ts_ldsm_x4(bf, ks + ts_swz<DCH>(j * 8 + ts_brow(lane), kk * 16 + ts_bcol(lane)));",
                            "ts_ldsm_x4(bf, ks + ts_swz<DCH>(j * 8 + ts_arow(lane), kk * 16 + ts_acol(lane)));"),
    # the tile loader writes unswizzled rows that ldmatrix reads swizzled
    "unswizzled fill": _edit("elem_t* dst = s + ts_swz<COLS_ / 8>(r, c);", "elem_t* dst = s + r * COLS_ + c;"),
}


@pytest.mark.parametrize("bug", sorted(WRONG_NUMBERS))
def test_planted_fragment_bugs_give_wrong_numbers(bug):
    results = run_case(WRONG_NUMBERS[bug])
    assert any(np.abs(np.asarray(got, np.float64) - want).max() > 0.1 for got, want in results)


FWD_WAIT = "    ts_cp_async_wait<1>();                              // tile it (group it + 2) retired ...\n"
TRAILING = "    __syncthreads();                                    // every warp is done with stage st\n"


@pytest.mark.parametrize("bug, edit, errors", [
    ("no wait in the K/V loop", _edit(FWD_WAIT, "", count=2), emu.AsyncCopyError),
    ("wait<2> in the K/V loop", _edit(FWD_WAIT, "    ts_cp_async_wait<2>();\n", count=2), emu.AsyncCopyError),
    ("no trailing barrier", _edit(TRAILING, "", count=2), (emu.RaceError, emu.AsyncCopyError)),
    ("no commit of the first K/V tile", _edit("  ts_cp_async_commit();                                 // group 2: K/V tile 0\n",
                                              "", count=2), emu.AsyncCopyError),
    # S = Q K^T reads the other K stage: the one being refilled with the next tile
    ("wrong stage", _edit("const elem_t* ks = sK + st * FWD_BN * D;", "const elem_t* ks = sK + (st ^ 1) * FWD_BN * D;"),
     emu.AsyncCopyError),
])
def test_planted_pipeline_bugs_fail_in_the_harness(bug, edit, errors):
    with pytest.raises(errors, match=r"kernel ts_flash_(fwd|bwd_dkdv)"):
        run_case(edit)
