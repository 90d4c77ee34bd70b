"""``cupy.cuda``: streams, events, devices, the memory pool, runtime/driver errors, NCCL."""
from . import (
    driver,
    graph,  # noqa: F401  (cupy.cuda.graph)
    memory,
    nccl,  # imports mpi4py.MPI only when used
    pinned_memory,
    runtime,
)
from .device import Device
from .driver import CUDADriverError
from .graph import Graph
from .memory import MemoryPointer, MemoryPool, PooledMemory, get_allocator, get_default_memory_pool, set_allocator
from .pinned_memory import PinnedMemoryPointer, alloc_pinned_memory
from .runtime import CUDARuntimeError
from .stream import BaseStream, Event, ExternalStream, Stream, get_current_stream, get_elapsed_time

__all__ = ["Device", "Graph", "Stream", "ExternalStream", "BaseStream", "Event", "get_current_stream",
           "get_elapsed_time", "get_default_memory_pool", "MemoryPool", "MemoryPointer",
           "PooledMemory", "set_allocator", "get_allocator", "PinnedMemoryPointer", "alloc_pinned_memory", "CUDARuntimeError",
           "CUDADriverError", "runtime", "driver", "memory", "pinned_memory", "nccl", "is_available",
           "get_device_id"]


def is_available() -> bool:
    return runtime.getDeviceCount() > 0


def get_device_id() -> int:
    return Device().id

