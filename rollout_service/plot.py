"""Line charts as PNG with Pillow: the demo's plot and ``rollout-service look``.

Runs in whichever process renders (the trainer's demo, the ``look`` command); no
plotting library beyond Pillow, which vLLM already brings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from PIL import Image, ImageDraw

Series = Mapping[str, Sequence[tuple[float, float]]]
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def line_chart(series: Series, *, title: str, xlabel: str,
               y_range: tuple[float, float] | None = None,
               size: tuple[int, int] = (800, 450)) -> Image.Image:
    """One chart, one line (with markers) per series; ``y_range`` None fits the data."""
    width, height = size
    margin = 60
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    points = [p for pts in series.values() for p in pts]
    x_low = min((x for x, _ in points), default=0.0)
    x_high = max((x for x, _ in points), default=1.0)
    x_high = x_high if x_high > x_low else x_low + 1.0
    if y_range is None:
        low = min((y for _, y in points), default=0.0)
        high = max((y for _, y in points), default=1.0)
        pad = 0.05 * (high - low) if high > low else 0.5
        y_range = (low - pad, high + pad)
    low, high = y_range

    def xy(x: float, y: float) -> tuple[float, float]:
        return (margin + (x - x_low) / (x_high - x_low) * (width - 2 * margin),
                height - margin - (y - low) / (high - low) * (height - 2 * margin))

    draw.rectangle([margin, margin, width - margin, height - margin], outline="black")
    for i in range(6):
        value = low + (high - low) * i / 5
        y = xy(x_low, value)[1]
        draw.line([margin, y, width - margin, y], fill=(225, 225, 225))
        draw.text((5, y - 6), f"{value:.2f}", fill="black")
    for i in range(11):
        x_value = x_low + (x_high - x_low) * i / 10
        draw.text((xy(x_value, low)[0] - 8, height - margin + 6), f"{x_value:g}", fill="black")
    draw.text((width // 2 - 4 * len(xlabel), height - 25), xlabel, fill="black")
    draw.text((margin, 20), title, fill="black")
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = [xy(x, y) for x, y in pts]
        if len(coords) > 1:
            draw.line(coords, fill=color, width=3)
        for x, y in coords:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        draw.line([width - 230, 25 + 18 * i, width - 200, 25 + 18 * i], fill=color, width=3)
        draw.text((width - 195, 18 + 18 * i), name, fill="black")
    return image


def save_stacked(charts: Sequence[Image.Image], path: Path) -> Path:
    """Charts one above the other in one PNG."""
    width = max(c.width for c in charts)
    canvas = Image.new("RGB", (width, sum(c.height for c in charts)), "white")
    top = 0
    for chart in charts:
        canvas.paste(chart, (0, top))
        top += chart.height
    canvas.save(path)
    return path
