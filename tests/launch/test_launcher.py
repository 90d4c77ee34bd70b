import glob
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tessera_rt import launch_hosts, launch_ranks, launcher

from conftest import mpi_env

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")
# a job that runs until it is stopped (says "ready" once its ranks are connected)
SPIN = textwrap.dedent("""
        import time
        import numpy as np
        from tessera_rt import dist
        dist.init()
        dist.all_reduce(np.ones(2))
        print("ready", flush=True)
        while True:
            dist.all_reduce(np.ones(2))
            time.sleep(0.01)
    """)


def test_dry_run_uses_the_venv_mpiexec_and_mpi4py(capsys):
    assert launcher.main(["-n", "3", "--dry-run", "prog.py", "--flag"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[0] == launcher.find_mpiexec() and cmd[1:3] == ["-n", "3"]
    assert cmd[-5:] == ["-m", "tessera_run", "--rank", "prog.py", "--flag"]


def test_thread_pools_are_capped_per_rank_unless_set(monkeypatch):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    env = launcher.rank_env(4, {"MKL_NUM_THREADS": "3"})
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "4"
    assert env["MKL_NUM_THREADS"] == "3"                         # the user's setting wins
    assert launcher.rank_env(32, {})["OMP_NUM_THREADS"] == "1"


def test_no_mpi_installed_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: None)
    assert launcher.main(["-n", "2", "prog.py"]) == 127
    err = capsys.readouterr().err
    assert "no MPI launcher" in err and "pip install 'tessera_rt[mpich]'" in err


@pytest.mark.mpi
def test_one_rank_raising_before_a_collective_ends_the_job_in_seconds(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from tessera_rt import dist
        w = dist.init()
        if w.rank == 2:
            raise RuntimeError("rank 2 fails before the all_reduce")
        dist.all_reduce(np.ones(4))     # the other ranks wait here for rank 2
        print("unreachable", flush=True)
    """))
    start = time.monotonic()
    p = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "4", str(script)], env=mpi_env(4),
                       capture_output=True, text=True)
    elapsed = time.monotonic() - start
    assert p.returncode not in (0, 124), p.stdout + p.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s to end the job"
    assert "rank 2 fails before the all_reduce" in p.stderr      # the traceback is shown
    assert "unreachable" not in p.stdout


@pytest.mark.mpi(ranks=2)
def test_a_clean_program_exits_zero(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("from tessera_rt import dist\nimport numpy as np, sys\n"
                      "w = dist.init(); y = dist.all_reduce(np.ones(1))\n"
                      "sys.exit(0 if y[0] == w.size else 3)\n")
    p = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "2", str(script)], env=mpi_env(2),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.mpi(ranks=3)
def test_a_rank_that_vanishes_with_status_0_fails_the_job_by_rank(tmp_path):
    # mpiexec reports success when a rank leaves with os._exit(0) mid-run; tessera-run counts
    # a rank as finished only at a normal interpreter exit
    script = tmp_path / "vanish.py"
    script.write_text(textwrap.dedent("""
        import os, time
        import numpy as np
        from tessera_rt import dist
        w = dist.init()
        for i in range(20):
            if i == 5 and w.rank == 1:
                os._exit(0)
            dist.all_reduce(np.ones(2))
            time.sleep(0.1)
        print("finished", w.rank, flush=True)
    """))
    p = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "3", str(script)], env=mpi_env(3),
                       capture_output=True, text=True)
    assert p.returncode not in (0, 124), p.stdout + p.stderr
    assert "finished 0" not in p.stdout
    # issue 40: the rank that vanished is named, not every rank MPI ended after it (mpiexec reports
    # success, or MPICH ends the others by force: that depends on MPICH's timing)
    said = p.stderr.strip().splitlines()[-1]
    assert said in (
        "tessera-run: mpiexec reported success, but rank 1 exited with status 0 before the end of the program "
        "(os._exit(0), or a library that exits the process); MPI then ended ranks 0, 2, which waited for it; the job "
        "failed (exit code 1)",
        f"tessera-run: rank 1 (pid {said.split('pid ')[-1].split(')')[0]}) exited with status 0 before the end of the "
        "program; MPI then ended the other ranks"), p.stderr


@pytest.mark.mpi(ranks=2)
def test_ctrl_c_ends_the_job_with_one_line(tmp_path):
    import os
    import signal
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    # Ctrl-C in a terminal signals the whole foreground process group: launcher, mpiexec, ranks
    p = subprocess.Popen([TESSERA_RUN, "-n", "2", str(script)], env=mpi_env(2), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "ready" not in p.stdout.readline():
            pass
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip() == "tessera-run: stopped by SIGINT; the 2 ranks were ended", err


@pytest.mark.mpi(ranks=2)
@pytest.mark.parametrize("when", ["launcher", "ranks"])
def test_ctrl_c_while_the_job_starts_gives_one_line_and_exit_130(tmp_path, when):
    # issue 40: while tessera-run starts (once a 40-line KeyboardInterrupt traceback from its
    # imports), or while its ranks import tessera_rt (a traceback per rank, then mpiexec's lines)
    script = tmp_path / f"spin_{when}.py"
    script.write_text(SPIN)
    p = subprocess.Popen([TESSERA_RUN, "-n", "2", str(script)], env=mpi_env(2), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if when == "launcher":
            time.sleep(0.1)                             # (it starts in ~50 ms, then starts mpiexec)
        else:                                           # as soon as the ranks are there: they import
            deadline = time.monotonic() + 30
            while not subprocess.run(["pgrep", "-f", "--", f"--rank {script}"], capture_output=True).stdout and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
        os.killpg(p.pid, signal.SIGINT)                 # the terminal's Ctrl-C: every process of the group
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out + err
    # (the launcher now starts in tens of milliseconds: at 0.1 s it may be starting mpiexec)
    said = {"launcher": ("tessera-run: stopped by SIGINT while starting; no rank was started",
                         "tessera-run: stopped by SIGINT; the 2 ranks were ended"),
            "ranks": ("tessera-run: stopped by SIGINT; the 2 ranks were ended",)}[when]
    assert err.strip() in said, err
    assert set(out.split("\n")) <= {"", "ready"}, out        # nothing of mpiexec's ("Sending Ctrl-C ...")


@pytest.mark.mpi(ranks=2)
def test_a_killed_launchers_folder_is_removed_by_the_next_tessera_run(tmp_path):
    # issue 40: SIGKILL leaves tessera-run no moment to remove its /tmp/tessera-run-* folder
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    hello = tmp_path / "hello.py"
    hello.write_text("print('hello')\n")
    # a temp dir of its own: the launches of tests beside it (pytest -n) make folders in /tmp too
    # (a short path: the launcher's socket lives there)
    with tempfile.TemporaryDirectory(prefix="tl-") as tmp:
        env = dict(mpi_env(2), TMPDIR=tmp)
        p = subprocess.Popen([TESSERA_RUN, "-n", "2", str(script)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "ready" not in p.stdout.readline():
                pass
            left = set(glob.glob(os.path.join(tmp, "tessera-run-*")))
            p.kill()                                         # the ranks go too (mpiexec's parent-death signal)
            p.wait(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
        assert len(left) == 1 and all(os.path.isdir(d) for d in left), left
        q = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "1", str(hello)], env=env, capture_output=True,
                           text=True)
        assert q.returncode == 0 and q.stdout == "hello\n", q.stdout + q.stderr
        assert not glob.glob(os.path.join(tmp, "tessera-run-*")), left


@pytest.mark.mpi(ranks=2)
def test_python_script_and_python_c_are_run_as_mpirun_users_type_them(tmp_path, capsys):
    # issue 40: `tessera-run -n 2 python hello.py` gave FileNotFoundError: .../python
    hello = tmp_path / "hello.py"
    hello.write_text("import sys\nfrom tessera_rt import dist\nprint('hello', dist.init().rank, sys.argv[1:])\n")
    code = "import sys; from tessera_rt import dist; print('code', dist.init().rank, sys.argv)"
    procs = [subprocess.Popen(["timeout", "60", TESSERA_RUN, "-n", "2", *argv], env=mpi_env(2), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for argv in (["python", str(hello), "a"], ["python3", "-u", "-c", code, "x"])]
    outs = [(p.communicate(timeout=90), p.returncode) for p in procs]
    assert [rc for _, rc in outs] == [0, 0], outs
    assert sorted(outs[0][0][0].splitlines()) == ["hello 0 ['a']", "hello 1 ['a']"], outs[0]
    assert sorted(outs[1][0][0].splitlines()) == ["code 0 ['-c', 'x']", "code 1 ['-c', 'x']"], outs[1]
    assert launcher.main(["-n", "2", "--dry-run", "python", "-m", "pkg.mod"]) == 0
    assert capsys.readouterr().out.split()[-4:] == ["tessera_run", "--rank", "-m", "pkg.mod"]
    for argv, said in ((["python", "-O", "x.py"], "python -O: tessera-run passes no interpreter option but -u"),
                       (["/usr/bin/python3", "x.py"], "the ranks run this Python"), (["python", "-c"], "needs the code")):
        with pytest.raises(SystemExit) as stop:
            launcher.main(["-n", "2", *argv])
        assert stop.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.mpi(ranks=2)
def test_a_usage_error_is_not_restarted(tmp_path):
    # issue 40: --max-restarts restarted train.py's "pass --run-dir" error, printing it once per attempt
    p = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "2", "--max-restarts", "2",
                        str(Path(__file__).resolve().parents[2] / "scripts" / "train.py"), "--steps", "1"],
                       env=mpi_env(2), capture_output=True, text=True)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.splitlines() == [
        "train.py: under tessera-run --max-restarts, pass --run-dir DIR (a restarted job resumes from the checkpoint "
        "there)",
        "tessera-run: the job exited with code 2, a usage error: not restarting it (the same command would fail "
        "again; --max-restarts restarts failures)"], p.stderr


@pytest.mark.mpi(ranks=2)
@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_to_the_launcher_alone_ends_the_job_without_a_restart(tmp_path, sig):
    # issue 27: `kill -INT <tessera-run pid>` (a scheduler, a parent script: not the terminal's
    # Ctrl-C, which signals every process) ends every rank in seconds, with 128 + signal, and
    # --max-restarts does not start the job again
    import os
    import signal
    script = tmp_path / f"spin_{sig}_marker.py"
    script.write_text(SPIN)
    p = subprocess.Popen([TESSERA_RUN, "-n", "2", "--max-restarts", "2", str(script)], env=mpi_env(2),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "ready" not in p.stdout.readline():
            pass
        time.sleep(0.3)
        start = time.monotonic()
        p.send_signal(getattr(signal, f"SIG{sig}"))
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + getattr(signal, f"SIG{sig}"), out + err
    assert took < 15, took          # under a second when the machine is idle
    assert err.strip() == f"tessera-run: stopped by SIG{sig}; the 2 ranks were ended", err
    assert "BAD TERMINATION" not in out, out
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", script.name], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left: {left}"


@pytest.mark.mpi(ranks=2)
def test_tag_output_prefixes_each_line_with_its_rank(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("from tessera_rt import dist\nw = dist.init()\nprint('hello from', w.rank, flush=True)\n")
    p = subprocess.run(["timeout", "60", TESSERA_RUN, "-n", "2", "--tag-output", str(script)], env=mpi_env(2),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(p.stdout.splitlines()) == ["[0] hello from 0", "[1] hello from 1"], p.stdout


def _dry_run(capsys, *argv) -> list[str]:
    assert launcher.main([*argv, "--dry-run", "prog.py"]) == 0
    return capsys.readouterr().out.split()


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_hosts_lay_out_the_ranks_host_by_host(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "is_open_mpi", lambda mpiexec: False)
    cmd = _dry_run(capsys, "--hosts", "a:2,b:2")                    # -n unset: one rank per slot
    assert _after(cmd, "-n") == "4" and _after(cmd, "-hosts") == "a:2,b:2"
    cmd = _dry_run(capsys, "-n", "5", "--hosts", "a,b")              # no counts: -n spread evenly, in order
    assert _after(cmd, "-hosts") == "a:3,b:2"
    assert _after(_dry_run(capsys, "-n", "3", "-H", "a:2,b:2,c:2"), "-hosts") == "a:2,b:1"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the two nodes\nnode1 slots=2\n\nnode2:3   # MPICH's spelling\n")
    cmd = _dry_run(capsys, "--hostfile", str(hostfile), "--launcher-exec", "/bin/myrsh")
    assert _after(cmd, "-n") == "5" and _after(cmd, "-hosts") == "node1:2,node2:3"
    assert _after(cmd, "-launcher") == "rsh" and _after(cmd, "-launcher-exec") == "/bin/myrsh"
    # a rank's finished mark is looked for only on this machine's hosts
    monkeypatch.setattr(launch_hosts, "is_local", lambda host: host == "node2")
    assert launch_hosts.ranks_here([("node1", 2), ("node2", 3)]) == [2, 3, 4]


@pytest.mark.parametrize("argv, said", [
    (["--hostfile", "/no/such/hostfile"], "--hostfile /no/such/hostfile: cannot read it (No such file or directory)"),
    (["--hosts", "a:x,b"], "--hosts: bad slot count in 'a:x': write HOST or HOST:N"),
    (["--hosts", "a:0"], "bad slot count in 'a:0'"),
    (["--hosts", "a,,b"], "--hosts: an empty host name"),
    (["-n", "5", "--hosts", "a:2,b:2"], "-n 5 ranks but --hosts names 4 slots (a:2,b:2); lower -n to 4"),
    (["--hosts", "a:2,b"], "give every host a slot count (node1:4,node2:4) or none"),
    (["--hosts", "a,b,a"], "--hosts names a more than once"),
    (["--launcher-exec", "/bin/myrsh"], "--launcher-exec starts processes on other hosts: name them with --hosts"),
    (["--hosts", "a", "--hostfile", "f"], "not allowed with argument"),
])
def test_host_mistakes_say_what_to_write(capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        launcher.main([*argv, "prog.py"])
    assert stop.value.code == 2
    assert said in capsys.readouterr().err


def test_a_bad_hostfile_line_is_named_by_line(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2 max_slots=4\n")
    with pytest.raises(SystemExit):
        launcher.main(["--hostfile", str(hostfile), "prog.py"])
    assert f"--hostfile {hostfile}, line 2: 'node2 max_slots=4' is not a host line" in capsys.readouterr().err


def test_help_documents_hosts(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--hosts", "--hostfile", "--launcher-exec", "node1 slots=4", "without a password"):
        assert flag in text


# a stand-in for ssh: "nowhere" cannot be reached; any other host runs the command here
FAKE_SSH = """#!/bin/sh
if [ "$1" = nowhere ]; then echo "ssh: connect to host nowhere port 22: No route to host" >&2; exit 255; fi
exec sh -c "$2"
"""


@pytest.mark.parametrize("host, cwd, python, said", [
    ("nowhere", None, None, "cannot start a process on host nowhere (ssh: connect to host nowhere port 22: No route "
                            "to host); check that `{rsh} nowhere true` works from here without a password prompt"),
    ("node2", "/no/such/folder", None, "host node2 has no folder /no/such/folder: the ranks start in the current "
                                       "folder on every host; use the same paths on every host"),
    ("node2", None, "/no/such/python", "host node2 has no /no/such/python: every host needs this Python environment"),
])
def test_a_host_that_cannot_run_the_ranks_is_named_before_the_launch(capsys, tmp_path, monkeypatch, host, cwd,
                                                                      python, said):
    rsh = tmp_path / "rsh"
    rsh.write_text(FAKE_SSH)
    rsh.chmod(0o755)
    monkeypatch.setattr(launch_hosts, "is_local", lambda h: h == "here")
    monkeypatch.setattr(launcher, "run_mpiexec", lambda *a: pytest.fail("launched despite the host's problem"))
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: "mpiexec")
    if cwd:
        monkeypatch.setattr(launcher.os, "getcwd", lambda: cwd)
    if python:
        monkeypatch.setattr(launcher.sys, "executable", python)
    assert launcher.main(["--hosts", f"here,{host}", "--launcher-exec", str(rsh), "prog.py"]) == 1
    assert said.format(rsh=rsh) in capsys.readouterr().err


def test_a_death_banner_from_another_host_is_not_taken_for_a_rank_here(monkeypatch):
    # MPICH's banner names each dead process by PID and host: a PID on another host may be
    # the PID of one of this machine's ranks too
    monkeypatch.setattr(launcher, "is_local", lambda host: host == "here")
    banner = (b"=   PID 4242 RUNNING AT elsewhere\n=   EXIT CODE: 9\n"
              b"=   PID 4343 RUNNING AT here\n=   EXIT CODE: 9\n")
    read, write = os.pipe()
    os.write(write, banner)
    os.close(write)
    seen = {"deaths": {}}
    with os.fdopen(read, "rb") as src:
        launcher.copy_stdout(src, io.BytesIO(), seen)
    assert seen["deaths"] == {4343: 9}


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_lines_of_different_ranks_are_never_interleaved(tmp_path):
    # unbuffered output (PYTHONUNBUFFERED) writes print()'s pieces one by one; each rank's
    # line must still reach the terminal whole
    script = tmp_path / "lines.py"
    script.write_text("from mpi4py import MPI\nr = MPI.COMM_WORLD.Get_rank()\n"
                      "for i in range(150):\n    print('rank', r, 'line', i, 'end')\n")
    env = dict(mpi_env(4), PYTHONUNBUFFERED="1")
    p = subprocess.run([TESSERA_RUN, "-n", "4", str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    broken = [line for line in lines if len(line.split()) != 5 or not line.endswith("end")]
    assert len(lines) == 600 and not broken, broken[:5]


def test_a_rank_still_in_the_listen_backlog_when_the_job_ends_is_recorded(tmp_path, monkeypatch):
    """Under load the recording thread may not have accepted a rank's connection by the time
    mpiexec returns: the rank's record and last words wait in the socket's backlog, and the
    verdict must still see them (a thread that never got a turn is the extreme case)."""
    class NeverRuns:
        def __init__(self, **kwargs):
            pass

        def start(self):
            pass

        def is_alive(self):
            return False

    monkeypatch.setattr(launch_ranks, "threading", type("threading", (), {"Thread": NeverRuns}))
    records = launch_ranks.RankRecords(str(tmp_path))
    for rank, said in ((0, "done"), (1, "abort 3")):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(tmp_path / launch_ranks.SOCKET_NAME))
            sock.sendall(f"rank {rank} {1000 + rank}\n{said}\n".encode())
    records.close()
    assert sorted(records.ranks) == [0, 1]
    assert records.ranks[0].said == "done" and records.ranks[1].said == "abort 3"
    assert records.unfinished([0, 1]) == [1]
