"""NVTX ranges: each op and collective as a range in the ``tessera`` domain, named and
categorized by stream role, for Nsight Systems (see the profiler's module doc)."""
from __future__ import annotations

import os

from ..dist.comm.hooks import SEAM

__all__ = ["enable_nvtx", "nvtx_listening", "nvtx_domain", "coll_name", "op_name"]


class _Nvtx:
    def __init__(self):
        import nvtx
        self._nvtx = nvtx
        self._dom = nvtx.get_domain("tessera")
        self._attrs: dict = {}

    def _attr(self, name: str, role: str):
        a = self._attrs.get((name, role))
        if a is None:
            a = self._attrs[(name, role)] = self._dom.get_event_attributes(
                message=name, color="green" if role == "compute" else "orange", category=role)
        return a

    def push(self, name: str, role: str) -> None:
        self._dom.push_range(self._attr(name, role))

    def pop(self) -> None:
        self._dom.pop_range()

    def start(self, name: str, role: str):
        return self._dom.start_range(self._attr(name, role))

    def end(self, rid) -> None:
        self._dom.end_range(rid)


# [the NVTX module or False], looked up once
_NVTX: list = []


def nvtx_listening() -> bool:
    """True when a tool collects NVTX ranges: Nsight Systems/Compute load their injection
    library through ``NVTX_INJECTION64_PATH``; ``TESSERA_NVTX=1`` says so for any other.
    Without one the ranges go nowhere, and their Python calls cost ~2.5 us per op."""
    env = os.environ
    return (env.get("TESSERA_NVTX", "") not in ("", "0") or "NVTX_INJECTION64_PATH" in env
            or "NVTX_INJECTION32_PATH" in env)


def nvtx_domain():
    if not _NVTX:
        try:
            _NVTX.append(_Nvtx())
        except Exception:           # nvtx not installed: ranges are skipped
            _NVTX.append(None)
    return _NVTX[0]


def coll_name(call) -> str:
    dt = f" {call.dtype}[{','.join(map(str, call.shape))}]" if call.dtype else ""
    return f"{call.op}({call.axis}){dt}"


def op_name(dec) -> str:
    return f"{dec.op} {dec.layout!r} [{','.join(map(str, dec.shape))}]"


class _NvtxOnly:
    """Hooks that only emit NVTX ranges (TESSERA_NVTX=1)."""

    def before(self, call) -> None:
        nv = nvtx_domain()
        if nv is None:
            return
        if call.async_op:
            call.nvtx = ("start", nv.start(coll_name(call), call.role))
        else:
            nv.push(coll_name(call), call.role)
            call.nvtx = ("push", None)

    def after(self, call) -> None:
        nv, p = nvtx_domain(), call.nvtx
        if nv is None or p is None:
            return
        call.nvtx = None
        if p[0] == "start":
            nv.end(p[1])
        else:
            nv.pop()

    def op_begin(self, dec, args) -> None:
        nv = nvtx_domain()
        if nv is not None:
            nv.push(op_name(dec), "compute")

    def op_end(self, dec, args, out) -> None:
        nv = nvtx_domain()
        if nv is not None:
            nv.pop()


_NVTX_HOOK = _NvtxOnly()


def enable_nvtx(on: bool = True) -> None:
    """Emit an NVTX range for every op and collective, without profiling (no table, no trace).

    Parameters
    ----------
    on : bool
        True starts the ranges, False stops them.
    """
    for lst in (SEAM.watchers, SEAM.op_watchers):
        if on and _NVTX_HOOK not in lst:
            lst.append(_NVTX_HOOK)
        elif not on and _NVTX_HOOK in lst:
            lst.remove(_NVTX_HOOK)
