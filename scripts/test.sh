#!/usr/bin/env bash
# Creates .venv, installs tessera_rt[dev] (the first time: about 3 minutes, pip's steps shown as
# they go) and runs the test suite on every core, in a shuffled order:
#   bash scripts/test.sh          everything: the single-process tests, the CUDA sources compiled
#                                 by NVRTC/ptxas and run in the emulation harness, the Numba
#                                 simulator, every multi-rank test under mpiexec at 1-4 ranks
#                                 (about 10 minutes on 2 cores)
#   bash scripts/test.sh --fast   ruff and mypy (scripts/lint.sh), then the single-process tests
#                                 not marked slow: no test that starts ranks (about a minute on
#                                 2 cores)
# Extra arguments go to pytest: -k NAME, -n 1 (one process), -p no:randomly (the files' order),
# --randomly-seed=N (the order of a run, whose seed it prints).  TESSERA_TEST_WORKERS sets the
# number of workers (default: the cores).  It ends with the skips counted by reason, the
# slowest tests and the time it took.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then   # before any venv is made
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
TIER=all
if [ "${1:-}" = "--fast" ]; then TIER=fast; shift; fi
START=$SECONDS
source "$(dirname "$0")/_venv.sh"
ensure_venv dev
# torch is optional: the CPU wheel lets a few tests compare against torch (they skip without it)
if [ "${TESSERA_SKIP_TORCH:-0}" != 1 ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "== installing torch 2.13.0 (CPU) for the tests that compare against it"
  pip_progress "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off torch==2.13.0 \
    || echo "note: torch==2.13.0 is not installable here; the optional torch comparisons will skip"
fi
cd "$ROOT"
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)      # (nproc counts OMP_NUM_THREADS)
# one thread a process: a test's ranks, and the workers beside it, share the cores
export NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# the suite starts hundreds of Python processes: without the modules' bytecode cached in
# __pycache__ each one compiles tessera_rt from source again (a third of its start-up)
unset PYTHONDONTWRITEBYTECODE
WORKERS="${TESSERA_TEST_WORKERS:-$CORES}"
if [ "$TIER" = fast ]; then
  # tests that start ranks are marked mpi (tests/cores.py fails one that is not)
  SELECT=(-m "not mpi and not slow and not gpu")
  EXPECT_MIN=1 LIMIT_S=900
else
  SELECT=()
  EXPECT_MIN=10 LIMIT_S=2400
fi
# the outer timeout is a backstop for a hang that slipped past the per-test and per-launch
# timeouts, at a few times the expected time
if [ "$TIER" = fast ]; then
  bash "$ROOT/scripts/lint.sh"      # ruff and mypy: the fast tier is what a commit should pass
fi
echo "== pytest, $TIER tier, on $WORKERS workers: about $EXPECT_MIN minute(s) on 2 cores (less on more);" \
     "stopped after $((LIMIT_S / 60)) minutes"
set +e
timeout -k 10 "$LIMIT_S" "$VENV/bin/python" -m pytest -q -n "$WORKERS" --durations=15 "${SELECT[@]}" "$@"
rc=$?
set -e
[ "$rc" = 124 ] && echo "== stopped by the outer timeout ($LIMIT_S s): a test hung past its own timeout"
took=$((SECONDS - START))
echo "== test.sh ($TIER tier) took $((took / 60)) min $((took % 60)) s, install included; exit $rc"
exit "$rc"
