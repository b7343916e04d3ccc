"""base/units.py: byte sizes: ``parse_size('2GiB')`` (text to bytes) and ``human(n)`` (bytes to
text)."""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["parse_size", "human"]


def parse_size(x) -> int:
    """Bytes from an int or a string like '2GiB', '512MB', '64M', '1.5G' (binary multiples for
    'K/M/G/T')."""
    if isinstance(x, bool):
        raise TypeError("size must be an int or a string like '2GiB'")
    if isinstance(x, int):
        if x <= 0:
            raise ValueError(f"size must be positive, got {x}")
        return x
    if not isinstance(x, str):
        raise TypeError(f"size must be an int or a string like '2GiB', got {type(x).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", x)
    if not m:
        raise ValueError(f"cannot parse size {x!r} (examples: '2GiB', '512MB', 1073741824)")
    unit = m.group(2).upper()
    decimal = m.group(3) is not None and m.group(3).lower() == "b" and unit != ""
    base = 1000 if decimal else 1024
    v = (int(float(m.group(1)) * base ** " KMGT".index(unit or " ")) if unit
         else int(float(m.group(1))))
    if v <= 0:
        raise ValueError(f"size must be positive, got {x!r}")
    return v


def human(n: Optional[float], digits: int = 1) -> str:
    """Bytes as text in binary units: ``human(100) == '100 B'``, ``human(1536) == '1.5 KiB'``,
    ``human(3 * 2**30, digits=2) == '3.00 GiB'`` (``digits`` after the point from KiB up; the
    planner's tables use 2); ``None`` (unknown) gives ``'?'``. The one byte formatter of
    offload."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"
