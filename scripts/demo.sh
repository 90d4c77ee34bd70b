#!/usr/bin/env bash
# The main job: a 4-rank program on a 2x2 (tp x dp) mesh that shows a sharded computation
# and the collectives it issued.  CPU ranks with MPI by default; GPUs with CuPy/NCCL where present.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then   # before any venv is made
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; echo "Extra arguments go to scripts/demo.py."; exit 0
fi
source "$(dirname "$0")/_venv.sh"
EXTRAS=mpich
if have_gpu && [ "${TESSERA_DEVICE:-}" != "cpu" ]; then
  # a GPU is here: add CuPy/NCCL if the registry can give them, else run on the CPU
  if "$VENV/bin/python" -c "import cupy" 2>/dev/null || \
     "$VENV/bin/python" -m pip install --quiet -e "$ROOT[mpich,cuda12]" 2>/dev/null; then
    EXTRAS=mpich,cuda12
  else
    echo "note: GPU found but CuPy could not be installed; running on CPU ranks"
  fi
fi
ensure_venv "$EXTRAS"
cd "$ROOT"
exec "$VENV/bin/tessera-run" -n "${NRANKS:-4}" scripts/demo.py "$@"
