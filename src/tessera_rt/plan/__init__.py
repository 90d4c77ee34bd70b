"""Mesh planner and cost model: memory and step time per (tp, ep, pp, dp), calibrated on
this machine's collectives and kernels, ranking the seeds' recipes (seed 000 §2.1, §6, §9;
seed 001 §7.5, §7.8; seed 004).

    from tessera_rt import plan
    cands = plan.search(model="llama3-70b", cluster="nvl72", workload="train", batch=32, seq=8192)
    cands[0].mesh_shape, cands[0].memory, cands[0].step_time, cands[0].why

The planner sits above the runtime: it reads collectives and kernels only to calibrate, and
lends its time model to the runtime's redistribution choices through ``dist.cost``
(``use_calibrated``).
"""
from ..deprecation import aliases as _aliases
from .cluster import CLUSTERS, Cluster, get_cluster, local_cluster_path
from .memory import ParallelConfig, activation_bytes, memory_per_gpu, param_counts
from .runtime_cost import ClusterCostModel, use_builtin, use_calibrated
from .search import RECIPES, Candidate, evaluate, factorizations, recipes, search
from .specs import MODELS, ModelSpec, get_model
from .timing import BUS_FACTOR, collective_time, step_time

__all__ = [
    "ModelSpec", "Cluster", "MODELS", "CLUSTERS", "get_model", "get_cluster", "local_cluster_path",
    "ParallelConfig", "memory_per_gpu", "param_counts", "activation_bytes", "collective_time", "step_time", "BUS_FACTOR",
    "Candidate", "search", "evaluate", "factorizations", "recipes", "RECIPES",
    "ClusterCostModel", "use_calibrated", "use_builtin",
]

# renamed (issue 41: one name per thing; a Layout is a DTensor's placement), kept for one release
__getattr__ = _aliases(__name__, {"Layout": ("tessera_rt.plan.ParallelConfig", lambda: ParallelConfig)})
