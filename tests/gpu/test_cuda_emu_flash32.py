"""The f32 flash attention kernels (flash_f32_cuda: TF32 tensor cores, 3xTF32) in the emulation
harness against float64.

Launched as attention_cuda launches them, at the shapes where every edge shows (ragged tails,
grouped-query heads, Sq != Sk with the causal diagonal at the end, rows that see no key, head
dims 64, 96, 128 and one that is no multiple of 16, heads read in place from a projection).
"f32" (3xTF32) must be as accurate as f32 itself, under both of the harness's models of the
MMA's summation; "tf32" (1xTF32, the "high" precision) measurably less; the backward must
give the same bits whatever the block order.  Planted bugs in the fragments, the split and
the pipeline must fail, as numbers the comparison rejects or as a harness error.
"""
import numpy as np
import pytest

from tessera_rt.kernels.flash_f32_cuda import render_flash32

import cuda_emu as emu
from emu_helpers import Device, build, needs_compiler, rnd
from flash_launch import FLASH32, backward, forward, reference

pytestmark = needs_compiler
F32_TOL = 2e-6          # tests/kernels/test_gpu.py::test_f32_attention_is_f32's bar


def module(d, precision="f32", edit=None):
    src = render_flash32(d, precision)
    return build(edit(src) if edit else src, f"flash_attention_{precision}")


def rel_err(got, want):
    """Largest error relative to the larger of 1 and the largest entry (test_gpu's measure);
    inf unless the same entries are finite (lse = -inf where a row sees no key)."""
    got = np.asarray(got, np.float64)
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), fin):
        return float("inf")
    return float(np.max(np.abs(got[fin] - want[fin])) / max(1.0, np.max(np.abs(want[fin]))))


def run(case, precision="f32", accumulation="nearest", edit=None, layout="bhsd"):
    """(errors of o, lse, dq, dk, dv against float64, the gradients, a second backward's)."""
    b, h, hkv, sq, sk, d, causal = case
    mod = module(d, precision, edit)
    before = mod.set_tf32_accumulation(accumulation)
    try:
        dev = Device()
        if layout == "bshd":           # heads read in place: (B, S, H, D) memory seen as (B, H, S, D)
            host = [rnd((b, s, n, d), np.float32, seed=i) for i, (s, n) in enumerate(((sq, h), (sk, hkv), (sk, hkv),
                                                                                       (sq, h)), 1)]
            gq, gk, gv, gdo = (dev.put(t).transpose(0, 2, 1, 3) for t in host)
            q, k, v, do = (t.transpose(0, 2, 1, 3) for t in host)
        else:
            q, k, v, do = (rnd(s, np.float32, seed=i) for i, s in enumerate(((b, h, sq, d), (b, hkv, sk, d),
                                                                             (b, hkv, sk, d), (b, h, sq, d)), 1))
            gq, gk, gv, gdo = (dev.put(t) for t in (q, k, v, do))
        o, lse = forward(dev, mod, gq, gk, gv, causal, FLASH32)
        assert o.strides == gq.strides
        grads = backward(dev, mod, gq, gk, gv, o, gdo, lse, causal, FLASH32)
        again = backward(dev, mod, gq, gk, gv, o, gdo, lse, causal, FLASH32)
    finally:
        mod.set_tf32_accumulation(before)
    wo, wl, wgrads = reference(q, k, v, do, causal)
    errs = [rel_err(got, want) for got, want in [(o, wo), (lse, wl), *zip(grads, wgrads)]]
    return errs, grads, again


CASES = [  # b, h, hkv, sq, sk, d, causal
    (1, 4, 2, 150, 90, 64, True),       # GQA, Sq > Sk: the first 60 queries see no key
    (2, 2, 1, 70, 200, 64, False),      # Sk > Sq, ragged tails, several K/V tiles
    (1, 2, 2, 130, 130, 128, True),     # head dim 128, two query blocks
    (1, 6, 2, 33, 47, 96, True),        # head dim 96 (the 128 bucket's tiles)
    (1, 2, 1, 40, 70, 40, False),       # head dim 40: k8 steps, no multiple of 16
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}k{c[4]}d{c[5]}{'c' if c[6] else ''}")
def test_f32_forward_and_backward_are_f32_accurate_and_deterministic(case):
    errs, grads, again = run(case)
    assert max(errs) < F32_TOL, errs
    for x, y in zip(grads, again):                     # no atomics: the same bits, whatever the block order
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["d64", "d128"])
def test_f32_stays_f32_accurate_under_truncating_accumulation(case):
    """With the A100 model of the MMA's summation (aligned without guard bits, truncated toward
    zero): each tile's products are summed from zero and then added in f32, so truncation acts
    on a tile's sum, not on the running total; the errors stay at f32's level."""
    errs, _, _ = run(case, accumulation="truncate")
    assert max(errs) < 1e-6, errs


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["d64", "d128"])
def test_tf32_is_measurably_tf32(case):
    """precision "tf32" (1xTF32, the float32 matmul precision "high"): TF32's 10 mantissa bits."""
    errs, _, _ = run(case, "tf32")
    assert 1e-5 < max(errs) < 3e-3, errs


def test_heads_read_in_place_from_a_projection():
    errs, _, _ = run((2, 4, 2, 70, 70, 64, True), layout="bshd")
    assert max(errs) < F32_TOL, errs


# ------------------------------------------------------------------------------ planted bugs

def _edit(old, new, count=1):
    def edit(src):
        assert src.count(old) == count, old
        return src.replace(old, new)
    return edit


BUGS = {
    # the C fragment fed as an A fragment unpermuted: P's columns 2t+1 and 2t+8.. land on the wrong keys
    "c_to_a unpermuted": (_edit("const float r[4] = {c[0], c[2], c[1], c[3]};", "const float r[4] = {c[0], c[1], c[2], c[3]};"),
                          0.05),
    # V read at rows t, t+4 (the ISA's B rows) while P's k is permuted to 2t, 2t+1
    "V rows unpermuted": (_edit("const float* p = s + (k0 + 2 * (lane & 3)) * LD + n0 + (lane >> 2);\n"
                                "  const float r[2] = {p[0], p[LD]};",
                                "const float* p = s + (k0 + (lane & 3)) * LD + n0 + (lane >> 2);\n"
                                "  const float r[2] = {p[0], p[4 * LD]};"), 0.05),
    # K by the A lane pattern: the two n8 tiles and the two k halves of the x4 swap
    "K lane pattern": (_edit("s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + c0 + (((lane >> 3) & 1) << 2)",
                             "s + (n0 + (lane & 15)) * LD + c0 + ((lane >> 4) << 2)"), 0.05),
    # 3xTF32 without the lo parts: TF32's rounding, well above the f32 bar
    "lo dropped": (_edit("lo = ts_tf32(x - __uint_as_float(hi));", "lo = 0u;"), F32_TOL),
    # f32 bits passed to the MMA unconverted (the tensor core truncates them), lo zero
    # tiles filled unpadded but read padded: the reads meet never-written (NaN-poisoned) bytes
    "row stride D": (_edit("ts_cp_async<16>(s + r * LD + c,", "ts_cp_async<16>(s + r * D + c,"), 0.05),
    "no cvt": (_edit("ts_split_tf32(x[i], f.hi[i], f.lo[i]);", "f.hi[i] = __float_as_uint(x[i]); f.lo[i] = 0u;"), F32_TOL),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_fragment_and_split_bugs_give_wrong_numbers(bug):
    edit, floor = BUGS[bug]
    errs, _, _ = run((1, 2, 1, 100, 140, 64, False), edit=edit)
    assert max(errs) > floor, errs


FWD_WAIT = "    ts_cp_async_wait<1>();                              // tile it (and Q) retired ...\n"
TRAILING = "    __syncthreads();                                    // every warp is done with stage st\n"


@pytest.mark.parametrize("bug, edit, errors", [
    ("no wait in the K/V loop", _edit(FWD_WAIT, ""), emu.AsyncCopyError),
    ("no trailing barrier", _edit(TRAILING, "", count=2), (emu.RaceError, emu.AsyncCopyError)),
    ("wrong stage", _edit("const float* ks = sK + st * FWD_BN * LD;", "const float* ks = sK + (st ^ 1) * FWD_BN * LD;"),
     emu.AsyncCopyError),
])
def test_planted_pipeline_bugs_fail_in_the_harness(bug, edit, errors):
    with pytest.raises(errors, match=r"kernel ts_flash_(fwd|bwd_dkdv|bwd_dq)"):
        run((1, 2, 1, 100, 140, 64, False), edit=edit)
