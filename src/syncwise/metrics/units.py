"""Numbers as people read them: bytes with a unit, seconds, losses at one precision."""
from __future__ import annotations

from typing import Any

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(n: Any) -> str:
    """``21930000`` → ``'21.9 MB'`` (decimal units, as network rates and nccl-tests use); '–' for None."""
    if n is None:
        return "–"
    n = float(n)
    i = 0
    while abs(n) >= 1000 and i < len(_UNITS) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} {_UNITS[i]}" if i == 0 else f"{n:.3g} {_UNITS[i]}" if abs(n) < 100 else f"{n:.0f} {_UNITS[i]}"


def human_seconds(s: Any) -> str:
    """``0.0395`` → ``'39.5 ms'``, ``75`` → ``'1 min 15 s'``; '–' for None."""
    if s is None:
        return "–"
    s = float(s)
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 60:
        return f"{s:.3g} s"
    m, sec = divmod(round(s), 60)
    if m < 60:
        return f"{m} min {sec} s"
    h, m = divmod(m, 60)
    return f"{h} h {m} min"


def loss(v: Any) -> str:
    """Every loss at the same precision (4 decimals), so 1.8 and 1.7995 are not printed side by side."""
    return "–" if v is None else f"{float(v):.4f}"
