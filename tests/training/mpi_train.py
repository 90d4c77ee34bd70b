"""scripts/train.py: the loss after N steps on every dp x tp mesh of the job equals the
loss of the same loop run on plain arrays in one process (float tolerance)."""
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import tessera_rt as ts
from tessera_rt import dist, nn, op, optim
from tessera_rt.autodiff.engine import tree_flatten

SIZE = MPI.COMM_WORLD.Get_size()
ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(d, SIZE // d) for d in range(1, SIZE + 1) if SIZE % d == 0]      # (dp, tp)
STEPS = 4
# a small text shipped with the tests, so the suite does not depend on ../shared/seeds
CORPUS = ROOT / "tests" / "data" / "tiny_corpus.txt"
ARGS = ["--steps", str(STEPS), "--batch", "4", "--seq", "16", "--d-model", "16", "--heads", "2", "--layers", "2",
        "--lr", "1e-2", "--quiet", "--no-plot", "--no-checkpoint", "--data", str(CORPUS)]


def load_train():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TRAIN = load_train()


def reference_losses(args):
    """The same loop on arrays, one process: the single-rank reference.  With MoE blocks and
    micro-batches (--pp/--microbatches) the loss is accumulated per micro-batch, as the
    pipeline computes it (the balance loss is not linear in the batch)."""
    text = TRAIN.load_text(args.data)
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    moe = TRAIN.moe_config(args)
    model = nn.Transformer(len(chars), args.d_model, args.heads, args.layers, args.seq, moe=moe)
    params = model.init(args.seed)
    opt = optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    m = (args.microbatches or min(2 * args.pp, args.batch)) if moe and (args.pp > 1 or args.microbatches) else 1
    parts = np.array_split(np.arange(args.batch), m)

    def loss_fn(p, x, y):
        if m == 1:
            return model.loss(p, x, y)
        terms = [op.mul(model.loss(p, x[i], y[i]), len(i) / args.batch) for i in parts]
        return functools.reduce(op.add, terms)
    losses = []
    for step in range(args.steps):
        x, y = TRAIN.get_batch(data, step, args.batch, args.seq, args.seed)
        loss, grads = ts.value_and_grad(loss_fn)(params, x, y)
        grads, _ = optim.clip_grad_norm(grads, args.clip)
        params = opt.step(params, grads)
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_losses(TRAIN.parse_args(ARGS))


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_loss_after_n_steps_matches_single_rank(world, reference, dp, tp):
    out = TRAIN.train(TRAIN.parse_args(ARGS + ["--dp", str(dp), "--tp", str(tp)]))
    assert out["dp"] == dp and out["tp"] == tp
    np.testing.assert_allclose(out["losses"], reference, rtol=2e-5)
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", ["0", "0.002"])
def test_loss_with_gradient_buckets_or_none(world, reference, cap):
    """One all-reduce per parameter, and 2 KiB buckets (several per step, the big gradients
    alone), on the widest dp mesh, on dp x tp, and on tp=3 (uneven shards: every rank must
    make the same bucket decisions, or the ranks' collective counts differ and the agreement
    check hung): the same losses as one process."""
    dp, tp = {4: (2, 2), 3: (1, 3)}.get(SIZE, (SIZE, 1)) if cap != "0" else (SIZE, 1)
    out = TRAIN.train(TRAIN.parse_args(ARGS + ["--dp", str(dp), "--tp", str(tp), "--grad-bucket-mb", cap]))
    np.testing.assert_allclose(out["losses"], reference, rtol=2e-5)


@pytest.mark.timeout(120)
def test_heads_that_do_not_split_over_tp_match_single_rank(world):
    """4 heads over tp = world size (uneven at 3 ranks: q, k and v are gathered beside their
    shards every layer, through compiled redistribution plans): the same losses as one
    process.  Kept plan outputs once let the gathered q and k share a buffer here."""
    args = ARGS + ["--heads", "4", "--d-model", "64", "--seq", "64", "--batch", "8", "--steps", "2"]
    ref = reference_losses(TRAIN.parse_args(args))
    out = TRAIN.train(TRAIN.parse_args(args + ["--dp", "1", "--tp", str(SIZE)]))
    np.testing.assert_allclose(out["losses"], ref, rtol=2e-5)


def test_checkpoint_and_bad_mesh(world, tmp_path):
    out_dir = MPI.COMM_WORLD.bcast(str(tmp_path), root=0)
    args = [a for a in ARGS if a != "--no-checkpoint"] + ["--steps", "1", "--out", out_dir]
    TRAIN.train(TRAIN.parse_args(args))
    ck = dist.load(str(Path(out_dir) / "checkpoint"))       # collective; whole arrays on every rank
    assert ck["params"]["head"]["w"].shape[0] == 16 and ck["step"] == 1
    assert ck["optimizer"]["masters"]["head"]["w"].dtype == np.float32 and ck["optimizer"]["t"] == 1
    assert ck["optimizer"]["v"]["head"]["w"].shape == ck["params"]["head"]["w"].shape
    assert set(ck["params"]["blocks"]) == {"0", "1"}
    # the structure model.init() returns (the blocks a list) reads it back (issue 27)
    model = nn.Transformer(ck["params"]["head"]["w"].shape[1], 16, 2, 2, 16)
    got = dist.load(str(Path(out_dir) / "checkpoint"), like={"params": model.init(0)})
    assert isinstance(got["params"]["blocks"], list)
    for a, b in zip(tree_flatten(got["params"])[0], tree_flatten(dict(ck["params"], blocks=[
            ck["params"]["blocks"][i] for i in ("0", "1")]))[0]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(SystemExit, match="ranks but the job has"):
        TRAIN.train(TRAIN.parse_args(ARGS + ["--tp", str(SIZE + 1), "--dp", "1"]))


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_diverging_run_stops_at_its_first_non_finite_step_and_saves_nothing(world, tmp_path):
    # --lr 1e8 --clip 0 diverges: the run stops before the update of the first step whose loss
    # is inf/nan (found by the same run with the check off), on every rank, and the good
    # checkpoint already in the run directory stays as it was (with the check off, the end's save
    # refuses); the diverging runs resume that run
    out_dir = MPI.COMM_WORLD.bcast(str(tmp_path), root=0)
    good = [a for a in ARGS if a != "--no-checkpoint"] + ["--steps", "1", "--out", out_dir]
    TRAIN.train(TRAIN.parse_args(good))
    MPI.COMM_WORLD.Barrier()
    before = _files(Path(out_dir))
    bad = [a for a in good if a not in ("--lr", "1e-2")] + ["--lr", "1e8", "--clip", "0", "--steps", "6", "--resume"]
    free = TRAIN.train(TRAIN.parse_args(bad + ["--no-check-finite", "--no-checkpoint"]))["losses"]
    first = next(i for i, v in enumerate(free) if not np.isfinite(v)) + 1
    with pytest.raises(optim.NonFiniteError, match=f"^step {first}: the loss is nan; the first non-finite gradient "
                       r"on rank \d+ is \['\w+'\]") as e:
        TRAIN.train(TRAIN.parse_args(bad))
    assert e.value.step == first and e.value.rank == world.rank
    with pytest.raises(optim.NonFiniteError, match=r"step 6: not saving the checkpoint: \['params'\]\['\w+'\]"):
        TRAIN.train(TRAIN.parse_args(bad + ["--no-check-finite"]))
    MPI.COMM_WORLD.Barrier()
    assert _files(Path(out_dir)) == before


def test_a_diverged_resume_keeps_the_last_good_checkpoint(world, tmp_path):
    # issue 40: resuming a good checkpoint with --lr 1e8 --clip 0 --save-every 1 saved finite but
    # diverged weights (|w| 1e10 after one step, while the loss barely moves) over it, and the
    # good one was gone when the loss turned nan; now that save is refused and the good one stays
    run = MPI.COMM_WORLD.bcast(str(tmp_path / "run"), root=0)
    good = _RUN + ["--steps", "2", "--run-dir", run]
    TRAIN.train(TRAIN.parse_args(good))
    bad = [a for a in good if a not in ("--lr", "1e-2")] + ["--lr", "1e8", "--clip", "0", "--steps", "6",
                                                            "--save-every", "1", "--resume"]
    with pytest.raises(optim.NonFiniteError, match=r"^step 3: not saving the checkpoint: the weights' norm \S+ is "
                       r"\S+ x the last save's \(\S+; more than --weight-growth 10\)") as e:
        TRAIN.train(TRAIN.parse_args(bad))
    stop = TRAIN._stopped(TRAIN.parse_args(bad), e.value)            # (collective)
    if world.rank == 0:
        assert "Stopped at step 3 of 6" not in stop and "train.py: stopped at step 3 of 6: the weights' norm" in stop
        assert "The run directory keeps the checkpoint at step 2 (--resume continues from it)" in stop, stop
        assert "--weight-growth 0 turns this check off" in stop, stop
    assert [dist.load(h)["step"] for h in dist.checkpoint.history(f"{run}/checkpoint")] == [2]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_loss_spike_stops_the_run_and_drops_the_save_its_weights_made(world, monkeypatch, tmp_path, sync):
    # a spike at step 7 comes from the weights after step 6: their save is dropped (in flight:
    # never committed; --sync-save: rolled back), and the checkpoint at step 5 is the run's again
    real = optim.LossSpikeGuard.check
    monkeypatch.setattr(optim.LossSpikeGuard, "check",
                        lambda self, loss, step=None: real(self, loss * (1e3 if step == 7 else 1), step))
    run = MPI.COMM_WORLD.bcast(str(tmp_path / "run"), root=0)
    args = TRAIN.parse_args(_RUN + ["--steps", "9", "--save-every", "1", "--run-dir", run] + ["--sync-save"] * sync)
    with pytest.raises(optim.LossSpikeError, match=r"^step 7: the loss \S+ is \S+ x the median \S+ of the last 6 steps"
                       r" \(a spike: more than 5 x\)") as e:
        TRAIN.train(args)
    stop = TRAIN._stopped(args, e.value)
    if world.rank == 0:
        assert ("The save after step 6 was dropped (its weights gave this); the run directory keeps the checkpoint at "
                "step 5 (--resume continues from it). Lower --lr") in stop, stop
        assert "--loss-spike 0 turns this check off" in stop, stop
    steps = [dist.load(h)["step"] for h in dist.checkpoint.history(f"{run}/checkpoint")]
    assert steps == ([5] if sync else [5, 4]), steps
    out = TRAIN.train(TRAIN.parse_args(_RUN + ["--steps", "6", "--run-dir", run, "--resume"]))
    assert out["start"] == 5


def test_resume_takes_the_newest_checkpoint_that_verifies(world, tmp_path):
    run = MPI.COMM_WORLD.bcast(str(tmp_path / "run"), root=0)
    TRAIN.train(TRAIN.parse_args(_RUN + ["--steps", "4", "--save-every", "2", "--sync-save", "--run-dir", run]))
    newest = dist.checkpoint.read_index(f"{run}/checkpoint")
    if world.rank == 0:                          # every file of the newest checkpoint damaged
        for f in (Path(run) / "checkpoint" / newest["data_dir"]).iterdir():
            blob = bytearray(f.read_bytes())
            blob[-1] ^= 1
            f.write_bytes(bytes(blob))
    MPI.COMM_WORLD.Barrier()
    out = TRAIN.train(TRAIN.parse_args(_RUN + ["--steps", "5", "--run-dir", run, "--resume"]))
    assert out["start"] == 2 and len(out["losses"]) == 5


@pytest.mark.timeout(120)
def test_loss_scaling_still_skips_a_non_finite_step_and_finite_steps_check_only_scalars(world, monkeypatch):
    # fp16 with a loss scale of 2^17: the scaled gradients overflow fp16, so the scaler skips
    # steps (halving the scale) as before the finiteness check, which leaves those steps alone;
    # the other steps check the loss and the norm only (no pass over the gradients)
    made = []

    def no_pass(tree):
        raise AssertionError("a finite step searched the gradients")
    monkeypatch.setattr(optim.finite, "non_finite_leaves", no_pass)

    class Scaler(optim.DynamicLossScaler):
        def __init__(self):
            super().__init__(init_scale=2.0 ** 17)
            made.append(self)
    monkeypatch.setattr(optim, "DynamicLossScaler", Scaler)
    out = TRAIN.train(TRAIN.parse_args(ARGS + ["--dtype", "fp16", "--steps", "6"]))
    assert 1 <= made[0].skipped < 6 and np.isfinite(out["losses"][-1]), (made[0].skipped, out["losses"])


# ------------------------------------------------------------------ --save-every and --resume

class _Stopped(Exception):
    """A run ended after a save (as by a dead rank), standing in for the crash."""


def _crash_after_save_at(monkeypatch, step: int, sync: bool = False):
    """The run stops as it starts the step after the one that followed the save at ``step``:
    an asynchronous save (the default) has been written while that step ran; it is waited
    for first, so the crash comes after its commit."""
    real_save, real_batch, made = TRAIN.save_checkpoint, TRAIN.get_batch, []

    def save(*a, **k):
        made.append((a[6], real_save(*a, **k)))    # save_checkpoint(world, path, model, params, opt, scaler, step, ...)
        return made[-1][1]

    def batch(data, at, *a, **k):
        if at == step + 1:
            info = dict(made)[step]
            assert isinstance(info, str if sync else dist.checkpoint.SaveHandle), info
            if not sync:
                info.wait()
            raise _Stopped
        return real_batch(data, at, *a, **k)
    monkeypatch.setattr(TRAIN, "save_checkpoint", save)
    monkeypatch.setattr(TRAIN, "get_batch", batch)


_MESHES = {"dp": ["--dp", str(SIZE)], "tp": ["--dp", "1", "--tp", str(SIZE)],
           "pp": ["--pp", str(SIZE), "--schedule", "1f1b", "--microbatches", str(2 * SIZE)],
           "gpipe": ["--pp", str(SIZE), "--schedule", "gpipe", "--microbatches", str(SIZE)],
           "ep": ["--experts", "4", "--ep", str(SIZE), "--dp", "1"],
           "pp2xtp2": ["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "interleaved", "--layers", "4",
                       "--microbatches", "2"],
           "fp16": ["--dp", str(SIZE), "--dtype", "fp16", "--sync-save"],   # the loss scaler's state; sync saves
           "llama": ["--dp", str(SIZE), "--arch", "llama"]}
_SAME_MESH = {1: ["dp", "pp", "ep", "fp16", "llama"], 2: ["dp", "tp", "pp", "gpipe", "ep"], 3: ["fp16"], 4: ["pp2xtp2"]}[SIZE]
# saved on one mesh, resumed on another of the same job
_CROSS = {2: [("ep", ["--experts", "4", "--ep", "1", "--dp", "2"])],
          4: [("pp2xtp2", ["--dp", "4", "--layers", "4"])]}.get(SIZE, [])
_RUN = [a for a in ARGS if a != "--no-checkpoint"]


def _stop_and_resume(monkeypatch, tmp_path, saved_on: list, resumed_on: list) -> list:
    """Losses of a run saved every 2 steps on ``saved_on``, stopped a step after the save at step 2, and
    resumed from its run directory on ``resumed_on``."""
    run = MPI.COMM_WORLD.bcast(str(tmp_path / "run"), root=0)
    with monkeypatch.context() as m:
        _crash_after_save_at(m, 2, sync="--sync-save" in saved_on)
        with pytest.raises(_Stopped):
            TRAIN.train(TRAIN.parse_args(_RUN + saved_on + ["--save-every", "2", "--run-dir", run]))
    out = TRAIN.train(TRAIN.parse_args(_RUN + resumed_on + ["--save-every", "2", "--run-dir", run, "--resume"]))
    assert out["start"] == 2 and len(out["losses"]) == STEPS
    return out["losses"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mesh", _SAME_MESH)
def test_a_resumed_run_continues_bitwise_on_the_same_mesh(world, monkeypatch, tmp_path, mesh):
    """Parameters, AdamW's masters and moments, the step and the data position come back: the
    losses after the resume are the uninterrupted run's, bit for bit.  fp16 starts at a loss
    scale whose first step overflows: the halved scale must come back too."""
    if mesh == "fp16":
        scaler = functools.partial(optim.DynamicLossScaler, init_scale=2.0 ** 16)
        monkeypatch.setattr(optim, "DynamicLossScaler", scaler)
    whole = TRAIN.train(TRAIN.parse_args(_RUN + _MESHES[mesh] + ["--no-checkpoint"]))["losses"]
    resumed = _stop_and_resume(monkeypatch, tmp_path, _MESHES[mesh], _MESHES[mesh])
    assert resumed == whole, (resumed, whole)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved_on,resumed_on", _CROSS, ids=[c[0] for c in _CROSS])
def test_a_run_resumes_onto_another_mesh(world, monkeypatch, tmp_path, saved_on, resumed_on):
    """pp2 x tp2 (interleaved) saved, dp4 resumed; ep2 saved, ep1 x dp2 resumed: the losses
    continue as the uninterrupted run's, up to float rounding."""
    whole = TRAIN.train(TRAIN.parse_args(_RUN + _MESHES[saved_on] + ["--no-checkpoint"]))["losses"]
    resumed = _stop_and_resume(monkeypatch, tmp_path, _MESHES[saved_on], resumed_on)
    np.testing.assert_allclose(resumed, whole, rtol=2e-5)
    assert resumed[:2] == whole[:2]


def test_a_run_directory_is_never_replaced(world, tmp_path):
    run = MPI.COMM_WORLD.bcast(str(tmp_path / "run"), root=0)
    args = _RUN + ["--steps", "1", "--run-dir", run]
    TRAIN.train(TRAIN.parse_args(args))
    MPI.COMM_WORLD.Barrier()
    before = _files(Path(run))
    with pytest.raises(SystemExit, match=f"the run directory {run} is not empty; pass --resume"):
        TRAIN.train(TRAIN.parse_args(args))
    # a run resumed at its end (a restart after the final save) is complete: nothing runs or changes
    done = TRAIN.train(TRAIN.parse_args(args + ["--resume"]))
    assert done["complete"] and done["start"] == 1 and len(done["losses"]) == 1
    with pytest.raises(SystemExit, match=r"was saved with --d-model 16 \(now 32\)"):
        TRAIN.train(TRAIN.parse_args(args + ["--resume", "--steps", "2", "--d-model", "32"]))
    empty = MPI.COMM_WORLD.bcast(str(tmp_path / "empty"), root=0)
    with pytest.raises(SystemExit, match=f"--resume: {empty} holds no checkpoint"):
        TRAIN.train(TRAIN.parse_args(args[:-1] + [empty, "--resume"]))
    MPI.COMM_WORLD.Barrier()
    assert _files(Path(run)) == before
