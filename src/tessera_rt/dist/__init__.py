"""tessera_rt.dist: the process group, meshes, communicators, collectives and DTensors.

    from tessera_rt import dist
    dist.init()                                   # idempotent; world size 1 without mpirun
    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    y = dist.all_reduce(x, axis="dp", op="sum", mesh=mesh)          # on an array
    X = dist.distribute(a, layout=dist.ShardSpec(partition=("col",), mesh_axes=("tp",)), mesh=mesh)
    Y = X @ W                                                        # a DTensor op: eager collectives

The collectives here take arrays or DTensors: an array is communicated as it is; a DTensor
(routed to ``dtensor_collectives``) becomes a layout change run by the redistribution planner.
"""
from ..deprecation import aliases as _aliases
from ..upper import UpperNames
from .checkpoint import CheckpointError, async_save, load, save
from .checks import debug
from .checks.debug import CollectiveMismatchError, flight_records
from .checks.determinism import deterministic, is_deterministic, set_deterministic
from .comm.collectives import (
    CollectiveRecord,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    bus_factor,
    reduce_scatter,
    trace_collectives,
)
from .comm.mesh import AxisGroup, Mesh, current_mesh, mesh, set_mesh
from .comm.p2p import barrier
from .comm.process_group import World, abort, get_rank, get_world_size, init, is_initialized, world
from .comm.work import Work, world_group
from .tensor import cost, dispatch as _dispatch, interop as _interop  # noqa: F401  (they plug into DTensor on import)
from .tensor.dtensor import DTensor, distribute, from_local, full, ones, rand, randn, tensor, zeros
from .tensor.dtensor_collectives import recv, send  # (importing it also routes DTensors into the collectives)
from .tensor.layout import (
    Layout,
    LayoutError,
    Partial,
    PartialSpec,
    Placement,
    Replicate,
    ReplicateSpec,
    Shard,
    ShardSpec,
    as_layout,
)
from .tensor.redistribute import RedistributionPlan, Step, plan_redistribute
from .tensor.rules import RuleError, register_rule
from .tensor.shard import local_shape, local_slices, split_offsets, split_sizes

__all__ = [
    "init", "world", "World", "is_initialized", "get_rank", "get_world_size", "abort",
    "Mesh", "mesh", "AxisGroup", "current_mesh", "set_mesh",
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
    "barrier", "Work", "trace_collectives", "CollectiveRecord", "bus_factor", "world_group",
    "Layout", "LayoutError", "ShardSpec", "ReplicateSpec", "PartialSpec", "Placement", "Replicate", "Shard",
    "Partial", "as_layout", "local_shape", "local_slices", "split_sizes", "split_offsets",
    "RedistributionPlan", "Step", "plan_redistribute", "DTensor", "tensor", "zeros", "ones", "full", "distribute",
    "from_local", "rand", "randn", "RuleError", "register_rule",
    "debug", "cost", "CollectiveMismatchError", "flight_records", "save", "async_save", "load", "CheckpointError",
    "deterministic", "set_deterministic", "is_deterministic",
]

# renamed (issue 41: one name per thing), kept for one release
_RENAMED = _aliases(__name__, {"Plan": ("tessera_rt.dist.RedistributionPlan", lambda: RedistributionPlan)})
# a name that lives above dist: tessera_rt.pipeline provides it when imported
UPPER = UpperNames(__name__, {"Pipeline": "tessera_rt.pipeline"})


def __getattr__(name: str):
    err = UPPER.missing(name)
    if err is not None:
        raise err
    return _RENAMED(name)
