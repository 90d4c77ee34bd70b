"""Fault injection: jobs that go wrong in each documented way end as documented, in seconds.

Each test launches a small job under ``timeout`` and checks the exit status, the time, what
was printed (one report per job, naming the odd rank and the lines) and that no rank
process is left behind.  Disagreements of each kind in the default mode are also checked at
1-4 ranks inside tests/mpi/test_debug.py (one launch per size).
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import mpi_env

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")
pytestmark = pytest.mark.timeout(90)


def _script(tmp_path, name, body) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def _run(cmd, env, limit=60):
    start = time.monotonic()
    p = subprocess.run(["timeout", "-k", "5", str(limit)] + cmd, env=env, capture_output=True, text=True)
    return p, time.monotonic() - start


def _left(marker: str) -> list[str]:
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]


def test_an_uncaught_mismatch_is_one_error_per_job_naming_the_odd_rank(tmp_path):
    s = _script(tmp_path, "dtype_job.py", """
        import numpy as np
        from tessera_rt import dist
        w = dist.init()
        x = np.ones(4, np.float32)
        y = dist.all_reduce(x.view(np.int32) if w.rank == 1 else x)   # same bytes, another dtype
        print("result used", y[0], flush=True)
    """)
    p, took = _run([TESSERA_RUN, "-n", "4", str(s)], mpi_env(4))
    err = p.stderr
    assert p.returncode not in (0, 124), p.stdout + err
    assert took < 30 and "result used" not in p.stdout
    assert err.count("Traceback") == 1 and err.count("CollectiveMismatchError:") == 1, err
    assert "rank 1 differs from the others: rank 1 all_reduce(world) int32[4] at dtype_job.py:6" in err, err
    assert "ranks [0,2,3] all_reduce(world) float32[4] at dtype_job.py:6" in err and "disagree on dtype" in err
    assert "ranks failing the same way, CollectiveMismatchError at dtype_job.py:6" in err, err
    assert "runpy" not in err and "mpi4py" not in err and "launcher.py" not in err, err
    assert "application called MPI_Abort" not in err, err
    assert not _left(str(s))


def test_a_rank_sigkilled_mid_collective_ends_the_job(tmp_path):
    s = _script(tmp_path, "killed_job.py", """
        import os, signal
        import numpy as np
        from tessera_rt import dist
        w = dist.init()
        dist.all_reduce(np.ones(2))
        if w.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(np.ones(2))
        print("unreachable", flush=True)
    """)
    p, took = _run([TESSERA_RUN, "-n", "4", str(s)], mpi_env(4))
    assert p.returncode not in (0, 124), p.stdout + p.stderr
    assert took < 30, took
    assert "unreachable" not in p.stdout
    assert not _left(str(s))


def test_a_stuck_rank_gives_one_watchdog_report_telling_finished_from_dead(tmp_path):
    s = _script(tmp_path, "stuck_job.py", """
        import os, signal, time
        import numpy as np
        from tessera_rt import dist
        w = dist.init(timeout=2)
        dist.all_reduce(np.ones(2))
        if w.rank == 3:
            raise SystemExit(0)                      # finishes early, normally
        if w.rank == 2:
            time.sleep(60)                           # stuck outside any collective
        dist.all_reduce(np.ones(2))
    """)
    p, took = _run([TESSERA_RUN, "-n", "4", str(s)], mpi_env(4))
    err = p.stderr
    assert p.returncode == 14, p.stdout + err
    assert took < 30, took
    assert err.count("[tessera watchdog]") == 1, err
    assert "rank 3: finished normally" in err, err
    assert "rank 2 (" in err and "time.sleep(60)" in err, err
    assert "rank 0 (" in err and "all_reduce(world) float64[2] at stuck_job.py:11" in err, err
    assert "dead" not in err.lower().replace("dead or unresponsive", ""), err
    assert "TESSERA_DEBUG=collectives" in err
    assert not _left(str(s))


def test_a_skipped_collective_is_reported_where_the_ranks_diverged(tmp_path):
    s = _script(tmp_path, "skip_job.py", """
        import numpy as np
        from tessera_rt import dist
        w = dist.init(timeout=2)
        x = np.ones(4, np.float32)
        for i in range(3):
            if not (w.rank == 1 and i == 1):
                dist.all_reduce(x)                   # rank 1 skips this once
            dist.all_reduce(x)
    """)
    p, took = _run([TESSERA_RUN, "-n", "4", str(s)], mpi_env(4))
    err = p.stderr
    assert p.returncode == 14 and took < 30, p.stdout + err
    assert "diverged first at" in err and "call #3 on group [0, 1, 2, 3]" in err, err
    assert "rank 1 all_reduce(world) float32[4] at skip_job.py:9" in err, err
    assert "ranks [0,2,3] all_reduce(world) float32[4] at skip_job.py:8" in err, err
    assert not _left(str(s))


def test_ranks_on_different_axes_are_reported_within_the_timeout(tmp_path):
    s = _script(tmp_path, "axis_job.py", """
        import numpy as np
        from tessera_rt import dist
        w = dist.init(timeout=2)
        mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
        if w.rank == 1:
            dist.all_gather(np.ones(16, np.float32), axis="tp", mesh=mesh)
        else:
            dist.all_reduce(np.ones(16, np.float32), axis="dp", mesh=mesh)
        dist.barrier()
    """)
    p, took = _run([TESSERA_RUN, "-n", "4", str(s)], mpi_env(4))
    err = p.stderr
    assert p.returncode == 14 and took < 30, p.stdout + err
    assert err.count("[tessera watchdog]") == 1, err
    assert "all_gather(tp) float32[16] at axis_job.py:7" in err, err
    assert "all_reduce(dp) float32[16] at axis_job.py:9" in err, err
    assert not _left(str(s))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
def test_killing_the_launcher_ends_every_rank(tmp_path, sig):
    s = _script(tmp_path, f"victim_{sig.name}.py", """
        import time
        import numpy as np
        from tessera_rt import dist
        dist.init()
        dist.all_reduce(np.ones(2))
        print("started", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([TESSERA_RUN, "-n", "3", str(s)], env=mpi_env(3), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "started" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert "started" in line
        proc.send_signal(sig)
        proc.wait(timeout=20)
        end = time.monotonic() + 10
        while _left(str(s)) and time.monotonic() < end:
            time.sleep(0.5)
        assert not _left(str(s)), f"ranks left after {sig.name} to tessera-run"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_send_recv_of_another_dtype_and_shape_is_an_error_naming_both_sides(tmp_path):
    s = _script(tmp_path, "p2p_job.py", """
        import numpy as np
        from tessera_rt import dist
        w = dist.init(debug="collectives")
        if w.rank == 0:
            dist.send(np.ones(128, np.float32), 1)
        else:
            buf = np.zeros(64, np.float64)           # the same 512 bytes, another dtype and shape
            dist.recv(buf, 0)
            print("received", buf[0], flush=True)
    """)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s)], mpi_env(2))
    err = p.stderr
    assert p.returncode not in (0, 124) and took < 30, p.stdout + err
    assert "received" not in p.stdout
    assert "rank 1: recv from rank 0" in err and "float64[64]" in err and "float32[128] at p2p_job.py:6" in err, err
    assert "p2p_job.py:9" in err, err


def test_a_worker_stream_error_nobody_waits_for_still_ends_the_job(tmp_path):
    # an exception on a CPU stream's worker is raised at the caller's next wait; a rank that
    # never waits (here: stuck elsewhere) must not keep the job alive: dist.init's timer ends it
    s = _script(tmp_path, "worker_job.py", """
        import time
        import numpy as np
        from tessera_rt import dist, runtime as rt
        w = dist.init()
        dist.all_reduce(np.ones(2), async_op=True).wait()
        if w.rank == 1:
            def failing_step():
                raise ZeroDivisionError("on the worker")
            rt.stream("tp_collective").submit(failing_step)
        time.sleep(60)
        print("unreachable", flush=True)
    """)
    p, took = _run([TESSERA_RUN, "-n", "2", str(s)], mpi_env(2, extra={"TESSERA_CPU_STREAMS": "threads"}))
    err = p.stderr
    assert p.returncode not in (0, 124), p.stdout + err
    assert took < 30, took
    assert err.count("Traceback") == 1 and "failing_step" in err and "ZeroDivisionError: on the worker" in err, err
    assert "unreachable" not in p.stdout
    assert not _left(str(s))
