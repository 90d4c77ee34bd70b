"""The hosts of a ``tessera-run --hosts/--hostfile`` job: reading what the user wrote, laying
the ranks out host by host, telling this machine's hosts from the others, and asking each
other host, before the launch, whether it can run the ranks.

Every mistake is a ``HostError`` whose message says where it is and what to write instead
(``tessera-run`` prints it as a usage error).
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["HostError", "HOST_LINE", "parse_hosts", "read_hostfile", "place", "is_local", "check_hosts", "ranks_here",
           "PROBE_TIMEOUT_S"]


class HostError(ValueError):
    """A mistake in --hosts or --hostfile (the message says where and what to write).

    Parameters
    ----------
    message : str
        Where the mistake is and what to write instead.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


HOST_LINE = "one host a line: node1, node1:4 or node1 slots=4"


def _host_item(item: str, where: str) -> tuple[str, int | None]:
    name, colon, count = item.strip().partition(":")
    if not name:
        raise HostError(f"{where}: an empty host name in {item!r}; write HOST or HOST:N, e.g. node1:4")
    if colon and not (count.isdigit() and int(count) >= 1):
        raise HostError(f"{where}: bad slot count in {item!r}: write HOST or HOST:N, N the ranks it runs "
                        f"(1 or more), e.g. {name}:4")
    return name, int(count) if colon else None


def parse_hosts(spec: str) -> list[tuple[str, int | None]]:
    """Read ``--hosts``: ``a,b`` or ``a:4,b:4``.

    Parameters
    ----------
    spec : str
        Comma-separated hosts, each ``HOST`` or ``HOST:N`` (N slots).

    Returns
    -------
    list of (str, int or None)
        Each host with its slot count (None where none was given).
    """
    return [_host_item(item, "--hosts") for item in spec.split(",")]


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """Read a hostfile: MPICH's ``host:N`` lines or Open MPI's ``host slots=N``; ``#`` starts
    a comment.

    Parameters
    ----------
    path : str
        The file.

    Returns
    -------
    list of (str, int or None)
        Each host with its slot count (None where none was given).
    """
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HostError(f"--hostfile {path}: cannot read it ({err.strerror}); it lists the hosts, {HOST_LINE}")
    hosts = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        slots = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S*)", line)
        if slots:
            line = f"{slots[1]}:{slots[2]}"
        if line and len(line.split()) > 1:
            raise HostError(f"--hostfile {path}, line {i}: {line!r} is not a host line ({HOST_LINE})")
        if line:
            hosts.append(_host_item(line, f"--hostfile {path}, line {i}"))
    if not hosts:
        raise HostError(f"--hostfile {path} names no host ({HOST_LINE})")
    return hosts


def place(hosts: list[tuple[str, int | None]], nranks: int | None, where: str) -> list[tuple[str, int]]:
    """Ranks per host, host by host (rank 0 on the first): the slot counts filled in order, or
    without counts the ranks spread evenly; -n unset runs one rank per slot (per host).

    Parameters
    ----------
    hosts : list of (str, int or None)
        ``parse_hosts`` / ``read_hostfile``'s result.
    nranks : int or None
        ``-n`` (None: unset).
    where : str
        The flag the hosts came from, for error messages.

    Returns
    -------
    list of (str, int)
        The hosts that get ranks, each with its rank count.
    """
    names = [h for h, _ in hosts]
    twice = sorted({h for h in names if names.count(h) > 1})
    if twice:
        raise HostError(f"{where} names {', '.join(twice)} more than once; name each host once, with its slot count "
                        f"({twice[0]}:N)")
    counts = [c for _, c in hosts]
    if None in counts and any(counts):
        bare = [h for h, c in hosts if c is None]
        raise HostError(f"{where}: give every host a slot count (node1:4,node2:4) or none (the ranks are then "
                        f"spread evenly); {', '.join(bare)} {'has' if len(bare) == 1 else 'have'} none")
    if None in counts:
        n = len(hosts) if nranks is None else nranks
        share, extra = divmod(n, len(hosts))
        counts = [share + (i < extra) for i in range(len(hosts))]
    else:
        slots = [c for c in counts if c is not None]           # (every host has one here)
        n = sum(slots) if nranks is None else nranks
        if n > sum(slots):
            named = ",".join(f"{h}:{c}" for h, c in hosts)
            raise HostError(f"-n {n} ranks but {where} names {sum(slots)} slots ({named}); lower -n to "
                            f"{sum(slots)}, raise the slot counts or add hosts")
        left = n
        for i, c in enumerate(slots):
            slots[i], left = min(c, left), left - min(c, left)
        counts = list(slots)
    return [(h, c) for h, c in zip(names, counts) if c]


@functools.cache
def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (mpiexec starts its ranks without ssh).

    Parameters
    ----------
    host : str
        A host name or address.

    Returns
    -------
    bool
        True for this machine's name or one of its addresses.
    """
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, _, _, address in addresses:
        try:            # only an address of this machine can be bound
            with socket.socket(family, kind) as s:
                s.bind((address[0], 0))
            return True
        except OSError:
            pass
    return False


PROBE_TIMEOUT_S = 30


def check_hosts(hosts: list[str], rsh: str | None) -> str | None:
    """Ask each other host, the way mpiexec will start its ranks there, for what they need (this
    folder, this Python).

    Parameters
    ----------
    hosts : list of str
        The job's hosts (this machine's are skipped).
    rsh : str or None
        What starts a process on a host (``--launcher-exec``; None: ssh).

    Returns
    -------
    str or None
        The first host that fails, said for people (what to check), or None.
    """
    remote = [h for h in hosts if not is_local(h)]
    here, python = os.getcwd(), sys.executable
    probe = f"cd {shlex.quote(here)} || exit 3; test -x {shlex.quote(python)} || exit 4"
    way_in = [rsh] if rsh else ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={PROBE_TIMEOUT_S // 2}"]

    def ask(host: str) -> tuple[int | None, str]:
        try:
            p = subprocess.run(way_in + [host, probe], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"no answer in {PROBE_TIMEOUT_S} s"
        except OSError as err:
            return None, f"{way_in[0]}: {err.strerror}"
        return p.returncode, (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]

    with ThreadPoolExecutor(max_workers=min(16, len(remote) or 1)) as pool:
        answers = list(pool.map(ask, remote))
    for host, (rc, said) in zip(remote, answers):
        if rc == 3:
            return (f"tessera-run: host {host} has no folder {here}: the ranks start in the current folder on "
                    "every host; use the same paths on every host (a shared file system, or the same checkout at "
                    "the same path)")
        if rc == 4:
            return (f"tessera-run: host {host} has no {python}: every host needs this Python environment (with "
                    "tessera_rt, mpi4py and mpich) at the same path")
        if rc != 0:
            test = shlex.join(([rsh] if rsh else ["ssh"]) + [host, "true"])
            keys = "" if rsh else f" (an ssh key: ssh-copy-id {host})"
            return (f"tessera-run: cannot start a process on host {host} ({said}); check that `{test}` works from "
                    f"here without a password prompt{keys}, that the name {host} resolves and the host is up")
    return None


def ranks_here(layout: list[tuple[str, int]]) -> list[int]:
    """The ranks ``layout`` puts on this machine.

    Parameters
    ----------
    layout : list of (str, int)
        ``place``'s result.

    Returns
    -------
    list of int
        The ranks on this machine's hosts.
    """
    ranks, first = [], 0
    for host, count in layout:
        ranks += list(range(first, first + count)) if is_local(host) else []
        first += count
    return ranks
