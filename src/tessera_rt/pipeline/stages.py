"""Stage assignment over the ``pp`` mesh axis (seed 000 §2, §3.3): which layers each
pipeline stage runs, and the mesh each stage's ranks compute on.

A mesh ``{"pp": P, "dp": D, "tp": T}`` is P stages; the ranks of one stage form a
``{"dp": D, "tp": T}`` sub-mesh (the *stage mesh*) on which that stage's DTensors live, so
tensor and data parallelism inside a stage work unchanged and no DTensor collective ever
crosses stages.  Stage boundaries are point-to-point sends along ``pp`` (pipeline/runner).

With ``virtual_stages=v`` (interleaved schedules) there are ``P * v`` virtual stages;
rank-stage ``s`` holds chunks ``c = 0..v-1``, chunk ``c`` being virtual stage ``c * P + s``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dist.comm.mesh import Mesh
from ..nn.parts import register_stage_plan

__all__ = ["StagePlan", "split_layers", "stage_meshes"]

# cache: (mesh, pp axis) -> the per-stage sub-meshes (made once, collectively)
_STAGE_MESHES: dict = {}


def stage_meshes(mesh: Mesh, axis: str = "pp") -> list:
    """One sub-mesh per stage over the mesh's other axes.  Collective over the whole job the first
    time (every rank makes every stage's mesh); cached after.

    Parameters
    ----------
    mesh : Mesh
        The mesh with the pipeline axis.
    axis : str
        The pipeline axis.

    Returns
    -------
    list of Mesh or None
        Indexed by stage; None entries when ``axis`` is the only axis (a one-rank stage computes on
        plain arrays).
    """
    key = (mesh, axis)
    got = _STAGE_MESHES.get(key)
    if got is not None:
        return got
    rest = [a for a in mesh.axes if a != axis]
    grid = np.moveaxis(mesh.device_grid, mesh.axis_index(axis), 0)
    if not rest:
        got = [None] * mesh.size(axis)
    else:
        got = [Mesh(axes=rest, shape={a: mesh.shape[a] for a in rest}, devices=[int(r) for r in grid[s].reshape(-1)])
               for s in range(grid.shape[0])]
    _STAGE_MESHES[key] = got
    return got


def split_layers(n_layers: int, n_stages: int, stage_of: Sequence[int] | None = None,
                 what: str = "pipeline") -> list[list[int]]:
    """The layers of each (virtual) stage: an even split (earlier stages take the extra
    layers of an uneven count), or the explicit ``stage_of[layer] = stage``.

    Parameters
    ----------
    n_layers : int
        Layers in all.
    n_stages : int
        (Virtual) stages.
    stage_of : sequence of int, optional
        ``stage_of[layer] = stage``; default an even split.
    what : str
        Names the caller in errors.

    Returns
    -------
    list of list of int
        The layer indices of each stage.
    """
    if stage_of is None:
        if n_stages > n_layers:
            raise ValueError(f"{what}: {n_stages} pipeline stages but only {n_layers} layers; every stage needs "
                             f"at least one layer: use pp <= {n_layers} (and virtual_stages * pp <= n_layers), "
                             "or build a deeper model")
        bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n_layers), n_stages)])
        return [list(range(int(bounds[s]), int(bounds[s + 1]))) for s in range(n_stages)]
    stage_of = [int(s) for s in stage_of]
    if len(stage_of) != n_layers:
        raise ValueError(f"{what}: stage_of has {len(stage_of)} entries for {n_layers} layers; give one stage "
                         "per layer")
    if any(not 0 <= s < n_stages for s in stage_of):
        raise ValueError(f"{what}: stage_of={stage_of} names stages outside 0..{n_stages - 1}")
    if any(b < a for a, b in zip(stage_of, stage_of[1:])):
        raise ValueError(f"{what}: stage_of={stage_of} must be non-decreasing (layers run in order through "
                         "the stages)")
    layers = [[i for i, s in enumerate(stage_of) if s == st] for st in range(n_stages)]
    empty = [st for st, ls in enumerate(layers) if not ls]
    if empty:
        raise ValueError(f"{what}: stage_of={stage_of} leaves stages {empty} without a layer; every stage "
                         "needs at least one")
    return layers


class StagePlan:
    """Where each layer runs: ``layers[vs]`` for virtual stage ``vs``; this rank's ``stage``
    and its ``chunks`` (virtual stage ids, in chunk order), its stage mesh and pp group.

    Parameters
    ----------
    mesh : Mesh
        The mesh with the pipeline axis.
    axis : str
        The pipeline axis.
    n_layers : int
        Layers in all.
    stage_of : sequence of int, optional
        ``stage_of[layer] = virtual stage``; default an even split.
    virtual_stages : int
        Chunks per rank (interleaved schedules).
    what : str
        Names the caller in errors.
    """

    def __init__(self, mesh: Mesh, axis: str, n_layers: int, stage_of: Sequence[int] | None = None,
                 virtual_stages: int = 1, what: str = "Transformer"):
        if axis not in mesh.axes:
            raise ValueError(f"{what}: mesh {mesh!r} has no {axis!r} axis to split stages over; add it, "
                             f"e.g. dist.Mesh(axes=[{axis!r}, 'dp'], ...)")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"{what}: virtual_stages={virtual_stages!r} must be an int >= 1")
        self.mesh, self.axis = mesh, axis
        self.pp = mesh.size(axis)
        self.virtual = virtual_stages
        self.n_virtual = self.pp * virtual_stages
        self.layers = split_layers(n_layers, self.n_virtual, stage_of, what)
        if virtual_stages > 1 and stage_of is None and n_layers % self.n_virtual:
            raise ValueError(f"{what}: {n_layers} layers do not divide over pp={self.pp} x virtual_stages="
                             f"{virtual_stages} = {self.n_virtual} virtual stages; use a layer count that is a "
                             f"multiple of {self.n_virtual}, another virtual_stages, or an explicit stage_of=")
        self.stage = mesh.coordinate(axis) if mesh.is_member else None
        self.chunks = [c * self.pp + self.stage for c in range(virtual_stages)] if self.stage is not None else []
        self.stage_mesh = stage_meshes(mesh, axis)[self.stage] if self.stage is not None else None

    def rank_of(self, vs: int) -> int:
        """The pp position that runs virtual stage ``vs``.

        Parameters
        ----------
        vs : int
            A virtual stage.

        Returns
        -------
        int
            vs % pp.
        """
        return vs % self.pp

    @property
    def local_layers(self) -> list[int]:
        return [i for vs in self.chunks for i in self.layers[vs]]

    def __repr__(self) -> str:
        return f"StagePlan(pp={self.pp}, virtual={self.virtual}, layers={self.layers}, stage={self.stage})"


register_stage_plan(StagePlan)   # nn.Transformer splits its blocks over pp with it (nn.parts)
