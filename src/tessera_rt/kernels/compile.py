"""Compile kernel sources without a GPU: NVRTC → PTX, ``ptxas -v`` → registers and shared memory.

CI has no GPU, so every CUDA C source is checked here the way the driver would see it:
NVRTC (through ``cuda.bindings.nvrtc``) compiles it to PTX for ``compute_80``/``compute_90``,
then ``ptxas -v`` assembles that PTX for ``sm_80``/``sm_90`` and reports what the kernel
costs: registers per thread, spills and static shared memory.  Numba kernels go through
``numba.cuda.compile_ptx`` (``tile.numba_ptx``, also named here).  ``inspect_ir`` shows a registered source the way seed 002's
``kernel.inspect_ir("tile" | "target")`` does.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .tile import numba_ptx  # (also named here: the entry points that compile without a GPU)

__all__ = ["CompileError", "ResourceUsage", "nvrtc_compile", "ptxas_resources", "cuda_include_dir",
           "ptxas_path", "numba_ptx", "register_source", "registered_sources", "inspect_ir",
           "KernelSource"]


class CompileError(RuntimeError):
    """NVRTC or ptxas rejected a kernel; the message carries the compiler log."""


@dataclass(frozen=True)
class ResourceUsage:
    """What ``ptxas -v`` reports for one kernel entry on one architecture."""

    kernel: str
    arch: str
    registers: int
    smem_static: int
    spill_stores: int
    spill_loads: int
    stack_frame: int

    def __str__(self) -> str:
        return (f"{self.kernel} [{self.arch}]: {self.registers} regs, {self.smem_static} B static smem, "
                f"spills {self.spill_stores}/{self.spill_loads} B, stack {self.stack_frame} B")


def _nvidia_dir(sub: str) -> Path | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        p = Path(root) / sub
        if p.exists():
            return p
    return None


@functools.cache
def cuda_include_dir() -> str | None:
    """Directory with cuda_fp16.h/mma.h: the nvidia-cuda-runtime wheel, else $CUDA_HOME/include."""
    p = _nvidia_dir("cuda_runtime/include")
    if p is not None:
        return str(p)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return str(Path(home) / "include") if (Path(home) / "include" / "cuda_fp16.h").exists() else None


@functools.cache
def ptxas_path() -> str | None:
    p = _nvidia_dir("cuda_nvcc/bin/ptxas")
    return str(p) if p is not None else shutil.which("ptxas")


# cache: (source, options, arch) -> PTX, per process
_PTX_CACHE: dict[tuple, str] = {}
_LOCK = threading.Lock()


def nvrtc_compile(source: str, name: str = "kernel.cu", arch: str = "sm_80",
                  options: tuple[str, ...] = (), fast_math: bool = True) -> str:
    """PTX text for ``source`` compiled by NVRTC for ``arch``'s virtual architecture
    (``fast_math``: with ``--use_fast_math``, as the launchers compile most sources)."""
    from cuda.bindings import nvrtc

    key = (source, arch, options, fast_math)
    with _LOCK:
        if key in _PTX_CACHE:
            return _PTX_CACHE[key]
    cc = arch.split("_")[-1]
    opts = [f"--gpu-architecture=compute_{cc}", "-std=c++17"] + (["--use_fast_math"] if fast_math else []) + list(options)
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        enc = [o.encode() for o in opts]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        err, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed on {name} for {arch}:\n{log.decode(errors='replace')}")
        err, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * n
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    text = ptx.rstrip(b"\x00").decode()
    with _LOCK:
        _PTX_CACHE[key] = text
    return text


def _check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_resources(ptx: str, arch: str = "sm_80") -> dict[str, ResourceUsage]:
    """Assemble ``ptx`` with ``ptxas -v`` and return each entry's :class:`ResourceUsage`."""
    exe = ptxas_path()
    if exe is None:
        raise CompileError("ptxas not found; pip install nvidia-cuda-nvcc-cu12 (tessera_rt[dev])")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"ptxas -arch={arch} failed:\n{proc.stderr}")
    out: dict[str, ResourceUsage] = {}
    entry: str | None = None
    frame: tuple[int, ...] = (0, 0, 0)
    for line in proc.stderr.splitlines():
        if m := _ENTRY.search(line):
            entry, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and entry:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and entry:
            out[entry] = ResourceUsage(entry, arch, int(m.group(1)), int(m.group(2) or 0),
                                       frame[1], frame[2], frame[0])
            entry = None
    return out


# --------------------------------------------------------------------------- Numba


# --------------------------------------------------------------------------- registry


@dataclass
class KernelSource:
    """A CUDA C source generator and the configs it is compiled for (for inspection and tests)."""

    name: str
    render: Callable[..., str]          # config kwargs -> CUDA C source
    entries: tuple[str, ...]            # extern "C" kernel names in the source
    configs: list[dict] = field(default_factory=list)
    smem_dynamic: Callable[..., int] | None = None   # config -> dynamic shared bytes at launch
    fast_math: bool = True              # compiled with --use_fast_math (False: exact expf/logf, f32 attention)


# the CUDA source registry: name -> source (filled by register_source on import)
_SOURCES: dict[str, KernelSource] = {}


def register_source(src: KernelSource) -> KernelSource:
    _SOURCES[src.name] = src
    return src


def registered_sources() -> dict[str, KernelSource]:
    """Every RawKernel source the kernels package defines: the *_cuda modules register them
    when imported, which ``tessera_rt.kernels`` (run before this module) does."""
    return dict(_SOURCES)


def inspect_ir(kernel: str, level: str = "source", arch: str = "sm_90", **config) -> str:
    """A kernel's CUDA C source, PTX or ptxas report.

    Parameters
    ----------
    kernel : str
        A registered source name (``registered_sources()``).
    level : str
        "source" / "tile" (CUDA C), "ptx" / "target" (PTX), or "resources" (the ptxas report).
    arch : str
        The GPU architecture compiled for.
    **config
        Picks the variant (default: the first registered config).

    Returns
    -------
    str
        The text.
    """
    sources = registered_sources()
    if kernel not in sources:
        raise KeyError(f"inspect_ir: no kernel source {kernel!r}; known: {sorted(sources)}")
    src = sources[kernel]
    cfg = config or (src.configs[0] if src.configs else {})
    text = src.render(**cfg)
    if level in ("source", "tile"):
        return text
    ptx = nvrtc_compile(text, f"{kernel}.cu", arch, fast_math=src.fast_math)
    if level in ("ptx", "target"):
        return ptx
    if level == "resources":
        return "\n".join(str(r) for r in ptxas_resources(ptx, arch).values())
    raise ValueError(f"inspect_ir: level={level!r}; use 'source'/'tile', 'ptx'/'target' or 'resources'")
