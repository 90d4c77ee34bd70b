# The C extension built from _hot.c (setup.py; optional: without a compiler there is no
# module and the collectives run in Python).  What it exports, for type checkers.
from typing import Any

ALL_REDUCE: int
REDUCE_SCATTER: int
ALL_GATHER: int
ALL_TO_ALL: int
BROADCAST: int

class Collective:
    """A collective's repeat path in C, with the Python function as its fallback."""

    hits: int
    def __init__(self, kind: int, fallback: Any, key: tuple, none: tuple, /) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def setup(*tables: Any) -> bool: ...
def run_compiled(plan: Any, x: Any, depth: int, out: Any = ..., /) -> Any: ...
def compiled_hits() -> int: ...
def pending() -> tuple[int, Any, Any, int] | None: ...
