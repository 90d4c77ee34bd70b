"""autotune(space=...): time candidate configs on first use per (shape, dtype, device), keep the winner.

Seed 002 §2.3's ``@kernel.autotune(space=dict(BM=[128, 256], stages=[2, 3]))`` as a
decorator over any launcher taking the space's names as keywords:

    @autotune(space={"tile_shape": [None, (128, 128, 32), (64, 64, 32)]})
    def gemm(a, b, *, tile_shape=None): ...

The first call with a new key runs every candidate (``warmup`` + ``reps`` times, GPU
work timed with events after a synchronize), skips candidates that raise ``ValueError``
(a tile that does not fit, say) and stores the fastest in memory and in a JSON file
under ``$TESSERA_CACHE_DIR`` (default ``~/.cache/tessera_rt``), so later processes reuse
it (seed 000's "autotune on a subset, then freeze").  Writes are atomic renames, so ranks
sharing a home directory cannot leave a torn file.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dtypes import dtype_name
from ._common import is_cupy

__all__ = ["autotune", "Autotuner", "cache_dir", "cache_path", "device_name", "clear_cache"]


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_CACHE_DIR") or Path.home() / ".cache" / "tessera_rt")


def cache_path() -> Path:
    return cache_dir() / "autotune.json"


def device_name(arrays: tuple = ()) -> str:
    """"cpu", or "cuda:<name>:sm<cc>" for the current CuPy device when any array is on the GPU."""
    if any(is_cupy(a) for a in arrays):
        import cupy
        dev = cupy.cuda.Device()
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return f"cuda:{name}:sm{dev.compute_capability}"
    return "cpu"


_FILE_LOCK = threading.Lock()


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _store(key: str, entry: dict) -> None:
    with _FILE_LOCK:
        data = _load()
        data[key] = entry
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def clear_cache() -> None:
    """Remove the on-disk cache (in-memory winners of live Autotuners stay until they are rebuilt)."""
    try:
        cache_path().unlink()
    except FileNotFoundError:
        pass


def _describe(a: Any) -> Any:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return f"{tuple(int(s) for s in a.shape)}:{dtype_name(a.dtype)}"
    if isinstance(a, (int, float, str, bool)) or a is None:
        return repr(a)
    return type(a).__name__


def _to_json(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _from_json(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _synchronize(result: Any) -> None:
    items = result if isinstance(result, tuple) else (result,)
    if any(is_cupy(r) for r in items):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


class Autotuner:
    """Wraps ``fn``; ``tuner.best(*args)`` is the winning config for those arguments."""

    def __init__(self, fn: Callable, space: dict[str, list], *, name: str | None = None,
                 key: Callable[..., tuple] | None = None, warmup: int = 1, reps: int = 3):
        if not space or not all(isinstance(v, (list, tuple)) and v for v in space.values()):
            raise ValueError(f"autotune: space must map each keyword to a non-empty list, got {space!r}")
        self.fn = fn
        self.name = name or f"{fn.__module__}.{fn.__qualname__}"
        self.space = {k: list(v) for k, v in space.items()}
        self.key_fn = key
        self.warmup, self.reps = warmup, reps
        self._best: dict[str, dict] = {}
        self.timings: dict[str, dict[str, float]] = {}
        functools.update_wrapper(self, fn)

    def candidates(self) -> list[dict]:
        names = list(self.space)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.space[n] for n in names))]

    def cache_key(self, args: tuple, kwargs: dict) -> str:
        arrays = tuple(a for a in args if hasattr(a, "shape"))
        parts = self.key_fn(*args, **kwargs) if self.key_fn else tuple(_describe(a) for a in args)
        extra = tuple(f"{k}={_describe(v)}" for k, v in sorted(kwargs.items()))
        return f"{self.name}|{device_name(arrays)}|{'|'.join(map(str, parts + extra))}"

    def _time(self, cfg: dict, args: tuple, kwargs: dict) -> float:
        for _ in range(self.warmup):
            _synchronize(self.fn(*args, **kwargs, **cfg))
        t0 = time.perf_counter()
        for _ in range(self.reps):
            r = self.fn(*args, **kwargs, **cfg)
        _synchronize(r)
        return (time.perf_counter() - t0) / self.reps * 1e3

    def best(self, *args: Any, **kwargs: Any) -> dict:
        key = self.cache_key(args, kwargs)
        if key in self._best:
            return self._best[key]
        entry = _load().get(key)
        if entry is not None:
            cfg = {k: _from_json(v) for k, v in entry["config"].items()}
            self._best[key] = cfg
            return cfg
        times: dict[str, float] = {}
        errors: list[str] = []
        for cfg in self.candidates():
            try:
                times[json.dumps({k: _to_json(v) for k, v in cfg.items()})] = self._time(cfg, args, kwargs)
            except Exception as exc:
                # A candidate this input cannot use: a tile too big (ValueError), a launch the
                # device refuses (CuPy's CUDADriverError, a RuntimeError), a variant that does
                # not compile.  It loses; the others still compete.  If none runs, all the
                # reasons are raised together below.
                errors.append(f"{cfg}: {type(exc).__name__}: {exc}")
        if not times:
            raise ValueError(f"autotune {self.name}: no candidate config ran for this input:\n  "
                             + "\n  ".join(errors))
        winner = min(times, key=times.__getitem__)
        cfg = {k: _from_json(v) for k, v in json.loads(winner).items()}
        self._best[key] = cfg
        self.timings[key] = times
        _store(key, {"config": json.loads(winner), "times_ms": times})
        return cfg

    def __call__(self, *args: Any, **kwargs: Any):
        return self.fn(*args, **kwargs, **self.best(*args, **kwargs))


def autotune(space: dict[str, list], *, name: str | None = None, key: Callable[..., tuple] | None = None,
             warmup: int = 1, reps: int = 3) -> Callable[[Callable], Autotuner]:
    """Decorator: ``@autotune(space={"tile_shape": [...]})`` (see the module doc).

    Parameters
    ----------
    space : dict of str to list
        Each keyword the launcher takes and its candidate values; every combination is timed.
    name : str, optional
        The cache entry's name (default: the function's).
    key : callable, optional
        ``key(*args, **kwargs) -> tuple``: what a winner is kept per (default: the arguments' shapes
        and dtypes).
    warmup : int
        Untimed runs per candidate.
    reps : int
        Timed runs per candidate.

    Returns
    -------
    callable
        The decorator: it wraps the launcher in an ``Autotuner``.
    """
    return lambda fn: Autotuner(fn, space, name=name, key=key, warmup=warmup, reps=reps)
