"""Checkpoint failures across whole jobs (issue 7, item 7): a save killed midway leaves the
previous checkpoint whole; a checkpoint from 4 ranks loads onto a 2-rank job's mesh."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import mpi_env

TESSERA_RUN = str(Path(sys.executable).parent / "tessera-run")


def _run(tmp_path, name, body, n, extra_env=None):
    s = tmp_path / name
    s.write_text(textwrap.dedent(body))
    env = mpi_env(n)
    env.update(extra_env or {})
    start = time.monotonic()
    p = subprocess.run(["timeout", "-k", "5", "60", TESSERA_RUN, "-n", str(n), str(s)], env=env,
                       capture_output=True, text=True)
    return p, time.monotonic() - start


SAVE = """
    import os, sys
    import numpy as np
    from tessera_rt import dist
    from tessera_rt.dist import checkpoint
    w = dist.init()
    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    version = int(sys.argv[1])
    W = np.arange(48, dtype=np.float32).reshape(8, 6) * version
    X = dist.distribute(W, layout=dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "dp")), mesh=mesh)
    if os.environ.get("KILL_RANK") == str(w.rank):
        real = checkpoint._write_atomic
        def dying(path, data):
            with open(path + ".partial", "wb") as f:
                f.write(data[: len(data) // 2])          # half a file on disk, then the rank dies
            os.kill(os.getpid(), 9)
        checkpoint._write_atomic = dying
    dist.save({"w": X, "step": version}, os.environ["CKPT"])
    print("saved", version, flush=True)
"""

LOAD = """
    import os
    import numpy as np
    from tessera_rt import dist
    w = dist.init()
    mesh = dist.Mesh(axes=["dp"], shape={"dp": w.size})
    like = {"w": dist.zeros((8, 6), layout=dist.ShardSpec(partition=("col",), mesh_axes=("dp",)), mesh=mesh),
            "step": 0}
    got = dist.load(os.environ["CKPT"], like=like)
    full = got["w"].full_tensor()
    v = got["step"]
    assert np.array_equal(full, np.arange(48, dtype=np.float32).reshape(8, 6) * v), full
    print(f"rank {w.rank} loaded version {v} local {got['w'].to_local().shape}", flush=True)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p, _ = _run(tmp_path, "save.py", SAVE.replace("sys.argv[1]", "1"), 4, {"CKPT": ckpt})
    assert p.returncode == 0 and "saved 1" in p.stdout, p.stdout + p.stderr
    before = open(os.path.join(ckpt, "index.json")).read()
    p, took = _run(tmp_path, "save2.py", SAVE.replace("sys.argv[1]", "2"), 4, {"CKPT": ckpt, "KILL_RANK": "2"})
    assert p.returncode not in (0, 124), p.stdout + p.stderr
    assert took < 30 and "saved 2" not in p.stdout
    assert open(os.path.join(ckpt, "index.json")).read() == before        # the commit point never moved
    leftovers = [d for d in os.listdir(ckpt) if d.startswith("data-")]
    assert len(leftovers) == 2                                             # the killed save's dir is garbage
    # the previous checkpoint loads whole, resharded onto a 2-rank job's mesh
    p, _ = _run(tmp_path, "load.py", LOAD, 2, {"CKPT": ckpt})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0 loaded version 1 local (8, 3)" in p.stdout
    # the next good save commits and removes the killed save's leftovers
    p, _ = _run(tmp_path, "save3.py", SAVE.replace("sys.argv[1]", "3"), 4, {"CKPT": ckpt})
    assert p.returncode == 0, p.stdout + p.stderr
    assert len([d for d in os.listdir(ckpt) if d.startswith("data-")]) == 1
    assert json.load(open(os.path.join(ckpt, "index.json")))["values"]["step"] == 3
    p, _ = _run(tmp_path, "load3.py", LOAD, 3, {"CKPT": ckpt})
    assert p.returncode == 0 and "loaded version 3" in p.stdout, p.stdout + p.stderr


def test_a_corrupted_shard_file_fails_the_load_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p, _ = _run(tmp_path, "save.py", SAVE.replace("sys.argv[1]", "1"), 4, {"CKPT": ckpt})
    assert p.returncode == 0, p.stdout + p.stderr
    index = json.load(open(os.path.join(ckpt, "index.json")))
    f = os.path.join(ckpt, index["data_dir"], "rank00003.safetensors")
    blob = bytearray(open(f, "rb").read())
    blob[-1] ^= 0x01
    open(f, "wb").write(bytes(blob))
    p, took = _run(tmp_path, "load.py", LOAD, 2, {"CKPT": ckpt})
    assert p.returncode not in (0, 124) and took < 30, p.stdout + p.stderr
    assert "rank00003.safetensors fails its sha256 check" in p.stderr and "['w'] differ" in p.stderr, p.stderr
    assert "loaded" not in p.stdout
