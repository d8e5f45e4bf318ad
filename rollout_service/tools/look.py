"""``rollout-service look``: the key panels' data from Prometheus, as one PNG.

Runs in the operator's process and talks only to Prometheus's HTTP API
(``/api/v1/query_range``), for people without Grafana at hand. The queries are
the dashboard's (``rollout_service/telemetry/queries.py``), rendered with the
given rate window and no label matchers: every figure sums over all replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollout_service.telemetry import queries
from rollout_service.tools.plot import LineChart, save_charts

Points = list[tuple[float, float]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    """One chart: a line (or a line per label value) per figure of ``queries``."""

    title: str
    ylabel: str
    """The y axis's label, with its unit."""
    lines: dict[str, Callable[[queries.Scope], str]]
    """Legend -> figure. A legend may name the series' labels, e.g. ``"{role}"``, when
    the figure keeps a label."""
    y_range: tuple[float, float] | None = None
    integer_y: bool = False
    """Whole-number ticks (versions)."""


PANELS = (
    Panel(title="accept rate: macro (per request) vs micro (per token)",
          ylabel="accept rate (ratio)", y_range=(0.0, 1.05),
          lines={"macro": queries.macro_accept_rate, "micro": queries.micro_accept_rate}),
    Panel(title="accept length: macro vs micro", ylabel="accept length (tokens / verify step)",
          lines={"macro": queries.macro_accept_length, "micro": queries.micro_accept_length}),
    Panel(title="weight version: main model vs MTP drafter", ylabel="weight version",
          lines={"{role}": queries.weight_version}, integer_y=True),
    Panel(title="net speed-up of speculation (below 1: a slow-down)", ylabel="speed-up (ratio)",
          lines={"net speed-up": queries.net_speedup,
                 "verify cost ratio": queries.verify_cost_ratio}),
    Panel(title="macro accept rate by request category", ylabel="accept rate (ratio)",
          y_range=(0.0, 1.05), lines={"{category}": queries.macro_accept_rate_by_category}),
    Panel(title="drafter: rollout acceptance vs training accuracy by version",
          ylabel="acceptance, top-1 accuracy (ratio)", y_range=(0.0, 1.05),
          lines={"rollout {weights} v{version} pos {position}": queries.acceptance_by_weights,
                 "trainer v{version} pos {position}": queries.trainer_mtp_accuracy}),
)


def query_range(prometheus_url: str, query: str, *, start: float, end: float,
                step_s: float) -> list[tuple[dict[str, str], Points]]:
    """Each series of ``query``: its labels and ``(seconds since start, value)`` points.

    Raises:
        ValueError: Prometheus rejected the query (message included).
    """
    response = httpx.get(f"{prometheus_url}/api/v1/query_range", timeout=30, params={
        "query": query, "start": start, "end": end, "step": step_s})
    body = response.json()
    if body.get("status") != "success":
        raise ValueError(f"query {query!r}: {body.get('error', response.text)}")
    return [(series["metric"], [(float(t) - start, float(v)) for t, v in series["values"]
                                if v not in ("NaN", "+Inf", "-Inf")])
            for series in body["data"]["result"]]


def _panel_data(prometheus_url: str, panel: Panel, scope: queries.Scope, *, start: float,
                end: float, step_s: float) -> dict[str, Points]:
    """Legend -> points; a figure without any series keeps its legend with no points."""
    data: dict[str, Points] = {}
    for legend, figure in panel.lines.items():
        found = query_range(prometheus_url, figure(scope), start=start, end=end, step_s=step_s)
        data.update({legend.format(**labels): points for labels, points in found}
                    or {legend: []})
    return data


def render_look(prometheus_url: str, out: Path, *, minutes: float = 15.0,
                step_s: float = 15.0, window: str = "1m") -> dict[str, dict[str, Points]]:
    """Query every panel over the last ``minutes`` and write one PNG; returns the data
    (panel title -> legend -> points)."""
    end = time.time()
    start = end - 60 * minutes
    scope = queries.Scope(window=window)
    data = {panel.title: _panel_data(prometheus_url, panel, scope, start=start, end=end,
                                     step_s=step_s) for panel in PANELS}
    save_charts([LineChart(title=p.title, xlabel="time (s)", ylabel=p.ylabel,
                           series=data[p.title], y_range=p.y_range, integer_y=p.integer_y)
                 for p in PANELS], out)
    return data
