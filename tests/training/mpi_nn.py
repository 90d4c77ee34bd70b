"""Every module's gradients on every dp x tp mesh of the job equal the single-process
gradients of the same module on plain arrays (float64, so only summation order differs)."""
import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, nn, op
from tessera_rt.autodiff import tree_flatten

SIZE = MPI.COMM_WORLD.Get_size()
SHAPES = [(d, SIZE // d) for d in range(1, SIZE + 1) if SIZE % d == 0]      # (dp, tp)
_MESHES: dict = {}


def get_mesh(dp, tp):
    if (dp, tp) not in _MESHES:
        dist.init()
        _MESHES[(dp, tp)] = dist.Mesh(axes=["dp", "tp"], shape={"dp": dp, "tp": tp})
    return _MESHES[(dp, tp)]


def place(x, mesh, batch_dims=1):
    spec = dist.ShardSpec(partition=(0,), mesh_axes=("dp",))
    return dist.distribute(x, layout=spec, mesh=mesh)


def compare(make, inputs, mesh, loss_of=None, rtol=1e-9):
    """make(mesh) -> module; loss = sum(module(params, *inputs) * weights)."""
    ref_mod, mod = make(None), make(mesh)
    rp, p = ref_mod.init(3), mod.init(3)
    loss_of = loss_of or (lambda m, prm, *xs: op.sum(op.tanh(m(prm, *xs))))
    rl, rg = ts.value_and_grad(lambda prm: loss_of(ref_mod, prm, *inputs))(rp)
    dl, dg = ts.value_and_grad(lambda prm: loss_of(mod, prm, *[place(x, mesh) for x in inputs]))(p)
    np.testing.assert_allclose(float(dl.full_tensor()), float(rl), rtol=rtol)
    for (r, path), g, prm in zip(zip(*tree_flatten(rg)[:2]), tree_flatten(dg)[0], tree_flatten(p)[0]):
        assert g.layout == prm.layout, path
        np.testing.assert_allclose(g.full_tensor(), r, rtol=rtol, atol=1e-12, err_msg=path)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


F64 = dict(dtype="float64")


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_linear_column_row_and_norm(world, dp, tp):
    mesh = get_mesh(dp, tp)
    x = rand(4, 3, 6, seed=1)
    for par in ("column", "row", None):
        compare(lambda m: nn.Linear(6, 5, parallel=par, bias=True, mesh=m, **F64), [x], mesh)
    compare(lambda m: nn.RMSNorm(6, mesh=m, **F64), [x], mesh)


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_embedding_and_vocab_parallel_cross_entropy(world, dp, tp):
    mesh = get_mesh(dp, tp)
    ids = np.random.default_rng(2).integers(0, 11, (4, 5))
    compare(lambda m: nn.Embedding(11, 6, mesh=m, **F64), [ids], mesh)

    class Head(nn.Module):
        def __init__(self, mesh):
            super().__init__(mesh, dtype="float64")
            self.lin = nn.Linear(6, 11, parallel="column", mesh=mesh, **F64)
            self.emb = nn.Embedding(11, 6, mesh=mesh, **F64)

        def init(self, seed):
            return {"lin": self.lin.init(seed, "lin"), "emb": self.emb.init(seed, "emb")}

        def __call__(self, p, ids):
            logits = self.lin(p["lin"], self.emb(p["emb"], ids))
            return nn.cross_entropy(logits, ids, self.emb.iota(2))
    compare(Head, [ids], mesh, loss_of=lambda m, prm, ids: m(prm, ids))


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_attention_and_mlp(world, dp, tp):
    mesh = get_mesh(dp, tp)
    x = rand(4, 5, 8, seed=3)
    compare(lambda m: nn.Attention(8, 4, mesh=m, **F64), [x], mesh)
    compare(lambda m: nn.SwiGLUMLP(8, 12, mesh=m, **F64), [x], mesh)


@pytest.mark.parametrize("dp,tp", SHAPES)
@pytest.mark.parametrize("remat", ["none", "every_other"])
def test_transformer(world, dp, tp, remat):
    mesh = get_mesh(dp, tp)
    tok = np.random.default_rng(4).integers(0, 13, (4, 7))
    x, y = tok[:, :-1], tok[:, 1:]

    def make(m):
        return nn.Transformer(13, 8, 2, 2, 6, mesh=m, remat=remat, **F64)
    compare(make, [x, y], mesh, loss_of=lambda m, prm, x, y: m.loss(prm, x, y))
