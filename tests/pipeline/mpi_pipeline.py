"""dist.Pipeline at 1-4 ranks: the loss and every gradient of a stage-split Transformer
equal the single-process result (float64) on every pp mesh of the job (pp alone, pp x dp,
pp x tp, and pp x ep with MoE blocks in the stages), for each schedule, with micro-batch
counts that do and do not divide the batch; parameter bytes per rank fall with pp; stats,
the Chrome trace and bad input; train.py with --pp (and --ep) matches one process.

Kept cheap (it launches at 4 rank counts): small models (pp + 1 layers: an uneven split),
one micro-batch count per schedule (gpipe m=4 does not divide the batch of 6, 1f1b m=3
does and is below pp=4's warm-up), references computed once per job."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, graph, nn, op
from tessera_rt.autodiff import tree_flatten

SIZE = MPI.COMM_WORLD.Get_size()
V, D, H, S, B = 11, 8, 2, 5, 6
pytestmark = pytest.mark.timeout(60)

# every mesh with a pp axis this job can make (pp > 1 where the rank count allows)
MESHES = [{"pp": SIZE}] + ([{"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}] if SIZE == 4 else [])
# MoE blocks in the stages (pp x ep): ep=2 at 4 ranks, else ep=1 inside every stage; the
# balance and z losses weigh enough that a stage that drops its own term fails the test
MOE = dict(num_experts=4, top_k=2, capacity_factor=None, aux_coef=0.1, z_coef=0.01)
MOE_MESHES = [{"pp": 2, "ep": 2}] if SIZE == 4 else [{"pp": SIZE, "ep": 1}]
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


def reference(n_layers, remat="none", rows=B, moe=False, m=1):
    """The single-process loss and gradients (plain arrays, f64).  With MoE blocks, the loss
    of each of the ``m`` micro-batches weighted by its rows (gradient accumulation: the
    balance loss is per micro-batch); without, the batch mean (the same thing)."""
    m = m if moe else 1
    return once((n_layers, remat, rows, moe, m), lambda: _reference(n_layers, remat, rows, moe, m))


def _reference(n_layers, remat, rows, moe, m):
    x, y = batch(rows=rows)
    ref = nn.Transformer(V, D, H, n_layers, S, dtype="float64", remat=remat, moe=MOE if moe else None)
    parts = np.array_split(np.arange(rows), m)
    return ts.value_and_grad(lambda p: sum_of([op.mul(ref.loss(p, x[i], y[i]), len(i) / rows) for i in parts]))(
        ref.init(1))


def once(key, compute):
    """A single-process reference, computed by rank 0 only and sent to the others (the
    ranks share 2 cores in CI), then kept for the rest of the job."""
    if key not in _REF:
        _REF[key] = MPI.COMM_WORLD.bcast(compute() if MPI.COMM_WORLD.rank == 0 else None)
    return _REF[key]


def sum_of(terms):
    out = terms[0]
    for t in terms[1:]:
        out = op.add(out, t)
    return out


def local(g):
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def check(shape, schedule, m, n_layers, virtual=1, stage_of=None, remat="none", rows=B, moe=False):
    mesh = get_mesh(shape)
    model = nn.Transformer(V, D, H, n_layers, S, mesh=mesh, dtype="float64", virtual_stages=virtual,
                           stage_of=stage_of, remat=remat, moe=MOE if moe else None)
    params = model.init(1)
    pipe = dist.Pipeline(model, mesh=mesh, axis="pp", microbatches=m, schedule=schedule)
    loss, grads = pipe.value_and_grad(params, *batch(rows=rows))
    rl, rg = reference(n_layers, remat, rows, moe, m)
    np.testing.assert_allclose(loss, float(rl), rtol=1e-12)
    want = {k: rg[k] if k != "blocks" else [rg["blocks"][i] for i in model.stage_plan.local_layers] for k in grads}
    got, paths, _ = tree_flatten(grads)
    assert len(got) == len(tree_flatten(params)[0]) and paths == tree_flatten(want)[1]
    for g, r, p, path in zip(got, tree_flatten(want)[0], tree_flatten(params)[0], paths):
        assert getattr(g, "layout", None) == getattr(p, "layout", None), path
        np.testing.assert_allclose(local(g), r, rtol=1e-9, atol=1e-13, err_msg=f"{shape} {schedule} m={m} {path}")
    return pipe, model


def mesh_id(shape):
    return "x".join(f"{k}{v}" for k, v in shape.items())


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
def test_loss_and_grads_equal_single_rank(world, shape):
    # pp + 1 layers split unevenly; gpipe m=4 does not divide the batch of 6, 1f1b m=3 does
    for schedule, m in (("gpipe", 4), ("1f1b", 3)):
        check(shape, schedule, m, n_layers=shape["pp"] + 1)


@pytest.mark.parametrize("shape", MOE_MESHES, ids=mesh_id)
def test_moe_blocks_in_stages_equal_single_rank(world, shape):
    """pp x ep: every stage's MoE balance/z terms reach the loss and their gradients (a
    non-last stage seeds its own term); micro-batches must keep dp x ep shards whole."""
    pp, ep = shape["pp"], shape["ep"]
    for schedule, m in (("gpipe", 3), ("1f1b", 3 if ep > 1 else 4)):      # 4: uneven rows (ep = 1)
        check(shape, schedule, m, n_layers=pp + 1, moe=True)
    if pp == 2 and ep == 1:    # two chunks per rank: the last rank seeds a non-last chunk's term too
        check(shape, "interleaved", 2, n_layers=4, virtual=2, moe=True)
    if ep > 1:
        model = nn.Transformer(V, D, H, pp + 1, S, mesh=get_mesh(shape), dtype="float64", moe=MOE)
        pipe = dist.Pipeline(model, microbatches=4)
        with dist.trace_collectives() as log:
            with pytest.raises(ValueError, match=r"\[1, 2\] sequences.*need a multiple of 2"):
                pipe.value_and_grad(model.init(1), *batch())
        assert log.count() == 0


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
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
    pp, m = SIZE, 4
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


# pp alone, pp x dp with interleaving and remat (pp x tp is covered gradient by gradient
# above), pp x ep with MoE blocks, and one rank through a one-stage pipeline (--microbatches)
MOE_ARGS = ["--experts", "4", "--microbatches", "2"]
TRAIN_CASES = ([["--pp", str(SIZE)]] if SIZE > 1 else [["--pp", "1"] + MOE_ARGS]) + (
    [["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--microbatches", "2", "--remat", "every_other"],
     ["--pp", "2", "--ep", "2"] + MOE_ARGS] if SIZE == 4 else [])


@pytest.mark.parametrize("extra", TRAIN_CASES, ids=lambda a: "-".join(a).replace("--", ""))
def test_train_script_with_pp_matches_single_rank(world, extra):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from mpi_train import ARGS, TRAIN, reference_losses
    args = ARGS + ["--layers", "4", "--steps", "2"] + extra
    # the dense reference does not depend on pp; the MoE ones use the same 2 micro-batches
    ref = once(("train", "--experts" in extra), lambda: reference_losses(TRAIN.parse_args(args)))
    out = TRAIN.train(TRAIN.parse_args(args))
    assert out["pp"] == int(extra[1]) and len(out["bubbles"]) == len(ref)
    np.testing.assert_allclose(out["losses"], ref, rtol=1e-4)
    if "--experts" in extra:
        assert out["moe"]["dropped"] == 0
