"""Human byte sizes: ``16GiB``, ``512MB``, ``1_000``; used by the CLI and the partitioner."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``'16GiB'`` -> 17179869184.  Raises ``ValueError`` with the accepted forms."""
    m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 512MiB, 16GiB, 8GB or a number of bytes")
    return int(float(m.group(1).replace("_", "")) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; exact below 1 KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
