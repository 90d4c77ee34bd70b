"""The plain collectives' C path (dist/comm/_hot.c) on one process: built, wrapping the Python
functions faithfully, building the same plan keys (a repeat call is a hit for every argument
form the Python function caches), and leaving errors to Python.  Multi-rank behaviour:
tests/collectives/mpi_collectives.py (results against NumPy at 1-4 ranks), tests/debug/test_failures.py
(the watchdog sees a hang inside the C path)."""
import inspect
import os

import numpy as np
import pytest

from tessera_rt import dist
from tessera_rt.dist.comm import collectives as C

pytestmark = pytest.mark.timeout(60)

NAMES = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]


@pytest.fixture(scope="module")
def line():
    w = dist.init()
    return dist.Mesh(axes=["x"], shape=(w.size,))


def test_the_extension_is_built_and_reads_numpy_arrays_directly():
    if os.environ.get("TESSERA_HOT", "1") in ("0", "off", "false", "no"):
        pytest.skip("TESSERA_HOT=0 keeps the Python collectives")
    assert C.HOT is not None, "tessera_rt.dist.comm._hot did not build: run `pip install -e .` with a C compiler"
    assert C.HOT_ARRAY_FIELDS, "the NumPy array layout check failed: the C path reads arrays through attributes"


@pytest.mark.parametrize("name", NAMES)
def test_each_collective_keeps_its_python_signature_and_docs(name):
    if C.HOT is None:
        pytest.skip("not built (see the first test)")
    fn = getattr(dist, name)
    assert fn is getattr(C, name) and isinstance(fn, C.HOT.Collective)
    py = fn.__wrapped__
    assert inspect.signature(fn) == inspect.signature(py)
    assert fn.__doc__ == py.__doc__ and fn.__name__ == name and fn.__module__ == py.__module__
    assert repr(fn) == f"<tessera_rt collective {name}>"


# every argument form of each collective that the Python function caches a plan for, and
# whether the plan allows the direct call
FORMS = [
    ("all_reduce", lambda m, x: dist.all_reduce(x, "x", mesh=m), True),
    ("all_reduce", lambda m, x: dist.all_reduce(x, "x", "max", mesh=m, out=np.empty_like(x)), True),
    ("all_reduce", lambda m, x: dist.all_reduce(x, "x", op="min", mesh=m, role="a2a"), True),
    ("all_reduce", lambda m, x: dist.all_reduce(x, mesh=m, tag="ring"), True),
    ("all_reduce", lambda m, x: dist.all_reduce(x), True),
    ("reduce_scatter", lambda m, x: dist.reduce_scatter(x, "x", mesh=m), True),
    ("reduce_scatter", lambda m, x: dist.reduce_scatter(x, "x", "max", dim=0, mesh=m), True),
    ("reduce_scatter", lambda m, x: dist.reduce_scatter(x, "x", dim=1, mesh=m), True),      # packs first
    ("all_gather", lambda m, x: dist.all_gather(x, "x", mesh=m), True),
    ("all_gather", lambda m, x: dist.all_gather(x, "x", dim=0, mesh=m, out=np.empty_like(x)), True),
    ("all_to_all", lambda m, x: dist.all_to_all(x, "x", mesh=m), True),
    ("all_to_all", lambda m, x: dist.all_to_all(x, "x", split_dim=0, mesh=m, out=np.empty_like(x)), True),
    ("broadcast", lambda m, x: dist.broadcast(x, "x", root=0, mesh=m), True),
    ("broadcast", lambda m, x: dist.broadcast(x, mesh=m), True),
]


@pytest.mark.parametrize("i", range(len(FORMS)))
def test_a_repeat_call_finds_the_plan_the_python_function_made(line, i):
    if C.HOT is None:
        pytest.skip("not built (see the first test)")
    name, call, direct = FORMS[i]
    fn = getattr(C, name)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    first = call(line, x.copy())
    hits = fn.hits
    again = call(line, x.copy())
    assert fn.hits == hits + direct
    np.testing.assert_array_equal(again, first)


def test_errors_are_the_python_functions(line):
    x = np.ones(4, np.float32)
    dist.all_gather(x, "x", mesh=line)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dims'"):
        dist.all_gather(x, "x", dims=0, mesh=line)
    with pytest.raises(TypeError, match="multiple values for argument 'axis'"):
        dist.all_gather(x, "x", axis="x", mesh=line)
    with pytest.raises(ValueError, match=r"out= must be a contiguous float32\[4\], got float32\[4\]"):
        dist.all_gather(x, "x", mesh=line, out=np.ones(8, np.float32)[::2])
    with pytest.raises((TypeError, ValueError), match="all_gather"):
        dist.all_gather([1.0, 2.0], "x", mesh=line)
    with pytest.raises(ValueError, match="axis 'y'"):
        dist.all_gather(x, "y", mesh=line)


def test_an_output_is_reused_only_once_nothing_refers_to_it(line):
    if C.HOT is None:
        pytest.skip("not built (see the first test)")
    import weakref
    n = dist.init().size
    a, b = np.full(16, 1.0, np.float32), np.full(16, 2.0, np.float32)
    dist.all_reduce(a, "x", mesh=line)                  # the plan
    r1 = dist.all_reduce(a, "x", mesh=line)
    r2 = dist.all_reduce(b, "x", mesh=line)
    r3 = dist.all_reduce(a, "x", mesh=line)
    assert r1 is not r2 and r2 is not r3 and r1 is not r3
    kept = id(r1)
    del r1                                              # only the C path refers to it now
    r4 = dist.all_reduce(b, "x", mesh=line)
    assert id(r4) == kept                               # reused, like the raw call's buffer
    np.testing.assert_array_equal(r2, np.full(16, 2.0 * n))     # results still held are untouched
    np.testing.assert_array_equal(r3, np.full(16, 1.0 * n))
    np.testing.assert_array_equal(r4, np.full(16, 2.0 * n))
    seen = weakref.ref(r4)
    del r4                                              # a weak reference may still read it
    r5 = dist.all_reduce(a, "x", mesh=line)
    assert seen() is not r5
    assert seen() is None or (seen() == 2.0 * n).all()
    np.testing.assert_array_equal(r5, np.full(16, 1.0 * n))


def test_a_view_keeps_its_output_from_being_reused(line):
    if C.HOT is None:
        pytest.skip("not built (see the first test)")
    n = dist.init().size
    for count in (16, 1 << 14):            # NumPy's own memory, and 64 KiB: a pool block's array
        a, b = np.full(count, 1.0, np.float32), np.full(count, 2.0, np.float32)
        dist.all_reduce(a, "x", mesh=line)
        view = dist.all_reduce(a, "x", mesh=line)[1:]          # only the view is left
        for _ in range(3):
            dist.all_reduce(b, "x", mesh=line)
        np.testing.assert_array_equal(view, np.full(count - 1, 1.0 * n))


def test_the_collectives_read_their_check_from_the_seam(line):
    # The agreement check every collective runs is the seam's slot (dist.comm.hooks.SEAM), which the
    # checkers fill: no module global of collectives holds it, and the C path hands a call to
    # Python while the slot holds a check other than the agreement check it runs itself.
    from tessera_rt.dist.comm.hooks import SEAM
    for gone in ("_check", "_check_sig", "_DET"):
        assert not hasattr(C, gone), gone
    x = np.ones(4, np.float32)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x, "x", mesh=line),
        "reduce_scatter": lambda: dist.reduce_scatter(x, "x", mesh=line),
        "all_gather": lambda: dist.all_gather(x, "x", mesh=line),
        "all_to_all": lambda: dist.all_to_all(x, "x", mesh=line),
        "broadcast": lambda: dist.broadcast(x, "x", mesh=line),
    }
    for call in calls.values():
        call()                               # plans made: a repeat would take the C path
    seen, before = [], SEAM.check_plan
    SEAM.check_plan = lambda p, depth=2: seen.append(p.op)
    try:
        for call in calls.values():
            call()
    finally:
        SEAM.check_plan = before
    assert seen == list(calls)


def test_a_wait_is_named_to_the_watchdog_through_the_seam():
    # a layer above dist names what the main thread waits for with hooks.note (no frame locals)
    from tessera_rt.dist.checks import watchdog
    from tessera_rt.dist.comm import hooks
    assert watchdog.note_of_main() == ""
    with hooks.note("pipeline stage 1 waits for micro-batch 0"):
        with hooks.note("the inner wait"):
            assert watchdog.note_of_main() == "the inner wait"
        assert watchdog.note_of_main() == "pipeline stage 1 waits for micro-batch 0"
    assert watchdog.note_of_main() == "" and hooks.SEAM.notes == []
