"""Sizes as people write them."""
from __future__ import annotations

import re

_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]?)(i?B?)?\s*\Z", re.IGNORECASE)
_MULT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`6G`, `6GiB`, `512M`, `1048576` -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (write e.g. 6G, 512M or a number of bytes)")
    return int(m.group(1)) * _MULT[m.group(2).upper()]


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
