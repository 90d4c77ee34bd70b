"""dist.ccl at any world size: line/ring collectives against the plain collectives and the
NumPy result on the full data, persistent buffers, fused ops, ring attention.

1-D meshes over every rank; at 4 ranks also a 2x2 mesh (cluster_axis 0 and 1, by index and
by name).  Uneven shapes: lengths that 3 ranks do not divide, given as ``sizes``.
"""
import ml_dtypes
import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import dist
from tessera_rt.dist import ccl
from tessera_rt.dist.tensor.shard import split_sizes

pytestmark = pytest.mark.timeout(60)

BACKEND = ts.get_backend()
xp = BACKEND.xp
host = BACKEND.to_host
ALGOS = ["ring", "line", "library"]


def data(rank, shape, dtype, salt=0):
    rng = np.random.default_rng(1000 * salt + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def check(got, want, dtype, n=1):
    got = host(got)
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        t = {np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 5e-2}.get(np.dtype(dtype), 1e-5)
        np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=t, atol=t * n)


def meshes(world):
    """(mesh, cluster_axis spelling, axis name) pairs to run each test on."""
    out = [(dist.Mesh(axes=["x"], shape={"x": world.size}), 0, "x")]
    if world.size == 4:
        m = dist.Mesh(axes=["row", "col"], shape={"row": 2, "col": 2})
        out += [(m, 0, "row"), (m, "col", "col")]
    return out


def _cases(world):
    """Every (mesh, cluster_axis, axis name) with every algorithm."""
    return [(m, algo) for m in meshes(world) for algo in ALGOS]


def group_data(mesh, axis, shape, dtype, salt=0):
    """This rank's data and every group member's (by position in the group)."""
    ranks = mesh.group_ranks(axis)
    return [data(r, shape, dtype, salt) for r in ranks], mesh.group(axis).index


@pytest.fixture(autouse=True)
def _fresh_buffers(monkeypatch):
    monkeypatch.delenv("TESSERA_COMM_ALGO", raising=False)
    ccl.clear_persistent_buffers()
    ccl.reset_algo_override()
    yield
    ccl.clear_persistent_buffers()
    ccl.reset_algo_override()


@pytest.mark.parametrize("dtype", [np.int32, np.float32, ml_dtypes.bfloat16])
def test_line_reduce_scatter(world, dtype):
    for (mesh, ca, axis), algo in _cases(world):
        n = mesh.size(axis)
        for shape, dim in (((2, 3, 4 * n), 2), ((4 * n, 5), 0), ((2, 7, 3), 1), ((3, 2, 5), 1)):  # 2: zero parts at 3-4
            sizes = split_sizes(shape[dim], n) if shape[dim] % n else None
            everyone, me = group_data(mesh, axis, shape, dtype)
            x = xp.asarray(everyone[me])
            if BACKEND.is_gpu and algo != "library" and np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
                with pytest.raises(TypeError, match="none for bf16 on the GPU"):
                    ccl.line_reduce_scatter(x, dim=dim, cluster_axis=ca, mesh=mesh, sizes=sizes, algo=algo)
                continue
            y = ccl.line_reduce_scatter(x, dim=dim, cluster_axis=ca, mesh=mesh, sizes=sizes, algo=algo,
                                        buffer_key=f"rs{axis}{shape}{algo}")
            plain = dist.reduce_scatter(x, axis, dim=dim, sizes=sizes, mesh=mesh)
            total = np.sum([e.astype(np.float64) for e in everyone], axis=0)
            part = sizes or [shape[dim] // n] * n
            lo = sum(part[:me])
            want = np.take(total, range(lo, lo + part[me]), axis=dim)
            assert y.shape == plain.shape and y.dtype == plain.dtype
            check(y, want, dtype, n)
            if np.dtype(dtype).kind == "i":
                np.testing.assert_array_equal(host(y), host(plain))     # exactly the plain collective


@pytest.mark.parametrize("dtype", [np.int32, np.float32, ml_dtypes.bfloat16])
def test_line_all_gather(world, dtype):
    for (mesh, ca, axis), algo in _cases(world):
        n = mesh.size(axis)
        for base, dim, uneven in (((2, 3, 4), 2, False), ((3, 5), 0, False), ((2, 3, 4), 1, True)):
            sizes = [(base[dim] + i) % 3 for i in range(n)] if uneven else None    # 1, 2, 0, 1: zero parts
            me = mesh.group(axis).index
            shapes = [tuple(sizes[i] if d == dim else s for d, s in enumerate(base)) for i in range(n)] \
                if uneven else [base] * n
            everyone = [data(r, shapes[i], dtype) for i, r in enumerate(mesh.group_ranks(axis))]
            x = xp.asarray(everyone[me])
            y = ccl.line_all_gather(x, dim=dim, cluster_axis=ca, mesh=mesh, sizes=sizes, algo=algo, num_links=2,
                                    buffer_key=f"ag{axis}{dim}{algo}")
            plain = dist.all_gather(x, axis, dim=dim, sizes=sizes, mesh=mesh)
            np.testing.assert_array_equal(host(y), np.concatenate(everyone, axis=dim))   # a gather is exact
            np.testing.assert_array_equal(host(y), host(plain))


@pytest.mark.parametrize("op,dtype", [("sum", np.int64), ("max", np.int64), ("sum", np.float64),
                                      ("avg", np.float16), ("min", np.float32), ("avg", np.int64)])
def test_line_all_reduce(world, op, dtype):
    if op == "avg" and np.dtype(dtype).kind == "i":
        for algo in ALGOS:
            with pytest.raises(TypeError, match="avg"):
                ccl.line_all_reduce(xp.zeros(3, dtype), cluster_axis=0, mesh=meshes(world)[0][0], op=op, algo=algo)
        return
    for (mesh, ca, axis), algo in _cases(world):
        n = mesh.size(axis)
        for shape in ((5, 7), (1,), (2, 0)):       # 35 elements: uneven parts at 2, 3 and 4 ranks
            everyone, me = group_data(mesh, axis, shape, dtype, salt=1)
            x = xp.asarray(everyone[me])
            y = ccl.line_all_reduce(x, cluster_axis=ca, mesh=mesh, op=op, algo=algo, num_links=3)  # 3 sub-messages
            stack = np.stack([e.astype(np.float64) for e in everyone])
            want = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0), "avg": stack.mean(0)}[op]
            assert y.shape == x.shape and y.dtype == x.dtype
            check(y, want, dtype, n)
            if np.dtype(dtype).kind == "i":
                np.testing.assert_array_equal(host(y), host(dist.all_reduce(x, axis, op, mesh=mesh)))


def test_tune_measures_the_same_table_on_every_rank(world):
    mesh = meshes(world)[-1][0]
    try:
        table = ccl.tune(mesh=mesh, cluster_axis=0, sizes=(64, 4096), reps=1, iters=1)
        assert table == ccl.algo_table() and set(table) == {"reduce_scatter", "all_gather", "all_reduce"}
        for rows in table.values():
            assert [b for b, _ in rows][-1] == float("inf") and all(a in ALGOS for _, a in rows)
        g = mesh.group(mesh.axes[0])         # the members of a group agree (groups may differ)
        assert g.comm.mpi.allgather(table) == [table] * g.size
        assert ccl.persistent_buffers() == []           # tune leaves no buffers behind
    finally:
        ccl.set_algo_table(None)


def test_auto_and_override(world, monkeypatch):
    mesh = meshes(world)[0][0]
    x = xp.arange(12, dtype=np.float32)
    ccl.set_algo_table({"all_reduce": [(64, "ring"), (float("inf"), "library")]})
    try:
        with dist.trace_collectives() as log:
            ccl.line_all_reduce(x[:4], mesh=mesh)          # 16 B: ring
            ccl.line_all_reduce(x, mesh=mesh, algo="auto")  # 48 B: ring
            ccl.line_all_reduce(xp.zeros(100, np.float32), mesh=mesh)   # 400 B: library
            monkeypatch.setenv("TESSERA_COMM_ALGO", "line")
            ccl.reset_algo_override()                                   # read once per run otherwise
            ccl.line_all_reduce(x, mesh=mesh, algo="library")           # the override wins
        algos = [r.algo for r in log.records if r.op == "line_all_reduce"]
        assert algos == ["ring", "ring", "library", "line"]
        assert "algo=line" in str(log.records[-1])
    finally:
        ccl.set_algo_table(None)
    with pytest.raises(ValueError, match="last bound inf"):
        ccl.set_algo_table({"all_reduce": [(64, "ring")]})


def test_cached_plans_follow_the_table_and_the_override(world, monkeypatch):
    """A repeated call reuses its plan; a new table or TESSERA_COMM_ALGO re-plans it."""
    mesh = meshes(world)[0][0]
    x = xp.ones(6 * world.size, np.float32)
    try:
        with dist.trace_collectives() as log:
            for table in ("ring", "line", "ring"):
                ccl.set_algo_table({"reduce_scatter": [(float("inf"), table)]})
                for _ in range(2):
                    check(ccl.line_reduce_scatter(x, 0, mesh=mesh), np.full(6, world.size), np.float32)
            monkeypatch.setenv("TESSERA_COMM_ALGO", "library")
            ccl.reset_algo_override()
            ccl.line_reduce_scatter(x, 0, mesh=mesh)
        assert [r.algo for r in log.records if r.op == "line_reduce_scatter"] == \
            ["ring", "ring", "line", "line", "ring", "ring", "library"]
    finally:
        monkeypatch.delenv("TESSERA_COMM_ALGO")
        ccl.reset_algo_override()
        ccl.set_algo_table(None)


# --------------------------------------------------------------------------- persistent buffers

@pytest.mark.parametrize("algo", ["ring", "line"])
def test_persistent_buffers_no_allocation_after_first_call(world, algo):
    import tracemalloc
    a0 = ccl.allocations()
    mesh = meshes(world)[0][0]
    n = world.size
    x = xp.asarray(data(world.rank, (4, 8192 * n), np.int32).astype(np.float32))   # 128 KiB a part; exact sums
    first = ccl.line_reduce_scatter(x, dim=1, cluster_axis=0, mesh=mesh, buffer_key="FF1", algo=algo)
    assert ccl.allocations() == a0 + 6       # two sets of (work, slot0, slot1)
    rows = {r["key"]: r for r in ccl.persistent_buffers()}
    assert rows["FF1"]["op"] == "line_reduce_scatter" and rows["FF1"]["sets"] == 2
    assert rows["FF1"]["bytes"] >= 2 * x.nbytes and rows["FF1"]["made_at"].startswith("mpi_ccl.py:")
    kept = host(first).copy()
    second = ccl.line_reduce_scatter(x * 2, dim=1, cluster_axis=0, mesh=mesh, buffer_key="FF1", algo=algo)
    # double buffering: call 2 wrote the other set, so call 1's result is still intact
    np.testing.assert_array_equal(host(first), kept)
    np.testing.assert_array_equal(host(second), 2 * kept)
    ccl.line_reduce_scatter(x * 3, dim=1, cluster_axis=0, mesh=mesh, buffer_key="FF1", algo=algo)
    np.testing.assert_array_equal(host(first), 3 * kept)       # call 3 reused call 1's set
    tracemalloc.start()        # NumPy reports its allocations to tracemalloc (host arrays only)
    try:
        for _ in range(3):
            third = ccl.line_reduce_scatter(x, dim=1, cluster_axis=0, mesh=mesh, buffer_key="FF1", algo=algo)
            ccl.line_all_gather(third, dim=1, cluster_axis=0, mesh=mesh, buffer_key="AG", algo=algo)
        a1 = ccl.allocations()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(3):
            third = ccl.line_reduce_scatter(x, dim=1, cluster_axis=0, mesh=mesh, buffer_key="FF1", algo=algo)
            ccl.line_all_gather(third, dim=1, cluster_axis=0, mesh=mesh, buffer_key="AG", algo=algo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if not BACKEND.is_gpu:
        # no array-sized allocation per call: Python bookkeeping only, far below one 128 KiB part
        assert peak - before < 16384, (peak - before, x.nbytes)
    assert ccl.allocations() == a1          # the ccl allocation counter: nothing after warm-up


@pytest.mark.parametrize("algo", ["library", "ring"])
@pytest.mark.parametrize("per_rank", [64, None])      # None: a 4 MiB result (CPU: on a mapping of its own)
def test_a_dropped_result_gives_its_set_back(world, algo, per_rank):
    """A held result (or a view of it) is never written over by the next call; on CPU ranks a
    call whose previous result was dropped takes that warm set again (on a GPU: cycles)."""
    mesh = meshes(world)[0][0]
    ptr = (lambda a: a.data.ptr) if BACKEND.is_gpu else (lambda a: a.ctypes.data)
    key = "REUSE_" + algo
    x = xp.arange(per_rank * world.size if per_rank else (1 << 20) // world.size, dtype=np.float32)
    r1 = ccl.line_all_gather(x, 0, 0, mesh=mesh, algo=algo, buffer_key=key)
    a, keep = ptr(r1), host(r1).copy()
    r2 = ccl.line_all_gather(x * 2, 0, 0, mesh=mesh, algo=algo, buffer_key=key)
    assert ptr(r2) != a
    np.testing.assert_array_equal(host(r1), keep)                 # held: call 2 took the other set
    v = r2[3:]
    del r1, r2
    r3 = ccl.line_all_gather(x * 3, 0, 0, mesh=mesh, algo=algo, buffer_key=key)
    np.testing.assert_array_equal(host(v), 2 * keep[3:])          # a view of call 2's result still held
    b = ptr(r3)
    del v, r3
    # a dropped result's set is taken again (CPU) or the other one (GPU: cycles).  Any other
    # holder makes a CPU call cycle too: the watchdog keeps the frame it last sampled (with
    # its locals) for up to 0.2 s, so the pairs are repeated (the same number on every rank)
    reused = 0
    for k in range(4, 8):
        r = ccl.line_all_gather(x * k, 0, 0, mesh=mesh, algo=algo, buffer_key=key)
        np.testing.assert_array_equal(host(r), k * keep)
        reused += ptr(r) == b
        b = ptr(r)
        del r
    assert (reused > 0) != BACKEND.is_gpu and (BACKEND.is_gpu or reused >= 2)
    ccl.clear_persistent_buffers(key)


def test_library_path_runs_the_plain_collectives_plan(world):
    """The library path and the plain collective share one plan (one table, dist/comm/plans.py):
    with a buffer_key its result is the plain call's, call after call, with no array allocated."""
    import tracemalloc

    from tessera_rt.dist.comm import plans
    mesh = meshes(world)[0][0]
    x = xp.asarray(data(world.rank, (4096 * world.size,), np.int32).astype(np.float32))    # exact sums
    want = [host(dist.all_reduce(x, "x", mesh=mesh)), host(dist.reduce_scatter(x, "x", dim=0, mesh=mesh)),
            host(dist.all_gather(x, "x", dim=0, mesh=mesh))]

    def run():
        return [ccl.line_all_reduce(x, 0, mesh=mesh, algo="library", buffer_key="L_AR"),
                ccl.line_reduce_scatter(x, 0, 0, mesh=mesh, algo="library", buffer_key="L_RS"),
                ccl.line_all_gather(x, 0, 0, mesh=mesh, algo="library", buffer_key="L_AG")]
    made = plans.plans_made()
    for _ in range(3):
        for got, w in zip(run(), want):
            np.testing.assert_array_equal(host(got), w)
    # a ccl plan per op, plus the reduce-scatter's async form (for between=); the plain plans were reused
    assert plans.plans_made() == made + 4
    tracemalloc.start()
    try:
        run()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(3):
            run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if not BACKEND.is_gpu:
        assert peak - before < 8192, peak - before        # no output array per call


def test_buffer_key_conflict_names_both_and_where(world):
    mesh = meshes(world)[0][0]
    n = world.size
    ccl.line_all_gather(xp.zeros((2, 3), np.float32), dim=0, mesh=mesh, buffer_key="BINARY_MUL", algo="ring")
    with pytest.raises(ValueError, match=r"BINARY_MUL.*first made at mpi_ccl.py:\d+.*float32\[2, 3\].*"
                                         r"float16\[2, 3\].*different dtype"):
        ccl.line_all_gather(xp.zeros((2, 3), np.float16), dim=0, mesh=mesh, buffer_key="BINARY_MUL", algo="ring")
    with pytest.raises(ValueError, match="different shape"):
        ccl.line_all_gather(xp.zeros((4, 3), np.float32), dim=0, mesh=mesh, buffer_key="BINARY_MUL", algo="ring")
    assert n >= 1


# --------------------------------------------------------------------------- bad input

def test_bad_input_errors_before_anything_is_sent(world):
    mesh = meshes(world)[0][0]
    n = world.size
    x = xp.zeros((2, 3 * n + (1 if n > 1 else 0)), np.float32)
    with pytest.raises(ValueError, match=r"cluster_axis=1 but the mesh has 1 axes \['x'\]"):
        ccl.line_all_reduce(x, cluster_axis=1, mesh=mesh)
    with pytest.raises(ValueError, match="cluster_axis='tp' is not an axis"):
        ccl.line_all_gather(x, cluster_axis="tp", mesh=mesh)
    if n > 1:
        with pytest.raises(ValueError, match=r"does not split evenly over \d ranks; pass sizes="):
            ccl.line_reduce_scatter(x, dim=1, cluster_axis=0, mesh=mesh, algo="ring")
    with pytest.raises(ValueError, match="algo='tree'"):
        ccl.line_all_reduce(x, mesh=mesh, algo="tree")
    with pytest.raises(ValueError, match="num_links=0"):
        ccl.line_all_reduce(x, mesh=mesh, num_links=0)
    with pytest.raises(TypeError, match="to_local"):
        ccl.line_all_reduce(dist.distribute(np.zeros((2, 2), np.float32), dist.ReplicateSpec(("x",)), mesh=mesh),
                            mesh=mesh)
    # every rank raised, nothing is in flight: a collective still matches up
    y = ccl.line_all_reduce(xp.ones(3, np.float32), mesh=mesh, algo="ring")
    check(y, np.full(3, n), np.float32)


# --------------------------------------------------------------------------- fused ops

@pytest.mark.parametrize("algo", ALGOS)
def test_double_matmul_line_reduce_scatter(world, algo):
    for mesh, ca, axis in meshes(world):
        n = mesh.size(axis)
        me = mesh.group(axis).index
        x = xp.asarray(data(world.rank, (2, 3, 8), np.float32, salt=2))
        w1 = xp.asarray(data(world.rank, (8, 4 * n), np.float32, salt=3))
        w3 = xp.asarray(data(world.rank, (8, 4 * n), np.float32, salt=4))
        want_rs = dist.reduce_scatter(xp.asarray(host(x) @ host(w1)), axis, dim=2, mesh=mesh)
        # the default (6 rows <= 2F: overlapped on the CPU), one pass over x, overlapped
        for overlap in (None, False, True):
            rs, y3 = ccl.double_matmul_line_reduce_scatter(x, w1, w3, cluster_axis=ca, dim=-1, mesh=mesh,
                                                           algo=algo, buffer_key=f"dm{axis}", overlap=overlap)
            check(rs, host(want_rs), np.float32, n)
            check(y3, host(x) @ host(w3), np.float32)
            assert rs.shape == (2, 3, 4) and me >= 0
        # many rows: the CPU default is the one pass, x @ [w1 | w3]
        xl = xp.asarray(data(world.rank, (5, 8 * n + 1, 8), np.float32, salt=5))
        rs, y3 = ccl.double_matmul_line_reduce_scatter(xl, w1, w3, cluster_axis=ca, dim=-1, mesh=mesh, algo=algo)
        check(rs, host(dist.reduce_scatter(xp.asarray(host(xl) @ host(w1)), axis, dim=2, mesh=mesh)), np.float32, n)
        check(y3, host(xl) @ host(w3), np.float32)
        # fp16: on a GPU (and the stand-in) the DUAL_OUT tile kernel, one pass over x
        h = [a.astype(np.float16) for a in (x, w1, w3)]
        rs, y3 = ccl.double_matmul_line_reduce_scatter(*h, cluster_axis=ca, dim=-1, mesh=mesh, algo=algo)
        hx, h1, h3 = (host(a).astype(np.float64) for a in h)
        check(rs, host(dist.reduce_scatter(xp.asarray(hx @ h1), axis, dim=2, mesh=mesh)), np.float16, n)
        check(y3, hx @ h3, np.float16)
        if n > 1:
            with pytest.raises(ValueError, match=r"does not split evenly over the \d ranks"):
                    ccl.double_matmul_line_reduce_scatter(x, w1[:, :4 * n - 1], w3[:, :4 * n - 1], cluster_axis=ca,
                                                      mesh=mesh)


@pytest.mark.parametrize("algo", ALGOS)
def test_the_overlapped_matmul_runs_while_the_transfer_travels(world, monkeypatch, algo):
    # overlap=True: x @ w3 runs after the reduce-scatter's first messages are launched (NCCL
    # holds non-blocking send/recv until a wait) and, on a GPU, on the compute stream (not
    # queued behind the transfer on the collective's stream)
    from tessera_rt import runtime as rt
    from tessera_rt.dist.ccl import fused
    mesh, ca, axis = meshes(world)[0]
    n, g = mesh.size(axis), mesh.group(axis)
    comm = g.comm.raw if BACKEND.is_gpu else g.comm          # NCCL's launches, or MPI's posts
    log = []
    for name in ("send", "recv", "reduceScatter" if BACKEND.is_gpu else "reduce_scatter"):
        real = getattr(comm, name)
        monkeypatch.setattr(comm, name, lambda *a, _real=real, _name=name, **k: (log.append(_name), _real(*a, **k))[1])
    matmul = fused.local_matmul

    def logged(a, b):
        cur = __import__("cupy").cuda.get_current_stream() if BACKEND.is_gpu else None
        log.append(("matmul", cur == rt.stream("compute").raw if BACKEND.is_gpu else True))
        return matmul(a, b)
    monkeypatch.setattr(fused, "local_matmul", logged)
    x = xp.asarray(data(world.rank, (2, 3, 8), np.float32, salt=2))
    w1, w3 = (xp.asarray(data(world.rank, (8, 4 * n), np.float32, salt=s)) for s in (3, 4))
    rs, y3 = ccl.double_matmul_line_reduce_scatter(x, w1, w3, cluster_axis=ca, mesh=mesh, algo=algo, overlap=True)
    check(y3, host(x) @ host(w3), np.float32)
    mm = [i for i, e in enumerate(log) if isinstance(e, tuple)]
    assert len(mm) == 2 and log[mm[0]] == ("matmul", True), log          # x @ w1, before the transfer
    assert log[mm[1]] == ("matmul", True), f"x @ w3 ran on {rt.stream('tp_collective')}, not compute: {log}"
    launched = log[mm[0] + 1:mm[1]]
    if n > 1:        # (a line's first step may only send, or only receive, on this rank)
        assert launched, f"x @ w3 ran before the transfer started: {log}"


@pytest.mark.parametrize("algo", ["ring", "library"])
def test_llama_rs_create_heads(world, algo):
    for mesh, ca, axis in meshes(world):
        n = mesh.size(axis)
        me = mesh.group(axis).index
        h, hkv, d, b, s = 4 * n, 2 * n, 3, 2, 5
        everyone = [data(r, (b, s, (h + 2 * hkv) * d), np.float64, salt=5) for r in mesh.group_ranks(axis)]
        q, k, v = ccl.llama_rs_create_heads(xp.asarray(everyone[me]), n_heads=h, n_kv_heads=hkv, head_dim=d,
                                            cluster_axis=ca, mesh=mesh, algo=algo, buffer_key=f"qkv{axis}")
        # unfused: all-reduce the projection, split Q | K | V into heads, keep this rank's
        full = sum(everyone)
        def split(lo, nh):
            return full[..., lo * d:(lo + nh) * d].reshape(b, s, nh, d).transpose(0, 2, 1, 3)
        qa, ka, va = split(0, h), split(h, hkv), split(h + hkv, hkv)
        hl, kl = h // n, hkv // n
        assert q.shape == (b, hl, s, d) and k.shape == v.shape == (b, kl, s, d)
        check(q, qa[:, me * hl:(me + 1) * hl], np.float64, n)
        check(k, ka[:, me * kl:(me + 1) * kl], np.float64, n)
        check(v, va[:, me * kl:(me + 1) * kl], np.float64, n)
        if n > 1:
            with pytest.raises(ValueError, match="must both be divisible"):
                ccl.llama_rs_create_heads(xp.zeros((b, s, (n + 1 + 2 * hkv) * d)), n_heads=n + 1, n_kv_heads=hkv,
                                          head_dim=d, cluster_axis=ca, mesh=mesh)


@pytest.mark.parametrize("algo", ["line", "library"])
def test_all_gather_concat(world, algo):
    for mesh, ca, axis in meshes(world):
        n = mesh.size(axis)
        me = mesh.group(axis).index
        everyone = [data(r, (2, 3, 5, 4), np.float32, salt=6) for r in mesh.group_ranks(axis)]
        y = ccl.all_gather_concat(xp.asarray(everyone[me]), dim=1, cluster_axis=ca, num_heads=3, mesh=mesh,
                                  algo=algo, buffer_key=f"agc{axis}")
        gathered = dist.all_gather(xp.asarray(everyone[me]), axis, dim=1, mesh=mesh)
        np.testing.assert_array_equal(host(y), host(gathered).transpose(0, 2, 1, 3).reshape(2, 5, n * 3 * 4))
        with pytest.raises(ValueError, match="num_heads=2 but x holds 3 heads"):
            ccl.all_gather_concat(xp.asarray(everyone[me]), dim=1, cluster_axis=ca, num_heads=2, mesh=mesh)


# --------------------------------------------------------------------------- ring attention

def _attention_case(world, mesh, axis, seq_len, layout, dtype=np.float64, h=4, hkv=2, d=8):
    n, me = mesh.size(axis), mesh.group(axis).index
    rng = np.random.default_rng(7)                     # the same full tensors on every rank
    Q, K, V, W = (rng.standard_normal(s).astype(dtype) for s in
                  ((2, h, seq_len, d), (2, hkv, seq_len, d), (2, hkv, seq_len, d), (2, h, seq_len, d)))
    pos = ccl.sequence_positions(seq_len, n, me, layout)
    local = [xp.asarray(np.ascontiguousarray(t[:, :, pos])) for t in (Q, K, V, W)]
    return (Q, K, V, W), local, pos


@pytest.mark.parametrize("layout,causal", [("striped", True), ("contiguous", True), ("striped", False)])
def test_ring_attention_forward_and_backward(world, layout, causal):
    from tessera_rt import op
    from tessera_rt.kernels.attention import flash_attention, flash_attention_backward
    for mesh, ca, axis in meshes(world):
        n = mesh.size(axis)
        for seq_len in (4 * n, 4 * n + (n - 1)):       # even, and uneven at n > 1 (pass seq_len)
            (Q, K, V, W), (q, k, v, w), pos = _attention_case(world, mesh, axis, seq_len, layout)
            kw = dict(axis=ca, mesh=mesh, causal=causal, layout=layout, seq_len=seq_len)
            o = ccl.ring_attention(q, k, v, **kw)
            # the oracle: op.flash_attention's NumPy reference on the gathered sequence, on the host
            want, lse = flash_attention(Q, K, V, causal=causal, return_lse=True)
            np.testing.assert_allclose(host(o), want[:, :, pos], rtol=1e-6, atol=1e-6)   # the merge's lse is f32

            def loss(q, k, v):
                return op.sum(ccl.ring_attention(q, k, v, **kw) * w)
            dq, dk, dv = ts.grad(loss, argnums=(0, 1, 2))(q, k, v)
            # d(sum(o * W)) = W: the backward of the whole attention, cut to this rank's positions
            dQ, dK, dV = flash_attention_backward(Q, K, V, want, W, lse, causal=causal)
            for got, full in ((dq, dQ), (dk, dK), (dv, dV)):
                np.testing.assert_allclose(host(got), host(full)[:, :, pos], rtol=1e-6, atol=1e-6)


def test_ring_attention_errors(world):
    mesh = meshes(world)[0][0]
    n = world.size
    q = xp.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="cluster_axis='dp' is not an axis"):
        ccl.ring_attention(q, q, q, axis="dp", mesh=mesh)
    if n > 1:
        with pytest.raises(ValueError, match=r"q holds 3 tokens .* gives this rank \d+; pass seq_len="):
            ccl.ring_attention(q, q, q, axis=0, mesh=mesh, seq_len=3 * n + n)
    with pytest.raises(ValueError, match="layout='blocks'"):
        ccl.ring_attention(q, q, q, axis=0, mesh=mesh, layout="blocks")


# --------------------------------------------------------------------------- hierarchical and tags

@pytest.mark.parametrize("algo", ["ring", "library"])
def test_hierarchical_all_reduce(world, algo):
    n = world.size
    line = dist.Mesh(axes=["x"], shape={"x": n})
    everyone = [data(r, (5, 3), np.int64, salt=8) for r in range(n)]
    want = np.sum(everyone, axis=0)
    for local in sorted({1, n} | ({2} if n % 2 == 0 else set())):
        with dist.trace_collectives() as log:
            y = ccl.hierarchical_all_reduce(xp.asarray(everyone[world.rank]), mesh=line, local_size=local, algo=algo)
        np.testing.assert_array_equal(host(y), want)
        assert [r.op for r in log.records if r.op.startswith("line_")] == \
            ["line_reduce_scatter", "line_all_reduce", "line_all_gather"]
    y = ccl.hierarchical_all_reduce(xp.asarray(everyone[world.rank]), mesh=line)      # split by real host
    np.testing.assert_array_equal(host(y), want)
    if n == 4:
        m = dist.Mesh(axes=["row", "col"], shape={"row": 2, "col": 2})
        y = ccl.hierarchical_all_reduce(xp.asarray(everyone[world.rank]).astype(np.float64), mesh=m, intra="col",
                                        inter="row", op="avg", algo=algo)
        check(y, want / 4, np.float64)
    with pytest.raises(ValueError, match="local_size=5 must divide"):
        ccl.hierarchical_all_reduce(xp.zeros(3), mesh=line, local_size=5)


def test_tags_choose_and_are_recorded(world, monkeypatch):
    mesh = dist.Mesh(axes=["x"], shape={"x": world.size})
    x = xp.ones(8, np.float32)
    with dist.trace_collectives() as log:
        a = ccl.line_all_reduce(x, mesh=mesh, tag="ring")
        b = ccl.line_all_reduce(x, mesh=mesh, tag="tree")
        c = ccl.line_all_reduce(x, mesh=mesh, tag="tree", algo="line")     # an explicit algo wins over a tag
        monkeypatch.setenv("TESSERA_COMM_ALGO", "tree")
        ccl.reset_algo_override()
        d = ccl.line_all_reduce(x, mesh=mesh, tag="ring")                   # the run's override wins over both
    got = [(r.algo, r.tag) for r in log.records if r.op == "line_all_reduce"]
    assert got == [("ring", "ring"), ("library", "tree"), ("line", "tree"), ("library", "ring")]
    assert "tag=tree" in str(log.records[1])
    for y in (a, b, c, d):
        check(y, np.full(8, world.size), np.float32)
    with pytest.raises(ValueError, match="tag='fast'"):
        ccl.line_all_reduce(x, mesh=mesh, tag="fast")
    monkeypatch.setenv("TESSERA_COMM_ALGO", "fastest")
    ccl.reset_algo_override()
    with pytest.raises(ValueError, match="TESSERA_COMM_ALGO='fastest'"):
        ccl.line_all_reduce(x, mesh=mesh)


def test_plain_collectives_take_tags(world):
    """dist.all_reduce/reduce_scatter/all_gather/broadcast with tag=: the same results, the tag
    in the trace records; on NCCL a tagged all-reduce runs on a communicator made with NCCL_ALGO."""
    import os
    n = world.size
    mesh = dist.Mesh(axes=["x"], shape={"x": n})
    everyone = [data(r, (2 * n, 3), np.int64) for r in range(n)]
    x = xp.asarray(everyone[world.rank])
    env = os.environ.get("NCCL_ALGO")
    with dist.trace_collectives() as log:
        for tag in ("tree", "ring"):
            np.testing.assert_array_equal(host(dist.all_reduce(x, "x", mesh=mesh, tag=tag)), sum(everyone))
            np.testing.assert_array_equal(host(dist.reduce_scatter(x, "x", dim=0, mesh=mesh, tag=tag)),
                                          sum(everyone)[2 * world.rank:2 * world.rank + 2])
            np.testing.assert_array_equal(host(dist.all_gather(x, "x", dim=1, mesh=mesh, tag=tag)),
                                          np.concatenate(everyone, axis=1))
            b = x.copy()
            np.testing.assert_array_equal(host(dist.broadcast(b, "x", root=n - 1, mesh=mesh, tag=tag)), everyone[-1])
        dist.all_reduce(x, "x", mesh=mesh)
    got = [(r.op, r.tag) for r in log.records]
    assert got == [(o, t) for t in ("tree", "ring") for o in ("all_reduce", "reduce_scatter", "all_gather",
                                                              "broadcast")] + [("all_reduce", "")]
    assert "tag=ring" in str(log.records[4]) and "tag" not in str(log.records[-1])
    comm = mesh.group("x").comm
    tree = comm.tagged("all_reduce", "tree")
    if comm.kind == "nccl":     # a second communicator, made with NCCL_ALGO=Tree; the env is left as it was
        assert tree is not comm and tree.algo_env == "Tree" and comm.tagged("all_reduce", "tree") is tree
        assert comm.tagged("all_gather", "tree") is comm
    else:                       # MPI: no per-call algorithm choice, the tag is only recorded
        assert tree is comm
    assert os.environ.get("NCCL_ALGO") == env
    with pytest.raises(ValueError, match="tag='fast'"):
        dist.all_reduce(x, "x", mesh=mesh, tag="fast")
    X = dist.distribute(xp.zeros((n, 2)), layout=dist.ReplicateSpec(mesh_axes=("x",)), mesh=mesh)
    with pytest.raises(ValueError, match="tag applies to arrays"):
        dist.all_gather(X, "x", tag="ring")
