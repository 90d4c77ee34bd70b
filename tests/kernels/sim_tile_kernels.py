"""The seeds' tile kernels (tile API on numba.cuda) run in the CUDA simulator against NumPy.

Not a ``test_*`` file: the simulator must be chosen before numba is imported, so this runs in
a process of its own with NUMBA_ENABLE_CUDASIM=1 (tests/kernels/test_cudasim_suite.py launches
it; by hand: ``NUMBA_ENABLE_CUDASIM=1 pytest tests/kernels/sim_tile_kernels.py``).
"""
import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("runs with NUMBA_ENABLE_CUDASIM=1 in its own process (tests/kernels/test_cudasim_suite.py)",
                allow_module_level=True)

from tessera_rt.kernels import tile
from tessera_rt.kernels.tile_kernels import (
    make_tiled_matmul,
    saxpy_reference,
    saxpy_tile,
    staged_axpy_tile,
    tiled_matmul_tile,
)


def test_running_in_simulator():
    assert tile.SIMULATOR


@pytest.mark.parametrize("n", [1, 33, 128, 200])
def test_saxpy(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    got = saxpy_tile(x, y, 1.5)
    np.testing.assert_allclose(got, saxpy_reference(x, y, 1.5), rtol=1e-6)
    assert not np.shares_memory(got, y)
    out = y.copy()
    assert saxpy_tile(x, out, -2.0, out=out) is out         # the seed's `mut y`: in place
    np.testing.assert_allclose(out, -2.0 * x + y, rtol=1e-6)


@pytest.mark.parametrize("n,groups", [(100, 1), (100, 2), (64, 4), (31, 1)])
def test_staged_axpy_double_buffers(n, groups):
    # with few groups each one walks several tiles, toggling its two shared buffers
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 3.0, np.float32)
    np.testing.assert_array_equal(staged_axpy_tile(x, y, 2.0, groups=groups), 2.0 * x + 3.0)


@pytest.mark.parametrize("shape,ts", [((20, 13, 9), 8), ((32, 32, 32), 16), ((5, 17, 3), 4), ((8, 8, 8), 8)])
def test_tiled_matmul(shape, ts):
    m, k, n = shape
    rng = np.random.default_rng(m * k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = tiled_matmul_tile(a, b, ts=ts)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_shared_allocations_do_not_alias():
    # two shared_alloc calls in one kernel must be two buffers (the simulator keys by line)
    a = np.eye(8, dtype=np.float32) * 2
    b = np.arange(64, dtype=np.float32).reshape(8, 8)
    np.testing.assert_allclose(tiled_matmul_tile(a, b, ts=8), 2 * b)


def test_errors_before_launch():
    with pytest.raises(ValueError, match="same length"):
        saxpy_tile(np.ones(3, np.float32), np.ones(4, np.float32), 1.0)
    with pytest.raises(TypeError, match="float64"):
        saxpy_tile(np.ones(3), np.ones(3), 1.0)
    with pytest.raises(ValueError, match="ts <= 32"):
        tiled_matmul_tile(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32), ts=64)
    with pytest.raises(ValueError, match="2-D"):
        tiled_matmul_tile(np.ones((4, 4), np.float32), np.ones((5, 4), np.float32))
    with pytest.raises(RuntimeError, match="inside a tile kernel"):
        tile.linear_id()


def test_user_kernel_with_tile_api():
    @tile.kernel(group_size=16)
    def reverse_in_groups(x):
        s = tile.shared_alloc(16, np.float32)
        lane = tile.lane_id()
        i = tile.linear_id()
        s[lane] = x[i]
        tile.barrier()
        x[i] = s[tile.group_size() - 1 - lane]

    x = np.arange(32, dtype=np.float32)
    reverse_in_groups.launch(32, x)
    np.testing.assert_array_equal(x, np.concatenate([np.arange(15, -1, -1), np.arange(31, 15, -1)]))
    assert make_tiled_matmul(8) is make_tiled_matmul(8)


class _RecordingJit:
    """Stands between a TileKernel and its Numba dispatcher, recording each launch config."""

    def __init__(self, jit, seen):
        self._jit, self._seen = jit, seen

    def __getitem__(self, config):
        self._seen.append(config)
        return self._jit[config]


@pytest.mark.parametrize("path", ["saxpy", "staged", "matmul"])
def test_every_launch_path_runs_on_cupys_current_stream(monkeypatch, path):
    # Numba's default (stream 0) does not synchronize with CuPy's non-blocking compute
    # stream: each launch must be ordered on CuPy's current stream, or on the stream passed.
    import sys
    import types

    from tessera_rt.kernels import tile_kernels as tk
    current = types.SimpleNamespace(ptr=0xC0FFEE)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: current))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    seen = []
    kern = {"saxpy": tk.saxpy_kernel, "staged": tk.staged_axpy_kernel, "matmul": tk.make_tiled_matmul(8)}[path]
    monkeypatch.setattr(kern, "_jit", _RecordingJit(kern._jit, seen))
    x = np.arange(40, dtype=np.float32)
    a = np.ones((8, 8), np.float32)
    run = {"saxpy": lambda s: saxpy_tile(x, x, 2.0, stream=s),
           "staged": lambda s: staged_axpy_tile(x, x, 2.0, stream=s),
           "matmul": lambda s: tiled_matmul_tile(a, a, ts=8, stream=s)}[path]
    run(None)
    explicit = types.SimpleNamespace(ptr=0xBEEF, synchronize=lambda: None)
    run(explicit)
    assert [cfg[2].ptr for cfg in seen] == [0xC0FFEE, 0xBEEF], seen
