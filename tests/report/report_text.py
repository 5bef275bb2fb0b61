"""Read the numbers back out of ``restage report``'s text table (to check it against the JSON)."""

from __future__ import annotations

import re


def blocks(text: str) -> dict[str, list[list[str]]]:
    """Each titled block of the text as rows of cells (cells are separated by two or more spaces)."""
    out: dict[str, list[list[str]]] = {}
    title = None
    for line in text.splitlines():
        if not line.strip():
            title = None
        elif not line.startswith("  "):
            title = line.split(" (")[0]
            out[title] = []
        elif title is not None:
            out[title].append(re.split(r"\s{2,}", line.strip()))
    return out


def close_to_printed(cell: str, value: float) -> bool:
    """Whether ``value`` rounds to the printed ``cell`` (half a unit of its last digit, plus float slack)."""
    cell = cell.rstrip("%")
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return abs(float(cell) - value) <= 0.5 * 10**-decimals + 1e-9 * abs(value)
