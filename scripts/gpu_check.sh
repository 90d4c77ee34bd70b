#!/usr/bin/env bash
# One command, one short run: what tessera_rt does on this machine's GPU, as one table
# (scripts/gpu_check.py has the parts).  From a fresh clone on one GPU it fits in 9.5 minutes,
# installing what is missing first.
#
#   bash scripts/gpu_check.sh [--quick] [--emulate] [--with-torch] [--out DIR] [--budget SECONDS]
#
# Python: $TESSERA_PYTHON, else .venv/bin/python, else python3 (a machine image's, with its
# CuPy and torch).  Where a GPU is present and CuPy, MPI or pytest is missing, it installs
# tessera_rt[cuda12,mpich]'s dependencies (only [mpich]'s where a CuPy already sees the GPU),
# pytest and pytest-timeout, into .venv (made over python3, whose packages it still sees), and
# the vendor providers' Python packages (nvidia-cudnn-frontend, nvmath-python) where missing:
# from wheels in $TESSERA_WHEELS when set (offline machines), else from the package index when
# one answers, pip under a time limit; what could not be installed is said, and the parts that
# need it fail in the table.  tessera_rt itself runs from src/ (PYTHONPATH): nothing is built.  torch (the attention peer) is used when already installed; --with-torch
# also tries to install it.  Without a GPU nothing is installed: the same parts run on the CuPy
# stand-in and the emulation harness (tests/gpu_emu), and the first line says so.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TOTAL_S=570                       # the whole run, installs included (a lease's 10-minute command)
START=$(date +%s)
PIP_LIMIT_S="${TESSERA_PIP_LIMIT_S:-240}"

args=()
with_torch=0
emulate=0
for a in "$@"; do
  case "$a" in
    --with-torch) with_torch=1 ;;
    --emulate) emulate=1; args+=("$a") ;;       # the stand-in even where a GPU is present: no installs
    *) args+=("$a") ;;
  esac
done

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# the imports every part needs; prints the first missing one
missing() {
  PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "$1" - <<'EOF' 2>/dev/null || echo "python"
import importlib, shutil, sys, os
need = ["numpy", "numba", "ml_dtypes", "safetensors", "mpi4py.MPI", "pytest", "pytest_timeout", "tessera_rt"]
for mod in need:
    try:
        importlib.import_module(mod)
    except Exception as exc:
        print(f"{mod} ({type(exc).__name__})"); sys.exit(0)
try:
    # numba-cuda registers NumPy functions when it compiles the first kernel: a NumPy newer
    # than it knows (np.row_stack left NumPy 2.5) breaks every Numba kernel there
    import numba.cuda.np.arrayobj  # noqa: F401
except ImportError:
    pass
except Exception as exc:
    print(f"numba-cuda with NumPy {sys.modules['numpy'].__version__} ({type(exc).__name__}: {exc})"); sys.exit(0)
try:
    import cupy
    assert cupy.cuda.runtime.getDeviceCount() > 0
except Exception as exc:
    print(f"cupy ({type(exc).__name__})"); sys.exit(0)
here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
if not (os.path.exists(here) or shutil.which("mpiexec")):
    print("mpiexec")
EOF
}

pip_install() {   # pip_install PY ARGS...: limited in time, quiet; 0 on success
  local py="$1"; shift
  local src=(--timeout 20 --retries 1)
  if [ -n "${TESSERA_WHEELS:-}" ]; then
    src=(--no-index --find-links "$TESSERA_WHEELS")
  elif ! timeout 15 "$py" -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/pip/', timeout=10)" \
      >/dev/null 2>&1; then
    echo "WARNING: no package index reachable (and TESSERA_WHEELS unset): not installing $*"
    return 1
  fi
  local until=$(( $(date +%s) + PIP_LIMIT_S ))
  timeout -k 5 "$PIP_LIMIT_S" "$py" -m pip install --quiet --disable-pip-version-check "${src[@]}" "$@" 2>/dev/null \
    && return 0
  # pip installs all or nothing: one requirement the index (or the wheel folder) lacks must not
  # keep the others out, so each goes alone now, in what is left of the time limit
  local req failed=()
  for req in "$@"; do
    local left=$(( until - $(date +%s) ))
    if [ "$left" -le 5 ] || ! timeout -k 5 "$left" "$py" -m pip install --quiet --disable-pip-version-check \
        "${src[@]}" "$req" >/dev/null 2>&1; then
      failed+=("$req")
    fi
  done
  [ "${#failed[@]}" = 0 ] && return 0
  echo "WARNING: could not install: ${failed[*]}"
  return 1
}

requirements() {  # requirements EXTRAS: tessera_rt's dependencies from setup.cfg (the package itself
  # runs from src/ through PYTHONPATH: nothing to build)
  "$PY" - "$1" <<'EOF'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = cfg["options"]["install_requires"].splitlines()
for extra in sys.argv[1].split(","):
    lines += cfg["options.extras_require"][extra].splitlines()
print("\n".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#")))
EOF
}

PY="${TESSERA_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi

if [ "$emulate" = 0 ] && have_gpu; then
  need="$(missing "$PY")"
  if [ -n "$need" ] && [ -z "${TESSERA_PYTHON:-}" ] && [ "$PY" != "$ROOT/.venv/bin/python" ]; then
    # a venv that still sees $PY's packages (a machine image's CuPy and torch), to install into
    echo "== $PY lacks $need: making $ROOT/.venv over it"
    base_site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if "$PY" -m venv "$ROOT/.venv"; then
      PY="$ROOT/.venv/bin/python"
      # addsitedir, not a bare path: the base's own .pth files must run too (numba-cuda's
      # redirector among them, without which numba.cuda is Numba's old built-in target)
      echo "import site; site.addsitedir('$base_site')" \
        > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_gpu_check_base.pth"
      need="$(missing "$PY")"
    else
      echo "WARNING: could not make a venv with $PY; installing into it directly"
    fi
  fi
  if [ -n "$need" ]; then
    extras="mpich"
    PYTHONPATH="" "$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" 2>/dev/null || extras="cuda12,mpich"
    echo "== $PY lacks $need: installing tessera_rt[$extras]'s dependencies, pytest, pytest-timeout (limit ${PIP_LIMIT_S} s)"
    mapfile -t reqs < <(requirements "$extras")
    pip_install "$PY" "${reqs[@]}" pytest pytest-timeout \
      || echo "WARNING: installing tessera_rt[$extras]'s dependencies failed or ran over ${PIP_LIMIT_S} s (offline? set TESSERA_WHEELS to a folder of wheels)"
    need="$(missing "$PY")"
    [ -n "$need" ] && echo "WARNING: still missing: $need; the parts that need it will fail below"
  fi
  # The vendor providers (tessera_rt.kernels.providers): cuDNN's Python frontend and nvmath-python
  # (cuBLASLt).  A GPU image may carry CuPy, torch, cuDNN and cuBLAS but not these two; they load
  # the cuDNN/cuBLAS libraries already there.  Offline: from $TESSERA_WHEELS (docs/kernels.md,
  # "Providers", has the pip download line).  Missing, the own kernels run and the notes say why.
  if ! "$PY" -c "import cudnn, nvmath.linalg.advanced" 2>/dev/null; then
    echo "== installing the vendor providers nvidia-cudnn-frontend and nvmath-python (limit ${PIP_LIMIT_S} s)"
    pip_install "$PY" nvidia-cudnn-frontend nvmath-python \
      || echo "WARNING: no vendor providers: attention and fused GEMMs run the project's own kernels"
  fi
  if [ "$with_torch" = 1 ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "== installing a CUDA torch for the attention peer (limit ${PIP_LIMIT_S} s)"
    pip_install "$PY" torch || echo "WARNING: no CUDA torch: flash attention is compared with the tensor-core roofline"
  fi
fi

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The collectives' C path (dist/comm/_hot.c): tessera_rt runs from src/, where a fresh machine
# has no built extension, so it is built in place; without a C compiler the collectives run in
# Python (TESSERA_HOT=0) and the multi-rank row says so.
if ! "$PY" -c "import tessera_rt.dist.comm._hot" 2>/dev/null; then
  echo "== building the collectives' C path (src/tessera_rt/dist/comm/_hot.c) in place"
  timeout 180 "$PY" "$ROOT/setup.py" -q build_ext --inplace >/dev/null 2>&1 || true
  if ! "$PY" -c "import tessera_rt.dist.comm._hot" 2>/dev/null; then
    echo "WARNING: dist/comm/_hot.c did not build (a C compiler and Python headers are needed): running with TESSERA_HOT=0"
    export TESSERA_HOT=0
  fi
fi
spent=$(( $(date +%s) - START ))
budget=$(( TOTAL_S - spent - 20 ))          # 20 s for the report and the slowest kill
[ "$budget" -lt 60 ] && budget=60
case " ${args[*]:-} " in *" --budget "*) ;; *) args+=(--budget "$budget") ;; esac
exec "$PY" "$ROOT/scripts/gpu_check.py" "${args[@]}"
