"""Numba CUDA kernels under the CUDA simulator; launched by tests/test_cudasim_suite.py.

NUMBA_ENABLE_CUDASIM must be set before numba is imported, so this suite runs in its own
process.  The launcher sets the variable; running ``pytest tests/cudasim`` by hand sets it
here.  In any other process (the main test run) this folder collects nothing: numba may
already be imported there in real-CUDA mode.  (tests/conftest.py should also list
"cudasim" in collect_ignore, as it does for "mpi".)
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _only_this_folder_requested() -> bool:
    paths = [a for a in sys.argv[1:] if not a.startswith("-") and Path(a.split("::")[0]).exists()]
    return bool(paths) and all(HERE in [Path(p.split("::")[0]).resolve(), *Path(p.split("::")[0]).resolve().parents]
                               for p in paths)


if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and "numba" not in sys.modules and _only_this_folder_requested():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
