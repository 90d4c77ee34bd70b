"""Small formatting helpers shared by reports (profile tables, checkpoint summaries)."""
from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'`` (decimal units, as the tables print them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
