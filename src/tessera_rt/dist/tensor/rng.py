"""Counter-based random values for ``dist.rand`` / ``dist.randn``: each element's value
depends only on (seed, its global index), so a global tensor is the same whatever the mesh
and layout, and each rank computes only its piece (splitmix64 over the index)."""
from __future__ import annotations

import numpy as np

__all__ = ["counter_values"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _uniform(xp, flat, seed: int, stream: int):
    key = _mix(np.uint64((seed * 2 + stream) & 0xFFFFFFFFFFFFFFFF) + _GOLDEN)
    bits = _mix(flat * _GOLDEN + key)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def counter_values(xp, kind: str, shape: tuple, offs, sizes, seed: int):
    """float64 values of the piece at ``offs`` (size ``sizes``) of a global ``shape`` tensor:
    uniform in [0, 1) for ``kind`` "rand", standard normal (Box-Muller) for "randn"."""
    flat = xp.zeros(sizes, dtype=np.uint64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        idx = xp.arange(offs[d], offs[d] + sizes[d], dtype=np.uint64) * np.uint64(stride)
        flat += idx.reshape((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= shape[d]
    with np.errstate(over="ignore"):
        if kind == "rand":
            return _uniform(xp, flat, seed, 0)
        u1, u2 = _uniform(xp, flat, seed, 0), _uniform(xp, flat, seed, 1)
        return xp.sqrt(-2.0 * xp.log1p(-u1)) * xp.cos(2.0 * np.pi * u2)
