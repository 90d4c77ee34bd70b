"""Providers: vendor libraries in the kernel table, per op, dtype and shape.

A GPU op's entry in the kernel table (``backend.register_kernel(op, "cuda", ...)``) is a
dispatcher over an ordered list of providers, ending with the project's own kernel:

* ``flash_attention`` / ``flash_attention_backward`` / ``flash_attention_varlen`` /
  ``paged_decode_attention``: cuDNN's fused attention (``nvidia-cudnn-frontend``), then the
  project's flash / paged kernels;
* ``matmul_bias_act`` / ``matmul_fp8``: cuBLASLt through ``nvmath-python`` (fused bias and
  activation epilogues, FP8 with per-tensor scales), then the project's GEMM + row kernel.

Each provider says once per process (and device) whether it can run at all (``available``:
the library imports, the GPU's compute capability and the library's version suffice), and
per call whether it takes these arguments (``supports``: dtype, head dim, layout, shapes).
The first provider that does runs; when none does the project's own kernel runs, and the
precision record (``kernels.precision.note``) says so together with each provider's reason,
so a profile or ``TESSERA_DEBUG=kernels`` never hides a fallback.

One switch forces the project's own kernels everywhere, for comparison and for machines
without the libraries: ``TESSERA_KERNELS=own`` at start, or ``use_providers(False)`` (also a
context manager: ``with use_providers(False): ...``).
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .precision import add_listener, note, own_kernel_of

__all__ = ["Provider", "Unsupported", "register_provider", "providers_for", "dispatch", "dispatching",
           "use_providers", "providers_enabled", "describe", "reset", "compute_capability", "set_debug", "FORCED_WHY", "REGISTRY"]

_KERNELS_ENV = os.environ.get("TESSERA_KERNELS", "").strip().lower()
# whether vendor providers may run (use_providers; TESSERA_KERNELS=own turns them off)
_ENABLED = [_KERNELS_ENV != "own"]
FORCED_WHY = "own kernels forced (TESSERA_KERNELS=own or use_providers(False))"


class Unsupported(Exception):
    """A provider found out while running that it cannot take these arguments (a graph its
    library would not build, say); the dispatcher moves on to the next provider."""


def compute_capability() -> int:
    """The current CUDA device's compute capability as an int (90 for sm_90)."""
    import cupy
    return int(cupy.cuda.Device().compute_capability)


class Provider:
    """One implementation of an op by a vendor library.

    Subclasses set ``name`` (what the notes say, e.g. "cudnn"), ``library`` (the package to
    install) and implement ``_probe`` (None when usable, else why not), ``supports`` and
    ``run`` (both take the op's own arguments).  ``run`` notes the precision it ran in.

    Parameters
    ----------
    op : str
        The op this provider implements.
    """

    name = "provider"
    library = ""

    def __init__(self, op: str):
        self.op = op
        self._available: dict = {}          # device id -> None (usable) or the reason it is not

    def _probe(self) -> str | None:         # pragma: no cover - every provider defines it
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """None when the library can run on this device, else why not (decided once a device)."""
        try:
            import cupy
            dev = cupy.cuda.Device().id
        except Exception as exc:            # no CuPy: nothing GPU-side can run
            return f"no CUDA device ({type(exc).__name__})"
        if dev not in self._available:
            try:
                self._available[dev] = self._probe()
            except Exception as exc:        # a library that imports but cannot start
                self._available[dev] = f"{self.library} failed to start: {type(exc).__name__}: {exc}"
        return self._available[dev]

    def supports(self, *args: Any, **kwargs: Any) -> str | None:
        """None when this provider takes these arguments, else why not."""
        return None

    def run(self, *args: Any, **kwargs: Any) -> Any:     # pragma: no cover
        raise NotImplementedError

    def reset(self) -> None:
        """Forget availability and cached plans/graphs (tests; a changed environment)."""
        self._available.clear()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} for {self.op!r}>"


# the provider registry: op -> providers in the order tried (register_provider)
REGISTRY: dict[str, list[Provider]] = {}
_LOCK = threading.Lock()


def register_provider(provider: Provider, *, first: bool = False) -> Provider:
    """Add ``provider`` to its op's list (last, or first with ``first=True``); the project's
    own kernel always comes after every provider.

    Parameters
    ----------
    provider : Provider
        The provider (its ``op`` names the list).
    first : bool
        Put it before the providers already registered.

    Returns
    -------
    Provider
        ``provider``.
    """
    with _LOCK:
        lst = REGISTRY.setdefault(provider.op, [])
        lst = [p for p in lst if p.name != provider.name]      # re-registering replaces
        lst.insert(0 if first else len(lst), provider)
        REGISTRY[provider.op] = lst
    return provider


def providers_for(op: str) -> list[Provider]:
    """The providers of ``op`` in the order they are tried (the own kernel follows them).

    Parameters
    ----------
    op : str
        A kernel-table op name.

    Returns
    -------
    list of Provider
        A copy of the list.
    """
    return list(REGISTRY.get(op, ()))


def providers_enabled() -> bool:
    """Whether vendor providers may run (False under ``TESSERA_KERNELS=own`` or ``use_providers(False)``).

    Returns
    -------
    bool
        The switch.
    """
    if _KERNELS_ENV not in ("", "auto", "own", "providers", "vendor"):
        raise ValueError(f"TESSERA_KERNELS={_KERNELS_ENV!r}: use 'own' (the project's kernels everywhere) or "
                         "'auto' (vendor libraries where installed; the default)")
    return _ENABLED[0]


class use_providers:
    """Turn the vendor providers on or off; as a context manager, only inside the block.

    ``use_providers(False)`` forces the project's own kernels everywhere (what
    ``TESSERA_KERNELS=own`` does at start); ``with use_providers(False): ...`` restores the
    previous setting after the block.

    Parameters
    ----------
    enabled : bool
        True: providers where available (the default); False: the own kernels.
    """

    def __init__(self, enabled: bool = True):
        self._before = _ENABLED[0]
        _ENABLED[0] = bool(enabled)

    def __enter__(self) -> use_providers:
        return self

    def __exit__(self, *exc: Any) -> None:
        _ENABLED[0] = self._before


def dispatch(op: str, own: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` with the first provider that is available and supports the arguments, else
    with ``own`` (the project's kernel), whose notes then carry the providers' reasons.

    Parameters
    ----------
    op : str
        The op.
    own : callable
        The project's own kernel, called as ``own(*args, **kwargs)``.
    args : tuple
        Positional arguments of the op.
    kwargs : dict
        Keyword arguments of the op.

    Returns
    -------
    object
        What the provider or ``own`` returned.
    """
    reasons = []
    if not providers_enabled():
        reasons.append(FORCED_WHY)
    else:
        for p in REGISTRY.get(op, ()):
            why = p.unavailable() or p.supports(*args, **kwargs)
            if why is None:
                try:
                    return p.run(*args, **kwargs)
                except Unsupported as exc:
                    why = str(exc)
            reasons.append(f"{p.name}: {why}")
    why = "; ".join(reasons) or None
    with own_kernel_of(op, why) as noted:
        result = own(*args, **kwargs)
    if not noted[0]:
        # the own kernel ran a path that records nothing (the CuPy reference): say so here
        note(op, "reference", "own", why)
    return result


def dispatching(op: str, own: Callable) -> Callable:
    """The kernel-table entry for ``op``: ``dispatch`` over its providers, then ``own``.

    Parameters
    ----------
    op : str
        The op.
    own : callable
        The project's own GPU kernel (what runs when no provider does).

    Returns
    -------
    callable
        A function with ``own``'s signature and docstring.
    """
    def entry(*args: Any, **kwargs: Any) -> Any:
        return dispatch(op, own, args, kwargs)
    entry.__name__ = getattr(own, "__name__", op)
    entry.__qualname__ = entry.__name__
    entry.__doc__ = own.__doc__
    entry.__wrapped__ = own  # type: ignore[attr-defined]  # as functools.wraps sets it
    return entry


def describe() -> list[str]:
    """One line per op: its providers in order, each available or not (and why), then "own".

    Returns
    -------
    list of str
        For ``TESSERA_DEBUG=kernels``, ``scripts/gpu_check.py`` and people.
    """
    lines = []
    for op in sorted(REGISTRY):
        parts = []
        for p in REGISTRY[op]:
            why = p.unavailable()
            parts.append(f"{p.name} ({'available' if why is None else 'unavailable: ' + why})")
        lines.append(f"{op}: {' -> '.join(parts + ['own'])}")
    if not providers_enabled():
        lines.append(FORCED_WHY)
    return lines


def reset() -> None:
    """Forget every provider's availability and cached graphs/plans (tests)."""
    for lst in REGISTRY.values():
        for p in lst:
            p.reset()


# --------------------------------------------------------------------------- TESSERA_DEBUG=kernels

def _debug_line(op: str, precision: str, provider: str | None, why: str | None) -> None:
    line = f"[tessera kernels] {op} {precision} -> {provider or '?'}"
    print(line + (f"  ({why})" if why else ""), file=sys.stderr, flush=True)


# whether each choice is printed (set_debug; TESSERA_DEBUG=kernels)
_DEBUG = [False]


def set_debug(on: bool) -> None:
    """Print one line per kernel call naming its precision and provider (and, for a fallback,
    why each provider declined) to stderr; ``TESSERA_DEBUG=kernels`` turns it on at start.

    Parameters
    ----------
    on : bool
        On or off.
    """
    from .precision import remove_listener
    if on and not _DEBUG[0]:
        add_listener(_debug_line)
    elif not on and _DEBUG[0]:
        remove_listener(_debug_line)
    _DEBUG[0] = bool(on)


def _debug_from_env() -> bool:
    words = {w.strip().lower() for w in os.environ.get("TESSERA_DEBUG", "").replace(";", ",").split(",")}
    return bool(words & {"kernels", "providers"})


set_debug(_debug_from_env())
