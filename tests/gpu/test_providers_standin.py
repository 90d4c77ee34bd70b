"""The vendor providers' tests on the CuPy stand-in, in a process of their own: cuDNN and
cuBLASLt mocked at their call boundary (tests/gpu_emu/fake_vendor), the project's side of the
boundary checked (tests/kernels/test_providers.py) and every provider against the NumPy
reference (tests/kernels/test_providers_gpu.py, which runs the real libraries on a GPU)."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT, mpi_env, standin_env

# the one skip the stand-in is expected to take: it models CuPy 13, which casts nothing to bf16
EXPECTED_SKIP = re.compile(r"SKIPPED \[1\] .*test_providers\.py:\d+: the stand-in models CuPy 13")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_providers_on_the_standin_with_mocked_libraries():
    files = [str(ROOT / "tests" / "kernels" / f) for f in ("test_providers.py", "test_providers_gpu.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, env=mpi_env(1, "cuda", standin_env()), capture_output=True, text=True, timeout=580)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and " passed" in tail, tail
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(EXPECTED_SKIP.match(line) for line in skips), "unexpected skips:\n" + "\n".join(skips)
