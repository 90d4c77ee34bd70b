"""Deterministic reductions and the golden hash (issue 7, item 4; seed 000 §3.4, §11).

Under dist.deterministic(): the same logits bits on every rerun and on every mesh shape
(tp x dp factorizations of the job, and one process), and fixed-order all_reduce.
"""
import hashlib

import numpy as np
import pytest

from tessera_rt import dist, get_backend, op
from tessera_rt.dist.checks import determinism as det


def _h(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _weights():
    rng = np.random.default_rng(2024)
    X = rng.standard_normal((9, 40)).astype(np.float32)        # 9 rows: uneven over dp = 2, 4
    W1 = (rng.standard_normal((40, 24)) / 6).astype(np.float32)
    W2 = (rng.standard_normal((24, 10)) / 5).astype(np.float32)
    return X, W1, W2


def _reference(X, W1, W2):
    """The model on whole arrays, with the same fixed-order kernels (no mesh at all)."""
    h = np.maximum(det.matmul(X, W1), 0)
    logits = det.matmul(h, W2)
    probs = get_backend().kernel("softmax", like=logits)(logits, axis=-1)
    return logits, probs, det.reduce_sum(logits, None, False)


def _model(X, W1, W2, mesh):
    Xd = dist.distribute(X, layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)), mesh=mesh)
    W1d = dist.distribute(W1, layout=dist.ShardSpec(partition=("col",), mesh_axes=("tp",)), mesh=mesh)
    W2d = dist.distribute(W2, layout=dist.ShardSpec(partition=("row",), mesh_axes=("tp",)), mesh=mesh)
    h = op.relu(Xd @ W1d)                       # (S(0)@dp, S(1)@tp)
    logits = h @ W2d                            # k sharded over tp: kept whole in deterministic mode
    probs = op.softmax(logits, axis=-1)
    return logits.full_tensor(), probs.full_tensor(), logits.sum().full_tensor()


def _factorizations(n):
    return [(tp, n // tp) for tp in range(1, n + 1) if n % tp == 0]


def test_golden_hash_of_logits_is_the_same_on_every_rerun_and_mesh_shape(world):
    X, W1, W2 = _weights()
    ref = [_h(a) for a in _reference(X, W1, W2)]
    assert ref == [_h(a) for a in _reference(X, W1, W2)]                 # rerun
    with dist.deterministic(op.numeric(deterministic=True)):
        for tp, dp in _factorizations(world.size):
            mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": tp, "dp": dp})
            for rerun in range(2):
                got = [_h(a) for a in _model(X, W1, W2, mesh)]
                assert got == ref, f"tp={tp} dp={dp} rerun {rerun}: {got} != golden {ref}"
    # the golden hash is the same on every rank
    assert world.mpi.allgather(tuple(ref)) == [tuple(ref)] * world.size


def test_without_the_mode_a_sharded_contraction_is_a_pending_sum(world):
    if world.size < 2:
        pytest.skip("needs a sharded contraction")
    mesh = dist.Mesh(axes=["tp"], shape={"tp": world.size})
    A = dist.distribute(np.ones((4, 8), np.float32), layout=dist.ShardSpec(partition=("col",), mesh_axes=("tp",)),
                        mesh=mesh)
    B = dist.distribute(np.ones((8, 2), np.float32), layout=dist.ShardSpec(partition=("row",), mesh_axes=("tp",)),
                        mesh=mesh)
    assert (A @ B).layout.partial == (("tp", "sum"),)
    with dist.deterministic():
        C = A @ B
        assert C.layout.partial == () and np.array_equal(C.full_tensor(), np.full((4, 2), 8, np.float32))
    # the per-call policy asks for the same
    C = op.matmul(A, B, policy=op.numeric(deterministic=True))
    assert C.layout.partial == ()
    assert not dist.is_deterministic()


def test_fixed_order_all_reduce_is_rank_order_and_identical_everywhere(world):
    rng = np.random.default_rng(world.rank)
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 6, 1000)).astype(np.float32)
    every = np.stack(world.mpi.allgather(x))
    with dist.deterministic():
        y = dist.all_reduce(x.copy())
        ya = dist.all_reduce(x.copy(), op="avg")
        w = dist.all_reduce(x.copy(), async_op=True).wait()
        rs = dist.reduce_scatter(np.tile(x, world.size))
    want = det.tree_sum(every, 0, compensated=False)
    assert np.array_equal(y, want) and np.array_equal(w, want) and np.array_equal(rs, want)
    assert np.array_equal(ya, want / world.size)
    assert len({_h(a) for a in world.mpi.allgather(y)}) == 1
    with dist.deterministic(compensated=True):
        yc = dist.all_reduce(x.copy())
    exact = every.astype(np.float64).sum(0)
    assert np.abs(yc - exact).max() <= np.abs(y - exact).max()
    assert np.array_equal(yc, det.tree_sum(every, 0, compensated=True))


def test_deterministic_sum_and_mean_do_not_depend_on_the_layout(world):
    rng = np.random.default_rng(5)
    A = rng.standard_normal((7, 33)).astype(np.float32)
    mesh = dist.Mesh(axes=["x"], shape={"x": world.size})
    want = det.reduce_sum(A, (1,), False), det.reduce_sum(A, None, False), det.reduce_sum(A, (0,), True, mean_of=7)
    with dist.deterministic():
        for spec in (dist.ShardSpec(partition=("row",), mesh_axes=("x",)),
                     dist.ShardSpec(partition=("col",), mesh_axes=("x",)), dist.ReplicateSpec(mesh_axes=("x",))):
            X = dist.distribute(A, layout=spec, mesh=mesh)
            got = (X.sum(axis=1).full_tensor(), X.sum().full_tensor(), X.mean(axis=0, keepdims=True).full_tensor())
            for g, w_ in zip(got, want):
                assert g.dtype == w_.dtype and np.array_equal(g, w_), spec


def test_deterministic_pending_sums_reduce_scatter_along_the_leading_dim(world):
    """A pending sum of a 2-D tensor redistributed to rows (a reduce_scatter along dim 0) takes
    the fixed order and equals the rank-order sum of the pieces (it raised a broadcast error)."""
    mesh = dist.Mesh(axes=["x"], shape={"x": world.size})
    every = np.random.default_rng(9).standard_normal((world.size, 2 * world.size + 1, 3)).astype(np.float32)
    pending = dist.Layout(((), ()), (("x", "sum"),))
    X = dist.from_local(every[world.rank].copy(), layout=pending, mesh=mesh, shape=every.shape[1:])
    rows = dist.ShardSpec(partition=(0,), mesh_axes=("x",))
    with dist.deterministic():
        Y = X.redistribute(rows)
    want = det.tree_sum(every, 0)
    assert np.array_equal(Y.to_local(), want[dist.local_slices(want.shape, Y.layout, mesh)])


def test_tree_sum_kernels():
    x = np.arange(1, 12, dtype=np.float64)
    assert det.tree_sum(x) == 66.0
    big = np.array([1e8, 1.0, -1e8, 1.0] * 5, np.float32)
    assert det.tree_sum(big, compensated=True) == 10.0
    a = np.random.default_rng(0).standard_normal((5, 70)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((70, 6)).astype(np.float32)
    c = det.matmul(a, b)
    assert np.allclose(c, a @ b, atol=1e-4)
    assert np.array_equal(det.matmul(a[2:], b[:, 1:4]), c[2:, 1:4])      # row/col subsets: same bits
