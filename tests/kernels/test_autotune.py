"""autotune: times candidates once per (shape, dtype, device), caches the winner on disk."""
import json
import time

import numpy as np
import pytest

from tessera_rt.kernels import autotuner as AT


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    return tmp_path


def make(calls, delays):
    def op(x, *, block=None, stages=None):
        if block == 999:
            raise ValueError("block 999 does not fit")
        calls.append((block, stages))
        time.sleep(delays[(block, stages)])
        return x * 2
    return op


# The winner's margin is wide (10x, 15 ms) so a loaded machine's late wake-ups cannot reorder them
# (a 1 ms vs 3 ms margin lost once under a concurrent build).
DELAYS = {(64, 2): 0.02, (64, 3): 0.0015, (128, 2): 0.03, (128, 3): 0.015, (999, 2): 0, (999, 3): 0}


def test_picks_fastest_and_caches_on_disk(cache_dir):
    calls = []
    tuned = AT.autotune(space={"block": [64, 128, 999], "stages": [2, 3]}, name="t", reps=2)(make(calls, DELAYS))
    x = np.ones((4, 8), np.float32)
    assert np.array_equal(tuned(x), x * 2)
    assert tuned.best(x) == {"block": 64, "stages": 3}
    assert len(calls) == 4 * 3 + 1            # 4 runnable candidates x (warmup + 2 reps), then the call
    data = json.loads((cache_dir / "autotune.json").read_text())
    (key,) = data
    assert "t|cpu|(4, 8):float32" == key
    assert data[key]["config"] == {"block": 64, "stages": 3} and len(data[key]["times_ms"]) == 4

    calls.clear()
    tuned(x)                                  # same key: no timing
    assert calls == [(64, 3)]
    calls.clear()
    fresh = AT.autotune(space={"block": [64, 128, 999], "stages": [2, 3]}, name="t")(make(calls, DELAYS))
    fresh(x)                                  # a new process reads the disk cache
    assert calls == [(64, 3)]
    calls.clear()
    tuned(np.ones((2, 2), np.float64))        # a new shape/dtype tunes again
    assert len(calls) > 1


def test_tuple_configs_roundtrip_json():
    seen = []

    def op(x, *, tile_shape=None):
        seen.append(tile_shape)
        if tile_shape == (8, 8, 8):
            time.sleep(0.002)
        return x
    tuned = AT.autotune(space={"tile_shape": [None, (8, 8, 8)]}, name="tup")(op)
    tuned(np.ones(3))
    fresh = AT.autotune(space={"tile_shape": [None, (8, 8, 8)]}, name="tup")(op)
    assert fresh.best(np.ones(3)) == {"tile_shape": None}
    t2 = AT.autotune(space={"tile_shape": [(8, 8, 8)]}, name="tup2")(op)
    assert AT.Autotuner.best(t2, np.ones(3)) == {"tile_shape": (8, 8, 8)}
    assert AT.autotune(space={"tile_shape": [(8, 8, 8)]}, name="tup2")(op).best(np.ones(3))["tile_shape"] == (8, 8, 8)


def test_errors():
    with pytest.raises(ValueError, match="non-empty"):
        AT.autotune(space={"block": []})(lambda x, block: x)
    tuned = AT.autotune(space={"block": [999]}, name="bad")(make([], DELAYS))
    with pytest.raises(ValueError, match="no candidate config ran"):
        tuned(np.ones(2))


def test_clear_cache(cache_dir):
    AT.autotune(space={"block": [64]}, name="c")(make([], DELAYS))(np.ones(1), stages=2)
    assert (cache_dir / "autotune.json").exists()
    AT.clear_cache()
    assert not (cache_dir / "autotune.json").exists()
