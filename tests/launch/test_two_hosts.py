"""Two hosts on this machine: two network namespaces joined by a veth pair, each with its own
address and (in a UTS namespace) its own hostname.  ``tessera-run --hosts A:2,B:2`` runs in
host A, as a user would after logging in there, and starts host B's ranks through
``--launcher-exec``: a stand-in for ssh that opens a shell in B's namespace.  MPICH sees two
nodes (one hydra proxy each); tessera sees two hosts (the hostnames)."""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import mpi_env

ROOT = Path(__file__).resolve().parents[2]
ADDRESSES = ("10.77.0.1", "10.77.0.2")          # private to the two namespaces
NAMES = ("tessera-a", "tessera-b")
TRAIN = ["--steps", "3", "--batch", "4", "--seq", "16", "--d-model", "16", "--heads", "2", "--layers", "1",
         "--quiet", "--no-plot", "--no-checkpoint"]

# what each rank reports: its seat, the hierarchical all-reduce's stages, the tp groups' hosts,
# and a short train.py run on a dp=2 x tp=2 mesh with the collectives it issued
JOB = textwrap.dedent("""
    import json, runpy, sys
    import numpy as np
    from tessera_rt import dist
    from tessera_rt.dist import ccl
    w = dist.init()
    line = dist.Mesh(axes=["all"], shape={"all": w.size})
    x = np.arange(10.0) * (w.rank + 1)
    with dist.trace_collectives() as log:
        y = ccl.hierarchical_all_reduce(x, mesh=line)
    hier = [[r.op, r.axis, r.group_size] for r in log.records]
    tp_ranks = dist.Mesh(axes=["dp", "tp"], shape={"dp": 2, "tp": 2}).group_ranks("tp")
    train = runpy.run_path(sys.argv[1], run_name="train")
    with dist.trace_collectives() as log:
        losses = train["train"](train["parse_args"](sys.argv[2:]))["losses"]
    print("RESULT " + json.dumps({
        "rank": w.rank, "host": w.host, "local": [w.local_rank, w.local_size], "hier": hier,
        "hier_ok": bool(np.allclose(y, np.arange(10.0) * sum(range(1, w.size + 1)))),
        "tp_hosts": [w.seats[r].host for r in tp_ranks], "axes": sorted({r.axis for r in log.records}),
        "losses": [float(v) for v in losses]}), flush=True)
""")

# ssh to the two test hosts: a shell in the host's namespace under the host's name
RSH = textwrap.dedent("""\
    #!/bin/sh
    host=$1; shift
    case "$host" in
      {a}) ns={ns_a}; name={name_a} ;;
      {b}) ns={ns_b}; name={name_b} ;;
      *) echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255 ;;
    esac
    exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$name" "$*"
""")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    """The ssh stand-in for two fresh namespaces (unique names), removed afterwards."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("two hosts on one machine need network namespaces, which need root")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"two hosts on one machine need {' and '.join(missing)} (iproute2, util-linux)")
    tag = f"ts{secrets.token_hex(3)}"               # interface names stay under 16 characters
    ns, veth = [tag + "a", tag + "b"], [tag + "va", tag + "vb"]
    try:
        made = _ip("netns", "add", ns[0])
        if made.returncode:
            pytest.skip(f"cannot make a network namespace here (ip netns add: {made.stderr.strip()})")
        steps = [("netns", "add", ns[1]), ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
        for n, v, address in zip(ns, veth, ADDRESSES):
            steps += [("link", "set", v, "netns", n), ("-n", n, "addr", "add", f"{address}/24", "dev", v),
                      ("-n", n, "link", "set", v, "up"), ("-n", n, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        rsh = tmp_path / "rsh"
        rsh.write_text(RSH.format(a=ADDRESSES[0], b=ADDRESSES[1], ns_a=ns[0], ns_b=ns[1], name_a=NAMES[0],
                                  name_b=NAMES[1]))
        rsh.chmod(0o755)
        probe = subprocess.run([str(rsh), ADDRESSES[1], "hostname"], capture_output=True, text=True, timeout=30)
        if probe.returncode:
            pytest.skip(f"cannot enter a network and UTS namespace here: {probe.stderr.strip()}")
        yield str(rsh)
    finally:
        for n in ns:            # deleting a namespace deletes its veth end, and with it the peer
            _ip("netns", "del", n)
        _ip("link", "del", veth[0])                 # if it never moved into a namespace


@pytest.mark.mpi
def test_two_hosts_lay_out_ranks_by_host_and_train_as_one_host(two_hosts, tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    train = str(ROOT / "scripts" / "train.py")
    hosts = ",".join(f"{a}:2" for a in ADDRESSES)
    launch = [sys.executable, "-m", "tessera_rt.launcher", "--hosts", hosts, "--launcher-exec", two_hosts,
              "--tag-output", str(job), train, "--tp", "2", "--run-dir", str(tmp_path / "run"), *TRAIN]
    # log in to host A (the stand-in for ssh) and run tessera-run there
    p = subprocess.run(["timeout", "-k", "5", "150", two_hosts, ADDRESSES[0], shlex.join(launch)], cwd=ROOT,
                       env=mpi_env(4), capture_output=True, text=True)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    ranks = sorted((json.loads(line.partition(" RESULT ")[2]) for line in p.stdout.splitlines()
                    if " RESULT " in line), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], p.stdout
    # host by host: ranks 0, 1 on A and 2, 3 on B, each host's node-local ranks 0 and 1 of 2
    assert [r["host"] for r in ranks] == [NAMES[0]] * 2 + [NAMES[1]] * 2
    assert [r["local"] for r in ranks] == [[0, 2], [1, 2]] * 2
    for r in ranks:
        # the 1-D mesh split by host: inside each host, across hosts, inside again
        stages = [h for h in r["hier"] if h[0].startswith("line_")]
        assert stages == [["line_reduce_scatter", "intra", 2], ["line_all_reduce", "inter", 2],
                          ["line_all_gather", "intra", 2]]
        assert r["hier_ok"]
        # the mesh's default order keeps tp (the innermost axis) on one host; training ran tp collectives
        assert len(set(r["tp_hosts"])) == 1 and r["tp_hosts"][0] == r["host"]
        assert "tp" in r["axes"]
        assert r["losses"] == ranks[0]["losses"]

    # the same run on one host, in one process: the same losses (up to float rounding)
    one = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, runpy, sys
        train = runpy.run_path(sys.argv[1], run_name="train")
        print(json.dumps(train["train"](train["parse_args"](sys.argv[2:]))["losses"]))
        """), train, "--run-dir", str(tmp_path / "one"), *TRAIN], cwd=ROOT, env=mpi_env(1), capture_output=True,
                         text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-4000:]
    reference = json.loads(one.stdout.splitlines()[-1])
    assert len(reference) == 3
    assert ranks[0]["losses"] == pytest.approx(reference, rel=1e-5)
