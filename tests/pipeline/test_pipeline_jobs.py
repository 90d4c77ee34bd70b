"""Pipeline jobs launched whole.  Jobs that go wrong end in seconds with one report: a stage
that raises, a stage that hangs (the watchdog names the stage and micro-batch the others
wait on), a boundary tensor of the wrong dtype (after a first step under
TESSERA_DEBUG=collectives that checks every boundary send/recv and passes: one launch for
both); and the cuda backend's path (the strict CuPy/NCCL stand-in, not a GPU: send/recv in
order on the pp stream, grouped as NCCL needs) trains to the single-process losses."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import LAUNCH_TIMEOUT_S, ROOT, mpi_env, standin_env

sys.path.insert(0, str(ROOT / "tests" / "debug"))
from test_fault_injection import _left, _run

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")
pytestmark = pytest.mark.timeout(90)

JOB = """
    import sys, time
    import numpy as np
    from tessera_rt import dist, nn, op
    w = dist.init(timeout=float(sys.argv[2]))
    mesh = dist.Mesh(axes=["pp"], shape={"pp": 2})
    model = nn.Transformer(11, 8, 2, 2, 5, mesh=mesh, dtype="float64")
    pipe = dist.Pipeline(model, microbatches=4, schedule="1f1b")
    forward = model.stage_forward

    def faulty(p, vs, h, targets=None):
        if sys.argv[1] == "raise" and vs == 1 and h.shape[0] == 1:
            raise RuntimeError("stage 1 failed on purpose")
        if sys.argv[1] == "hang" and vs == 0 and w.rank == 0 and faulty.calls == 2:
            time.sleep(60)
        faulty.calls += 1
        out = forward(p, vs, h, targets)
        return op.astype(out, "float32") if sys.argv[1] == "dtype" and vs == 0 and step == 1 else out
    faulty.calls = 0
    model.stage_forward = faulty
    x = np.random.default_rng(0).integers(0, 11, (6, 5))
    for step in range(2 if sys.argv[1] == "dtype" else 1):      # "dtype": a good step, then the bad one
        loss, grads = pipe.value_and_grad(model.init(1), x, x)
        print("step done", round(loss, 6), flush=True)
"""


def _job(tmp_path):
    p = tmp_path / "pp_job.py"
    p.write_text(textwrap.dedent(JOB))
    return p


@pytest.mark.mpi(ranks=2)
def test_a_stage_that_raises_ends_the_job_in_seconds(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "raise", "300"], mpi_env(2))
    err = p.stderr
    assert p.returncode not in (0, 124), p.stdout + err
    assert took < 30 and "step done" not in p.stdout, (took, p.stdout)
    assert err.count("RuntimeError: stage 1 failed on purpose") == 1, err
    assert not _left(str(s))


@pytest.mark.mpi(ranks=2)
def test_the_watchdog_names_the_stage_and_micro_batch_a_rank_waits_on(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "hang", "2"], mpi_env(2))
    err = p.stderr
    assert p.returncode == 14 and took < 30, p.stdout + err
    assert "pipeline stage 1 waits for the activation of micro-batch 2 from stage 0 (rank 0)" in err, err
    assert not _left(str(s))


@pytest.mark.mpi(ranks=2)
def test_debug_mode_passes_then_a_boundary_tensor_of_another_dtype_is_named_before_it_is_sent(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "dtype", "300"], mpi_env(2, extra={"TESSERA_DEBUG": "collectives"}))
    err = p.stderr
    assert p.returncode not in (0, 124) and took < 30, p.stdout + err
    assert p.stdout.count("step done") == 2, p.stdout + err      # both ranks passed the debug checks once
    assert ("rank 0 (stage 0) would send the activation of micro-batch 0 as float32[2, 5, 8] to rank 1 (stage 1), "
            "which receives float64[2, 5, 8]") in err, err
    assert not _left(str(s))


@pytest.mark.mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("pp,schedule", [(4, "1f1b"), (2, "interleaved")])
def test_pipeline_trains_on_the_nccl_standin_to_the_single_process_losses(pp, schedule):
    # pp=2 interleaved: activations and gradients share each link, untagged (NCCL has no tags)
    sys.path.insert(0, str(ROOT / "tests" / "training"))
    from mpi_train import ARGS, TRAIN, reference_losses
    args = ARGS + ["--layers", "4", "--steps", "2"]
    ref = reference_losses(TRAIN.parse_args(args))
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), TESSERA_RUN, "-n", str(pp), "scripts/train.py"] + \
        [a for a in args if a != "--quiet"] + ["--pp", str(pp), "--microbatches", "4", "--schedule", schedule]
    p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(pp, "cpu", standin_env(devices=pp)), capture_output=True, text=True)
    m = re.search(r"final loss ([0-9.]+) after 2 steps", p.stdout)
    assert p.returncode == 0 and m, p.stdout[-3000:] + p.stderr[-3000:]
    assert float(m.group(1)) == pytest.approx(ref[-1], rel=1e-4)
