"""``cupy.cuda.driver``: the driver-API error launches raise."""
from __future__ import annotations

__all__ = ["CUDADriverError", "CUDA_ERROR_INVALID_VALUE"]

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701

_ERROR_NAMES = {
    CUDA_ERROR_INVALID_VALUE: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: ("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
                                         "too many resources requested for launch"),
}


class CUDADriverError(RuntimeError):
    """As cupy_backends.cuda.api.driver.CUDADriverError: ``str`` is "<NAME>: <description>"."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        name, text = _ERROR_NAMES.get(status, (f"CUDA_ERROR_{status}", "unknown error"))
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        return type(self), (self.status,)
