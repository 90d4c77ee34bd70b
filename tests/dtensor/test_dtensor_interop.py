"""DTensor interop with NumPy, DLPack (torch/cupy) and pickle, and what dist.distribute takes
(one rank; tests/checkpoint/mpi_checkpoint.py repeats pickling and np.* on real shards)."""
import copy
import pickle

import numpy as np
import pytest

from tessera_rt import dist


@pytest.fixture
def mesh():
    return dist.Mesh(axes=["tp", "dp"], shape={"tp": 1, "dp": 1})


@pytest.fixture
def X(mesh):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    return dist.distribute(a, layout=dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp")), mesh=mesh)


@pytest.mark.parametrize("value, name", [("abc", "str"), (None, "NoneType"), ({"a": 1}, "dict"),
                                         (object(), "object"), (np.array(["x"]), "ndarray of dtype <U1"),
                                         ([1, "a"], "list of dtype <U21")])
def test_distribute_refuses_non_arrays_naming_the_type(mesh, value, name):
    with pytest.raises(TypeError, match=rf"dist.distribute takes a numeric array .* got a {name}; make it one"):
        dist.distribute(value, mesh=mesh)


def test_distribute_refuses_a_dtensor_and_keeps_0d_arrays_0d(mesh, X):
    with pytest.raises(TypeError, match=r"got a DTensor .* use X.redistribute\(layout\)"):
        dist.distribute(X, mesh=mesh)
    for v in (np.array(2.5, np.float32), np.float64(2.5), 2.5):
        S = dist.distribute(v, mesh=mesh)
        assert S.shape == () and S.to_local().shape == () and S.full_tensor() == 2.5
    assert dist.distribute([[1, 2]], mesh=mesh).shape == (1, 2)


def test_numpy_functions_and_ufuncs_run_as_dtensor_ops(X):
    x = X.full_tensor()
    cases = {
        "np.sum": (np.sum(X), np.sum(x)), "np.sum axis": (np.sum(X, axis=0), x.sum(0)),
        "np.mean": (np.mean(X, axis=-1, keepdims=True), x.mean(-1, keepdims=True)),
        "np.max": (np.max(X), x.max()), "np.amin": (np.amin(X, axis=1), x.min(1)),
        "np.exp": (np.exp(X), np.exp(x)), "np.tanh": (np.tanh(X), np.tanh(x)),
        "np.matmul": (np.matmul(X, X.T), x @ x.T), "np.dot": (np.dot(X, X.T), x @ x.T),
        "np.add scalar": (np.add(X, 1.5), x + 1.5), "np.float32 * X": (np.float32(2) * X, 2 * x),
        "np.maximum": (np.maximum(X, 0.5), np.maximum(x, 0.5)), "np.less": (np.less(X, X), x < x),
        "np.transpose": (np.transpose(X), x.T), "np.reshape": (np.reshape(X, (4, 3)), x.reshape(4, 3)),
        "np.negative": (-X, -x), "np.square": (np.square(X), x * x),
    }
    for what, (got, want) in cases.items():
        assert type(got) is dist.DTensor, what
        np.testing.assert_allclose(got.full_tensor(), want, rtol=1e-6, err_msg=what)
    assert np.shape(X) == (3, 4) and np.ndim(X) == 2 and np.size(X) == 12


@pytest.mark.parametrize("call, name", [
    (lambda X: np.concatenate([X, X]), "np.concatenate"), (lambda X: np.arctan2(X, X), "np.arctan2"),
    (lambda X: np.add.reduce(X), "np.add.reduce"), (lambda X: np.exp(X, out=np.empty((3, 4))), "np.exp"),
    (lambda X: np.cumsum(X), "np.cumsum"),
])
def test_numpy_calls_without_a_dtensor_rule_refuse_and_say_what_to_use(X, call, name):
    with pytest.raises(TypeError, match=rf"rank 0: {name} .*float32\[3, 4\] \(S\(0\)@tp, S\(1\)@dp\).*"
                                        r"X.to_local\(\) .*X.full_tensor\(\)"):
        call(X)
    with pytest.raises(TypeError, match=r"np.sum on a DTensor takes \['axis', 'keepdims'\] only, got \['dtype'\]"):
        np.sum(X, dtype=np.float64)


def test_dlpack_refuses_with_a_message_naming_to_local(X):
    with pytest.raises(TypeError, match=r"DLPack export .* is not defined for a DTensor .* X.to_local\(\)"):
        np.from_dlpack(X)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"X.to_local\(\)"):
        torch.from_dlpack(X)
    assert torch.from_dlpack(X.to_local()).shape == (3, 4)          # the fix the message names works


def test_pickle_and_deepcopy_rebuild_on_the_same_mesh(X, mesh):
    for Y in (pickle.loads(pickle.dumps(X)), copy.deepcopy(X)):
        assert Y.layout == X.layout and Y.shape == X.shape and Y.dtype == X.dtype and Y.mesh == mesh
        assert np.array_equal(Y.full_tensor(), X.full_tensor()) and Y.to_local() is not X.to_local()
    blob = pickle.dumps(X)
    rebuild, args = X.__reduce__()                  # what pickle calls on load, with what it stored
    with pytest.raises(ValueError, match=r"holds rank 3's piece, so it can only be unpickled on rank 3"):
        rebuild(*args[:5], 3, args[6])
    other = (("ep",), (1,), (0,))                                     # no live mesh like this one
    with pytest.raises(ValueError, match=r"no live Mesh with those axes .* unpickle inside `with mesh:`"):
        rebuild(*args[:4], other, *args[5:])
    assert isinstance(blob, bytes)
