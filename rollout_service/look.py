"""``rollout-service look``: the key panels' data from Prometheus, as one PNG.

Runs in the operator's process and talks only to Prometheus's HTTP API
(``/api/v1/query_range``), for people without Grafana at hand. Every query sums
over replicas, like the dashboards (``grafana/dashboards.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollout_service.plot import line_chart, save_stacked

_RATE = "sum(rate({metric}[{window}]))"


@dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    """One chart: a title and named PromQL queries (``{window}`` is the rate window)."""

    title: str
    queries: dict[str, str]
    y_range: tuple[float, float] | None = None


PANELS = (
    Panel(title="accept rate: macro (per request) vs micro (per token)", y_range=(0.0, 1.05),
          queries={
              "macro": "sum(rate(rollout_spec_decode_request_accept_rate_sum[{window}])) / "
                       "sum(rate(rollout_spec_decode_request_accept_rate_count[{window}]))",
              "micro": "sum(rate(rollout_spec_decode_accepted_tokens_total[{window}])) / "
                       "sum(rate(rollout_spec_decode_draft_tokens_total[{window}]))"}),
    Panel(title="accept length: macro vs micro", queries={
        "macro": "sum(rate(rollout_spec_decode_request_accept_length_sum[{window}])) / "
                 "sum(rate(rollout_spec_decode_request_accept_length_count[{window}]))",
        "micro": "1 + sum(rate(rollout_spec_decode_accepted_tokens_total[{window}])) / "
                 "sum(rate(rollout_spec_decode_drafts_total[{window}]))"}),
    Panel(title="weight version: main model vs MTP drafter", queries={
        "main": 'max(rollout_weight_version{{role="main"}})',
        "drafter": 'max(rollout_weight_version{{role="draft"}})'}),
)


def query_range(prometheus_url: str, query: str, *, start: float, end: float,
                step_s: float) -> list[tuple[float, float]]:
    """``(seconds since start, value)`` points of a single-series query.

    Raises:
        ValueError: Prometheus rejected the query (message included).
    """
    response = httpx.get(f"{prometheus_url}/api/v1/query_range", timeout=30, params={
        "query": query, "start": start, "end": end, "step": step_s})
    body = response.json()
    if body.get("status") != "success":
        raise ValueError(f"query {query!r}: {body.get('error', response.text)}")
    results = body["data"]["result"]
    if not results:
        return []
    return [(float(t) - start, float(v)) for t, v in results[0]["values"]
            if v not in ("NaN", "+Inf", "-Inf")]


def render_look(prometheus_url: str, out: Path, *, minutes: float = 15.0,
                step_s: float = 15.0, window: str = "1m"
                ) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Query every panel over the last ``minutes`` and write one PNG; returns the data."""
    end = time.time()
    start = end - 60 * minutes
    data = {panel.title: {name: query_range(prometheus_url, q.format(window=window),
                                            start=start, end=end, step_s=step_s)
                          for name, q in panel.queries.items()}
            for panel in PANELS}
    charts = [line_chart(data[p.title], title=p.title, xlabel="seconds", y_range=p.y_range)
              for p in PANELS]
    save_stacked(charts, out)
    return data
