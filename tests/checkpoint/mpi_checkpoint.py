"""Distributed checkpoints (issue 7, item 5): save/load, resharding, atomicity, checksums,
the save report; and a DTensor's own persistence (pickle) and NumPy calls on real shards."""
import json
import os
import pickle
import re

import numpy as np
import pytest
from mpi4py import MPI

from tessera_rt import dist
from tessera_rt.dtypes import resolve_dtype


@pytest.fixture
def ckpt_dir(world, tmp_path_factory):
    path = None
    if world.rank == 0:
        path = str(tmp_path_factory.mktemp("ckpt") / "run")
    return MPI.COMM_WORLD.bcast(path, root=0)


def _meshes(n):
    out = [dist.Mesh(axes=["dp"], shape={"dp": n})]
    if n == 4:
        out.append(dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2}))
    return out


def _spec(mesh, kind):
    a = mesh.axes
    return {"rows": dist.ShardSpec(partition=("row",), mesh_axes=(a[0],)),
            "cols": dist.ShardSpec(partition=("col",), mesh_axes=(a[-1],)),
            "rep": dist.ReplicateSpec(mesh_axes=a),
            "both": dist.ShardSpec(partition=("row", "col"), mesh_axes=a) if len(a) == 2 else
            dist.ShardSpec(partition=("row",), mesh_axes=a)}[kind]


def test_save_then_load_onto_every_layout_and_mesh(world, ckpt_dir):
    n = world.size
    rng = np.random.default_rng(7)
    W = rng.standard_normal((7, 5)).astype(np.float32)          # 7 rows: uneven at 2, 3, 4 ranks
    E = rng.standard_normal((5, 3)).astype(np.float64)
    src = _meshes(n)[-1]
    state = {"model": {"w": dist.distribute(W, layout=_spec(src, "rows"), mesh=src),
                       "e": dist.distribute(E, layout=_spec(src, "cols"), mesh=src)},
             "opt": {"m": np.arange(6, dtype=np.int64)}, "step": 12, "name": "run-a"}
    dist.save(state, ckpt_dir)
    index = json.load(open(os.path.join(ckpt_dir, "index.json")))
    assert index["tensors"]["model/w"]["shape"] == [7, 5] and index["values"]["step"] == 12
    assert all(len(f["sha256"]) == 64 for f in index["files"].values())
    for mesh in _meshes(n):
        for kind in ("rows", "cols", "rep", "both"):
            like = {"model": {"w": dist.zeros((7, 5), layout=_spec(mesh, kind), mesh=mesh),
                              "e": dist.zeros((5, 3), layout=_spec(mesh, "rows"), mesh=mesh, dtype="float64")},
                    "opt": {"m": np.zeros(6, np.int64)}, "step": 0}
            got = dist.load(ckpt_dir, like=like)
            assert got["step"] == 12 and "name" not in got
            assert got["model"]["w"].layout == like["model"]["w"].layout
            assert np.array_equal(got["model"]["w"].full_tensor(), W)
            assert np.array_equal(got["model"]["e"].full_tensor(), E)
            assert np.array_equal(got["opt"]["m"], np.arange(6))
    whole = dist.load(ckpt_dir)
    assert np.array_equal(whole["model"]["w"], W) and whole["name"] == "run-a"


def test_bf16_partial_and_a_second_save_replacing_the_first(world, ckpt_dir):
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    bf16 = resolve_dtype("bf16")
    A = (np.arange(12, dtype=np.float32).reshape(4, 3) / 4).astype(bf16)
    X = dist.distribute(A, layout=dist.ShardSpec(partition=("col",), mesh_axes=("dp",)), mesh=mesh)
    P = dist.from_local(np.ones((2, 2), np.float32), layout=dist.PartialSpec(op="sum", mesh_axes=("dp",)),
                        mesh=mesh, shape=(2, 2))
    first = dist.save({"x": X, "p": P}, ckpt_dir)
    info = dist.save({"x": X, "p": P, "v": 2}, ckpt_dir)
    if world.rank == 0:
        assert len([d for d in os.listdir(ckpt_dir) if d.startswith("data-")]) == 1
        on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt_dir) for f in fs)
        assert info.bytes == on_disk and info.files == world.size + 1
    # the same report on every rank: the previous save's data replaced, nothing left over
    assert info.replaced_bytes > 0 and info.leftovers == [] and info.left_bytes == 0 and first.leftovers == []
    assert MPI.COMM_WORLD.allgather(info.summary()) == [info.summary()] * world.size
    got = dist.load(ckpt_dir, like={"x": dist.zeros((4, 3), mesh=mesh, dtype=bf16),
                                    "p": dist.zeros((2, 2), mesh=mesh)})
    assert got["x"].dtype == bf16 and np.array_equal(got["x"].full_tensor(), A)
    assert np.array_equal(got["p"].full_tensor(), np.full((2, 2), world.size, np.float32))


def test_a_corrupted_piece_is_named_on_every_rank(world, ckpt_dir):
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    W = np.arange(40, dtype=np.float32).reshape(8, 5)
    dist.save({"layer": {"w": dist.distribute(W, layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)),
                                              mesh=mesh)}}, ckpt_dir)
    victim = world.size - 1
    if world.rank == 0:
        index = json.load(open(os.path.join(ckpt_dir, "index.json")))
        f = os.path.join(ckpt_dir, index["data_dir"], f"rank{victim:05d}.safetensors")
        blob = bytearray(open(f, "rb").read())
        blob[-3] ^= 0xFF                                       # flip bits in the tensor data
        open(f, "wb").write(bytes(blob))
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(dist.CheckpointError) as e:
        dist.load(ckpt_dir, like={"layer": {"w": dist.zeros((8, 5), mesh=mesh)}})
    msg = str(e.value)
    assert f"rank{victim:05d}.safetensors fails its sha256 check" in msg, msg
    assert "['layer/w'] differ" in msg, msg


def test_missing_checkpoint_and_wrong_shape_are_clear_errors(world, ckpt_dir):
    with pytest.raises(dist.CheckpointError, match="no checkpoint at"):
        dist.load(ckpt_dir + "-nothing")
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    dist.save({"w": dist.zeros((4, 4), mesh=mesh)}, ckpt_dir)
    with pytest.raises(dist.CheckpointError, match=r"'w' was saved with shape \(4, 4\) and dtype float32, `like` "
                                                   r"has \(4, 5\) and float32; the saved entry is a dtensor of shape "
                                                   r"\(4, 4\) float32.*passed by ranks \[0.*, in data-\S+/rank00000"):
        dist.load(ckpt_dir, like={"w": dist.zeros((4, 5), mesh=mesh)})
    with pytest.raises(dist.CheckpointError, match=r"'w' was saved with shape \(4, 4\) and dtype float32, `like` "
                                                   r"has \(4, 4\) and float64"):
        dist.load(ckpt_dir, like={"w": dist.zeros((4, 4), mesh=mesh, dtype="float64")})
    with pytest.raises(dist.CheckpointError, match=r"has no entry 'v' \(.*index.json lists 1: \['w'\]\); no rank saved"):
        dist.load(ckpt_dir, like={"v": 1})


def test_a_dtensor_pickles_on_its_own_rank_and_numpy_calls_run_on_shards(world):
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    W = np.arange(35, dtype=np.float32).reshape(7, 5) / 10          # 7 rows: uneven at 2, 3, 4 ranks
    X = dist.distribute(W, layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)), mesh=mesh)
    Y = pickle.loads(pickle.dumps(X))
    assert Y.layout == X.layout and np.array_equal(Y.to_local(), X.to_local())
    assert np.array_equal(Y.full_tensor(), W)
    np.testing.assert_allclose(np.sum(X, axis=0).full_tensor(), W.sum(0), rtol=1e-6)
    np.testing.assert_allclose(np.max(np.exp(X)).full_tensor(), np.exp(W).max(), rtol=1e-6)
    np.testing.assert_allclose(np.matmul(X, np.transpose(X)).full_tensor(), W @ W.T, rtol=1e-5)
    blob = MPI.COMM_WORLD.bcast(pickle.dumps(X) if world.rank == 0 else None, root=0)
    if world.rank != 0:                        # rank 0's piece is not this rank's piece
        with pytest.raises(ValueError, match=r"holds rank 0's piece, so it can only be unpickled on rank 0"):
            pickle.loads(blob)


# pipeline stages and experts: each stage saves its own blocks (named by their global layer
# number), so ranks pass different trees; the index holds every rank's entries
V, D, H, S = 11, 8, 2, 5
MOE = dict(num_experts=4, top_k=2, capacity_factor=None)


def _pp_meshes(n):
    """(mesh shape, MoE, virtual stages): pp = the world size (one-rank stages compute on plain
    arrays), at 2 ranks also interleaved (stage 0 holds layers 0 and 2); at 4 ranks stages of 2
    ranks over dp, over tp, and over ep with MoE blocks (pp2 x ep2)."""
    out = [({"pp": n}, None, 1)] if n > 1 else []
    out += [({"pp": 2}, None, 2)] if n == 2 else []
    return out + ([({"pp": 2, "dp": 2}, None, 1), ({"pp": 2, "tp": 2}, None, 1), ({"pp": 2, "ep": 2}, MOE, 1)]
                  if n == 4 else [])


def _flat(tree):
    from tessera_rt.dist.checkpoint.format import flatten
    return flatten(tree)


def _full(x):
    return x.full_tensor() if type(x) is dist.DTensor else np.asarray(x)


def test_pipeline_and_expert_stages_round_trip_exactly(world, ckpt_dir):
    from tessera_rt import nn
    for shape, moe, virtual in _pp_meshes(world.size):
        mesh = dist.Mesh(axes=list(shape), shape=shape)
        model = nn.Transformer(V, D, H, 4, S, mesh=mesh, moe=moe, virtual_stages=virtual)
        params = model.init(seed=3)
        dist.save({"params": model.checkpoint_tree(params), "step": 5}, ckpt_dir)
        index = json.load(open(os.path.join(ckpt_dir, "index.json")))
        last_stage = sorted(int(r) for r in np.asarray(mesh.device_grid)[-1].reshape(-1))
        assert index["tensors"]["params/norm/w"]["ranks"] == last_stage         # held by the last stage only
        assert sorted(k for k in index["tensors"] if k.endswith("attn/q/w")) == [
            f"params/blocks/{i}/attn/q/w" for i in range(4)]
        # the same mesh: each rank gets its own stage's pieces back, bit for bit
        got = dist.load(ckpt_dir, like={"params": model.checkpoint_tree(model.init(seed=0)), "step": 0})
        assert got["step"] == 5
        back = _flat(model.from_checkpoint_tree(got["params"]))
        saved = _flat(params)
        assert list(back) == list(saved)
        for k, a in saved.items():
            b = back[k]
            assert type(a) is type(b) and (type(a) is not dist.DTensor or a.layout == b.layout), k
            assert np.array_equal(np.asarray(a.to_local() if type(a) is dist.DTensor else a),
                                  np.asarray(b.to_local() if type(b) is dist.DTensor else b)), k
        # onto one un-split model (the structure init() returns, lists included) on every
        # rank: every stage's saved values, gathered from the stages that saved them
        expected = {}
        for part in MPI.COMM_WORLD.allgather({f"params/{k}": _full(v)
                                              for k, v in _flat(model.checkpoint_tree(params)).items()}):
            expected.update(part)
        whole = dist.load(ckpt_dir, like={"params": nn.Transformer(V, D, H, 4, S, moe=moe).init(seed=0)})
        assert isinstance(whole["params"]["blocks"], list) and len(whole["params"]["blocks"]) == 4
        flat = {f"params/{k}": v for k, v in _flat(whole["params"]).items()}
        assert sorted(flat) == sorted(expected)
        for k, v in flat.items():
            assert np.array_equal(v, expected[k]), k
        MPI.COMM_WORLD.Barrier()


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs stages")
def test_stages_that_reuse_each_others_names_are_refused(world, ckpt_dir):
    from tessera_rt import nn
    for shape, moe, _ in [m for m in _pp_meshes(world.size) if m[2] == 1][:2]:
        mesh = dist.Mesh(axes=list(shape), shape=shape)
        model = nn.Transformer(V, D, H, 4, S, mesh=mesh, moe=moe)
        params = model.init(seed=3)
        # every stage's own blocks under "blocks/0", ...: saved as they were, stage 1 would
        # later read stage 0's weights
        with pytest.raises(dist.CheckpointError, match=r"ranks 0 and \d disagree about 'params/blocks/0/\S+': rank 0 "
                                                       r"passed a (dtensor|array) of shape .*checkpoint_tree"):
            dist.save({"params": params}, ckpt_dir)
        assert not os.path.exists(os.path.join(ckpt_dir, "index.json"))
        if "dp" in shape:        # loading with such names onto DTensor stages is refused too
            dist.save({"params": model.checkpoint_tree(params)}, ckpt_dir)
            with pytest.raises(dist.CheckpointError, match=r"ranks 0 and 2 load 'params/blocks/0/\S+' as DTensors on "
                                                           r"different meshes \(of ranks \[0, 1\] and \[2, 3\]\)"):
                dist.load(ckpt_dir, like={"params": model.init()})
    with pytest.raises(dist.CheckpointError, match=r"ranks 0 and 1 disagree about 'step': rank 0 passed the value 0, "
                                                   r"rank 1 passed the value 1"):
        dist.save({"step": world.rank}, ckpt_dir)
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    W = dist.zeros((4, 4), mesh=mesh)
    with pytest.raises(dist.CheckpointError, match=r"'w' is a dtensor .* but rank\(s\) \[1.*\] of that mesh did not "
                                                   r"pass it \(only ranks \[0\] did\)"):
        dist.save({"w": W} if world.rank == 0 else {}, ckpt_dir)


# ------------------------------------------------------------------ asynchronous saves

def _row_state(mesh, version):
    W = np.arange(56, dtype=np.float32).reshape(8, 7) * version
    return {"w": dist.distribute(W, layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)), mesh=mesh),
            "a": np.full(3, version, np.int64), "step": version}, W


def _saved_step(ckpt_dir):
    return MPI.COMM_WORLD.bcast(json.load(open(os.path.join(ckpt_dir, "index.json")))["values"]["step"]
                                if MPI.COMM_WORLD.rank == 0 else None, root=0)


@pytest.mark.timeout(120)
def test_an_async_save_snapshots_the_state_and_commits_only_when_every_rank_wrote(world, ckpt_dir):
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    dist.save(_row_state(mesh, 1)[0], ckpt_dir)
    state, W2 = _row_state(mesh, 2)
    h = dist.save(state, ckpt_dir, async_=True)
    assert isinstance(h, dist.checkpoint.SaveHandle)
    # the training goes on: it changes the state in place and runs collectives while the
    # files are written; nothing is committed before every rank says its write is done
    state["w"].to_local()[...] = -1
    state["a"][...] = -1
    for _ in range(3):
        dist.all_reduce(np.ones(4), axis="dp", mesh=mesh)
    assert _saved_step(ckpt_dir) == 1
    while not h.poll():                  # collective: every rank polls at the same points
        dist.all_reduce(np.ones(4), axis="dp", mesh=mesh)
    assert h.done() and _saved_step(ckpt_dir) == 2 and h.wait() == os.path.join(ckpt_dir, "index.json")
    got = dist.load(ckpt_dir, like=_row_state(mesh, 0)[0])
    assert got["step"] == 2 and np.array_equal(got["w"].full_tensor(), W2) and list(got["a"]) == [2, 2, 2]
    # the next save (or load) waits for the one in flight: at most one at a time
    h3 = dist.async_save(_row_state(mesh, 3)[0], ckpt_dir)
    info = dist.save(_row_state(mesh, 4)[0], ckpt_dir)
    assert h3.wait().replaced_bytes > 0 and _saved_step(ckpt_dir) == 4 and info.leftovers == []


@pytest.mark.timeout(120)
def test_an_async_save_that_fails_on_one_rank_raises_at_the_next_save_naming_it(world, ckpt_dir, monkeypatch):
    from tessera_rt.dist.checkpoint import files
    mesh = dist.Mesh(axes=["dp"], shape={"dp": world.size})
    dist.save(_row_state(mesh, 1)[0], ckpt_dir)
    victim = world.size - 1
    if world.rank == victim:
        def disk_full(path, data):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(files, "write_atomic", disk_full)
    dist.save(_row_state(mesh, 2)[0], ckpt_dir, async_=True)         # returns: the write fails on the worker
    with pytest.raises(dist.CheckpointError) as e:
        dist.save(_row_state(mesh, 3)[0], ckpt_dir)
    msg = str(e.value)
    assert re.search(rf"rank {victim}: dist.save\(.*\): writing data-\S+/rank{victim:05d}.safetensors failed: "
                     r".*No space left on device", msg), msg
    assert "an asynchronous dist.save" in msg and "the previous checkpoint is unchanged" in msg, msg
    monkeypatch.undo()
    assert dist.load(ckpt_dir)["step"] == 1                     # the failed save never committed
    dist.save(_row_state(mesh, 3)[0], ckpt_dir, async_=True).wait()
    assert dist.load(ckpt_dir)["step"] == 3
