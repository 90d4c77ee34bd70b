"""Old names kept for one release after a rename: each use warns with the new name.

A module keeps its renamed names with ``__getattr__ = deprecation.aliases(__name__, {...})``
(a module-level ``__getattr__`` runs only for names the module does not have, so the new
names cost nothing); a renamed module keeps a stub that calls ``deprecation.moved`` and
re-exports the new one.  Every warning is a ``DeprecationWarning`` naming the new name.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["warn", "aliases", "moved"]


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is renamed ``new`` (a ``DeprecationWarning``, pointed at the caller)."""
    warnings.warn(f"{old} is deprecated: use {new} (the old name is removed in the next release)",
                  DeprecationWarning, stacklevel=stacklevel)


def aliases(module: str, old: dict[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving renamed names: ``old`` maps each old name to (the new
    name as users write it, a function returning the object).  Other names raise the usual
    AttributeError."""
    def __getattr__(name: str) -> Any:
        entry = old.get(name)
        if entry is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, get = entry
        warn(f"{module}.{name}", new)
        return get()
    return __getattr__


def moved(old: str, new: str) -> None:
    """For the stub left at a renamed module's old path: warn once per import of it."""
    warn(f"the module {old}", new, stacklevel=4)
