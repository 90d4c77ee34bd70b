"""Train the small decoder-only transformer as a character-level language model.

    tessera-run -n 4 scripts/train.py --tp 2 --dp 2 --steps 200
    .venv/bin/python scripts/train.py --steps 50 --data notes.txt

The text defaults to the seed documents shipped in the repository (data/seeds/*.txt).  Any
dp x tp mesh works; the global batch is drawn the same way on every mesh (a seeded
generator per step), and the model is initialized to the same global values, so the loss
after N steps agrees across mesh shapes up to float rounding.  Rank 0 shows a tqdm bar
(when tqdm is installed and the output is a terminal; otherwise a plain line every --log-every
steps), writes a loss-curve PNG (when matplotlib is installed) and a checkpoint at the end.

Checkpoints and resuming: each run writes into its own directory (--run-dir DIR, or a new
out/<UTC time>; a non-empty one is refused unless --resume), which it holds for its whole
life (DIR/.lock: a second job there is refused naming the first).  --save-every K also
saves at steps K, 2K, ...; each save is committed atomically to DIR/checkpoint (a killed
save leaves the previous one whole), which keeps the newest --keep (2) of them.  Those saves are asynchronous (--sync-save: not): the state is copied to
host memory and the files are written on the io worker while the next steps run; the save
commits at the first step end by which every rank has written (the final save waits).
--resume continues from the newest committed save that verifies, on any mesh: parameters, AdamW's
masters and moments, the loss scaler, the step and the data position (the batches are a
function of (--seed, step), so there is no other RNG state), so the losses continue as if
the run had never stopped (bitwise on the same mesh; up to float rounding on another).

    tessera-run -n 4 scripts/train.py --pp 2 --tp 2 --steps 200 --save-every 50 --run-dir out/a
    tessera-run -n 4 scripts/train.py --dp 4 --steps 300 --run-dir out/a --resume

Under ``tessera-run --max-restarts N`` (which sets TESSERA_RESTART) --run-dir is required, and a
restarted attempt resumes from that directory's checkpoint (or starts afresh there when the
failed attempt had not saved one yet): at most the steps since the last committed save are
lost.  Resuming a run that is complete (its checkpoint at --steps) exits 0 saying so.

A run that goes bad stops before saving it: a loss or gradient norm that is inf/nan, or a
loss above --loss-spike (5) x the median of the last 50 steps (weights that diverge stay
finite for a step or two).  The save of the weights that gave that loss is dropped, so the
run directory keeps the checkpoint before it, and the message names it.  Mistakes in the
command line exit with status 2, which tessera-run --max-restarts does not restart.

Threads: each rank's BLAS/OpenMP/Numba pools default to one thread (set before NumPy is
imported; a variable you set yourself, or tessera-run's share of the cores, wins).  The
model's GEMMs are small, so extra threads only add spin-waiting and contention: an
uncapped OpenBLAS pool made a single-rank run about 10x slower.
"""
from __future__ import annotations

import os

# Before NumPy (and so OpenBLAS/MKL/OpenMP) is imported: their pools size themselves at load.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tessera_rt.dist.comm.script import UsageError  # a flag mistake: exit status 2

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "data" / "seeds"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Example: tessera-run -n 4 scripts/train.py --dp 2 --tp 2 --steps 200")
    p.add_argument("--data", default=str(DEFAULT_DATA.relative_to(ROOT)), help="a text file, or a directory of .txt files (relative paths: "
                   "from the current directory, else from the repository root)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", type=int, default=0, help="data-parallel ranks (0: world size / (tp * pp))")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the blocks split over them)")
    p.add_argument("--microbatches", type=int, default=0,
                   help="micro-batches per step with --pp (0: 2 * pp, at most --batch); given without --pp, the "
                   "step runs through the pipeline on one stage (gradient accumulation: with MoE blocks the "
                   "balance loss is per micro-batch, as with --pp)")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"],
                   help="pipeline schedule with --pp (interleaved: --virtual-stages chunks per rank)")
    p.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank with --schedule interleaved")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (characters)")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (split over tp)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decoupled weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    p.add_argument("--grad-bucket-mb", type=float, default=None,
                   help="gradient bucket cap in MiB for the data-parallel all-reduces (0: one per parameter; "
                        "default: $TESSERA_GRAD_BUCKET_MB or tessera_rt.autodiff.buckets' rule)")
    p.add_argument("--dtype", default="float32", help="parameter/compute dtype: float32, bf16 or fp16 "
                   "(low precision keeps f32 masters; fp16 adds dynamic loss scaling)")
    p.add_argument("--remat", default="none", choices=["none", "all", "every_other"],
                   help="recompute activations in the backward pass instead of keeping them")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (with --experts; tokens shard over dp x ep)")
    p.add_argument("--experts", type=int, default=0, help="experts per MoE block (0: dense MLP blocks)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="GShard capacity factor (0: dropless routing)")
    p.add_argument("--aux-coef", type=float, default=0.01, help="weight of the MoE balance loss")
    p.add_argument("--arch", default="transformer", choices=["transformer", "llama"],
                   help="transformer: learned positions; llama: RoPE, GQA (--kv-heads), exportable with --export-hf")
    p.add_argument("--kv-heads", type=int, default=0, help="--arch llama: key/value heads (0: as many as --heads)")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="--arch llama: save the trained model as a Hugging Face Llama checkpoint in DIR "
                        "(scripts/generate.py --model DIR reads it)")
    p.add_argument("--run-dir", "--out", dest="run_dir", default=None, metavar="DIR",
                   help="the run's directory, for its checkpoint and PNG (default: a new out/<UTC time>); a "
                   "non-empty one is refused unless --resume")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="also save the checkpoint after steps K, 2K, ... (0: at the end only)")
    p.add_argument("--sync-save", action="store_true",
                   help="--save-every saves block the step until written (default: written on the io worker "
                   "while the next steps run)")
    p.add_argument("--keep", type=int, default=2, metavar="K",
                   help="checkpoints kept in DIR/checkpoint, the newest K (--resume takes the newest that verifies)")
    p.add_argument("--loss-spike", type=float, default=5.0, metavar="F",
                   help="stop when a step's loss is above F x the median of the last 50 (a diverging run); the save "
                   "made from the weights that gave it is dropped (0: off)")
    p.add_argument("--weight-growth", type=float, default=10.0, metavar="G",
                   help="never save weights whose global norm grew more than G x since the last save or the run's "
                   "start (diverging weights stay finite for a step or two); 0: off")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its checkpoint (any mesh); --steps is the total")
    p.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    p.add_argument("--no-checkpoint", action="store_true", help="save no checkpoint (neither --save-every nor at "
                   "the end)")
    p.add_argument("--no-check-finite", action="store_true",
                   help="train on when the loss or the gradient norm is inf/nan (by default the run stops there "
                   "with an error naming the step; a non-finite state is never saved either way)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-step output")
    p.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="without a terminal (output redirected) or without tqdm: a plain line every N steps "
                   "instead of the progress bar")
    return p.parse_args(argv)


def load_text(path: str) -> str:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (ROOT / p).exists():
        p = ROOT / p                                  # the default, run from another directory
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise UsageError(f"train.py: no .txt files in {p}; pass --data FILE")
        return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not p.exists():
        raise UsageError(f"train.py: --data {p} does not exist")
    return p.read_text(encoding="utf-8", errors="replace")


def get_batch(data: np.ndarray, step: int, batch: int, seq: int, seed: int):
    """The same global batch on every rank and every mesh: starts drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    chunk = np.stack([data[s:s + seq + 1] for s in starts])
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------- run directory and checkpoints

# flags a resumed run must keep: they shape the model or the batches (the mesh flags, --steps,
# --lr and the like may change)
_SAME_ON_RESUME = ("arch", "d_model", "heads", "kv_heads", "layers", "seq", "batch", "seed", "experts", "top_k",
                   "capacity_factor", "aux_coef", "dtype")


_RUN_LOCK: list = []         # rank 0's lock on the run directory, held until train() returns


def _lock_run_dir(path: Path) -> str | None:
    """Rank 0: take the run directory (made if missing) for this job's life; the error naming
    the job that holds it."""
    from tessera_rt.dirlock import describe
    from tessera_rt.dist.checkpoint import DirInUse, DirLock
    try:
        _RUN_LOCK.append(DirLock(str(path)).acquire())
    except DirInUse as e:
        return (f"train.py: the run directory {path} is in use by another job ({describe(e.holder)}); two jobs in one "
                "directory overwrite each other's checkpoints: wait for that job to end, or pass another --run-dir")
    return None


def _release_run_dir() -> None:
    while _RUN_LOCK:
        _RUN_LOCK.pop().release()


def run_dir(args: argparse.Namespace, world, writes: bool) -> Path | None:
    """The run's directory, the same on every rank (rank 0 decides): --run-dir, else a new
    out/<UTC time>.  Rank 0 locks it for the job's life (a job already there is refused,
    named); a fresh run refuses a non-empty one (nothing is silently replaced); --resume
    needs one holding a checkpoint.  None when the run writes nothing."""
    if not (writes or args.resume):
        return None
    path, err = None, None
    restart = os.environ.get("TESSERA_RESTART")             # set by tessera-run --max-restarts
    if world.rank == 0:
        if restart not in (None, "0") and args.run_dir:     # a restarted job: resume if the failed attempt saved
            args.resume = (Path(args.run_dir) / "checkpoint" / "index.json").is_file()
        if restart is not None and not args.run_dir:
            err = ("train.py: under tessera-run --max-restarts, pass --run-dir DIR (a restarted job resumes from the "
                   "checkpoint there)")
        elif args.run_dir:
            path = Path(args.run_dir)
        elif args.resume:
            err = "train.py: --resume needs --run-dir DIR, the directory of the run to continue"
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            path = next(p for p in (ROOT / "out" / f"{stamp}{f'-{i}' if i else ''}" for i in range(1000))
                        if not p.exists())
        from tessera_rt.dirlock import LOCK_NAME
        if err is None and path.is_dir():                   # a job working there is named first
            err = _lock_run_dir(path)
        if err is None and args.resume and not (path / "checkpoint" / "index.json").is_file():
            err = (f"train.py: --resume: {path} holds no checkpoint ({path / 'checkpoint' / 'index.json'} does not "
                   "exist); pass the --run-dir of a run that saved one, or drop --resume to start a new run")
        elif err is None and not args.resume and restart in (None, "0") and path.is_dir() and \
                any(p.name != LOCK_NAME for p in path.iterdir()):
            err = (f"train.py: the run directory {path} is not empty; pass --resume to continue that run, or a new "
                   "--run-dir (by default each run gets a new out/<UTC time>)")
        elif err is None and not _RUN_LOCK:
            err = _lock_run_dir(path)                        # a new directory: made and taken
        if err:
            _release_run_dir()
    path, err, args.resume = world.mpi.bcast((path, err, args.resume), root=0)
    if err:
        raise UsageError(err)
    if world.rank == 0 and not args.quiet:
        print(f"train.py: run directory {path}{' (resuming)' if args.resume else ''}", flush=True)
    return path


def _state_tree(model, params, opt, scaler, step: int, seed: int, meta: str) -> dict:
    """What a checkpoint holds: the parameters and optimizer state with the blocks named by
    their global layer number (each pipeline stage passes its own), the loss scaler, the step
    and the data position (the global batch index: the batches are drawn from (seed, step)
    alone, so it is the same on every mesh), and the run's settings as JSON."""
    named = getattr(model, "checkpoint_tree", lambda tree: tree)
    opt_state = opt.state_dict()
    tree = {"params": named(params), "step": step, "data": {"seed": seed, "next_batch": step}, "meta": meta,
            "optimizer": {k: v if k == "t" else named(v) for k, v in opt_state.items()}}
    if scaler is not None:
        tree["scaler"] = scaler.state_dict()
    return tree


def save_checkpoint(world, path: Path, model, params, opt, scaler, step: int, seed: int, meta: dict,
                    async_: bool = False, keep: int = 1, growth=None):
    """Save the run's state after ``step`` steps into ``path`` (dist.save: one safetensors file
    per rank plus an index, committed atomically; ``path`` keeps the newest ``keep``; dist.load
    reads it onto any mesh).  Never a non-finite state, nor (``growth``) one whose weights blew
    up.  ``async_``: returns a SaveHandle once the state is copied to host memory (the files
    are written while training goes on)."""
    from tessera_rt import dist
    _refuse_non_finite(world, {"params": params, "masters": opt.state_dict()["masters"]}, step)
    if growth is not None:
        _refuse_grown(world, params, step, *growth)
    return dist.save(_state_tree(model, params, opt, scaler, step, seed, json.dumps(meta)), str(path), async_=async_,
                     keep=keep)


def resume_checkpoint(path: Path, model, params, opt, scaler, args: argparse.Namespace, vocab: str):
    """Load the newest checkpoint in ``path`` that verifies onto this run's mesh (the DTensor
    loads reshard; one whose index or files fail their checks gives way to the one before it,
    --keep): sets the optimizer's and the scaler's state; returns (params, the step to
    continue after, the saved losses)."""
    from tessera_rt import dist
    from tessera_rt.dist.checkpoint import CheckpointError, history
    failed = []
    for index in history(str(path)):
        try:
            return _resume_from(index, model, params, opt, scaler, args, vocab, failed)
        except CheckpointError as e:
            failed.append(str(e))
            if dist.init().rank == 0:
                print(f"train.py: --resume: the checkpoint {index} does not verify ({e}); trying the one before it",
                      file=sys.stderr, flush=True)
    raise SystemExit(f"train.py: --resume: no checkpoint in {path} verifies ({len(failed)} tried: "
                     f"{'; '.join(failed) or 'none found'}); start a new run (a new --run-dir)")


def _resume_from(index: str, model, params, opt, scaler, args: argparse.Namespace, vocab: str, failed: list):
    from tessera_rt import dist
    from tessera_rt.dist.checkpoint import read_index
    meta = json.loads(read_index(index)["values"]["meta"])       # the flags first: a clear error
    saved = meta["config"]
    changed = [f"--{k.replace('_', '-')} {saved[k]} (now {getattr(args, k)})" for k in _SAME_ON_RESUME
               if k in saved and saved[k] != getattr(args, k)]
    if meta["vocab"] != vocab:
        changed.append("--data (another character set)")
    if changed:
        raise UsageError(f"train.py: --resume: {index} was saved with {', '.join(changed)}; a resumed run keeps the "
                         "flags that shape the model and the batches (the mesh flags and --steps may change)")
    ck = dist.load(index, like=_state_tree(model, params, opt, scaler, 0, 0, ""))
    unnamed = getattr(model, "from_checkpoint_tree", lambda tree: tree)
    opt.load_state_dict({k: v if k == "t" else unnamed(v) for k, v in ck["optimizer"].items()})
    if scaler is not None:
        scaler.load_state_dict(ck["scaler"])
    step = int(ck["data"]["next_batch"])
    if failed and dist.init().rank == 0:
        print(f"train.py: --resume: resuming from the older checkpoint at step {step} ({index})", file=sys.stderr,
              flush=True)
    return unnamed(ck["params"]), step, list(meta["losses"][:step])


def _refuse_non_finite(world, state: dict, step: int) -> None:
    """Never write inf/nan weights as the run's checkpoint (over the last good one).  One pass
    over this rank's pieces, once per save; every rank learns every rank's findings, so all
    refuse together (dist.save is collective)."""
    from tessera_rt import optim
    everyone = world.mpi.allgather(optim.non_finite_leaves(state))
    bad = [(r, paths) for r, paths in enumerate(everyone) if paths]
    if bad:
        rank, paths = bad[0]
        raise optim.NonFiniteError(f"step {step}: not saving the checkpoint: {paths[0]} holds inf/nan on rank {rank}",
                                   reason="the weights to save hold inf/nan", step=step, rank=world.rank,
                                   what="weight", first=everyone[world.rank][0] if everyone[world.rank] else None,
                                   count=len(everyone[world.rank]))


def _kept(out: Path | None, dropped: int | None, stuck: int | None) -> str:
    """Rank 0, after a run went bad: what its run directory keeps, for the message (``dropped``:
    the step whose save was dropped; ``stuck``: one that could not be, --keep 1)."""
    from tessera_rt.dist.checkpoint import CheckpointError, read_index
    try:
        at = read_index(str(out / "checkpoint"))["values"]["step"] if out is not None else None
    except CheckpointError:
        at = None
    kept = ("nothing was saved" if at is None else
            f"the run directory keeps the checkpoint at step {at} (--resume continues from it)")
    if stuck is not None:
        return (f"the run directory keeps only the checkpoint at step {stuck}, made from the weights that gave this "
                "(--keep 2 keeps the one before it too)")
    return f"the save after step {dropped} was dropped (its weights gave this); {kept}" if dropped else kept


def _on_host(loss, norm):
    """The step's loss and gradient norm as floats, read in one device-to-host copy (a GPU's one
    host sync a step; on the CPU they are there already)."""
    from tessera_rt.backend import get_backend
    be = get_backend()
    if not be.is_gpu or type(loss) is not be.xp.ndarray:
        return float(loss), norm
    if norm is None or type(norm) is not be.xp.ndarray:
        return float(loss), norm
    pair = be.xp.stack([loss.reshape(()).astype(np.float64), norm.reshape(()).astype(np.float64)]).get()
    return float(pair[0]), float(pair[1])


def _refuse_grown(world, params, step: int, norm_of, last: list, factor: float) -> None:
    """Never save weights whose global norm grew more than ``factor`` x since the last save (or
    the run's start, ``last[0]``): diverging weights stay finite for a step or two (|w| 1e10
    after one step at --lr 1e8) while the loss barely moves, so neither the finiteness check
    nor the loss spike guard sees them.  Healthy training grows it by a third over hundreds of
    steps.  ``norm_of``: the global norm, collective."""
    from tessera_rt import optim
    now = float(norm_of(params))
    if now > factor * last[0]:
        reason = (f"the weights' norm {now:.3g} is {now / last[0]:.3g} x the last save's ({last[0]:.3g}; more than "
                  f"--weight-growth {factor:g})")
        raise optim.NonFiniteError(f"step {step}: not saving the checkpoint: {reason}", reason=reason, step=step,
                                   rank=world.rank, what="weight norm")
    last[0] = now


def _stopped(args: argparse.Namespace, err) -> str:
    """The job's one message for a step that went bad (every rank stops at the same step: the
    loss and the norm are agreed), with every rank's first non-finite leaf and what the run
    directory keeps."""
    from tessera_rt import dist, optim
    world = dist.init()
    firsts = world.mpi.allgather(err.first)
    ranks: dict = {}
    for r, path in enumerate(firsts):
        if path is not None:
            ranks.setdefault(path, []).append(r)
    where = "; ".join(f"the first non-finite {err.what} is {path} on rank{'s' if len(rs) > 1 else ''} "
                      f"{', '.join(map(str, rs))}" for path, rs in ranks.items())
    hint = [f"lower --lr (now {args.lr:g})"]
    if args.clip <= 0:
        hint.append("clip the gradients (--clip 1.0; now 0: off)")
    if isinstance(err, optim.LossSpikeError) or err.what == "weight norm":
        flag = "--loss-spike" if err.what == "loss" else "--weight-growth"
        regardless = f"; {flag} 0 turns this check off"
    else:
        regardless = "" if args.no_check_finite else \
            "; --no-check-finite trains on regardless (it still never saves a non-finite state)"
    kept = getattr(err, "kept", "") or "nothing was saved"
    return (f"train.py: stopped at step {err.step} of {args.steps}: {err.reason}{'; ' + where if where else ''}. "
            f"{kept[:1].upper() + kept[1:]}. "
            f"{' or '.join(hint).capitalize()}"
            f"{regardless}")


def _plot(path: Path, losses: list, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the loss-curve PNG (pip install matplotlib)"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


def moe_config(args: argparse.Namespace) -> dict | None:
    """The Transformer's moe= from the MoE flags (None: dense MLP blocks)."""
    if not args.experts:
        return None
    return {"num_experts": args.experts, "top_k": args.top_k, "aux_coef": args.aux_coef,
            "capacity_factor": args.capacity_factor or None}


def llama_model(args: argparse.Namespace, vocab: int, mesh):
    """train.py --arch llama: a Llama-shaped model (tessera_rt.models.llama.LlamaLM)."""
    from tessera_rt.models.llama import LlamaLM
    if args.pp > 1 or args.microbatches or args.experts or args.remat != "none":
        raise UsageError("train.py: --arch llama trains a dense model without --pp, --microbatches, --experts or --remat; "
                         "drop those flags or use --arch transformer")
    return LlamaLM(vocab, args.d_model, args.heads, args.layers, args.seq, n_kv_heads=args.kv_heads or None,
                   mesh=mesh, dtype=args.dtype)


def train(args: argparse.Namespace) -> dict:
    """Run the loop; returns {"losses": [...], "step_times": [...], ...} on every rank.  Rank 0
    holds the run directory until it returns."""
    try:
        return _train(args)
    finally:
        _release_run_dir()


def _train(args: argparse.Namespace) -> dict:
    import tessera_rt as ts
    from tessera_rt import dist, nn, optim
    from tessera_rt.dtypes import resolve_dtype

    if args.export_hf and args.arch != "llama":
        raise UsageError("train.py: --export-hf needs --arch llama (the default model has learned positions, "
                         "which a Hugging Face Llama checkpoint cannot hold)")
    world = dist.init()
    n = world.size
    tp, pp = args.tp, args.pp
    ep = args.ep if args.experts else 1
    if args.ep > 1 and not args.experts:
        raise UsageError("train.py: --ep needs --experts N (the MoE blocks are what ep shards)")
    dp = args.dp or max(n // (tp * ep * pp), 1)
    if tp * dp * ep * pp != n:
        raise UsageError(f"train.py: --tp {tp} x --dp {dp} x --ep {ep} x --pp {pp} = {tp * dp * ep * pp} ranks but "
                         f"the job has {n}; launch with tessera-run -n {tp * dp * ep * pp} or change --tp/--dp/--ep/--pp")
    piped = pp > 1 or args.microbatches > 0
    if piped and np.dtype(resolve_dtype(args.dtype)) == np.float16:
        raise UsageError("train.py: --pp/--microbatches with fp16 is not supported (the loss scale would have to "
                         "reach the last stage's loss); use --dtype bf16 or float32")
    if piped:                   # pp x ep: each stage's sub-mesh has dp, ep and tp
        axes = ["pp", "dp"] + (["ep"] if args.experts else []) + ["tp"]
        mesh = dist.Mesh(axes=axes, shape={a: {"pp": pp, "dp": dp, "ep": ep, "tp": tp}[a] for a in axes})
    elif args.experts:
        mesh = dist.Mesh(axes=["dp", "ep", "tp"], shape={"dp": dp, "ep": ep, "tp": tp})
    else:
        mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": dp, "tp": tp})
    rank0 = world.rank == 0
    if args.save_every < 0:
        raise UsageError(f"train.py: --save-every {args.save_every}: pass K >= 1 (0: save at the end only)")
    if args.log_every < 1:
        raise UsageError(f"train.py: --log-every {args.log_every}: pass N >= 1")
    if args.keep < 1 or not all(v == 0 or v > 1 for v in (args.loss_spike, args.weight_growth)):
        raise UsageError(f"train.py: --keep {args.keep} --loss-spike {args.loss_spike:g} --weight-growth "
                         f"{args.weight_growth:g}: pass K >= 1, and F, G > 1 (0: off)")
    # before the data and the model: a second job in this run directory is told at once
    out = run_dir(args, world, writes=not (args.no_checkpoint and args.no_plot))

    text = load_text(args.data)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.fromiter((stoi[c] for c in text), dtype=np.int32, count=len(text))
    if len(data) < args.seq + 2:
        raise UsageError(f"train.py: the text has {len(data)} characters; need more than --seq {args.seq}")

    virtual = args.virtual_stages if piped and args.schedule == "interleaved" else 1
    # the runtime's rules, which the planner's search applies too (tessera-plan ranks only these)
    from tessera_rt.pipeline.schedules import layout_problems
    bad = layout_problems(n_layers=args.layers, pp=pp, schedule=args.schedule if piped else "1f1b", virtual=virtual,
                          microbatches=args.microbatches or min(2 * pp, args.batch) if piped else 1, batch=args.batch,
                          rows_multiple=dp * ep if args.experts else 1, remat=args.remat, moe=bool(args.experts))
    if bad:
        raise UsageError(f"train.py: {'; '.join(bad)} (flags --layers, --pp, --microbatches, --schedule, "
                         "--virtual-stages, --batch, --remat)")
    # the parts of nn.Transformer that live above nn plug in when their package is imported
    from tessera_rt import moe  # noqa: F401  (registers the MoE block: --experts)
    from tessera_rt.pipeline import Pipeline  # (also nn.Transformer's stage split: --pp)
    if args.arch == "llama":
        model = llama_model(args, len(chars), mesh)
    else:
        model = nn.Transformer(len(chars), args.d_model, args.heads, args.layers, args.seq, mesh=mesh,
                               dtype=args.dtype, remat=args.remat, moe=moe_config(args), virtual_stages=virtual)
    params = model.init(args.seed)            # with --pp: this rank's stage only
    pipe = Pipeline(model, mesh=mesh, microbatches=args.microbatches or min(2 * pp, args.batch),
                    schedule=args.schedule) if piped else None
    if rank0 and not args.quiet:         # the layout this run has (a plan's launch line is checked against it)
        print(f"train.py: layout tp={tp} dp={dp} pp={pp} ep={ep}, batch {args.batch}, remat {args.remat}"
              + (f", schedule {pipe.schedule}, microbatches {pipe.microbatches}" if pipe is not None else ""),
              flush=True)
    opt = optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scaler = optim.DynamicLossScaler() if np.dtype(model.dtype) == np.float16 else None

    def loss_fn(p, x, y):
        loss = model.loss(p, x, y)
        return scaler.scale(loss) if scaler is not None else loss

    step_fn = ts.value_and_grad(loss_fn, bucket_mb=args.grad_bucket_mb)
    meta = {"vocab": "".join(chars), "dp": dp, "tp": tp, "ep": ep, "pp": pp, "steps": args.steps,
            "config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}}
    start, history = 0, []
    if args.resume:
        params, start, history = resume_checkpoint(out / "checkpoint", model, params, opt, scaler, args, meta["vocab"])
        if start >= args.steps:       # a finished run (a restart after its final save): nothing to do
            if rank0:
                print(f"train.py: the run in {out} is complete: its checkpoint is at step {start} (--steps "
                      f"{args.steps}); nothing to train (pass --steps above {start} to train on)", flush=True)
            return {"losses": history, "step_times": [], "dp": dp, "tp": tp, "ep": ep, "pp": pp, "bubbles": [],
                    "params": params, "moe": None, "start": start, "run_dir": out, "complete": True}
        if rank0 and not args.quiet:
            print(f"train.py: resumed at step {start} from {out / 'checkpoint'}", flush=True)
    saved, pending = None, None          # pending: the asynchronous save in flight
    saved_at = pending_at = None         # the steps of the last save committed here, and of the one in flight
    guard = optim.LossSpikeGuard(args.loss_spike) if args.loss_spike else None
    if guard is not None:
        guard.extend(history)            # a resumed run's median starts from its saved losses
    growth = None
    if args.weight_growth and not args.no_checkpoint:      # the weights' norm now, then at each save
        norm_of = pipe.grad_norm if pipe is not None else optim.global_norm
        growth = (norm_of, [float(norm_of(params))], args.weight_growth)

    def save(done: int, async_: bool = False):
        return save_checkpoint(world, out / "checkpoint", model, params, opt, scaler, done, args.seed,
                               dict(meta, losses=history + losses), async_=async_, keep=args.keep, growth=growth)
    bar = None
    # a bar redraws one line with carriage returns: right on a terminal, one endless line in a file
    if rank0 and not args.quiet and sys.stderr.isatty():
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, initial=start,
                       desc=f"train dp={dp} tp={tp}" + (f" ep={ep}" if args.experts else "")
                       + (f" pp={pp}" if pp > 1 else ""), unit="step")
        except ImportError:
            print(f"train.py: tqdm is not installed; printing every {args.log_every} steps", flush=True)
    losses, times, bubbles = [], [], []
    loop_start = time.perf_counter()
    try:
        for step in range(start, args.steps):
            xb, yb = get_batch(data, step, args.batch, args.seq, args.seed)
            t0 = time.perf_counter()
            if pipe is not None:
                loss, grads = pipe.value_and_grad(params, xb, yb)
                bubbles.append(pipe.stats().bubble)
            else:
                loss, grads = step_fn(params, model.batch(xb), model.batch(yb))
            finite, norm = True, None
            if scaler is not None:
                grads, finite = scaler.unscale(grads)
            if args.clip > 0 and finite:
                grads, norm = optim.clip_grad_norm(grads, args.clip, norm=pipe.grad_norm(grads) if pipe else None,
                                                   in_place=True)      # the step's own fresh gradients
            value, norm = (loss, norm) if pipe is not None else _on_host(loss.full_tensor(), norm)
            value /= scaler.scale_value if scaler else 1.0
            if finite and not args.no_check_finite:
                # the loss and the global norm, which every rank holds already: one scalar each
                # (a step the loss scaler skips is its business)
                optim.check_finite(loss=value, norm=norm, grads=grads, step=step + 1)
            if guard is not None and finite:
                guard.check(value, step=step + 1)
            if finite:
                params = opt.step(params, grads)
            if scaler is not None:
                scaler.update(finite)
            times.append(time.perf_counter() - t0)
            losses.append(value)
            if bar is not None:
                bar.set_postfix(loss=f"{value:.4f}")
                bar.update(1)
            elif rank0 and not args.quiet and ((step + 1) % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step + 1}/{args.steps} loss {value:.4f} ({times[-1] * 1e3:.0f} ms)", flush=True)
            # collective (every rank has the same save in flight): commits once all have written
            if pending is not None and pending.poll():
                saved, saved_at, pending = pending.wait(), pending_at, None
            if args.save_every and not args.no_checkpoint and (step + 1) % args.save_every == 0 \
                    and step + 1 < args.steps:
                if pending is not None:          # one save in flight at a time
                    saved, saved_at, pending = pending.wait(), pending_at, None
                if args.sync_save:
                    saved, saved_at = save(step + 1), step + 1
                else:
                    pending, pending_at = save(step + 1, async_=True), step + 1
    except optim.NonFiniteError as err:      # agreed by every rank: the run went bad at err.step
        # a loss or norm gone bad at step s came from the weights after step s - 1: their save
        # is dropped (uncommitted, or rolled back to the one before); an earlier one commits
        bad = err.step - 1 if err.step is not None and err.what in ("gradient", "loss") else None
        dropped = stuck = None
        if pending is not None and pending_at == bad:
            pending.abandon()
            dropped = bad
        elif pending is not None:
            pending.wait()
        elif saved_at is not None and saved_at == bad and rank0:
            from tessera_rt.dist.checkpoint import rollback
            if rollback(str(out / "checkpoint")) is None:
                stuck = bad
            else:
                dropped = bad
        err.kept = _kept(out, dropped, stuck) if rank0 else ""
        raise
    except BaseException:                    # maybe this rank alone: no collective; the previous checkpoint stays
        if pending is not None:
            pending.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
    moe_stats = model.moe_stats()           # collective: every rank reads it
    if moe_stats is not None and rank0 and not args.quiet:
        cvs = ", ".join(f"{v:.3f}" for v in moe_stats["load_cv"])
        print(f"MoE load std/mean per block (last step): {cvs}; dropped pairs {moe_stats['dropped']}", flush=True)

    if pending is not None:
        saved = pending.wait()
    loop_s = time.perf_counter() - loop_start     # the steps with their --save-every saves (not the final one)
    if not args.no_checkpoint:
        try:
            saved = save(args.steps)
        except optim.NonFiniteError as err:
            err.kept = _kept(out, None, None) if rank0 else ""
            raise
    losses = history + losses
    if args.export_hf:                      # collective (each parameter gathered); rank 0 writes
        from tessera_rt.models.llama import export_hf
        hf_dir = export_hf(model, params, args.export_hf, chars, rank=world.rank)
        if rank0 and not args.quiet:
            print(f"Hugging Face Llama checkpoint: {hf_dir} (scripts/generate.py --model {hf_dir})", flush=True)
    if rank0 and not args.quiet:
        if not args.no_plot:
            print(_plot(out / "loss.png", losses, f"char LM, dp={dp} tp={tp}"), flush=True)
        med = float(np.median(times[1:] if len(times) > 1 else times)) * 1e3
        print(f"final loss {losses[-1]:.4f} after {args.steps} steps; median step {med:.1f} ms on {n} ranks",
              flush=True)
        if saved is not None:
            print(f"checkpoint: {saved.summary()} (dist.load reads it onto any mesh)", flush=True)
            if args.arch == "llama":
                print(f"generate from it: scripts/generate.py --model {out} --prompt TEXT", flush=True)
        if pipe is not None:
            print(f"{pipe.stats()}\nmedian measured bubble over the steps {float(np.median(bubbles)):.1%}", flush=True)
    return {"losses": losses, "step_times": times, "dp": dp, "tp": tp, "ep": ep, "pp": pp, "bubbles": bubbles,
            "params": params, "moe": moe_stats, "start": start, "run_dir": out, "loop_s": loop_s}


def main(argv=None) -> int:
    from tessera_rt.optim import NonFiniteError
    args = parse_args(argv)
    try:
        train(args)
    except NonFiniteError as err:
        message = _stopped(args, err)
        if err.rank in (None, 0):
            print(message, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from tessera_rt.dist.comm.script import exit_once
    sys.exit(exit_once(main))
