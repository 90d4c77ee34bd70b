"""Run CUDA C RawKernel sources on the host: g++ plus a fiber-per-thread runtime.

``compile_module(code)`` builds a kernel source into a shared library: the source is
force-included after ``include/cuda_emu.h`` (the device language on the host), with
``include/`` ahead of the system headers so that ``<cuda_fp16.h>`` & co. are the emulated
ones, and linked with ``runtime.cpp`` (fibers, barriers, warp collectives, mma.sync m16n8k16
f16/bf16 and m16n8k8 tf32, ldmatrix, cp.async with its commit/wait groups; ``cuda_emu.h`` has
cvt.rna.tf32.f32).  The
kernel translation unit is compiled with ``-fsanitize=thread`` but linked without libtsan:
the runtime defines the ``__tsan_*`` callbacks, so every global and shared memory access
is checked (bounds against the launch's buffers, alignment, shared-memory races).

Launch convention (what ``cupy.RawModule``'s stand-in passes to :meth:`Function.launch`):

* ``args``: one ``bytes`` per kernel parameter, the parameter's value exactly as CuPy
  packs it: a device array is its 8-byte little-endian pointer, a NumPy scalar its own
  bytes (``np.int32(3).tobytes()``), ``None``/null a zero 8-byte pointer.  Each size is
  checked against ``sizeof`` of the C parameter (a GPU would silently misread it).
* ``buffers``: ``(pointer, nbytes)`` of every device allocation the kernel may touch
  (all live ones); any other address is an :class:`OutOfBounds`.  The kernels need the
  GPU's alignment: allocate device memory 256-byte aligned like CuPy.
* ``grid``/``block``: 1-3 ints; ``shared_mem``: dynamic shared memory bytes.
* ``seed``: the blocks run one at a time in an order shuffled from it (a GPU promises no
  order), so a kernel that depends on block order or reads another block's writes fails.
  By default each launch takes the next seed of a per-process sequence starting at
  ``$TESSERA_EMU_BLOCK_SEED`` (0): reproducible run to run, different launch to launch.
  A failure's message names its seed.

Compiled modules are cached on disk by the SHA-256 of the source, the headers, the runtime
and the compiler flags, under ``$TESSERA_EMU_CACHE`` or ``~/.cache/tessera_rt/cuda_emu``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["EmuError", "CompileError", "LaunchError", "RaceError", "MisalignedAccess", "OutOfBounds",
           "BarrierDivergence", "Deadlock", "Unsupported", "AsyncCopyError", "compile_module", "compiler", "Module", "Function",
           "MAX_DYNAMIC_SMEM", "MAX_STATIC_SMEM"]

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME = HERE / "runtime.cpp"

MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_STATIC_SMEM = 48 * 1024            # NVRTC rejects more static __shared__ than this
MAX_DYNAMIC_SMEM = 227 * 1024          # sm_90's opt-in maximum per block (static + dynamic)

# Warnings are off for the kernel source (it is written for NVRTC: `#pragma unroll` etc.);
# CUDA code type-puns freely (reinterpret_cast between uint4, unsigned and halves), which
# nvcc tolerates, so strict aliasing must not be assumed.  Device code has no exceptions
# (and unwinding data would be writable static data in the kernel object).
_COMMON_FLAGS = ("-std=c++20", "-fPIC", "-fno-strict-aliasing", "-fno-exceptions", "-w")
_KERNEL_FLAGS = _COMMON_FLAGS + ("-O1", "-fsanitize=thread")
_RUNTIME_FLAGS = _COMMON_FLAGS + ("-O2",)
# The module's __tsan_* hooks and runtime must bind to its own definitions, never to a
# previously loaded module's; and a hook GCC emits that the runtime lacks is a link error.
_LINK_FLAGS = ("-shared", "-Wl,-Bsymbolic", "-Wl,--no-undefined")


class EmuError(RuntimeError):
    """A kernel failed in the emulator; the message says which kernel, block and thread."""


class CompileError(EmuError):
    """g++ rejected the kernel source (message: the compiler log), or it uses an unsupported feature."""


class LaunchError(EmuError):
    """Invalid launch: configuration over CUDA's limits, or arguments not matching the parameters."""


class RaceError(EmuError):
    """Two threads of a block accessed the same shared-memory byte, one writing, with no barrier between."""


class MisalignedAccess(EmuError):
    """An N-byte access (N = 2, 4, 8, 16) at an address that is not a multiple of N."""


class OutOfBounds(EmuError):
    """An access outside every buffer passed to the launch, or past the block's shared memory."""


class BarrierDivergence(EmuError):
    """A warp collective some lanes of the warp cannot reach (exited, absent, or waiting elsewhere)."""


class Deadlock(BarrierDivergence):
    """No thread of the block can proceed (e.g. part of a warp at __syncthreads, part at a shuffle)."""


class Unsupported(EmuError):
    """The kernel used a feature the emulator does not implement (e.g. a partial shuffle mask)."""


class AsyncCopyError(EmuError):
    """A cp.async misuse: shared bytes read or written while a copy into them is in flight (its
    group not yet retired by the issuing thread's cp.async.wait_group/wait_all), two copies in
    flight into one byte, or a malformed copy (cp-size, src-size)."""


# ErrorKind in runtime.cpp
_ERRORS = {1: RaceError, 2: MisalignedAccess, 3: OutOfBounds, 4: BarrierDivergence, 5: Deadlock, 6: Unsupported,
           7: AsyncCopyError}

# NVRTC options with no meaning on the host (fast-math intrinsics are computed precisely).
_IGNORED_OPTIONS = re.compile(r"^(-std=|--std=|--use_fast_math$|-use_fast_math$|--gpu-architecture|-arch|"
                              r"--fmad|-lineinfo$|--generate-line-info$)")
_PASSED_OPTIONS = re.compile(r"^-[DUI]")

_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
                    r'(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
# `extern __shared__ [__align__(n)] T name[];` has no static counterpart: it becomes a
# pointer to the runtime's dynamic shared memory.
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\w+\s*\)\s*)?"
                            r"(?P<type>[A-Za-z_][\w\s:]*?)\s*\b(?P<name>\w+)\s*\[\s*\]\s*;")
# objdump -t: address, 7 flag columns, section, size, (demangled) name
_SYMBOL = re.compile(r"^([0-9a-f]+) (.{7}) (\S+)\s+([0-9a-f]+)\s+(.+)$")
_WRITABLE_SECTION = re.compile(r"^(\.bss|\.data|\.tbss|\.tdata|\*COM\*)")


@functools.cache
def compiler() -> tuple[str, str]:
    """(path, version line) of a g++ with C++20; raises :class:`CompileError` if there is none."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise CompileError("cuda_emu needs g++ (C++20): none found on PATH and $CXX is unset")
    probe = subprocess.run([cxx, "-std=c++20", "-fsanitize=thread", "-x", "c++", "-fsyntax-only", "-"],
                           input="#include <bit>\nint x = std::bit_cast<int>(1.f);\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise CompileError(f"{cxx} cannot compile C++20 with -fsanitize=thread:\n{probe.stderr}")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return cxx, version


def _cache_dir() -> Path:
    root = os.environ.get("TESSERA_EMU_CACHE") or Path.home() / ".cache" / "tessera_rt" / "cuda_emu"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


@functools.cache
def _emulator_sources() -> bytes:
    """Headers and runtime contents: part of every cache key."""
    files = sorted(INCLUDE.glob("*.h")) + [RUNTIME]
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"cuda_emu: {what} failed:\n$ {' '.join(cmd)}\n{proc.stderr[-8000:]}")


def _publish(tmp: Path, final: Path) -> None:
    """Atomic rename: concurrent test processes may build the same artifact."""
    os.replace(tmp, final)


def _runtime_object(cache: Path) -> Path:
    cxx, version = compiler()
    obj = cache / f"runtime-{_digest(version, ' '.join(_RUNTIME_FLAGS), _emulator_sources())[:24]}.o"
    if not obj.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / "runtime.o"
            _run([cxx, *_RUNTIME_FLAGS, "-I", str(INCLUDE), "-c", str(RUNTIME), "-o", str(out)], "compiling runtime.cpp")
            _publish(out, obj)
    return obj


def _translate_options(options: Sequence[str]) -> list[str]:
    flags = []
    for opt in options:
        if _PASSED_OPTIONS.match(opt):
            flags.append(opt)
        elif not _IGNORED_OPTIONS.match(opt):
            raise CompileError(f"cuda_emu: NVRTC option {opt!r} has no host equivalent; supported: -D, -U, -I, "
                               "and -std/--use_fast_math/-arch/--fmad/-lineinfo (ignored)")
    return flags


def _parameters(code: str, open_paren: int) -> list[str]:
    """The parameter declarations of the function whose '(' is at ``open_paren``."""
    depth, start, params = 0, open_paren + 1, []
    for i in range(open_paren, len(code)):
        ch = code[i]
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
            if depth == 0:
                params.append(code[start:i])
                break
        elif ch == "," and depth == 1:
            params.append(code[start:i])
            start = i + 1
    return [" ".join(p.split()) for p in params if p.strip() and p.strip() != "void"]


def _prepare(code: str) -> tuple[str, dict[str, list[str]]]:
    """The source as compiled (dynamic shared memory rewritten, entry trampolines appended)."""
    code = _EXTERN_SHARED.sub(lambda m: f"{m['type']}* {m['name']} = reinterpret_cast<{m['type']}*>"
                                        f"(ts_emu_dynamic_smem());", code)
    entries = {m.group(1): _parameters(code, m.end() - 1) for m in _ENTRY.finditer(code)}
    trampolines = "".join(f"TS_EMU_ENTRY({name})\n" for name in entries)
    return f"{code}\n// cuda_emu entry trampolines\n{trampolines}", entries


def _shared_symbols(obj: Path, name: str) -> list[tuple[int, int, str]]:
    """Static __shared__ variables of the kernel object: (offset, size, name).

    Raises :class:`CompileError` for writable static data outside the shared section: a
    ``__shared__`` declared in an inline or template function (GCC keeps those out of named
    sections) or a ``__device__`` global, neither of which the runtime can place.
    """
    proc = subprocess.run(["objdump", "-t", "-C", str(obj)], capture_output=True, text=True, check=True)
    shared, stray = [], []
    for line in proc.stdout.splitlines():
        m = _SYMBOL.match(line)
        if not m or "O" not in m.group(2):
            continue
        section, size, sym = m.group(3), int(m.group(4), 16), m.group(5)
        if section == "ts_emu_shared":
            shared.append((int(m.group(1), 16), size, sym))
        elif _WRITABLE_SECTION.match(section):
            stray.append(f"{sym} ({section}, {size} bytes)")
    if stray:
        raise CompileError(f"cuda_emu: {name} has static data the emulator cannot place: {', '.join(stray)}. "
                           "Only __shared__ variables of __global__ or non-inline functions and "
                           "`extern __shared__` arrays are supported (no __device__ globals)")
    return shared


_BLOCK_SEEDS = itertools.count(int(os.environ.get("TESSERA_EMU_BLOCK_SEED", "0")))
_MODULES: dict[str, Module] = {}
_MODULES_LOCK = threading.Lock()


def compile_module(code: str, options: Sequence[str] = (), name: str = "kernel") -> Module:
    """Build (or fetch from the cache) the host module of a CUDA C source."""
    cxx, version = compiler()
    source, entries = _prepare(code)
    flags = [*_KERNEL_FLAGS, "-I", str(INCLUDE), "-include", "cuda_emu.h", *_translate_options(options)]
    key = _digest(version, " ".join(flags), " ".join(_LINK_FLAGS), _emulator_sources(), source)
    with _MODULES_LOCK:
        if key in _MODULES:
            return _MODULES[key]
    cache = _cache_dir()
    lib, meta = cache / f"{key[:32]}.so", cache / f"{key[:32]}.json"
    if not (lib.exists() and meta.exists()):
        runtime = _runtime_object(cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, obj, out = Path(tmp) / f"{name}.cu.cpp", Path(tmp) / "kernel.o", Path(tmp) / "module.so"
            src.write_text(source)
            _run([cxx, *flags, "-c", str(src), "-o", str(obj)], f"compiling {name}")
            shared = _shared_symbols(obj, name)
            _run([cxx, *_LINK_FLAGS, "-o", str(out), str(obj), str(runtime)], f"linking {name}")
            meta_tmp = Path(tmp) / "meta.json"
            meta_tmp.write_text(json.dumps({"entries": entries, "shared": shared}))
            _publish(out, lib)
            _publish(meta_tmp, meta)
    info = json.loads(meta.read_text())
    module = Module(name, lib, info["entries"], [tuple(s) for s in info["shared"]])
    with _MODULES_LOCK:
        return _MODULES.setdefault(key, module)


class Module:
    """A compiled source: its ``extern "C" __global__`` entries by name."""

    def __init__(self, name: str, path: Path, entries: dict[str, list[str]], shared: list[tuple[int, int, str]]):
        self.name, self.path, self.entries = name, path, entries
        self._lib = ctypes.CDLL(str(path))
        self._lib.ts_emu_launch.restype = ctypes.c_int
        self._lib.ts_emu_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong]
        self._lib.ts_emu_static_smem_bytes.restype = ctypes.c_ulonglong
        self.static_smem_bytes = int(self._lib.ts_emu_static_smem_bytes())
        self._shared_names = [ctypes.c_char_p(sym.encode()) for _, _, sym in shared]   # kept alive for the runtime
        for (offset, size, _), sym in zip(shared, self._shared_names):
            self._lib.ts_emu_name_shared(ctypes.c_ulonglong(offset), ctypes.c_ulonglong(size), sym)
        self._functions: dict[str, Function] = {}

    def set_tf32_accumulation(self, model: str) -> str:
        """How this module's mma.sync m16n8k8 .tf32 sums: "nearest" (sequential f32 adds rounded
        to nearest, the default) or "truncate" (the A100 model of runtime.cpp: groups of four k
        aligned to the largest term without guard bits, truncated toward zero).  Returns the
        previous model."""
        models = ("nearest", "truncate")
        if model not in models:
            raise ValueError(f"tf32 accumulation {model!r}: use one of {models}")
        return models[self._lib.ts_emu_set_tf32_accumulation(models.index(model))]

    def get_function(self, name: str) -> Function:
        if name not in self.entries:
            raise EmuError(f"cuda_emu: module {self.name} has no extern \"C\" __global__ function {name!r}; "
                           f"entries: {sorted(self.entries)}")
        if name not in self._functions:
            self._functions[name] = Function(self, name)
        return self._functions[name]


def _dims(kernel: str, what: str, dims: Sequence[int] | int, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    dims = (dims,) if isinstance(dims, int) else tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3:
        raise LaunchError(f"{kernel}: {what} must have 1-3 dimensions, got {dims}")
    dims = dims + (1,) * (3 - len(dims))
    for axis, (d, limit) in enumerate(zip(dims, limits)):
        if not 1 <= d <= limit:
            raise LaunchError(f"{kernel}: {what}.{'xyz'[axis]} = {d} is outside CUDA's range [1, {limit}] "
                              f"({what} {dims})")
    return dims


class Function:
    """One kernel entry of a :class:`Module`."""

    def __init__(self, module: Module, name: str):
        self.module, self.name = module, name
        self.param_decls = module.entries[name]
        lib = module._lib
        self._entry = ctypes.cast(getattr(lib, f"ts_emu_entry_{name}"), ctypes.c_void_p).value
        sizes = (ctypes.c_ulonglong * 64)()
        count = getattr(lib, f"ts_emu_params_{name}")(sizes, 64)
        self.param_sizes = tuple(int(s) for s in sizes[:count])

    def _check_args(self, args: Sequence[bytes]) -> None:
        if len(args) != len(self.param_sizes):
            raise LaunchError(f"{self.name} takes {len(self.param_sizes)} parameters ({', '.join(self.param_decls)}), "
                              f"the launch passed {len(args)} arguments")
        for i, (arg, size) in enumerate(zip(args, self.param_sizes)):
            if len(arg) != size:
                decl = self.param_decls[i] if i < len(self.param_decls) else "?"
                raise LaunchError(f"{self.name}: parameter {i} `{decl}` is {size} bytes (sizeof of its C type), "
                                  f"the launch passed {len(arg)} bytes; a GPU would silently misread it")

    def launch(self, grid: Sequence[int] | int, block: Sequence[int] | int, args: Sequence[bytes],
               shared_mem: int = 0, buffers: Sequence[tuple[int, int]] = (), seed: int | None = None) -> None:
        """Run the kernel to completion, its blocks in an order shuffled from ``seed`` (default:
        the next of the process's sequence); raises an :class:`EmuError` subclass on any failed check."""
        grid3 = _dims(self.name, "grid", grid, MAX_GRID)
        block3 = _dims(self.name, "block", block, MAX_BLOCK)
        if block3[0] * block3[1] * block3[2] > MAX_THREADS_PER_BLOCK:
            raise LaunchError(f"{self.name}: block {block3} has {block3[0] * block3[1] * block3[2]} threads, "
                              f"more than {MAX_THREADS_PER_BLOCK}")
        static = self.module.static_smem_bytes
        if static > MAX_STATIC_SMEM:
            raise LaunchError(f"{self.name}: {static} bytes of static __shared__ memory, more than {MAX_STATIC_SMEM}")
        if not 0 <= shared_mem <= MAX_DYNAMIC_SMEM - static:
            raise LaunchError(f"{self.name}: shared_mem={shared_mem} bytes of dynamic shared memory plus {static} "
                              f"static exceeds the {MAX_DYNAMIC_SMEM} bytes a block can have")
        self._check_args(args)
        values = [ctypes.create_string_buffer(bytes(a), max(len(a), 1)) for a in args]
        argv = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        # The argument values are readable too (the GPU's parameter space): copying a
        # by-value parameter whose type has an inline copy constructor reads them.
        param_space = [(ctypes.addressof(v), len(a)) for v, a in zip(values, args)]
        flat = [int(x) for ptr, nbytes in (*buffers, *param_space) for x in (ptr, nbytes)]
        ranges = (ctypes.c_ulonglong * max(len(flat), 1))(*flat)
        message = ctypes.create_string_buffer(4096)
        status = self.module._lib.ts_emu_launch(
            self.name.encode(), self._entry, argv, (ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3),
            shared_mem, ranges, len(flat) // 2, message, len(message), next(_BLOCK_SEEDS) if seed is None else seed)
        if status:
            raise _ERRORS[status](message.value.decode(errors="replace"))
