"""tessera_rt.dist.ccl: topology-aware collectives (seed 004's Galaxy CCL, seed 000 §3.2.2, §3.6).

    from tessera_rt.dist import ccl
    y = ccl.line_reduce_scatter(x, dim=3, cluster_axis=1, mesh=mesh, buffer_key="FF1")   # = reduce_scatter
    y = ccl.line_all_gather(x, dim=3, cluster_axis=1, mesh=mesh, buffer_key="BINARY_MUL") # = all_gather
    y = ccl.line_all_reduce(x, cluster_axis=0, mesh=mesh)                                 # = all_reduce
    ccl.persistent_buffers()                                   # keys, shapes, bytes, where made

Line/ring algorithms run over the axis communicator's send/recv on the ``tp_collective``
stream, beside the library collective (``algo="library"``); ``algo="auto"`` reads a
per-size table.  This package knows collectives and buffers, never models.
"""
from ._common import ALGOS, DEFAULT_TABLE, TAGS, algo_table, reset_algo_override, set_algo_table
from .buffers import allocations, clear_persistent_buffers, persistent_buffers
from .fused import all_gather_concat, double_matmul_line_reduce_scatter, llama_rs_create_heads
from .hierarchical import hierarchical_all_reduce, host_mesh
from .line import line_all_gather, line_all_reduce, line_reduce_scatter
from .ring_attention import ring_attention, sequence_positions, shard_sequence
from .schedules import schedule
from .tune import tune

__all__ = [
    "line_reduce_scatter", "line_all_gather", "line_all_reduce", "schedule",
    "double_matmul_line_reduce_scatter", "llama_rs_create_heads", "all_gather_concat",
    "ring_attention", "sequence_positions", "shard_sequence", "hierarchical_all_reduce", "host_mesh",
    "persistent_buffers", "clear_persistent_buffers", "allocations",
    "tune", "ALGOS", "TAGS", "DEFAULT_TABLE", "algo_table", "set_algo_table", "reset_algo_override",
]
