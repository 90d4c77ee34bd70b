"""Paged decode attention's kernels (kernels.paged_attention_cuda: grouped-query blocks, 16-byte
page reads, partitions and their combine) against the float64 reference, on a GPU or in the
CUDA emulation harness under the CuPy stand-in: long contexts over many partitions, sliding
windows (partitions before and after the window empty), empty sequences, every group size a
block takes (1 to 8 query heads, and two blocks per kv head), head dims 32-256, f16/bf16/f32
pages, page sizes that are not powers of two, launch counts and the same bits on a rerun."""
import numpy as np
import pytest

from tessera_rt.dtypes import resolve_dtype
from tessera_rt.kernels import paged_attention as R, paged_attention_cuda as PC

from test_gpu import cp
from test_grouped_gemm_gpu import MANT, dev, host  # device copies and ulps of f16/bf16/f32

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]

BF16 = resolve_dtype("bf16")


def case(b, h, hkv, d, bs, lens, starts=None, dtype=np.float16, seed=0):
    """Inputs with pages in a shuffled order and -1 past each sequence (and before its window)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    mb = max(1, -(-int(lens.max()) // bs))
    nb = b * mb + 3
    perm = rng.permutation(nb)
    tables = np.full((b, mb), -1, np.int32)
    for i in range(b):
        used = -(-int(lens[i]) // bs)
        tables[i, :used] = perm[i * mb:i * mb + used]
        if starts is not None:
            tables[i, :int(starts[i]) // bs] = -1          # pages wholly before the window: dropped
    q = rng.standard_normal((b, h, d)).astype(dtype)
    kp = rng.standard_normal((nb, hkv, bs, d)).astype(dtype)
    vp = rng.standard_normal((nb, hkv, bs, d)).astype(dtype)
    st = None if starts is None else np.asarray(starts, np.int32)
    return q, kp, vp, tables, lens, st


def run(q, kp, vp, tables, lens, st, **kw):
    args = [dev(q), dev(kp), dev(vp), cp.asarray(tables), cp.asarray(lens)]
    with cp.testing.count_device_work() as work:
        got = PC.paged_decode_attention_cuda(*args, seq_starts=None if st is None else cp.asarray(st), **kw)
    return got, work


def check(got, q, kp, vp, tables, lens, st):
    f = lambda t: t.astype(np.float64)
    want = R.paged_decode_attention(f(q), f(kp), f(vp), tables, lens, seq_starts=st)
    g = host(got).astype(np.float64)
    mant = MANT[np.dtype(q.dtype)]
    e = np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -14)))
    # the output's rounding (half an ulp) plus the f32 softmax and sums (exp2 of f32 scores)
    bound = 0.5 * 2.0 ** (e - mant) * 1.001 + 2e-6 * np.abs(f(vp)).max() * 8
    err = np.abs(g - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    return want


@pytest.fixture
def sms(monkeypatch):
    """Set the SM count paged_plan sees (more SMs: shorter partitions, more of them)."""
    def set_(n):
        monkeypatch.setattr(PC, "plan_sm_count", lambda: n)
    return set_


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("h,hkv", [(8, 2), (4, 4), (16, 1), (6, 3)], ids=["g4", "g1", "g16", "g2"])
def test_long_contexts_over_partitions(dtype, h, hkv, sms):
    # 600 keys in partitions of 64 (10 of them), a sequence of 1 key, one of 0, a window
    sms(10_000)
    q, kp, vp, tables, lens, st = case(4, h, hkv, 64, 16, [600, 1, 0, 333], [0, 0, 0, 70], dtype, seed=h)
    got, work = run(q, kp, vp, tables, lens, st)
    assert work.syncs == 0 and work.launches == 2, work.report()          # partitions + combine
    assert got.dtype == dtype and got.shape == q.shape
    check(got, q, kp, vp, tables, lens, st)
    assert not host(got)[2].astype(np.float64).any()                        # no keys: zeros


@pytest.mark.parametrize("d", [32, 128, 256])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
def test_head_dims_one_partition(d, dtype, sms):
    sms(1)                                       # few SMs: one partition, the output written directly
    q, kp, vp, tables, lens, st = case(2, 8, 2, d, 16, [37, 200], None, dtype, seed=d)
    got, work = run(q, kp, vp, tables, lens, st)
    assert work.launches == 1, work.report()
    check(got, q, kp, vp, tables, lens, st)


def test_page_size_not_a_power_of_two_and_a_late_window(sms):
    sms(10_000)
    # window starts mid-page (page size 12) and one sequence's window is empty (start == len)
    q, kp, vp, tables, lens, st = case(3, 4, 2, 64, 12, [300, 50, 90], [125, 50, 7], np.float16, seed=5)
    got, _ = run(q, kp, vp, tables, lens, st, scale=0.3)
    f = lambda t: t.astype(np.float64)
    want = R.paged_decode_attention(f(q), f(kp), f(vp), tables, lens, seq_starts=st, scale=0.3)
    np.testing.assert_allclose(host(got).astype(np.float64), want, rtol=2e-3, atol=2e-3)
    assert not host(got)[1].astype(np.float64).any()


def test_same_bits_on_a_rerun(sms):
    sms(10_000)
    args = case(2, 8, 2, 128, 16, [700, 513], [0, 100], BF16, seed=7)
    a, _ = run(*args)
    b, _ = run(*args)
    assert np.array_equal(host(a).view(np.uint16), host(b).view(np.uint16))


def test_plan_fills_the_device_and_caps_partitions():
    # few sequences and heads: partitions of 64 so every SM gets 4 blocks; many: 256
    assert PC.paged_plan(1, 8, 2048, 132) == (64, 32)
    assert PC.paged_plan(16, 8, 2048, 132) == (256, 8)
    assert PC.paged_plan(128, 8, 200, 132) == (256, 1)             # one partition: no combine
    assert PC.paged_plan(2, 2, 40, 132) == (64, 1)


def test_out_and_kernel_table_entry():
    from tessera_rt.backend import get_backend
    q, kp, vp, tables, lens, st = case(2, 4, 2, 64, 16, [20, 33], None, np.float16, seed=9)
    out = cp.empty(q.shape, np.float16)
    got = get_backend().kernel("paged_decode_attention")(dev(q), dev(kp), dev(vp), cp.asarray(tables),
                                                          cp.asarray(lens), out=out)
    assert got is out
    check(got, q, kp, vp, tables, lens, st)
