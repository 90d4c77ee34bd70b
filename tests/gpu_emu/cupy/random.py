"""``cupy.random`` (a small part): host NumPy generators, their numbers put on the device.

The streams of numbers differ from cuRAND's; tests must not depend on the values.  CuPy
generates on the device, so each call counts as one kernel launch, not a host->device copy.
"""
import numpy as np

from . import _bridge

__all__ = ["seed", "rand", "randn", "random", "random_sample", "uniform", "normal",
           "standard_normal", "randint", "default_rng"]

_rng = np.random.default_rng(0)


def _device(host):
    return _bridge.host_to_device("cupy.random (cuRAND)", np.ascontiguousarray(host), op_class="kernel")


def seed(seed=None) -> None:
    global _rng
    _rng = np.random.default_rng(seed)


def rand(*shape, dtype=float):
    return _device(_rng.random(shape).astype(dtype))


def randn(*shape, dtype=float):
    return _device(_rng.standard_normal(shape).astype(dtype))


def random(size=None, dtype=float):
    return _device(np.asarray(_rng.random(size)).astype(dtype))


random_sample = random


def uniform(low=0.0, high=1.0, size=None, dtype=float):
    return _device(np.asarray(_rng.uniform(low, high, size)).astype(dtype))


def normal(loc=0.0, scale=1.0, size=None, dtype=float):
    return _device(np.asarray(_rng.normal(loc, scale, size)).astype(dtype))


def standard_normal(size=None, dtype=float):
    return _device(np.asarray(_rng.standard_normal(size)).astype(dtype))


def randint(low, high=None, size=None, dtype=int):
    return _device(np.asarray(_rng.integers(low, high, size)).astype(dtype))


class _Generator:
    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)

    def random(self, size=None, dtype=np.float64):
        return _device(np.asarray(self._rng.random(size)).astype(dtype))

    def standard_normal(self, size=None, dtype=np.float64):
        return _device(np.asarray(self._rng.standard_normal(size)).astype(dtype))

    def integers(self, low, high=None, size=None, dtype=np.int64):
        return _device(np.asarray(self._rng.integers(low, high, size)).astype(dtype))


def default_rng(seed=None):
    return _Generator(seed)
