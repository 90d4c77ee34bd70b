# Sourced by demo.sh and test.sh: make .venv (once) and install tessera_rt with the given extras.
# Usage: ensure_venv "mpich"   ->  .venv with `pip install -e .[mpich]`
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TESSERA_VENV:-$ROOT/.venv}"

ensure_venv() {
  local extras="$1"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  echo "== installing tessera_rt[$extras] into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$extras]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import tessera_rt" || { echo "install failed" >&2; exit 1; }
}

have_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
