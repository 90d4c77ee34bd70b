"""tessera_rt.dist: the process group, meshes, communicators and collectives.

    from tessera_rt import dist
    dist.init()                                   # idempotent; world size 1 without mpirun
    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    y = dist.all_reduce(x, axis="dp", op="sum", mesh=mesh)
"""
from .collectives import (
    CollectiveRecord, Work, all_gather, all_reduce, all_to_all, barrier, broadcast, bus_factor, recv,
    reduce_scatter, send, trace_collectives, world_group,
)
from .mesh import AxisGroup, Mesh, current_mesh, mesh, set_mesh
from .process_group import World, abort, get_rank, get_world_size, init, is_initialized, world

__all__ = [
    "init", "world", "World", "is_initialized", "get_rank", "get_world_size", "abort",
    "Mesh", "mesh", "AxisGroup", "current_mesh", "set_mesh",
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
    "barrier", "Work", "trace_collectives", "CollectiveRecord", "bus_factor", "world_group",
]
