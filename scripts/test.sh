#!/usr/bin/env bash
# Creates .venv, installs tessera_rt[dev], and runs the whole suite on every core: single-process
# tests, the CUDA sources compiled by NVRTC/ptxas, the Numba simulator, and every multi-rank test
# under mpiexec at 1, 2, 3 and 4 ranks.  Extra arguments go to pytest.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then   # before any venv is made
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; echo "Extra arguments go to pytest (bash scripts/test.sh -k NAME)."; exit 0
fi
source "$(dirname "$0")/_venv.sh"
ensure_venv dev
# torch is optional: the CPU wheel lets a few tests compare against torch (they skip without it)
if [ "${TESSERA_SKIP_TORCH:-0}" != 1 ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 2>/dev/null \
    || echo "note: torch==2.13.0 is not installable here; the optional torch comparisons will skip"
fi
cd "$ROOT"
export NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# on every core (pytest-xdist; each mpiexec launch's tests go to one worker, tests/conftest.py),
# in a shuffled order (pytest-randomly prints its seed: -p randomly_seed=N repeats it);
# TESSERA_TEST_WORKERS=1 runs one test at a time.  The outer timeout is the last backstop;
# each test and each mpiexec launch has its own.  --durations: where the time goes.
# (the cores this process may use: `nproc` would read the OMP_NUM_THREADS set above)
WORKERS="${TESSERA_TEST_WORKERS:-$("$VENV/bin/python" -c 'import os; print(len(os.sched_getaffinity(0)))')}"
echo "== pytest on $WORKERS workers: about 15-25 minutes on 2 cores (the install above: ~3 minutes, once)"
exec timeout -k 10 3000 "$VENV/bin/python" -m pytest -q -n "$WORKERS" -p no:cacheprovider --durations=25 "$@"
