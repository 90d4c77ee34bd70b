"""Run tests/kernels/sim_tile_kernels.py in its own process with NUMBA_ENABLE_CUDASIM=1.

The simulator must be chosen before numba is imported, so it cannot share a process with
tests that compile real PTX.  ``timeout`` bounds the launch in case a barrier deadlocks.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAUNCH_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_cudasim_suite():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TESSERA_DEVICE="cpu", NUMBA_NUM_THREADS="1")
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), sys.executable, "-m", "pytest", "-q",
           "-p", "no:cacheprovider", str(ROOT / "tests" / "kernels" / "sim_tile_kernels.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (f"cudasim suite exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                                  f"\n--- stderr\n{proc.stderr[-6000:]}")
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
