"""Hierarchical all-reduce for a group that spans hosts (seed 000 §3.6): reduce-scatter
inside each host, all-reduce across hosts (one rank per host and part), all-gather inside.

    y = ccl.hierarchical_all_reduce(x, mesh=mesh, intra="col", inter="row")   # two mesh axes
    y = ccl.hierarchical_all_reduce(x, mesh=line_mesh)       # a 1-D mesh split by host

Across hosts each rank moves 1/local of the data, so the slow links carry local times less
than a flat ring would put on them.  Each stage is a ccl op (``algo``/``tag`` apply to each
and each is recorded in traces).
"""
from __future__ import annotations

from typing import Any

from ..comm.mesh import Mesh, current_mesh
from ..comm.process_group import world
from ..tensor.shard import split_sizes
from ._common import check_array
from .line import line_all_gather, line_all_reduce, line_reduce_scatter

__all__ = ["hierarchical_all_reduce", "host_mesh"]

# cache: (world ranks, ranks per host) -> the (inter, intra) mesh over them, made once (collectively)
_HOST_MESHES: dict = {}


def host_mesh(mesh: Mesh, local_size: int | None = None) -> Mesh:
    """A 2-D view ``("inter", "intra")`` of a 1-D ``mesh``: ``intra`` runs over the ranks of one
    host, ``inter`` over hosts.  Collective over the job's ranks, cached per mesh.

    Parameters
    ----------
    mesh : Mesh
        A 1-D mesh whose ranks are grouped by host.
    local_size : int, optional
        Ranks per host (e.g. to run the hierarchical path on one machine); default the hosts'.

    Returns
    -------
    Mesh
        The 2-D mesh over the same ranks.
    """
    w = world()
    if mesh.ndim != 1:
        raise ValueError(f"rank {w.rank}: host_mesh takes a 1-D mesh, got {mesh!r}; for a 2-D mesh pass "
                         "intra= and inter= axis names to hierarchical_all_reduce")
    n = len(mesh.devices)
    if local_size is None:
        hosts = [w.seats[r].host for r in mesh.devices]
        local_size = hosts.count(hosts[0])
        if n % local_size or any(hosts[i] != hosts[i - i % local_size] for i in range(n)):
            raise ValueError(f"rank {w.rank}: mesh {mesh!r} spans hosts with different rank counts or "
                             f"interleaved ranks ({hosts}); pass local_size= or build a 2-D mesh")
    if local_size < 1 or n % local_size:
        raise ValueError(f"rank {w.rank}: local_size={local_size} must divide the mesh's {n} ranks")
    key = (mesh, local_size)
    if key not in _HOST_MESHES:
        _HOST_MESHES[key] = Mesh(axes=["inter", "intra"], shape={"inter": n // local_size, "intra": local_size},
                                 devices=list(mesh.devices))
    return _HOST_MESHES[key]


def hierarchical_all_reduce(x: Any, *, mesh: Mesh | None = None, intra: str | None = None,
                            inter: str | None = None, local_size: int | None = None, op: str = "sum",
                            algo: str = "auto", tag: str | None = None) -> Any:
    """``all_reduce(x)`` over ``intra`` x ``inter`` (or a 1-D mesh split by host) in three
    stages: reduce-scatter within a host, all-reduce across hosts, all-gather within a host.
    Any shape: the flattened array is split into uneven parts where needed.

    Parameters
    ----------
    x : array
        This rank's contribution.
    mesh : Mesh, optional
        Default: the current mesh.
    intra, inter : str, optional
        The mesh axes within and across hosts (both or neither); neither: ``host_mesh(mesh)``.
    local_size : int, optional
        Ranks per host for ``host_mesh``.
    op : {"sum", "max", "min", "avg"}
        The reduction.
    algo : {"auto", "library", "ring", "line"}
        Every stage's algorithm.
    tag : {None, "tree", "ring"}
        An algorithm hint, recorded and checked.

    Returns
    -------
    array
        The reduced array, on every rank.
    """
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError(f"rank {world().rank}: ccl.hierarchical_all_reduce needs a mesh: pass mesh=")
    if (intra is None) != (inter is None):
        raise ValueError(f"rank {world().rank}: ccl.hierarchical_all_reduce: pass both intra= and inter= "
                         f"(axes of {mesh!r}) or neither (a 1-D mesh split by host)")
    if intra is None or inter is None:           # (neither: both or neither, checked above)
        mesh, intra, inter = host_mesh(mesh, local_size), "intra", "inter"
    local = mesh.group(intra)
    x = check_array("hierarchical_all_reduce", local, x)
    if op == "avg" and x.dtype.kind not in "fcV":
        raise TypeError(f"rank {world().rank}: ccl.hierarchical_all_reduce: op='avg' needs a floating dtype, "
                        f"got {x.dtype}; use op='sum'")
    flat = x.reshape(-1)
    sizes = split_sizes(flat.size, local.size)
    part = line_reduce_scatter(flat, 0, intra, mesh=mesh, op="sum" if op == "avg" else op, sizes=sizes,
                               algo=algo, tag=tag)
    part = line_all_reduce(part, inter, mesh=mesh, op="sum" if op == "avg" else op, algo=algo, tag=tag)
    if op == "avg":
        part = part / (local.size * mesh.size(inter))
    return line_all_gather(part, 0, intra, mesh=mesh, sizes=sizes, algo=algo, tag=tag).reshape(x.shape)
