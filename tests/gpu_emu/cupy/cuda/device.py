"""``cupy.cuda.Device``: the current device is per thread, as in CUDA."""
from __future__ import annotations

import threading

from .. import _counters, _tracker
from .runtime import check_device

__all__ = ["Device", "current_device_id"]

_local = threading.local()


def current_device_id() -> int:
    return getattr(_local, "device_id", 0)


class Device:
    """``Device()`` is the current device; ``Device(i)`` names device i (checked)."""

    def __init__(self, device=None):
        self.id = current_device_id() if device is None else check_device(device)
        self._previous: list[int] = []

    def use(self) -> None:
        _local.device_id = self.id

    def __enter__(self):
        self._previous.append(current_device_id())
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        _local.device_id = self._previous.pop()

    def synchronize(self) -> None:
        """Every stream's work is done, and the host knows it."""
        from .. import _capture
        _capture.refuse_device_sync("Device.synchronize")
        _counters.note_sync("Device.synchronize")
        _tracker.host_synchronized_all()

    @property
    def compute_capability(self) -> str:
        return "90"

    @property
    def mem_info(self) -> tuple[int, int]:
        from .runtime import memGetInfo
        return memGetInfo()

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"
