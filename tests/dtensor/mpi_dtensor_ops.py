"""Every DTensor op on every operand layout, against NumPy on the full tensors, and the
collectives each op issues (runs under mpiexec at 1-4 ranks; 2x2 mesh at 4 ranks)."""
import itertools

import numpy as np
import pytest

from tessera_rt import dist, op
from tessera_rt.backend import get_backend, register_kernel
from tessera_rt.dist.tensor.layout import Layout

from mpi_dtensor_layouts import MESH_KINDS, SIZE, all_layouts, get_mesh, global_array, make_local


def dt(g, lay, mesh):
    return dist.from_local(make_local(g, lay, mesh), layout=lay, mesh=mesh, shape=g.shape, validate=False)


def close(actual, expected, what, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol,
                               atol=1e-9, err_msg=what)


def sample(lays, k):
    """Every layout on small meshes, an even spread of them on larger ones."""
    return lays if len(lays) <= k else lays[:: -(-len(lays) // k)]


# --------------------------------------------------------------------------- elementwise

BINARY = [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.true_divide),
          ("maximum", np.maximum), ("lt", np.less), ("eq", np.equal)]


@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("shape", [(5, 3), (4, 2)])
def test_binary_every_layout_pair(world, kind, shape):
    mesh = get_mesh(kind)
    a, b = global_array(shape, seed=1), np.abs(global_array(shape, seed=2)) + 1
    lays = all_layouts(mesh, 2, ("sum", "max"))
    for la, lb in itertools.product(lays, lays):
        A, B = dt(a, la, mesh), dt(b, lb, mesh)
        for name, ref in BINARY:
            Z = op.add(A, B) if name == "add" else getattr(op, {"sub": "sub", "mul": "mul", "div": "div",
                                                              "maximum": "maximum", "lt": "less",
                                                              "eq": "equal"}[name])(A, B)
            close(Z.full_tensor(), ref(a, b), f"{name} {la!r} {lb!r}")
    # Python operators
    A, B = dt(a, lays[-1], mesh), dt(b, lays[0], mesh)
    for Z, ref in [(A + B, a + b), (A - B, a - b), (A * B, a * b), (A / B, a / b), (-A, -a),
                   (A < B, a < b), (A <= B, a <= b), (A > B, a > b), (A >= B, a >= b), (A == B, a == b),
                   (A != B, a != b), (A ** 2, a ** 2), (2 - A, 2 - a), (3 / B, 3 / b), (A * 0.5, a * 0.5),
                   (abs(A), np.abs(a))]:
        close(Z.full_tensor(), ref, "operator")


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_broadcasting_and_scalars(world, kind):
    mesh = get_mesh(kind)
    a = global_array((5, 3), seed=3)
    cases = [(3,), (5, 1), (1, 3), (1, 1), (2, 5, 3)]
    for shape_b in cases:
        b = global_array(shape_b, seed=4)
        for la in all_layouts(mesh, 2, ("sum",)):
            for lb in sample(all_layouts(mesh, len(shape_b), ("sum",)), 8):
                A, B = dt(a, la, mesh), dt(b, lb, mesh)
                close((A + B).full_tensor(), a + b, f"{la!r} + {lb!r} {shape_b}")
                close((B * A).full_tensor(), b * a, f"{lb!r} * {la!r} {shape_b}")
    for la in all_layouts(mesh, 2, ("sum", "max", "avg")):
        A = dt(a, la, mesh)
        for Z, ref in [(A + 1, a + 1), (1 + A, 1 + a), (A * 2, a * 2), (np.float64(2) * A, 2 * a),
                       (A / 4, a / 4), (A - np.array(1.5), a - 1.5), (A > 0, a > 0)]:
            close(Z.full_tensor(), ref, f"scalar {la!r}")


UNARY = [("neg", np.negative), ("abs", np.abs), ("exp", np.exp), ("tanh", np.tanh), ("square", np.square),
         ("relu", lambda x: np.maximum(x, 0)), ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
         ("silu", lambda x: x / (1 + np.exp(-x))), ("sin", np.sin)]


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_unary_every_layout(world, kind):
    mesh = get_mesh(kind)
    a = global_array((5, 3), seed=5) / 4
    pos = np.abs(a) + 0.5
    for la in all_layouts(mesh, 2, ("sum", "max", "min", "avg")):
        A, Pz = dt(a, la, mesh), dt(pos, la, mesh)
        for name, ref in UNARY:
            close(getattr(op, name)(A).full_tensor(), ref(a), f"{name} {la!r}")
        close(op.sqrt(Pz).full_tensor(), np.sqrt(pos), f"sqrt {la!r}")
        close(op.log(Pz).full_tensor(), np.log(pos), f"log {la!r}")
        close(op.rsqrt(Pz).full_tensor(), 1 / np.sqrt(pos), f"rsqrt {la!r}")
        close(A.astype("float32").full_tensor(), a.astype(np.float32), f"astype {la!r}")


def test_neg_keeps_pending_reductions(world):
    mesh = get_mesh("1d")
    a = global_array((4, 3))
    for o, flipped in [("sum", "sum"), ("max", "min"), ("min", "max"), ("avg", "avg")]:
        A = dt(a, Layout(((), ()), (("tp", o),)), mesh)
        with dist.trace_collectives() as log:
            Z = -A
        assert log.count() == 0 and Z.layout.partial == (("tp", flipped),)
        close(Z.full_tensor(), -a, o)


# --------------------------------------------------------------------------- reductions

@pytest.mark.parametrize("kind", MESH_KINDS)
def test_reductions_every_layout(world, kind):
    mesh = get_mesh(kind)
    a = global_array((5, 4), seed=6)
    for la in all_layouts(mesh, 2, ("sum", "max", "avg")):
        A = dt(a, la, mesh)
        for name in ("sum", "mean", "max", "min"):
            for axis in (0, 1, -1, None, (0, 1)):
                for keepdims in (False, True):
                    Z = getattr(op, name)(A, axis=axis, keepdims=keepdims)
                    ref = getattr(np, name)(a, axis=axis, keepdims=keepdims)
                    assert Z.shape == np.shape(ref)
                    close(Z.full_tensor(), ref, f"{name}(axis={axis}, keepdims={keepdims}) {la!r}")
        close(A.sum().full_tensor(), a.sum(), "method")


def test_reduction_over_sharded_dim_is_pending(world):
    mesh = get_mesh("1d")
    a = global_array((2, 7), seed=8)           # 7 over 3 or 4 ranks: uneven, some pieces small
    A = dt(a, Layout(((), ("tp",))), mesh)
    n = int(SIZE > 1)
    for name, pend in [("sum", "sum"), ("mean", "sum"), ("max", "max"), ("min", "min")]:
        with dist.trace_collectives() as log:
            Z = getattr(A, name)(axis=1)
        assert log.count() == 0 and Z.layout == Layout((((),)), (("tp", pend),)), Z.layout
        with dist.trace_collectives() as log:
            full = Z.full_tensor()
        assert log.count("all_reduce") == n and log.count() == n
        close(full, getattr(np, name)(a, axis=1), name)
    B = dt(global_array((2, 2), seed=9), Layout(((), ("tp",))), mesh)     # zero-size pieces at 3-4 ranks
    close(B.max(axis=1).full_tensor(), B.full_tensor().max(axis=1), "max with empty pieces")


# --------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("shapes", [((5, 4), (4, 3)), ((4, 6), (6, 2)), ((1, 3), (3, 7))])
def test_matmul_every_layout_pair(world, kind, shapes):
    mesh = get_mesh(kind)
    a, b = global_array(shapes[0], seed=10), global_array(shapes[1], seed=11)
    lays = all_layouts(mesh, 2, ("sum",))
    for la, lb in itertools.product(lays, lays):
        A, B = dt(a, la, mesh), dt(b, lb, mesh)
        Z = A @ B
        assert Z.shape == (a @ b).shape
        close(Z.full_tensor(), a @ b, f"{la!r} @ {lb!r}")


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_batched_matmul(world, kind):
    mesh = get_mesh(kind)
    cases = [((3, 5, 4), (4, 2)), ((3, 5, 4), (3, 4, 2)), ((2, 1, 3, 4), (5, 4, 2))]
    for sa, sb in cases:
        a, b = global_array(sa, seed=12), global_array(sb, seed=13)
        for la in sample(all_layouts(mesh, len(sa), ("sum",)), 12):
            for lb in sample(all_layouts(mesh, len(sb), ("sum",)), 8):
                close(op.matmul(dt(a, la, mesh), dt(b, lb, mesh)).full_tensor(), a @ b, f"{la!r} @ {lb!r}")


def test_matmul_tp_patterns_issue_no_hidden_collectives(world):
    mesh = get_mesh("1d")
    n = int(SIZE > 1)
    x, w, w2 = global_array((6, 5), seed=14), global_array((5, 8), seed=15), global_array((8, 3), seed=16)
    R, S0, S1 = Layout(((), ())), Layout((("tp",), ())), Layout(((), ("tp",)))
    X, W, W2 = dt(x, R, mesh), dt(w, S1, mesh), dt(w2, S0, mesh)
    with dist.trace_collectives() as log:
        H = X @ W                    # column-parallel: no communication, output column-sharded
        Y = H @ W2                   # row-parallel: no communication, output pending sum
    assert log.count() == 0
    assert H.layout == S1 and Y.layout == Layout(((), ()), (("tp", "sum"),))
    with dist.trace_collectives() as log:
        Yr = Y.redistribute(dist.ReplicateSpec())          # the one all_reduce of the MLP
    assert [r.op for r in log.records] == ["all_reduce"] * n
    close(Yr.to_local(), x @ w @ w2, "mlp")
    # batch-sharded activations with replicated weights: data parallel, no communication
    with dist.trace_collectives() as log:
        Z = dt(x, S0, mesh) @ dt(w, R, mesh)
    assert log.count() == 0 and Z.layout == S0


def test_rs_mm_ag_attention_path(world):
    """Seed 000 §4.2: logits pending over tp -> reduce_scatter -> local softmax -> local PV
    -> all_gather; exactly those two collectives."""
    mesh = get_mesh("1d")
    n = int(SIZE > 1)
    q, k, v = global_array((7, 6), seed=17) / 8, global_array((5, 6), seed=18) / 8, global_array((5, 4), seed=19)
    Q = dt(q, Layout(((), ())), mesh)
    K = dt(k, Layout(((), ("tp",))), mesh)          # K column-sharded over tp
    V = dt(v, Layout(((), ())), mesh)
    with dist.trace_collectives() as log:
        S = Q @ K.T                                   # pending sum over tp (S_partial)
        P = op.softmax(S, axis=-1)                    # reduce_scatter onto rows, local softmax
        O = P @ V                                     # local PV, rows sharded
        out = O.full_tensor()                         # all_gather
    assert [r.op for r in log.records] == ["reduce_scatter"] * n + ["all_gather"] * n
    assert S.layout.partial == (("tp", "sum"),) and P.layout == Layout((("tp",), ()))
    s = q @ k.T
    e = np.exp(s - s.max(-1, keepdims=True))
    close(out, (e / e.sum(-1, keepdims=True)) @ v, "attention", rtol=1e-5)


def test_tile_shape_reaches_the_kernel(world):
    seen = []
    real = get_backend().kernel("matmul")

    def spy(a, b, **kw):
        seen.append(kw.get("tile_shape"))
        return real(a, b, **kw)
    register_kernel("matmul", "cpu", spy)
    try:
        mesh = get_mesh("1d")
        a, b = global_array((6, 4), np.float32), global_array((4, 5), np.float32)
        A, B = dist.distribute(a, mesh=mesh), dist.distribute(b, layout=dist.ShardSpec(("col",), ("tp",)), mesh=mesh)
        Z = op.matmul(A, B, tile_shape=(16, 16, 2))
        assert seen == [(16, 16, 2)]
        close(Z.full_tensor(), a @ b, "tiled")
        op.matmul(a, b, tile_shape=(16, 16, 2))          # arrays go straight to the kernel
        assert seen[-1] == (16, 16, 2)
    finally:
        register_kernel("matmul", "cpu", real)


def test_matmul_hands_transposed_operands_to_blas_without_copies(world):
    # a Linear's backward multiplies by W.T, attention by a transposed 3-D activation: BLAS
    # reads them in place (no copy counted, the kernel gets views of the operands), and a 3-D
    # activation times a weight runs as one 2-D GEMM.  An operand BLAS cannot read (strided
    # along both dims) is copied, counted, and the product is still right.
    from tessera_rt import profiler
    seen = []
    real = get_backend().kernel("matmul")

    def spy(a, b, **kw):
        seen.append((a, b))
        return real(a, b, **kw)
    register_kernel("matmul", "cpu", spy)
    try:
        mesh = get_mesh("1d")
        x, w = global_array((4, 6, 8), np.float32, seed=30), global_array((5, 8), np.float32, seed=31)
        X, W = dist.distribute(x, mesh=mesh), dist.distribute(w, mesh=mesh)
        Wt, Xt = op.transpose(W, None), op.transpose(X, (0, 2, 1))
        before = profiler.bytes_copied()
        with profiler.profile(print_table=False) as prof:
            Y = op.matmul(X, Wt)                          # (4, 6, 8) @ (8, 5)
            G = op.matmul(Xt, X)                          # (4, 8, 6) @ (4, 6, 8), batched
        assert profiler.bytes_copied() == before and prof.bytes_copied == 0
        close(Y.full_tensor(), x @ w.T, "x @ w.T")
        close(G.full_tensor(), x.transpose(0, 2, 1) @ x, "x.T @ x")
        (ya, yb), (ga, _) = seen
        assert ya.shape == (24, 8), f"the 3-D activation is not folded into one 2-D GEMM: {ya.shape}"
        assert np.shares_memory(yb, Wt.to_local()) and np.shares_memory(ga, Xt.to_local())
        big = global_array((12, 16), np.float32, seed=32)
        V = dist.from_local(big[::2, ::2], layout=Layout(((), ())), mesh=mesh, shape=(6, 8), validate=False)
        with profiler.profile(print_table=False) as prof:
            P = op.matmul(V, W.T)
        assert prof.bytes_copied == big[::2, ::2].nbytes
        close(P.full_tensor(), big[::2, ::2] @ w.T, "strided @ w.T")
    finally:
        register_kernel("matmul", "cpu", real)


# --------------------------------------------------------------------------- shape ops

@pytest.mark.parametrize("kind", MESH_KINDS)
def test_transpose_and_reshape(world, kind):
    mesh = get_mesh(kind)
    a = global_array((4, 6), seed=20)
    for la in all_layouts(mesh, 2, ("sum",)):
        A = dt(a, la, mesh)
        with dist.trace_collectives() as log:
            T = A.T
        assert log.count() == 0
        close(T.full_tensor(), a.T, f"T {la!r}")
        for new in [(24,), (2, 12), (4, 3, 2), (8, 3), (6, 4), (1, 4, 6, 1), (-1, 3)]:
            close(A.reshape(new).full_tensor(), a.reshape(new), f"reshape {new} {la!r}")
    b = global_array((2, 3, 4), seed=21)
    for lb in sample(all_layouts(mesh, 3, ("sum",)), 20):
        B = dt(b, lb, mesh)
        close(op.transpose(B, (1, 2, 0)).full_tensor(), b.transpose(1, 2, 0), f"perm {lb!r}")
        close(B.transpose(2, 0, 1).full_tensor(), b.transpose(2, 0, 1), f"perm {lb!r}")
        close(op.reshape(B, (6, 4)).full_tensor(), b.reshape(6, 4), f"reshape {lb!r}")


def test_reshape_keeps_sharding_when_pieces_stay_contiguous(world):
    mesh = get_mesh("1d")
    a = global_array((4 * SIZE, 6))
    A = dt(a, Layout((("tp",), ())), mesh)
    with dist.trace_collectives() as log:
        Z = A.reshape(4 * SIZE, 2, 3)
        Y = A.reshape(4 * SIZE * 6)
    assert log.count() == 0 and Z.layout == Layout((("tp",), (), ())) and Y.layout == Layout((("tp",),))
    close(Y.full_tensor(), a.reshape(-1), "flatten")


# --------------------------------------------------------------------------- softmax and norms

@pytest.mark.parametrize("kind", MESH_KINDS)
def test_softmax_layernorm_rmsnorm_every_layout(world, kind):
    mesh = get_mesh(kind)
    a = global_array((5, 6), seed=22) / 4
    w, bias = global_array((6,), seed=23) / 3, global_array((6,), seed=24)
    e = np.exp(a - a.max(-1, keepdims=True))
    mu, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
    refs = {"softmax": e / e.sum(-1, keepdims=True),
            "layernorm": (a - mu) / np.sqrt(var + 1e-5) * w + bias,
            "rmsnorm": a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * w}
    e0 = np.exp(a - a.max(0, keepdims=True))
    for la in all_layouts(mesh, 2, ("sum",)):
        A = dt(a, la, mesh)
        close(op.softmax(A, axis=-1).full_tensor(), refs["softmax"], f"softmax {la!r}", 1e-5)
        close(op.softmax(A, axis=0).full_tensor(), e0 / e0.sum(0, keepdims=True), f"softmax0 {la!r}", 1e-5)
        close(op.layernorm(A, w, bias).full_tensor(), refs["layernorm"], f"layernorm {la!r}", 1e-5)
        close(op.rmsnorm(A, dist.distribute(w, mesh=mesh)).full_tensor(), refs["rmsnorm"], f"rms {la!r}", 1e-5)


def test_softmax_on_sharded_dim_moves_it_with_one_all_to_all(world):
    mesh = get_mesh("1d")
    A = dt(global_array((8, 5)), Layout(((), ("tp",))), mesh)
    with dist.trace_collectives() as log:
        Z = op.softmax(A, axis=-1)
    assert [r.op for r in log.records] == ["all_to_all"] * int(SIZE > 1)
    assert Z.layout == Layout((("tp",), ()))


# --------------------------------------------------------------------------- errors

def test_bad_input_fails_before_any_collective(world):
    mesh = get_mesh("1d")
    other = dist.Mesh(axes=["dp"], shape={"dp": SIZE})
    A = dt(global_array((4, 3)), Layout((("tp",), ())), mesh)
    B = dist.distribute(global_array((4, 3)), layout=dist.ShardSpec((0,), ("dp",)), mesh=other)
    C = dt(global_array((5, 2)), Layout(((), ())), mesh)
    with dist.trace_collectives() as log:
        with pytest.raises(ValueError, match="different meshes"):
            A + B
        with pytest.raises(ValueError, match=r"\(4, 3\) and \(5, 2\) do not broadcast"):
            A + C
        with pytest.raises(ValueError, match="inner dims do not match.*3 with 5"):
            A @ C
        with pytest.raises(ValueError, match="unknown mesh axis 'zz'"):
            dist.all_reduce(A, axis="zz")
        with pytest.raises(ValueError, match="'ep'.*use one of"):
            A.redistribute(dist.ShardSpec(("col",), ("ep",)))
        with pytest.raises(TypeError, match="plain array"):
            A + np.ones((4, 3))
        with pytest.raises(ValueError, match="out of range"):
            A.sum(axis=2)
        with pytest.raises(ValueError, match="cannot reshape"):
            A.reshape(5, 2)
        with pytest.raises(ValueError, match="sharded over 'tp'"):
            dist.all_reduce(A, axis="tp")
        with pytest.raises(TypeError, match="full_tensor"):
            np.asarray(A)
    assert log.count() == 0
    msg = None
    try:
        A @ C
    except ValueError as e:
        msg = str(e)
    assert f"rank {world.rank}" in msg and "matmul" in msg and "S(0)@tp" in msg


# --------------------------------------------------------------------------- DTensor collectives

def test_dtensor_collectives(world):
    mesh = get_mesh("1d")
    n = SIZE
    g = global_array((5, 4))
    # data-parallel gradients: each rank's own values under a replicated layout
    G = dist.from_local(g * (world.rank + 1), layout=dist.ReplicateSpec(), mesh=mesh, shape=g.shape,
                        validate=False)
    S = dist.all_reduce(G, axis="tp", op="sum")
    close(S.to_local(), g * n * (n + 1) / 2, "all_reduce R")
    assert S.layout == Layout(((), ()))
    A = dist.all_reduce(G, axis="tp", op="avg")
    close(A.to_local(), g * (n + 1) / 2, "avg")
    # a pending reduction is completed
    P = dt(g, Layout(((), ()), (("tp", "sum"),)), mesh)
    close(dist.all_reduce(P, axis="tp").to_local(), g, "all_reduce P")
    # all_gather unshards (the seeds' TP GEMM epilogue)
    X = dt(g, Layout(((), ("tp",))), mesh)
    Y = dist.all_gather(X, axis="tp")
    assert Y.layout == Layout(((), ())) and np.array_equal(Y.to_local(), g)
    # reduce_scatter and all_to_all as layout changes
    RS = dist.reduce_scatter(P, axis="tp", op="sum", dim=1)
    assert RS.layout == Layout(((), ("tp",)))
    close(RS.full_tensor(), g, "reduce_scatter")
    A2 = dist.all_to_all(X, axis="tp", split_dim=0, concat_dim=1)
    assert A2.layout == Layout((("tp",), ()))
    close(A2.full_tensor(), g, "all_to_all")
    B = dist.broadcast(dist.from_local(np.full(3, float(world.rank)), mesh=mesh, shape=(3,), validate=False),
                       axis="tp", root=0)
    assert (B.to_local() == 0).all()
    w = dist.all_reduce(G, axis="tp", async_op=True).wait()
    close(w.to_local(), S.to_local(), "async")
    # arrays still go to the array collectives
    close(dist.all_reduce(np.ones(3), axis="tp", mesh=mesh), np.full(3, n), "array all_reduce")
    close(dist.all_gather(np.ones((1, 2)), axis="tp", mesh=mesh), np.ones((n, 2)), "array all_gather")


def test_dtensor_collectives_on_2x2(world):
    if "2x2" not in MESH_KINDS:
        return      # this check needs a 2x2 mesh: it runs in the 4-rank launch
    mesh = get_mesh("2x2")
    g = global_array((6, 4))
    tp_cols = dist.ShardSpec((1,), ("tp",))
    piece = g[dist.local_slices(g.shape, dist.as_layout(tp_cols, g.shape, mesh), mesh)]
    G = dist.from_local(piece * (mesh.coordinate("dp") + 1), layout=tp_cols, mesh=mesh, shape=g.shape,
                        validate=False)
    with dist.trace_collectives() as log:
        S = dist.all_reduce(G, axis="dp", op="sum")
    assert [(r.op, r.axis) for r in log.records] == [("all_reduce", "dp")]
    close(S.full_tensor(), g * 3, "dp all_reduce of tp-sharded grads")
