"""How a benchmark's tables print a per-round value: its median, then its range."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def median_spread(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """``median (min - max)`` of ``values``, each number written with ``fmt``."""
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))} - {fmt.format(max(values))})")


def min_max(values: Sequence[float]) -> str:
    """``min-max`` of ``values``, three significant digits each (beside a median column)."""
    return f"{min(values):.3g}-{max(values):.3g}"
