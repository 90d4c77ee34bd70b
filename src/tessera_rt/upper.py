"""Names a package serves for a layer above it, provided by that layer when it is imported.

``dist.Pipeline`` is ``tessera_rt.pipeline``'s class and ``nn.Llama`` / ``nn.KVCache`` are
``tessera_rt.inference``'s, but dist sits below pipeline and nn below inference, so neither
can import them.  The lower package owns an ``UpperNames`` listing which names it serves and
where they come from; the upper package calls ``provide`` on import, which makes each a
plain attribute of the lower package.  Reading one before that raises an AttributeError
naming the package to import (``import tessera_rt`` imports every layer).
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["UpperNames"]


class UpperNames:
    """The names ``package`` serves from above.

    Parameters
    ----------
    package : str
        The lower package's module name (``"tessera_rt.dist"``).
    sources : dict
        Each name -> the module that provides it (``{"Pipeline": "tessera_rt.pipeline"}``).
    """

    def __init__(self, package: str, sources: dict[str, str]) -> None:
        self.package, self.sources = package, dict(sources)

    def provide(self, name: str, obj: Any) -> None:
        """Called by the upper package on import: ``package.name`` is ``obj`` from now on.

        Parameters
        ----------
        name : str
            One of the names listed in ``sources``.
        obj : object
            What it is.
        """
        if name not in self.sources:
            raise KeyError(f"{self.package} serves no name {name!r} from above (it lists {sorted(self.sources)})")
        setattr(sys.modules[self.package], name, obj)

    def missing(self, name: str) -> AttributeError | None:
        """The error for reading ``name`` before it is provided (None: not one of these names).

        Parameters
        ----------
        name : str
            The attribute read.

        Returns
        -------
        AttributeError or None
            What to raise.
        """
        src = self.sources.get(name)
        if src is None:
            return None
        return AttributeError(f"{self.package}.{name} is {src}.{name}, which {src} provides when it is imported: "
                              f"import {src} first (or `import tessera_rt as ts` and read a name on ts, which "
                              "imports every layer)")
