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
  # the setup files' hash: an unchanged install is not redone (pip takes ~20 s to say so)
  local stamp
  stamp="$VENV/.tessera-$extras-$(cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml" 2>/dev/null \
    | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && "$VENV/bin/python" -c "import tessera_rt" 2>/dev/null; then
    echo "== tessera_rt[$extras] is installed in $VENV (setup files unchanged since)"
    return
  fi
  echo "== installing tessera_rt[$extras] into $VENV (the first time takes minutes; pip's steps below)"
  pip_progress "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -e "$ROOT[$extras]" \
    || { echo "install failed" >&2; exit 1; }
  "$VENV/bin/python" -c "import tessera_rt" || { echo "install failed" >&2; exit 1; }
  rm -f "$VENV/.tessera-$extras-"*
  touch "$stamp"
}

# Run a pip command showing what it fetches and installs as it goes (not every satisfied
# requirement; all of it in $VENV/pip-last.log); its exit status is pip's.
pip_progress() {
  local log="$VENV/pip-last.log"
  "$@" 2>&1 | tee "$log" | { grep --line-buffered -E "^(Collecting|Downloading|Installing|Successfully)" || true; } \
    | sed -u 's/^/   /'
  local rc="${PIPESTATUS[0]}"
  [ "$rc" = 0 ] || { echo "   pip exited $rc; its last lines (all in $log):"; tail -n 20 "$log"; }
  return "$rc"
}

have_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
