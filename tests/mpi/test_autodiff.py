"""ts.grad through DTensor ops, redistributions and collectives (runs under mpiexec at 1-4
ranks): DTensor gradients equal the single-process array gradients and come back in the
parameters' layouts; array collectives' VJPs against coordinated finite differences."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, op
from tessera_rt.dist.layout import Layout

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
_MESHES: dict = {}


def meshes():
    out = [("tp", {"tp": SIZE})]
    if SIZE == 4:
        out.append(("2x2", {"dp": 2, "tp": 2}))
    return [k for k, _ in out]


def get_mesh(kind):
    if kind not in _MESHES:
        dist.init()
        _MESHES[kind] = (dist.Mesh(axes=["tp"], shape={"tp": SIZE}) if kind == "tp"
                         else dist.Mesh(axes=["dp", "tp"], shape={"dp": 2, "tp": 2}))
    return _MESHES[kind]


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def layouts(mesh, ndim):
    """Every way of placing each mesh axis on a dim or replicating it."""
    out = []
    for choice in itertools.product([None] + list(range(ndim)), repeat=len(mesh.axes)):
        dims = [[] for _ in range(ndim)]
        for a, c in zip(mesh.axes, choice):
            if c is not None:
                dims[c].append(a)
        out.append(Layout(tuple(tuple(d) for d in dims)))
    return out


def compare(fn, arrays, lays, mesh, rtol=1e-9):
    ref = ts.grad(fn, argnums=tuple(range(len(arrays))))(*arrays)
    dts = [dist.distribute(a, layout=l, mesh=mesh) for a, l in zip(arrays, lays)]
    got = ts.grad(fn, argnums=tuple(range(len(dts))))(*dts)
    for r, g, d in zip(ref, got, dts):
        assert type(g) is dist.DTensor and g.layout == d.layout, (g, d.layout)
        np.testing.assert_allclose(g.full_tensor(), r, rtol=rtol, atol=1e-12, err_msg=f"{lays}")


# --------------------------------------------------------------------------- DTensor ops

@pytest.mark.parametrize("kind", meshes())
def test_mlp_every_weight_layout(world, kind):
    mesh = get_mesh(kind)
    x, w1, w2 = rand(6, 5, seed=1), rand(5, 7, seed=2), rand(7, 5, seed=3)

    def f(x, w1, w2):
        h = op.tanh(x @ w1)
        return op.sum(op.softmax(h @ w2, axis=-1) * x) + op.mean(op.exp(-op.square(h)))
    for l1, l2 in itertools.product(layouts(mesh, 2), layouts(mesh, 2)):
        compare(f, [x, w1, w2], [layouts(mesh, 2)[0], l1, l2], mesh)
    for lx in layouts(mesh, 2):
        compare(f, [x, w1, w2], [lx, layouts(mesh, 2)[1], layouts(mesh, 2)[-1]], mesh)


@pytest.mark.parametrize("kind", meshes())
def test_norms_reductions_shapes(world, kind):
    mesh = get_mesh(kind)
    x, w, b = rand(2, 4, 6, seed=4), rand(6, seed=5), rand(6, seed=6)

    def f(x, w, b):
        y = op.layernorm(x, w, b) + op.rmsnorm(x, w)
        z = op.reshape(op.transpose(y, (1, 0, 2)), (4, 12))
        return op.sum(op.max(z, axis=1)) + op.sum(op.min(x, axis=(0, 2))) + op.sum(op.maximum(x, 0.1) / 3.0)
    for lx in layouts(mesh, 3):
        compare(f, [x, w, b], [lx, layouts(mesh, 1)[0], layouts(mesh, 1)[-1]], mesh)


@pytest.mark.parametrize("kind", meshes())
def test_attention_heads_sharded_and_swiglu(world, kind):
    mesh = get_mesh(kind)
    q, k, v = rand(2, 4, 5, 3, seed=7), rand(2, 4, 5, 3, seed=8), rand(2, 4, 5, 3, seed=9)

    def f(q, k, v):
        return op.sum(op.flash_attention(q, k, v, causal=True) * q)
    for lay in layouts(mesh, 4):
        compare(f, [q, k, v], [lay] * 3, mesh)
    x, w1, w3 = rand(3, 4, seed=10), rand(4, 6, seed=11), rand(4, 6, seed=12)
    for lay in layouts(mesh, 2):
        compare(lambda x, a, b: op.sum(op.swiglu(x, a, b)), [x, w1, w3], [layouts(mesh, 2)[0], lay, lay], mesh)


@pytest.mark.parametrize("kind", meshes())
def test_redistribute_full_tensor_local(world, kind):
    mesh = get_mesh(kind)
    a = rand(5, 4, seed=13)
    for src, dst in itertools.product(layouts(mesh, 2), layouts(mesh, 2)):
        X = dist.distribute(a, layout=src, mesh=mesh)
        g = ts.grad(lambda X: op.sum(op.sin(X.redistribute(dst)) * X))(X)
        assert g.layout == src
        np.testing.assert_allclose(g.full_tensor(), np.cos(a) * a + np.sin(a), rtol=1e-12)
        g = ts.grad(lambda X: op.sum(op.square(X.full_tensor())))(X)
        np.testing.assert_allclose(g.full_tensor(), 2 * a, rtol=1e-12)
    # shard_map style: local pieces in and out
    X = dist.distribute(a, layout=layouts(mesh, 2)[1], mesh=mesh)

    def f(X):
        y = dist.from_local(op.tanh(X.to_local()), layout=X.layout, mesh=mesh, shape=X.shape)
        return op.sum(y * y)
    g = ts.grad(f)(X)
    np.testing.assert_allclose(g.full_tensor(), 2 * np.tanh(a) * (1 - np.tanh(a) ** 2), rtol=1e-12)


@pytest.mark.parametrize("kind", meshes())
def test_dtensor_collectives_are_identity_on_the_global_value(world, kind):
    mesh = get_mesh(kind)
    a, w = rand(4 * SIZE, 6, seed=14), rand(6, 3, seed=15)
    axis = "tp"
    Col = dist.ShardSpec(partition=(0,), mesh_axes=(axis,))
    X = dist.distribute(a, layout=Col, mesh=mesh)
    W = dist.distribute(w, mesh=mesh)

    def gather(X):                          # all_gather forward; its cotangent is a pending sum
        return op.sum(op.tanh(dist.all_gather(X, axis=axis) @ W))
    def a2a(X):
        return op.sum(op.tanh(dist.all_to_all(X, axis=axis, split_dim=1, concat_dim=0) @ W))
    def reduce(X):                          # P(sum) -> R by all_reduce, then reduce_scatter
        P = op.sum(X, axis=0, keepdims=True)
        return op.sum(op.exp(dist.all_reduce(P, axis=axis) * 0.1))
    ref = np.tanh(a @ w)
    expect = (1 - ref ** 2) @ w.T
    with dist.trace_collectives() as log:
        g = ts.grad(gather)(X)
    assert g.layout == X.layout
    np.testing.assert_allclose(g.full_tensor(), expect, rtol=1e-10)
    g = ts.grad(a2a)(X)
    np.testing.assert_allclose(g.full_tensor(), expect, rtol=1e-10)
    g = ts.grad(reduce)(X)
    np.testing.assert_allclose(g.full_tensor(), np.broadcast_to(0.1 * np.exp(0.1 * a.sum(0)), a.shape), rtol=1e-10)
    R = dist.distribute(a, mesh=mesh)
    g = ts.grad(lambda R: op.sum(op.sin(dist.reduce_scatter(R * 1.0, axis=axis, dim=0, op="avg"))))(R)
    # an axis the input is replicated on: each rank's piece is its own variable (d avg / d x_i = 1/n)
    np.testing.assert_allclose(g.full_tensor(), np.cos(a) / mesh.size(axis), rtol=1e-10)
    g = ts.grad(lambda R: op.sum(dist.broadcast(R, axis=axis, root=mesh.size(axis) - 1) * R))(R)
    np.testing.assert_allclose(g.full_tensor(), 2 * a, rtol=1e-12)


# --------------------------------------------------------------------------- array collectives

def coordinated_fd(f, x, eps=1e-6, picks=6):
    """Central differences of the *sum over ranks* of f's local scalar, perturbing one
    element of one rank's x at a time (the same choice on every rank)."""
    rng = np.random.default_rng(99)
    out = []
    for _ in range(picks):
        r, j = int(rng.integers(SIZE)), int(rng.integers(x.size))
        vals = []
        for s in (eps, -eps):
            xx = x.copy()
            if RANK == r:
                xx.reshape(-1)[j] += s
            vals.append(MPI.COMM_WORLD.allreduce(float(f(xx)), op=MPI.SUM))
        out.append((r, j, (vals[0] - vals[1]) / (2 * eps)))
    return out


def check_array_collective(f, x):
    g = ts.grad(f)(x)
    for r, j, num in coordinated_fd(f, x):
        mine = float(g.reshape(-1)[j])
        got = MPI.COMM_WORLD.bcast(mine, root=r)
        assert abs(got - num) < 1e-6 * max(1, abs(num)), (r, j, got, num)


def test_array_collectives_fd(world):
    mesh = get_mesh("tp")
    x = rand(2 * SIZE, 3, seed=20 + RANK)
    c = rand(2 * SIZE, 3, seed=40)
    check_array_collective(lambda x: op.sum(op.sin(dist.all_reduce(x * 1.0, axis="tp", mesh=mesh)) * c), x)
    check_array_collective(lambda x: op.sum(op.sin(dist.all_reduce(x * 1.0, axis="tp", op="avg", mesh=mesh)) * c), x)
    check_array_collective(lambda x: op.sum(op.sin(dist.all_gather(x, axis="tp", dim=1, mesh=mesh))), x)
    check_array_collective(lambda x: op.sum(op.sin(dist.reduce_scatter(x * 1.0, axis="tp", dim=0, mesh=mesh))), x)
    check_array_collective(lambda x: op.sum(op.square(dist.all_to_all(x * 1.0, axis="tp", split_dim=0,
                                                                      concat_dim=1, mesh=mesh)) * 0.5), x)
    check_array_collective(lambda x: op.sum(op.sin(dist.broadcast(x * 1.0, axis="tp", root=0, mesh=mesh))), x)


def test_send_recv_pipeline(world):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    x = rand(3, 4, seed=50 + RANK)
    w = rand(4, 4, seed=51)

    def stage(x):
        if RANK == 0:
            dist.send(op.tanh(x @ w), 1, tag=3)
            return op.sum(x * 0.0)
        if RANK == 1:
            y = dist.recv(np.zeros((3, 4)), 0, tag=3)
            return op.sum(op.square(y)) + op.sum(x * 0.0)
        return op.sum(x * 0.0)
    g = ts.grad(stage)(x)
    h = np.tanh(x @ w)
    y0 = MPI.COMM_WORLD.bcast(h if RANK == 0 else None, root=0)
    if RANK == 0:
        np.testing.assert_allclose(g, (2 * y0 * (1 - y0 ** 2)) @ w.T, rtol=1e-10)
    else:
        np.testing.assert_array_equal(g, 0)


def test_grad_reduce_runs_on_its_stream(world):
    from tessera_rt import runtime as rt
    mesh = get_mesh("tp")
    X = dist.distribute(rand(4 * SIZE, 3, seed=60), layout=dist.ShardSpec(partition=(0,), mesh_axes=("tp",)),
                        mesh=mesh)
    W = dist.distribute(rand(3, 2, seed=61), mesh=mesh)
    g = ts.grad(lambda W: op.sum(op.tanh(X @ W)))(W)        # a pending sum over tp, all-reduced async
    assert g.layout == W.layout
    assert ts.autodiff.GRAD_ROLE in rt.stream_map()
    ref = ts.grad(lambda w: op.sum(op.tanh(X.full_tensor() @ w)))(W.full_tensor())
    np.testing.assert_allclose(g.full_tensor(), ref, rtol=1e-10)
