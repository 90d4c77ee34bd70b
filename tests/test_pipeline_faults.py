"""Pipeline jobs that go wrong end in seconds with one report: a stage that raises, a stage
that hangs (the watchdog names the stage and micro-batch the others wait on); and a
TESSERA_DEBUG=collectives run checks every boundary send/recv and passes."""
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import mpi_env
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
        return op.astype(out, "float32") if sys.argv[1] == "dtype" and vs == 0 else out
    faulty.calls = 0
    model.stage_forward = faulty
    x = np.random.default_rng(0).integers(0, 11, (6, 5))
    loss, grads = pipe.value_and_grad(model.init(1), x, x)
    print("step done", round(loss, 6), flush=True)
"""


def _job(tmp_path):
    p = tmp_path / "pp_job.py"
    p.write_text(textwrap.dedent(JOB))
    return p


def test_a_stage_that_raises_ends_the_job_in_seconds(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "raise", "300"], mpi_env(2))
    err = p.stderr
    assert p.returncode not in (0, 124), p.stdout + err
    assert took < 30 and "step done" not in p.stdout, (took, p.stdout)
    assert err.count("RuntimeError: stage 1 failed on purpose") == 1, err
    assert not _left(str(s))


def test_the_watchdog_names_the_stage_and_micro_batch_a_rank_waits_on(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "hang", "2"], mpi_env(2))
    err = p.stderr
    assert p.returncode == 14 and took < 30, p.stdout + err
    assert "pipeline stage 1 waits for the activation of micro-batch 2 from stage 0 (rank 0)" in err, err
    assert not _left(str(s))


def test_debug_mode_checks_the_boundary_sends_and_passes(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "ok", "300"], mpi_env(2, extra={"TESSERA_DEBUG": "collectives"}))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step done" in p.stdout


def test_a_boundary_tensor_of_another_dtype_is_named_before_it_is_sent(tmp_path):
    s = _job(tmp_path)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s), "dtype", "300"], mpi_env(2))
    err = p.stderr
    assert p.returncode not in (0, 124) and took < 30, p.stdout + err
    assert ("rank 0 (stage 0) would send the activation of micro-batch 0 as float32[2, 5, 8] to rank 1 (stage 1), "
            "which receives float64[2, 5, 8]") in err, err
    assert not _left(str(s))
