"""op.moe on the cuda backend's Python, on the CPU (launched by tests/test_moe.py): the strict
CuPy/NCCL stand-in as ``cupy`` and the FP8 RawKernels in the CUDA emulation harness.  Nothing
here runs on a GPU.  The output and gradients equal the NumPy dense reference / CPU path."""
import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, op
from tessera_rt.backend import get_backend
from tessera_rt.moe import dense_reference

SIZE = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("cf, fp8", [(None, False), (1.0, False), (None, True)])
def test_moe_on_the_standin(cf, fp8):
    b = get_backend()
    assert b.is_gpu
    dist.init()
    mesh = dist.Mesh(axes=["ep"], shape={"ep": SIZE})
    rows = dist.ShardSpec(partition=("row",), mesh_axes=("ep",))
    m = op.moe(num_experts=5, top_k=2, capacity_factor=cf, d_model=32, d_ff=24, mesh=mesh, quantize_fp8=fp8)
    p = m.init(0)
    xg = np.random.default_rng(1).standard_normal((22, 32)).astype(np.float32)
    X = dist.distribute(b.xp.asarray(xg), layout=rows, mesh=mesh)
    P = m.shard(p)
    y, aux = m(P, X)
    yr, load, dropped = dense_reference(p, xg, 2, cf, sources=SIZE)
    got = b.to_host(y.full_tensor())
    if fp8:
        assert np.linalg.norm(got - yr) / np.linalg.norm(yr) < 0.06
    else:
        np.testing.assert_allclose(got, yr, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(aux["load"], load)
    assert aux["dropped"] == dropped
    g = ts.grad(lambda w, x: op.sum(m(w, x)[0]), argnums=(0, 1))(P, X)
    assert isinstance(g[0]["w1"].to_local(), b.xp.ndarray) and g[1].shape == (22, 32)
