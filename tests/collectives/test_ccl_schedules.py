"""dist.ccl's line/ring schedules, simulated on one process for 1..8 ranks and uneven chunks:
every rank ends with its reduced chunk (reduce-scatter) or every chunk (all-gather), each
transfer goes between neighbours (the line never uses the wrap-around link), and each rank
sends n-1 chunks (the line's all-gather forwards every chunk both ways: more)."""
import numpy as np
import pytest

from tessera_rt.dist.ccl.schedules import piece_bounds, schedule
from tessera_rt.dist.comm.interface import displacements


def simulate(kind, n, algo, counts, rng):
    offs, total = displacements(counts), sum(counts)
    if kind == "reduce_scatter":
        xs = [rng.integers(-9, 9, total) for _ in range(n)]
        work = [x.copy() for x in xs]
    else:
        ref = rng.integers(-9, 9, total)
        work = [np.full(total, -999) for _ in range(n)]
        for r in range(n):
            work[r][offs[r]:offs[r] + counts[r]] = ref[offs[r]:offs[r] + counts[r]]
    sent = [0] * n
    for step in schedule(kind, n, algo):
        msgs = []
        for src, dst, c, p in step:
            assert dst in ((src + 1) % n, (src - 1) % n)
            if algo == "line":
                assert abs(src - dst) == 1
            lo, hi = piece_bounds(offs, counts, c, p)
            msgs.append((dst, lo, hi, work[src][lo:hi].copy()))
            sent[src] += hi - lo
        for dst, lo, hi, m in msgs:               # all of a step's messages are in flight at once
            if kind == "reduce_scatter":
                work[dst][lo:hi] += m
            else:
                work[dst][lo:hi] = m
    for r in range(n):
        if kind == "reduce_scatter":
            want = sum(xs)[offs[r]:offs[r] + counts[r]]
            np.testing.assert_array_equal(work[r][offs[r]:offs[r] + counts[r]], want)
        else:
            np.testing.assert_array_equal(work[r], ref)
    return sent


@pytest.mark.parametrize("algo", ["ring", "line"])
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n", range(1, 9))
def test_schedules_reduce_and_gather(kind, n, algo):
    rng = np.random.default_rng(n)
    for counts in ([4] * n, [i % 3 for i in range(n)], [5 + i for i in range(n)]):
        sent = simulate(kind, n, algo, counts, rng)
        assert len(schedule(kind, n, algo)) == max(n - 1, 0)
        if counts == [4] * n:
            if algo == "line" and kind == "all_gather":
                # a line forwards every chunk both ways: an inner rank sends its own twice
                assert sent == [4 * ((r + 1 if r < n - 1 else 0) + (n - r if r > 0 else 0)) for r in range(n)]
            else:
                assert all(s == 4 * (n - 1) for s in sent)   # (n-1)/n of the data per rank


def test_comm_algo_reaches_nccl_as_nccl_algo(monkeypatch):
    from tessera_rt.dist.comm import communicators as comm
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setenv("TESSERA_COMM_ALGO", "tree")
    comm.nccl_algo_hint()
    import os
    assert os.environ["NCCL_ALGO"] == "Tree"
    monkeypatch.setenv("TESSERA_COMM_ALGO", "ring")
    comm.nccl_algo_hint()
    assert os.environ["NCCL_ALGO"] == "Tree"          # an NCCL_ALGO already set is left alone
