"""tessera_rt.dist.comm: moving bytes between ranks, the lowest floor of the distributed core.

It owns the MPI import (``mpi``), the process group (``process_group``), the communicator
interface (``interface``) and its kinds (``communicators``: MPI and host-staged, and
``make_communicator``, which picks one; ``nccl``), named meshes and their axis groups
(``mesh``), the seam every checker and tracer plugs into (``hooks.SEAM``), what a call is to
the layers above (``calls``: the ``Call`` record, signatures, group call states), the
per-call collective plans (``plans``), the collectives on arrays (``collectives``) with
their C plan-hit path (``c_path`` loads ``_hot``, built from ``_hot.c``), send, recv and the
barrier (``p2p``), how a call is issued on its group and stream (``work``: ``issue``, the
``Work`` handle of an async call), the collectives' trace records (``trace``), buffer packing (``packing``), the CPU async progress
(``cpu_async``) and the one-rank exit of scripts (``script``).

It may import the backend-level base (``backend``, ``runtime``, ``dtypes``, ...) and
``kernels``, and nothing else of tessera_rt: not ``dist.checks``, ``dist.tensor``,
``dist.ccl`` or ``dist.checkpoint``, which sit above it.  What those add to a collective
(the agreement check, debug records, determinism, the watchdog's notes, DTensor routes)
reaches it through the slots of ``hooks.SEAM`` and the registries here that they fill on
import.  ``tests/package/test_architecture.py`` enforces the order.
"""
