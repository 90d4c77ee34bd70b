"""``cupy.cuda.runtime``: device count and properties of the emulated device(s)."""
from __future__ import annotations

import os

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "getDeviceProperties",
           "deviceSynchronize", "memGetInfo", "runtimeGetVersion", "driverGetVersion",
           "streamCaptureModeGlobal", "streamCaptureModeThreadLocal", "streamCaptureModeRelaxed"]

# cudaError_t values used here (CUDA runtime API)
errorInvalidValue = 1
errorInvalidDevice = 101
errorInvalidResourceHandle = 400
errorNotReady = 600
errorIllegalState = 401
# stream capture (cudaError_t 900-908)
errorStreamCaptureUnsupported = 900
errorStreamCaptureInvalidated = 901
errorStreamCaptureMerge = 902
errorStreamCaptureUnmatched = 903
errorStreamCaptureUnjoined = 904
errorStreamCaptureIsolation = 905
errorStreamCaptureImplicit = 906
errorCapturedEvent = 907
errorStreamCaptureWrongThread = 908

# cudaStreamCaptureMode
streamCaptureModeGlobal = 0
streamCaptureModeThreadLocal = 1
streamCaptureModeRelaxed = 2

_ERROR_NAMES = {
    errorInvalidValue: ("cudaErrorInvalidValue", "invalid argument"),
    errorInvalidDevice: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    errorInvalidResourceHandle: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    errorNotReady: ("cudaErrorNotReady", "device not ready"),
    errorIllegalState: ("cudaErrorIllegalState", "the operation cannot be performed in the present state"),
    errorStreamCaptureUnsupported: ("cudaErrorStreamCaptureUnsupported",
                                    "operation not permitted when stream is capturing"),
    errorStreamCaptureInvalidated: ("cudaErrorStreamCaptureInvalidated",
                                    "operation failed due to a previous error during capture"),
    errorStreamCaptureMerge: ("cudaErrorStreamCaptureMerge", "operation would result in a merge of separate "
                              "capture sequences"),
    errorStreamCaptureUnmatched: ("cudaErrorStreamCaptureUnmatched", "capture was not ended in the same stream "
                                  "as it began"),
    errorStreamCaptureUnjoined: ("cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"),
    errorStreamCaptureIsolation: ("cudaErrorStreamCaptureIsolation", "dependency created on uncaptured work in "
                                  "another stream"),
    errorStreamCaptureImplicit: ("cudaErrorStreamCaptureImplicit", "operation would make the legacy stream "
                                 "depend on a capturing blocking stream"),
    errorCapturedEvent: ("cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a "
                         "capturing stream"),
    errorStreamCaptureWrongThread: ("cudaErrorStreamCaptureWrongThread", "attempt to terminate a thread-local "
                                    "capture sequence from another thread"),
}


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError: ``str`` is "<name>: <description>"."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        name, text = _ERROR_NAMES.get(status, (f"cudaError{status}", "unknown error"))
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        return type(self), (self.status,)


# An H100-like device, named so nobody mistakes it for hardware.
_TOTAL_MEM = 80 * (1 << 30)
_PROPERTIES = {
    "name": b"Tessera CuPy stand-in (NumPy emulation, sm_90)",
    "totalGlobalMem": _TOTAL_MEM,
    "sharedMemPerBlock": 48 * 1024,
    "sharedMemPerBlockOptin": 227 * 1024,
    "sharedMemPerMultiprocessor": 228 * 1024,
    "regsPerBlock": 65536,
    "warpSize": 32,
    "maxThreadsPerBlock": 1024,
    "maxThreadsDim": (1024, 1024, 64),
    "maxGridSize": (2 ** 31 - 1, 65535, 65535),
    "multiProcessorCount": 132,
    "major": 9,
    "minor": 0,
    "l2CacheSize": 50 * (1 << 20),
    "computeMode": 0,
    "concurrentKernels": 1,
}


def getDeviceCount() -> int:
    """1, or ``$TESSERA_STANDIN_DEVICES`` (to emulate several GPUs per node)."""
    return int(os.environ.get("TESSERA_STANDIN_DEVICES", "1"))


def check_device(device_id: int) -> int:
    device_id = int(device_id)
    if not 0 <= device_id < getDeviceCount():
        raise CUDARuntimeError(errorInvalidDevice, f"device {device_id}, count {getDeviceCount()}")
    return device_id


def getDevice() -> int:
    from .device import current_device_id
    return current_device_id()


def setDevice(device_id: int) -> None:
    from .device import Device
    Device(device_id).use()


def getDeviceProperties(device_id: int) -> dict:
    check_device(device_id)
    return dict(_PROPERTIES)


def deviceSynchronize() -> None:
    from .. import _capture, _counters, _tracker
    _capture.refuse_device_sync("cudaDeviceSynchronize")
    _counters.note_sync("cudaDeviceSynchronize")
    _tracker.host_synchronized_all()


def memGetInfo() -> tuple[int, int]:
    from .memory import get_default_memory_pool
    return _TOTAL_MEM - get_default_memory_pool().total_bytes(), _TOTAL_MEM


def runtimeGetVersion() -> int:
    return 12080


def driverGetVersion() -> int:
    return 12080
