"""op.moe on the cuda backend's Python, on the CPU (launched by tests/moe/test_moe.py): the strict
CuPy/NCCL stand-in as ``cupy`` and the FP8 RawKernels in the CUDA emulation harness.  Nothing
here runs on a GPU.  The output and gradients equal the NumPy dense reference / CPU path."""
import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, op, runtime as rt
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


def _tiered_pair(budget):
    """A plain and a tiered layer on an ep mesh over all ranks, their sharded parameters."""
    dist.init()
    mesh = dist.Mesh(axes=["ep"], shape={"ep": SIZE})
    plain, tiered = (op.moe(num_experts=4 * SIZE, top_k=1, d_model=16, d_ff=24, mesh=mesh) for _ in range(2))
    tiers = rt.register_prefetch(tiered, window=1, budget=budget)
    return mesh, plain, tiered, tiers, plain.shard(plain.init(0))


@pytest.mark.parametrize("budget", [1, 3])
def test_expert_tiers_on_the_standin(budget):
    # the pinned host tier (cupyx.empty_pinned) and the io-stream fetches and prefetches: the
    # same outputs as the layer without tiers, with experts evicted and fetched again
    b = get_backend()
    mesh, plain, tiered, tiers, P = _tiered_pair(budget)
    rows = dist.ShardSpec(partition=("row",), mesh_axes=("ep",))
    for step in range(3):
        xg = np.random.default_rng(step).standard_normal((8 * SIZE, 16)).astype(np.float32)
        X = dist.distribute(b.xp.asarray(xg), layout=rows, mesh=mesh)
        np.testing.assert_array_equal(b.to_host(tiered(P, X)[0].full_tensor()),
                                      b.to_host(plain(P, X)[0].full_tensor()))
    st = tiers.stats()
    assert st["misses"] > 0 and len(st["resident"]) <= budget
    assert all(b.xp.cuda.pinned_memory.is_pinned(h) for h in tiered.prefetch.host.values())


def test_expert_fetch_waits_for_compute_before_reusing_a_block():
    # gather without the routing's host sync: expert 0's blocks, read by compute's stack,
    # are evicted back to io's arena, and fetching expert 2 gets them on io; io must wait for
    # compute first (the stand-in reports the pool reuse race otherwise)
    b = get_backend()
    _, _, tiered, tiers, P = _tiered_pair(budget=1)
    w = (P["w1"], P["w3"], P["w2"])
    host = [b.to_host(t.to_local()) for t in w]     # (host syncs only before and after the loop)
    lt = tiered.prefetch
    got = []
    for e in range(3):
        got.append(lt.gather(np.array([e]), *w))    # stacked on compute from the cached experts
        lt.observe(np.zeros(lt.nle))                # evicts beyond the budget of one
    assert tiers.stats()["misses"] == 3 and tiers.stats()["resident"] == [(0, 2)]
    for e, stacked in enumerate(got):
        for g, h in zip(stacked, host):
            np.testing.assert_array_equal(b.to_host(g), h[e:e + 1])


def _grad_and_work(m, P, X):
    cp = get_backend().xp
    m(P, X)                                         # warm-up: buffers and kernels
    loss = lambda w, x: op.sum(op.square(m(w, x)[0]))
    with cp.testing.count_device_work() as fwd:
        m(P, X)
    with cp.testing.count_device_work() as both:
        ts.grad(loss, argnums=(0, 1))(P, X)
    return fwd, both


def test_dropless_routing_counts_stay_on_the_device_with_one_position():
    # one ep position (plain arrays): the counts never reach the host, the experts run the grouped
    # kernels on device offsets (2 launches forward, 2 + 4 with the backward) and nothing pads
    b = get_backend()
    m = op.moe(num_experts=6, top_k=2, capacity_factor=None, d_model=16, d_ff=24)
    p = m.init(0)
    P = {k: b.xp.asarray(v) for k, v in p.items()}
    xg = np.random.default_rng(3).standard_normal((20, 16)).astype(np.float32)
    fwd, both = _grad_and_work(m, P, b.xp.asarray(xg))
    assert fwd.syncs == 0 and both.syncs == 0, fwd.report() + "\n" + both.report()
    grouped = lambda w: sum(n for k, n in w.by_kind.items() if k.startswith("RawKernel ts_grouped"))
    assert grouped(fwd) == 2 and grouped(both) == 2 + 4, both.report()
    y, _ = m(P, b.xp.asarray(xg))
    np.testing.assert_allclose(b.to_host(y), dense_reference(p, xg, 2)[0], rtol=1e-5, atol=2e-5)


def test_dropless_routing_waits_once_for_the_exchanged_counts():
    # over ep ranks the host learns the counts once per forward (the payload exchanges' sizes);
    # the backward reuses them
    b = get_backend()
    dist.init()
    mesh = dist.Mesh(axes=["ep"], shape={"ep": SIZE})
    m = op.moe(num_experts=2 * SIZE, top_k=2, capacity_factor=None, d_model=16, d_ff=24, mesh=mesh)
    rows = dist.ShardSpec(partition=("row",), mesh_axes=("ep",))
    xg = np.random.default_rng(4).standard_normal((8 * SIZE, 16)).astype(np.float32)
    fwd, both = _grad_and_work(m, m.shard(m.init(0)), dist.distribute(b.xp.asarray(xg), layout=rows, mesh=mesh))
    want = 0 if SIZE == 1 else 1
    assert fwd.syncs_by_kind.get("ndarray.get", 0) == want, fwd.report()
    assert both.syncs_by_kind.get("ndarray.get", 0) == want, both.report()


@pytest.mark.parametrize("dtype, tol", [("float16", 4e-3), ("bfloat16", 3e-2)])
def test_16_bit_experts_on_the_tensor_core_kernels(dtype, tol):
    # f16/bf16 parameters and tokens: the grouped GEMMs' mma.sync path and the fused SwiGLU
    # kernels, forward against the dense reference and gradients against the f32 layer's (both
    # on the same rounded values), relative to the largest magnitude
    b = get_backend()
    m = op.moe(num_experts=6, top_k=2, capacity_factor=None, d_model=32, d_ff=48)
    p32 = {k: b.to_host(b.xp.asarray(v).astype(dtype)).astype(np.float32) for k, v in m.init(0).items()}
    xg = b.to_host(b.xp.asarray(np.random.default_rng(3).standard_normal((40, 32)).astype(np.float32))
                   .astype(dtype)).astype(np.float32)
    P16 = {k: b.xp.asarray(v).astype(dtype) for k, v in p32.items()}
    y, _ = m(P16, b.xp.asarray(xg).astype(dtype))
    yr = dense_reference(p32, xg, 2)[0]
    assert np.abs(b.to_host(y).astype(np.float32) - yr).max() <= tol * np.abs(yr).max()
    loss = lambda w, x: op.sum(op.astype(m(w, x)[0], "float32"))
    g16 = ts.grad(loss, argnums=(0,))(P16, b.xp.asarray(xg).astype(dtype))[0]
    g32 = ts.grad(loss, argnums=(0,))({k: b.xp.asarray(v) for k, v in p32.items()}, b.xp.asarray(xg))[0]
    for k in ("w1", "w3", "w2"):
        assert np.dtype(g16[k].dtype).name == dtype, g16[k].dtype
        got, want = b.to_host(g16[k]).astype(np.float32), b.to_host(g32[k])
        assert np.abs(got - want).max() <= 4 * tol * np.abs(want).max(), k
