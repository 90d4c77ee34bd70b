"""``cupy.cuda``: streams, events, devices, the memory pool, runtime/driver errors, NCCL."""
from . import driver, memory, nccl, runtime  # nccl imports mpi4py.MPI only when used
from .device import Device
from .driver import CUDADriverError
from .memory import MemoryPointer, MemoryPool, PooledMemory, get_default_memory_pool
from .runtime import CUDARuntimeError
from .stream import (BaseStream, Event, ExternalStream, Stream, get_current_stream,
                     get_elapsed_time)

__all__ = ["Device", "Stream", "ExternalStream", "BaseStream", "Event", "get_current_stream",
           "get_elapsed_time", "get_default_memory_pool", "MemoryPool", "MemoryPointer",
           "PooledMemory", "CUDARuntimeError", "CUDADriverError", "runtime", "driver", "memory",
           "nccl", "is_available", "get_device_id"]


def is_available() -> bool:
    return runtime.getDeviceCount() > 0


def get_device_id() -> int:
    return Device().id

