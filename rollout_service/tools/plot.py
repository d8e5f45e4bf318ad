"""Line charts as PNG with matplotlib: the RL demo's figure and ``rollout-service look``.

Runs in whichever process renders (the demo, the ``look`` command), with the
Agg backend: no display needed. Each chart is one axes with a title, labelled
axes with units, a legend and a light grid; the x axis takes only integer ticks
when the data are steps, on y when they are versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
from matplotlib.ticker import MaxNLocator  # noqa: E402

Series = Mapping[str, Sequence[tuple[float, float]]]
"""Line name -> ``(x, y)`` points."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LineChart:
    """One chart: a line (with markers) per series."""

    title: str
    xlabel: str
    """The x axis's label, with its unit."""
    ylabel: str
    """The y axis's label, with its unit (or "ratio")."""
    series: Series = field(default_factory=dict)
    y_range: tuple[float, float] | None = None
    """Fixed y limits; None fits the data."""
    integer_x: bool = False
    """Only integer ticks on x (steps)."""
    integer_y: bool = False
    """Only integer ticks on y (versions, counts)."""


def save_charts(charts: Sequence[LineChart], path: Path) -> Path:
    """Charts one above the other in one PNG (150 dpi)."""
    fig, axes = plt.subplots(len(charts), 1, figsize=(8, 3.6 * len(charts)), squeeze=False)
    try:
        for ax, chart in zip(axes[:, 0], charts):
            _draw(ax, chart)
        fig.tight_layout()
        fig.savefig(path, dpi=150)
    finally:
        plt.close(fig)
    return path


def _draw(ax: plt.Axes, chart: LineChart) -> None:
    for name, points in chart.series.items():
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.6, label=name)
    ax.set_title(chart.title)
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    if chart.y_range is not None:
        ax.set_ylim(*chart.y_range)
    if chart.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if chart.integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if any(chart.series.values()):
        ax.legend(loc="best", frameon=False)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                color="grey")
