"""``cupy.random`` (a small part): host NumPy generators, copied to the device.

The streams of numbers differ from cuRAND's; tests must not depend on the values.
"""
import numpy as np

from ._creation import asarray

__all__ = ["seed", "rand", "randn", "random", "random_sample", "uniform", "normal",
           "standard_normal", "randint", "default_rng"]

_rng = np.random.default_rng(0)


def seed(seed=None) -> None:
    global _rng
    _rng = np.random.default_rng(seed)


def rand(*shape, dtype=float):
    return asarray(_rng.random(shape).astype(dtype))


def randn(*shape, dtype=float):
    return asarray(_rng.standard_normal(shape).astype(dtype))


def random(size=None, dtype=float):
    return asarray(np.asarray(_rng.random(size)).astype(dtype))


random_sample = random


def uniform(low=0.0, high=1.0, size=None, dtype=float):
    return asarray(np.asarray(_rng.uniform(low, high, size)).astype(dtype))


def normal(loc=0.0, scale=1.0, size=None, dtype=float):
    return asarray(np.asarray(_rng.normal(loc, scale, size)).astype(dtype))


def standard_normal(size=None, dtype=float):
    return asarray(np.asarray(_rng.standard_normal(size)).astype(dtype))


def randint(low, high=None, size=None, dtype=int):
    return asarray(np.asarray(_rng.integers(low, high, size)).astype(dtype))


class _Generator:
    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)

    def random(self, size=None, dtype=np.float64):
        return asarray(np.asarray(self._rng.random(size)).astype(dtype))

    def standard_normal(self, size=None, dtype=np.float64):
        return asarray(np.asarray(self._rng.standard_normal(size)).astype(dtype))

    def integers(self, low, high=None, size=None, dtype=np.int64):
        return asarray(np.asarray(self._rng.integers(low, high, size)).astype(dtype))


def default_rng(seed=None):
    return _Generator(seed)
