"""The module base: a configuration that makes and places its parameters, and the
seeded initializer that gives every mesh the same global values."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import get_backend
from ..dist.comm.mesh import Mesh
from ..dist.tensor.dtensor import distribute
from ..dist.tensor.layout import ShardSpec
from ..dtypes import resolve_dtype


def _rng_normal(seed: int, name: str, shape: tuple, std: float) -> np.ndarray:
    # one stream per (seed, parameter name): every rank draws the same global tensor, so a
    # model initialized on any mesh holds the same values
    key = np.frombuffer(name.encode(), dtype=np.uint8).astype(np.uint64).sum() * 1000003 + len(name)
    rng = np.random.default_rng([seed, int(key) & 0xFFFFFFFF])
    return (rng.standard_normal(shape) * std).astype(np.float32)


class Module:
    """A configuration that makes a parameter dict (``init``) and applies it (``__call__``).

    Parameters
    ----------
    mesh : Mesh, optional
        The mesh its parameters live on; None: plain arrays (the single-process reference).
    tp_axis : str
        The tensor-parallel mesh axis (used when the mesh has it).
    dtype : str or dtype
        The parameters' dtype.
    """

    def __init__(self, mesh: Mesh | None = None, tp_axis: str = "tp", dtype: Any = "float32"):
        self.mesh = mesh
        self.tp = tp_axis if mesh is not None and tp_axis in mesh.axes else None
        self.dtype = resolve_dtype(dtype)

    def _place(self, value: np.ndarray, spec) -> Any:
        value = value.astype(self.dtype)
        if self.mesh is None:
            return get_backend().asarray(value)       # on the device (a GPU's, or NumPy's)
        return distribute(value, layout=spec if self.tp is not None else None, mesh=self.mesh)

    def spec(self, kind: str) -> ShardSpec | None:
        """The layout of a parameter kind: "col" (last dim over tp), "row" (dim -2 over tp),
        "vec" (1-D over tp), "rep" (replicated).

        Parameters
        ----------
        kind : str
            "col", "row", "vec" or "rep".

        Returns
        -------
        ShardSpec or None
            None without a tp axis or for "rep".
        """
        if self.tp is None or kind == "rep":
            return None
        part = {"col": ("col",), "row": ("row",), "vec": (0,)}[kind]
        return ShardSpec(partition=part, mesh_axes=(self.tp,))
