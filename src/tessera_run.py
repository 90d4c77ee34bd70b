"""``tessera-run``'s entry point, and each rank's (``python -m tessera_run --rank PROGRAM``).

It sits outside the ``tessera_rt`` package on purpose: importing the package's layers takes
up to a second (Numba and the CUDA bindings among them), and a Ctrl-C in that second printed
a KeyboardInterrupt traceback of some 40 lines per process.  Here SIGINT is
answered quietly until tessera_rt's own handling takes over (the launcher's forwarding to
mpiexec, which says once that the job was stopped; a rank's KeyboardInterrupt around the
program).  ``python -m tessera_run -n 2 script.py`` is ``tessera-run -n 2 script.py``.
"""
import os
import signal
import sys


def _launcher_stopped(signum, frame):
    sys.stderr.write(f"tessera-run: stopped by {signal.Signals(signum).name} while starting; no rank was started\n")
    os._exit(128 + signum)


def _rank_stopped(signum, frame):
    os._exit(128 + signum)               # the launcher says it once, for the job


def main() -> int:
    """Run tessera-run, or (``--rank``) one rank of its job.

    Returns
    -------
    int
        The exit status.
    """
    if sys.argv[1:2] == ["--rank"]:
        signal.signal(signal.SIGINT, _rank_stopped)
        from tessera_rt.launch_ranks import rank_main
        rank_main(sys.argv[2:])
        return 0
    signal.signal(signal.SIGINT, _launcher_stopped)
    from tessera_rt.launcher import main as launch
    return launch()


if __name__ == "__main__":
    sys.exit(main())
