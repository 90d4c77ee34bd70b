"""The ranks of a ``tessera-run`` job: what each rank runs (``rank_main``) and the launcher's
own record of them (``RankRecords``).

Each rank on the launcher's machine connects to a unix socket in the job's folder and says
who it is (rank, pid); at a normal exit it says "done", and when tessera_rt ends the job on
purpose (one error per job, the watchdog: its report is printed) it says "abort".  The
connection closes when the process ends, however it ends (SIGKILL included), so the launcher
knows which rank ended first, and how (``/proc/<pid>/stat`` holds the exit status while the
process exits), from its own records: MPICH's "BAD TERMINATION ... PID n" banner names the
first process *it* saw, often one it ended itself after the rank that died.  Ranks on other
hosts cannot reach the socket; they are not recorded.
"""
from __future__ import annotations

import atexit
import io
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time

__all__ = ["RankRecords", "Record", "rank_main", "RUN_DIR_VAR", "TAG_VAR", "SOCKET_NAME"]

RUN_DIR_VAR = "TESSERA_RUN_DIR"        # the job's folder: the ranks find the launcher's socket there
TAG_VAR = "TESSERA_TAG_OUTPUT"         # with --tag-output: the ranks prefix their lines
SOCKET_NAME = "ranks.sock"


class Record:
    """One local rank as the launcher saw it: its pid, what it said last ("done", "exit N",
    "abort N" or None), when its connection closed (monotonic seconds, None while alive) and its exit
    status then (``os.waitstatus_to_exitcode``'s form: -signal or the code; None unknown)."""
    __slots__ = ("rank", "pid", "said", "ended", "status")

    def __init__(self, rank: int, pid: int):
        self.rank, self.pid = rank, pid
        self.said: str | None = None
        self.ended: float | None = None
        self.status: int | None = None

    def exited(self) -> bool:
        """Whether the program ended normally: it returned, or called ``sys.exit``."""
        return self.said == "done" or (self.said or "").startswith("exit ")

    def how(self) -> str:
        """How it ended, for people: "died (SIGKILL)", "exited with code 3", "exited with status 0"
        or "ended"."""
        if self.status is None:
            return "ended"
        if self.status < 0:
            try:
                return f"died ({signal.Signals(-self.status).name})"
            except ValueError:
                return f"died (signal {-self.status})"
        return f"exited with {'status 0' if self.status == 0 else f'code {self.status}'}"


def _exit_status(pid: int) -> int | None:
    """The exit status of a process that is exiting (Linux: the last field of its stat line,
    in waitpid's form, readable until its parent reaps it), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = int(f.read().rsplit(b")", 1)[1].split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return -(raw & 0x7F) if raw & 0x7F else raw >> 8


class RankRecords:
    """The launcher's side: a unix socket in ``folder`` and a thread that records each local
    rank's connection, what it says and when its connection closes.

    Parameters
    ----------
    folder : str
        The job's folder (the ranks get it as ``TESSERA_RUN_DIR``).
    """

    def __init__(self, folder: str):
        self.ranks: dict[int, Record] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(os.path.join(folder, SOCKET_NAME))
        self._server.listen(1024)
        self._wake_r: int | None
        self._wake_r, self._wake_w = os.pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="tessera-run-ranks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._wake_r is not None:
            for key, _ in self._sel.select():
                if key.fileobj == self._wake_r:
                    return
                if key.fileobj is self._server:
                    conn, _ = self._server.accept()
                    self._sel.register(conn, selectors.EVENT_READ, data=[b"", None])
                else:
                    self._read(key)

    def _read(self, key) -> bool:
        """Read what a rank's connection holds; False once it closed (the process ended)."""
        conn, (pending, rec) = key.fileobj, key.data
        try:
            chunk = conn.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:                                   # the process ended (or closed it at exit)
            if rec is not None:
                rec.ended, rec.status = time.monotonic(), _exit_status(rec.pid)
                if rec.status is None and (rec.said or "").startswith("exit "):
                    rec.status = int(rec.said.split()[1])      # (its parent reaped it before /proc was read)
            self._sel.unregister(conn)
            conn.close()
            return False
        *lines, key.data[0] = (pending + chunk).split(b"\n")
        for line in lines:
            words = line.decode(errors="replace").split()
            if words[:1] == ["rank"] and len(words) == 3:
                rec = key.data[1] = self.ranks[int(words[1])] = Record(int(words[1]), int(words[2]))
            elif rec is not None and words and not (rec.said or "").startswith(("abort", "exit")):
                rec.said = " ".join(words)              # (an abort or exit stays: atexit's "done" follows)
        return True

    def close(self) -> None:
        """Stop recording, once the job has ended: what the ranks' connections still hold is
        read first (a rank's last words, its end), then they are closed."""
        if self._wake_r is None:
            return
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        # a rank that connected just before the job ended may still wait in the listen backlog
        # (the thread, slow under load, had not accepted it): its record and last words are there
        self._server.setblocking(False)
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:                             # (BlockingIOError: the backlog is empty)
                break
            conn.setblocking(True)
            self._sel.register(conn, selectors.EVENT_READ, data=[b"", None])
        for key in list(self._sel.get_map().values()):
            if key.data is not None and isinstance(key.fileobj, socket.socket):   # a rank's connection:
                key.fileobj.settimeout(0.5)                                          # read it to its end
                while self._read(key):
                    pass
        self._sel.close()
        self._server.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = None

    def unfinished(self, ranks) -> list[int]:
        """Which of ``ranks`` did not say "done" (never connected, or ended without)."""
        return [r for r in ranks if r not in self.ranks or self.ranks[r].said != "done"]

    def first_ended(self) -> Record | None:
        """The local rank that ended first without finishing ("done"), or with a non-zero
        status (``sys.exit(3)``), or None."""
        gone = [rec for rec in self.ranks.values() if rec.ended is not None and (rec.said != "done" or rec.status)]
        return min(gone, key=lambda rec: rec.ended or 0.0, default=None)          # (ended: set, in gone)

    def aborted(self) -> Record | None:
        """The first rank that ended the job on purpose (said "abort"), or None."""
        said = [rec for rec in self.ranks.values() if (rec.said or "").startswith("abort")]
        return min(said, key=lambda rec: rec.ended or float("inf"), default=None)


# --------------------------------------------------------------------------- the rank's side

_LINK: list = [None]             # this rank's connection to the launcher


def _say(what: str) -> None:
    sock = _LINK[0]
    if sock is not None:
        try:
            sock.sendall(what.encode() + b"\n")
        except OSError:
            pass


def _connect(folder: str, rank: int) -> None:
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)       # not inherited by the rank's children
        sock.connect(os.path.join(folder, SOCKET_NAME))
        sock.sendall(f"rank {rank} {os.getpid()}\n".encode())
    except OSError:
        return                   # a rank on another host (or a folder gone): the launcher keeps no record
    _LINK[0] = sock
    atexit.register(_say, "done")            # at a normal exit only (not os._exit, not a signal)


class _Tagged(io.TextIOBase):
    """A rank's stdout/stderr with ``[rank] `` before each line; a line goes out in one write
    (a partial one at a flush), so the ranks' lines do not mix."""

    def __init__(self, stream, tag: str):
        self.stream, self.tag, self.pending, self.at_start = stream, tag, "", True

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            done, _, self.pending = self.pending.rpartition("\n")
            self._emit(done + "\n")
        return len(text)

    def _emit(self, text: str) -> None:
        lines = text.splitlines(keepends=True)
        tagged = [(self.tag if i or self.at_start else "") + ln for i, ln in enumerate(lines)]
        self.at_start = text.endswith("\n")
        self.stream.write("".join(tagged))

    def flush(self) -> None:
        if self.pending:
            text, self.pending = self.pending, ""
            self._emit(text)
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def buffer(self):                   # bytes written here are not tagged
        return self.stream.buffer

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return self.stream.encoding


def rank_main(argv: list[str]) -> None:
    """One rank (``python -m tessera_run --rank``): its record to the launcher, the
    one-error-per-job hook, then the program as __main__: ``script.py args``, ``-m module
    args`` or ``-c CODE args``.

    Parameters
    ----------
    argv : list of str
        The program and its arguments.
    """
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    folder = os.environ.get(RUN_DIR_VAR)
    if folder:
        _connect(folder, rank)
    # one write per line: unbuffered (PYTHONUNBUFFERED) print() writes each piece on its own,
    # and mpiexec then interleaves other ranks' text into the middle of a line
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    if os.environ.get(TAG_VAR):
        sys.stdout, sys.stderr = _Tagged(sys.stdout, f"[{rank}] "), _Tagged(sys.stderr, f"[{rank}] ")
        atexit.register(sys.stdout.flush)
        atexit.register(sys.stderr.flush)
    from tessera_rt.dist.comm import process_group
    process_group.on_abort(lambda code: _say(f"abort {code}"))
    if MPI.COMM_WORLD.Get_size() > 1 and os.environ.get("TESSERA_ABORT_ON_ERROR", "1") != "0":
        process_group.install_excepthook(rank)
    signal.signal(signal.SIGINT, signal.default_int_handler)    # the program sees KeyboardInterrupt again
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c"] + argv[2:]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        # said before the exit: MPICH's proxy may reap the process before the launcher reads
        # its status from /proc, and "done" (at exit) would not tell sys.exit(3) from a return
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            _say(f"exit {code}")
        raise
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank and the launcher, which says it once: no traceback per rank
        sys.stdout.flush()
        os._exit(128 + signal.SIGINT)
