"""The seeds' spelling: ``with op.numeric(deterministic=True):`` scopes fixed-order reductions."""
import numpy as np

import tessera_rt as ts
from tessera_rt import dist, op
from tessera_rt.dist.checks.determinism import tree_sum


def test_numeric_policy_as_a_scope(world):
    mesh = dist.Mesh(axes=["x"], shape=(world.size,))
    x = ts.get_backend().xp.asarray(np.random.default_rng(world.rank).standard_normal(1000).astype(np.float32))
    assert not dist.is_deterministic()
    with op.numeric(deterministic=True):
        assert dist.is_deterministic()
        with dist.trace_collectives() as log:
            y = dist.all_reduce(x, "x", mesh=mesh)
        with op.numeric(deterministic=False):      # nested scopes restore in order
            assert not dist.is_deterministic()
        assert dist.is_deterministic()
    assert not dist.is_deterministic()
    assert log.count("all_reduce") == 1
    # inside the scope the sum is the fixed pairwise tree over ranks, bit for bit
    parts = np.stack([np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(world.size)])
    np.testing.assert_array_equal(ts.get_backend().to_host(y), tree_sum(parts, 0))
