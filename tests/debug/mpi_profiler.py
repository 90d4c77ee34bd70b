"""The profiler (issue 7, item 6): per-op table, NVTX names, merged Chrome trace, overlap ratio."""
import json
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from tessera_rt import dist, graph, op, profiler


@pytest.fixture
def mesh(world):
    return dist.Mesh(axes=["dp"], shape={"dp": world.size})


def _step(mesh):
    X = dist.distribute(np.ones((16, 8), np.float32), layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)),
                        mesh=mesh)
    W = dist.distribute(np.ones((8, 4), np.float32), layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)),
                        mesh=mesh)
    Y = X @ W                                       # W gathered: one all_gather inside the op
    return op.softmax(Y, axis=-1).sum()


def test_profile_a_step_prints_a_table_and_merges_a_trace(world, mesh, tmp_path_factory, capsys):
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("prof") / "trace.json") if world.rank == 0 else None)
    prof = graph.profile(_step, mesh, trace=path)
    assert prof.result.shape == ()
    out = capsys.readouterr().out
    rows = {(r["kind"], r["op"]) for r in prof.rows()}
    assert {("op", "matmul"), ("op", "softmax"), ("op", "sum")} <= rows
    if world.size > 1:
        assert ("collective", "all_gather") in rows
    mm = next(r for r in prof.rows() if r["op"] == "matmul")
    assert mm["calls"] == 1 and mm["achieved"].endswith("TFLOP/s") and mm["bytes"] > 0
    # this rank's matmul event: its rows of X (16 x 8), W whole (gathered inside the op: the
    # argument's piece counts) and its rows of the 16 x 4 output; 2 x 8 flops per output element
    ev = next(e for e in prof.events if e["cat"] == "op" and e["key"][1] == "matmul")
    rows_here = dist.split_sizes(16, world.size)[world.rank]
    w_rows = dist.split_sizes(8, world.size)[world.rank]
    assert ev["bytes"] == 4 * (rows_here * 8 + w_rows * 4 + rows_here * 4) == ev["busbytes"]
    assert ev["flops"] == 2 * 8 * rows_here * 4 and ev["t1"] >= ev["t0"] and ev["role"] == "compute"
    if world.rank == 0:
        assert "tessera profile _step -- rank 0" in out and "\n  matmul " in out
        trace = json.load(open(path))
        pids = {e["pid"] for e in trace["traceEvents"]}
        assert pids == set(range(world.size))
        names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
        assert any(n.startswith("matmul S(0)@dp [16,4]") for n in names), names
        if world.size > 1:
            assert any(n.startswith("all_gather(dp) float32[") for n in names), names
        if world.size > 1:
            assert f"measured time over {world.size} ranks" in out and "\n  axis dp " in out
        os.remove(path)


def test_the_table_is_a_short_summary_unless_the_full_one_is_asked_for(world, mesh, capsys, monkeypatch):
    """Many shapes (a training step has hundreds of op/layout/shape rows): the default table
    stays a screenful, the top ops and a line per mesh axis; table="full" has every row."""
    def many_shapes():
        for n in range(1, 31):
            X = dist.distribute(np.ones((4 * world.size, n), np.float32),
                                layout=dist.ShardSpec(partition=("row",), mesh_axes=("dp",)), mesh=mesh)
            op.softmax(op.exp(X) * 2.0, axis=-1).sum(axis=0).full_tensor()
    graph.profile(many_shapes)
    short = capsys.readouterr().out
    prof = graph.profile(many_shapes, table="full")
    full = capsys.readouterr().out
    monkeypatch.setenv("TESSERA_PROFILE_TABLE", "full")
    env_full = graph.profile(many_shapes).table_kind
    with pytest.raises(ValueError, match=r"profile\(table='long'\): use 'short' .*, 'full' .* or None"):
        graph.profile(many_shapes, table="long")
    assert env_full == "full" and len(prof.rows()) > 100
    if world.rank == 0:
        lines = short.strip().splitlines()
        assert len(lines) <= 14, short
        assert "table='full'" in lines[0] and lines[1].split() == ["top", "ops", "calls", "total", "ms", "share"]
        assert {ln.split()[0] for ln in lines[2:6]} <= {"softmax", "exp", "mul", "sum", "(1", "axis"}, short
        if world.size > 1:
            axis_lines = [ln for ln in lines if ln.startswith("  axis ")]
            assert len(axis_lines) == 1 and "dp" in axis_lines[0] and "all_reduce x30" in axis_lines[0], short
        assert len(full.splitlines()) > 100 and "mean us" in full


def test_overlap_ratio_counts_async_collectives_hidden_under_compute(world):
    g = np.ones(256, np.float32)
    dist.all_reduce(g, async_op=True).wait()        # the role's first: its stream and communicator
    with graph.profile(print_table=False) as prof:
        with prof.region("local matmul"):
            # issued inside the region: on the CPU the collective's interval is the time its
            # worker really ran it, which starts at once
            work = dist.all_reduce(g, async_op=True)
            a = np.random.default_rng(0).standard_normal((120, 120))
            for _ in range(5):
                a = np.tanh(a @ a)
            # a loaded machine may not give the worker a core until compute yields one
            deadline = time.monotonic() + 20
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.002)
        work.wait()
        dist.all_reduce(g)                          # blocking: nothing hides it
    ratio = prof.overlap_ratio
    assert ratio is not None and 0.0 < ratio < 1.0
    colls = [e for e in prof.events if e["cat"] == "collective"]
    assert [e["async"] for e in colls] == [True, False]
    # the definition, on hand-made intervals
    assert profiler.overlap_ratio([(0, 4), (6, 8)], [(1, 3), (5, 7)]) == pytest.approx(3 / 6)
    assert profiler.overlap_ratio([], [(0, 1)]) is None


class _FakeDomain:
    def __init__(self):
        self.log = []

    def get_event_attributes(self, message, color, category):
        return (message, category)

    def push_range(self, attr):
        self.log.append(("push",) + attr)

    def pop_range(self):
        self.log.append(("pop",))

    def start_range(self, attr):
        self.log.append(("start",) + attr)
        return len(self.log)

    def end_range(self, rid):
        self.log.append(("end", rid))


@pytest.fixture
def fake_nvtx(monkeypatch):
    """The NVTX domain replaced by one that logs its calls."""
    nv = profiler.nvtx_domain()
    if nv is None:
        pytest.skip("nvtx is not installed")
    fake = _FakeDomain()
    monkeypatch.setattr(nv, "_dom", fake)
    monkeypatch.setattr(nv, "_attrs", {})
    return fake


def test_every_op_and_collective_is_an_nvtx_range_named_with_its_axis_and_shape(world, mesh, fake_nvtx):
    fake = fake_nvtx
    profiler.enable_nvtx(True)
    try:
        _step(mesh)
        dist.all_reduce(np.ones(3, np.float32), async_op=True).wait()
    finally:
        profiler.enable_nvtx(False)
    pushes = [e for e in fake.log if e[0] in ("push", "start")]
    assert ("push", "matmul S(0)@dp [16,4]", "compute") in pushes
    assert ("start", "all_reduce(world) float32[3]", "tp_collective") in pushes
    if world.size > 1:
        assert any(e[1].startswith("all_gather(dp) float32[") and e[2] == "tp_collective" for e in pushes)
    assert sum(e[0] == "push" for e in fake.log) == sum(e[0] == "pop" for e in fake.log)


@pytest.mark.parametrize("env", [{}, {"NVTX_INJECTION64_PATH": "/nsight/libToolsInjection64.so"}, {"TESSERA_NVTX": "1"}])
def test_a_profile_emits_nvtx_ranges_only_when_a_tool_collects_them(world, mesh, monkeypatch, fake_nvtx, env):
    """Without Nsight (which sets NVTX_INJECTION64_PATH) or TESSERA_NVTX=1 the ranges would go
    nowhere: the profile skips their ~2.5 us per op."""
    fake = fake_nvtx
    for k in ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH", "TESSERA_NVTX"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with graph.profile(print_table=False):
        _step(mesh)
    pushes = [e for e in fake.log if e[0] == "push"]
    if env:
        assert ("push", "matmul S(0)@dp [16,4]", "compute") in pushes
    else:
        assert pushes == []
