"""The seeds' ``graph`` namespace (seed 001 §7.7): ``graph.profile(step_fn)``.

    from tessera_rt import graph
    prof = graph.profile(step_fn, batch)        # runs once, prints the per-op table
    with graph.profile(trace="trace.json"):     # a block; the merged Chrome trace of all ranks
        step_fn(batch)
"""
from .profiler import Profile, enable_nvtx, profile

__all__ = ["profile", "Profile", "enable_nvtx"]
