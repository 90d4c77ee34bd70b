#!/usr/bin/env bash
# Lint and type check: `ruff check` over every Python file of the repository (pyflakes, import
# order, pyupgrade; src/tessera_rt/dist included) and mypy over src/ (its default, non-strict
# mode).  Both are configured in pyproject.toml; .ci/run runs this before the suite, and
# .pre-commit-config.yaml runs the same two.  Makes .venv with the dev extra first if ruff or
# mypy is not in it.  `--fix` lets ruff fix what it can (import order, pyupgrade, stale noqa).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
source "$(dirname "$0")/_venv.sh"
if ! "$VENV/bin/python" -c "import ruff, mypy" 2>/dev/null; then
  ensure_venv dev
fi
cd "$ROOT"
echo "== ruff check"
"$VENV/bin/python" -m ruff check "$@" .
echo "== mypy"
"$VENV/bin/python" -m mypy
