"""dist.Pipeline at 1-4 ranks: the loss and every gradient of a stage-split Transformer
equal the single-process result (float64) on every pp mesh of the job (pp alone, pp x dp,
pp x tp), for each schedule, with micro-batch counts that do and do not divide the batch;
parameter bytes per rank fall with pp; stats, the Chrome trace and bad input."""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, graph, nn
from tessera_rt.autodiff import tree_flatten

SIZE = MPI.COMM_WORLD.Get_size()
V, D, H, S, B = 11, 8, 2, 5, 6
pytestmark = pytest.mark.timeout(60)

# every mesh with a pp axis this job can make (pp > 1 where the rank count allows)
MESHES = [{"pp": SIZE}] + ([{"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}] if SIZE == 4 else [])
_MESHES: dict = {}
_REF: dict = {}


def get_mesh(shape: dict):
    key = tuple(shape.items())
    if key not in _MESHES:
        dist.init()
        _MESHES[key] = dist.Mesh(axes=list(shape), shape=shape)
    return _MESHES[key]


def batch(seed=0, rows=B):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (rows, S)), rng.integers(0, V, (rows, S))


def reference(n_layers, remat="none", rows=B):
    """The single-process loss and gradients (plain arrays, f64)."""
    key = (n_layers, remat, rows)
    if key not in _REF:
        x, y = batch(rows=rows)
        ref = nn.Transformer(V, D, H, n_layers, S, dtype="float64", remat=remat)
        _REF[key] = ts.value_and_grad(lambda p: ref.loss(p, x, y))(ref.init(1))
    return _REF[key]


def local(g):
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def check(shape, schedule, m, n_layers, virtual=1, stage_of=None, remat="none", rows=B):
    mesh = get_mesh(shape)
    model = nn.Transformer(V, D, H, n_layers, S, mesh=mesh, dtype="float64", virtual_stages=virtual,
                           stage_of=stage_of, remat=remat)
    params = model.init(1)
    pipe = dist.Pipeline(model, mesh=mesh, axis="pp", microbatches=m, schedule=schedule)
    loss, grads = pipe.value_and_grad(params, *batch(rows=rows))
    rl, rg = reference(n_layers, remat, rows)
    np.testing.assert_allclose(loss, float(rl), rtol=1e-12)
    want = {k: rg[k] if k != "blocks" else [rg["blocks"][i] for i in model.stage_plan.local_layers] for k in grads}
    got, paths, _ = tree_flatten(grads)
    assert len(got) == len(tree_flatten(params)[0]) and paths == tree_flatten(want)[1]
    for g, r, p, path in zip(got, tree_flatten(want)[0], tree_flatten(params)[0], paths):
        assert getattr(g, "layout", None) == getattr(p, "layout", None), path
        np.testing.assert_allclose(local(g), r, rtol=1e-9, atol=1e-13, err_msg=f"{shape} {schedule} m={m} {path}")
    return pipe, model


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_loss_and_grads_equal_single_rank(world, shape, schedule):
    # 5 layers split unevenly over every pp; m=3 divides the batch of 6, m=4 does not
    for m in ((3, 4) if schedule == "1f1b" else (4,)):
        check(shape, schedule, m, n_layers=5)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_interleaved_virtual_stages(world, shape):
    pp = shape["pp"]      # 2 pp micro-batches (uneven rows at pp=2); pp=4 also m == pp (all warm-up)
    check(shape, "interleaved", 2 * pp, n_layers=2 * pp, virtual=2, rows=max(B, 2 * pp))
    if pp == 4:
        check(shape, "interleaved", pp, n_layers=2 * pp, virtual=2)


def test_explicit_split_and_remat(world):
    pp = SIZE
    stage_of = [0] + [min(i, pp - 1) for i in range(1, 5)] if pp > 1 else None
    check({"pp": pp}, "1f1b", 4, n_layers=5, stage_of=stage_of, remat="every_other")


def test_parameter_bytes_per_rank_fall_with_pp(world):
    full = nn.Transformer(V, D, H, 4, S, dtype="float64").init(1)
    total = sum(a.nbytes for a in tree_flatten(full)[0])
    model = nn.Transformer(V, D, H, 4, S, mesh=get_mesh({"pp": SIZE}), dtype="float64")
    mine = sum(local(a).nbytes for a in tree_flatten(model.init(1))[0])     # pp alone: plain arrays
    assert MPI.COMM_WORLD.allreduce(mine) == total         # every parameter on exactly one stage
    if SIZE > 1:
        assert MPI.COMM_WORLD.allreduce(mine, op=MPI.MAX) < total * 0.75


def test_stats_peak_live_and_grad_reduce_after_last_backward(world, tmp_path):
    pp, m = SIZE, 6
    mesh = get_mesh({"pp": pp})
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        model = nn.Transformer(V, D, H, max(pp, 2), S, mesh=mesh, dtype="float64")
        pipe = dist.Pipeline(model, microbatches=m, schedule=schedule)
        trace = str(tmp_path / "pp.json") if MPI.COMM_WORLD.rank == 0 else None
        trace = MPI.COMM_WORLD.bcast(trace)
        with graph.profile(trace=trace, print_table=False):
            pipe.value_and_grad(model.init(1), *batch())
        st = pipe.stats()
        peaks[schedule] = st.peak_live
        assert len(st.busy) == pp and all(0 < b <= w for b, w in zip(st.busy, st.wall))
        assert 0 <= st.bubble < 1 and str(st).startswith(f"pipeline {schedule}")
        # the chunk's gradient reduction is issued right after its last backward
        kinds = [(k, mb) for k, _, mb, _, _ in pipe.timeline]
        assert kinds[-1] == ("R", -1) and kinds[-2][0] == "B"
        if MPI.COMM_WORLD.rank == 0:
            ev = json.load(open(trace))["traceEvents"]
            rows = {e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
            assert {f"pp stage {s}" for s in range(pp)} <= rows
            spans = [e["name"] for e in ev if e.get("cat") == "pipeline" and e["pid"] == 0]
            assert [n for n in spans if n.startswith("F")] == [f"F{i}" for i in range(m)]
            os.remove(trace)
    assert peaks["gpipe"] == [m] * pp
    assert peaks["1f1b"] == [pp - s for s in range(pp)]            # at most pp micro-batches alive


def test_bad_input_errors_before_anything_is_sent(world):
    mesh = get_mesh({"pp": SIZE})
    with pytest.raises(ValueError, match="pipeline stages but only"):
        nn.Transformer(V, D, H, 1, S, mesh=mesh, virtual_stages=2)
    with pytest.raises(ValueError, match="do not divide over"):
        nn.Transformer(V, D, H, 2 * SIZE + 1, S, mesh=mesh, virtual_stages=2)
    model = nn.Transformer(V, D, H, 2 * SIZE, S, mesh=mesh, dtype="float64")
    for m in (0, -1, 1.5):
        with pytest.raises(ValueError, match="microbatches"):
            dist.Pipeline(model, microbatches=m)
    with pytest.raises(ValueError, match="'gpipe', '1f1b', 'interleaved'"):
        dist.Pipeline(model, schedule="zero-bubble")
    with pytest.raises(ValueError, match="virtual stages"):
        dist.Pipeline(model, microbatches=SIZE, schedule="interleaved")
    with pytest.raises(ValueError, match="no 'pp' axis|needs a mesh with a 'pp' axis"):
        dist.Pipeline(model, mesh=get_mesh({"dp": SIZE}))
    pipe = dist.Pipeline(model, microbatches=B + 1)
    with dist.trace_collectives() as log:
        with pytest.raises(ValueError, match="larger than the batch"):
            pipe.value_and_grad(model.init(1), *batch())
    assert log.count() == 0
    with pytest.raises(ValueError, match="split over pipeline stages"):
        model.loss(model.init(1), *batch())


@pytest.mark.skipif(SIZE < 2, reason="needs two stages")
def test_ranks_that_disagree_are_named_before_data_moves(world):
    mesh = get_mesh({"pp": SIZE})
    model = nn.Transformer(V, D, H, SIZE, S, mesh=mesh, dtype="float64")
    pipe = dist.Pipeline(model, microbatches=2)
    rows = B + (MPI.COMM_WORLD.rank == SIZE - 1)
    with pytest.raises(ValueError, match=r"\(stage \d\) and rank \d \(stage \d\) disagree on \['batch'\]"):
        pipe.value_and_grad(model.init(1), *batch(rows=rows))


# pp alone, and pp x dp with interleaving and remat (pp x tp is covered gradient by gradient above)
TRAIN_CASES = ([["--pp", str(SIZE)]] if SIZE > 1 else []) + (
    [["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--microbatches", "2", "--remat", "every_other"]]
    if SIZE == 4 else [])


@pytest.mark.parametrize("extra", TRAIN_CASES, ids=lambda a: "-".join(a).replace("--", ""))
def test_train_script_with_pp_matches_single_rank(world, extra):
    from test_train import ARGS, TRAIN, reference_losses
    args = ARGS + ["--layers", "4"]
    ref = _REF.get("train") or _REF.setdefault("train", reference_losses(TRAIN.parse_args(args)))
    out = TRAIN.train(TRAIN.parse_args(args + extra))
    assert out["pp"] == int(extra[1]) and len(out["bubbles"]) == len(ref)
    np.testing.assert_allclose(out["losses"], ref, rtol=1e-4)
