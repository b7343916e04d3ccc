"""base/units.py: sizes: ``parse_size('2GiB')`` and ``human(n)``."""
from __future__ import annotations

import re

__all__ = ["parse_size", "human"]


def parse_size(x) -> int:
    """Bytes from an int or a string like '2GiB', '512MB', '64M', '1.5G' (binary multiples for 'K/M/G/T')."""
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
    v = int(float(m.group(1)) * base ** " KMGT".index(unit or " ")) if unit else int(float(m.group(1)))
    if v <= 0:
        raise ValueError(f"size must be positive, got {x!r}")
    return v


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
