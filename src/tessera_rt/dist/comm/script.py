"""Script entry points under a multi-rank job: one message per job for a command-line error.

A script's flag checks run alike on every rank, so a ``SystemExit("train.py: --layers ...")``
is raised on every rank; Python would print it once per rank.  ``exit_once(main)`` prints it
from rank 0 only and exits with status 1 on every rank, or 2 for a ``UsageError`` (a mistake
in the command line, argparse's status: ``tessera-run --max-restarts`` does not start such a
job again); argparse's usage errors (and --help) are printed by rank 0 alone too.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

__all__ = ["exit_once", "job_rank", "UsageError", "USAGE_EXIT_CODE"]

USAGE_EXIT_CODE = 2          # argparse's: the command line is wrong, running it again will not help


class UsageError(SystemExit):
    """A mistake in the command line (a flag, a path): ``exit_once`` prints it once and exits
    with status 2.

    Parameters
    ----------
    message : str
        What is wrong and what to pass instead.
    """

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def job_rank() -> int:
    """This process's rank in the job (0 outside one), without joining MPI."""
    from . import process_group
    if process_group.is_initialized():
        return process_group.world().rank
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def exit_once(main: Callable[[], int]) -> int:
    """``main()``'s status; a ``SystemExit`` carrying a message is printed by rank 0 alone."""
    rank0 = job_rank() == 0
    if not rank0:           # every rank parses the same flags: rank 0 says what is wrong with them
        quiet = lambda self, message, file=None: None
        argparse.ArgumentParser._print_message = quiet  # type: ignore[method-assign]  # on purpose: rank 0 speaks
    try:
        return main()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        if rank0:
            print(e.code, file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE if isinstance(e, UsageError) else 1
