"""The rollout service's Grafana dashboard, built with grafana-foundation-sdk.

Runs on a developer's machine or in CI, never in the service: ``python -m
grafana.dashboards`` writes ``grafana/dashboards/rollout.json``, which Grafana
loads through ``grafana/provisioning/``. The committed JSON must equal what this
module generates (tests/test_deploy.py checks it), so edit this file, not the JSON.

Queries read the service's series (``rollout_service/telemetry.py``,
``rollout_service/weights/metrics.py``; labels ``model``, ``engine``) and vLLM's
own (``vllm:*``; labels ``model_name``, ``engine``), all with the ``instance``
label Prometheus adds. vLLM labels its series with its served model name, not the
service's ``model``, so the vLLM panels are filtered by ``$instance``, whose
choices follow ``$model``. The acceptance figures use the definitions of
``rollout_service/telemetry.py``; tests/test_deploy.py evaluates every query
against a real Prometheus scraping the real service.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Panel,
    VariableModel,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).parent / "dashboards" / "rollout.json"
UID = "mtp-rollout"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
WINDOW = "$__rate_interval"
PUSH_WINDOW = "15m"
"""Weight pushes come once per training step, minutes apart: a rate window of a
few scrapes would show mostly gaps. 15m matches the slow-push alert."""


def _sel(*matchers: str, model_label: bool = True) -> str:
    """Label selector for the dashboard's variables plus ``matchers``."""
    base = ['model=~"$model"'] if model_label else []
    return "{" + ", ".join([*base, 'instance=~"$instance"', *matchers]) + "}"


def _rate(metric: str, *matchers: str, window: str = WINDOW) -> str:
    return f"rate({metric}{_sel(*matchers)}[{window}])"


def _ratio(numerator: str, denominator: str, window: str = WINDOW) -> str:
    """``sum(rate(num)) / sum(rate(den))``: ratio of counters, exact across replicas."""
    return f"sum({_rate(numerator, window=window)}) / sum({_rate(denominator, window=window)})"


def _query(ref_id: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref_id).expr(expr).legend_format(legend).range()


def _timeseries(panel_id: int, title: str, description: str, unit: str,
                queries: list[prometheus.Dataquery], *, width: int = 12) -> timeseries.Panel:
    panel = (timeseries.Panel().id(panel_id).title(title).description(description)
             .datasource(DATASOURCE).unit(unit).height(8).span(width)
             .line_width(2).fill_opacity(10).span_nulls(False)
             .legend(common_builders.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).calcs(["lastNotNull", "mean"]))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    for query in queries:
        panel = panel.with_target(query)
    return panel


def _acceptance_panels() -> list[Builder[Panel]]:
    rate_bucket = "rollout_spec_decode_request_accept_rate_bucket"
    return [
        _timeseries(1, "Accept rate: macro vs micro",
                    "Macro: mean of per-request accepted/drafted tokens (every request with "
                    "drafts weighs the same; what a trainer logs). Micro: all accepted / all "
                    "drafted tokens (long answers dominate).", "percentunit", [
                        _query("A", _ratio("rollout_spec_decode_request_accept_rate_sum",
                                           "rollout_spec_decode_request_accept_rate_count"),
                               "macro"),
                        _query("B", _ratio("rollout_spec_decode_accepted_tokens_total",
                                           "rollout_spec_decode_draft_tokens_total"), "micro"),
                    ]).min(0).max(1),
        _timeseries(2, "Accept length: macro vs micro",
                    "Tokens emitted per verify step, bonus token included; 1.0 for a request "
                    "without drafts. Macro: mean over requests with stats. Micro: 1 + all "
                    "accepted tokens / all drafts.", "none", [
                        _query("A", _ratio("rollout_spec_decode_request_accept_length_sum",
                                           "rollout_spec_decode_request_accept_length_count"),
                               "macro"),
                        _query("B", "1 + " + _ratio("rollout_spec_decode_accepted_tokens_total",
                                                    "rollout_spec_decode_drafts_total"),
                               "micro"),
                    ]).min(1),
        _timeseries(3, "Acceptance per draft position",
                    "Share of drafts whose token at this 0-based position was accepted "
                    "(acceptance is a prefix, so it falls with the position).", "percentunit", [
                        _query("A", "sum by (position) ("
                               + _rate("rollout_spec_decode_accepted_per_position_total")
                               + ") / ignoring(position) group_left sum("
                               + _rate("rollout_spec_decode_drafts_total") + ")",
                               "position {{position}}"),
                    ]).min(0).max(1),
        heatmap.Panel().id(4).title("Per-request accept rate")
        .description("How many requests finished with each accept rate (requests with drafts; "
                     "0.05-wide buckets). A bimodal shape means the macro mean hides two "
                     "populations.")
        .datasource(DATASOURCE).height(8).span(12)
        .with_target(prometheus.Dataquery().ref_id("A").range()
                     .expr(f"sum by (le) (increase({rate_bucket}{_sel()}[$__interval]))")
                     .format(PromQueryFormat.HEATMAP).legend_format("{{le}}"))
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .y_axis(heatmap.YAxisConfig().unit("percentunit").decimals(2))
        .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
               .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
               .exponent(0.5).steps(64).fill("dark-orange"))
        .cell_values(heatmap.CellValues().unit("short")).show_tooltip().show_legend(),
        _timeseries(5, "Requests without drafts / without stats",
                    "Without drafts: finished with stats but no drafted token (e.g. "
                    "max_tokens=1); left out of the accept rate, accept length 1. Without "
                    "stats: the engine returned none (misconfiguration; see the alert).",
                    "percentunit", [
                        _query("A", _ratio("rollout_spec_decode_no_spec_requests_total",
                                           "rollout_requests_total"), "without drafts"),
                        _query("B", _ratio("rollout_spec_decode_missing_stats_requests_total",
                                           "rollout_requests_total"), "without stats"),
                    ]).min(0).max(1),
    ]


def _weight_panels() -> list[Builder[Panel]]:
    seconds = "rollout_weight_push_duration_seconds"

    def push_quantile(q: float) -> str:
        return (f"histogram_quantile({q}, sum by (le, instance) "
                f"({_rate(seconds + '_bucket', window=PUSH_WINDOW)}))")

    push_mean = (f"sum by (instance) ({_rate(seconds + '_sum', window=PUSH_WINDOW)}) / "
                 f"sum by (instance) ({_rate(seconds + '_count', window=PUSH_WINDOW)})")

    return [
        _timeseries(11, "Weight version: main vs drafter",
                    "Version served per role and replica; -1 before the first push. A drafter "
                    "behind main drafts for an older model (acceptance drops; alerted).", "none", [
                        _query("A", f"max by (instance, role) (rollout_weight_version{_sel()})",
                               "{{role}} {{instance}}"),
                    ], width=8).decimals(0),
        _timeseries(12, "Weight push duration",
                    f"Pause-to-resume time of completed pushes over {PUSH_WINDOW}: median and "
                    "p95 from the histogram, mean from _sum/_count.", "s", [
                        _query("A", push_quantile(0.5), "p50 {{instance}}"),
                        _query("B", push_quantile(0.95), "p95 {{instance}}"),
                        _query("C", push_mean, "mean {{instance}}"),
                    ], width=8),
        _timeseries(13, "Weight push outcomes",
                    "Pushes per minute by outcome: loaded, or refused before any change "
                    "(rejected), given up (aborted: trainer vanished or cancelled), failed.",
                    "short", [
                        _query("A", "60 * sum by (outcome) ("
                               + _rate("rollout_weight_pushes_total", window=PUSH_WINDOW) + ")",
                               "{{outcome}}"),
                    ], width=8).axis_label("pushes / min"),
    ]


def _serving_panels() -> list[Builder[Panel]]:
    latency = "vllm:e2e_request_latency_seconds_bucket"

    def latency_quantile(q: float) -> str:
        return (f"histogram_quantile({q}, sum by (le, instance) "
                f"(rate({latency}{_sel(model_label=False)}[{WINDOW}])))")

    return [
        _timeseries(21, "Generated tokens/s per instance",
                    "vLLM's vllm:generation_tokens_total; speculative decoding raises it by "
                    "about the accept length at equal batch size.", "short", [
                        _query("A", "sum by (instance) (rate(vllm:generation_tokens_total"
                               f"{_sel(model_label=False)}[{WINDOW}]))", "{{instance}}"),
                    ]).axis_label("tokens / s"),
        _timeseries(22, "End-to-end request latency per instance",
                    "vLLM's vllm:e2e_request_latency_seconds (one engine request = one "
                    "sequence): median and p95.", "s", [
                        _query("A", latency_quantile(0.5), "p50 {{instance}}"),
                        _query("B", latency_quantile(0.95), "p95 {{instance}}"),
                    ]),
    ]


def _variables() -> list[Builder[VariableModel]]:
    def label_variable(name: str, query: str) -> dashboard.QueryVariable:
        return (dashboard.QueryVariable(name).label(name).datasource(DATASOURCE)
                .query({"query": query, "refId": f"{name}-variable"})
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*")
                .current(VariableOption(selected=True, text="All", value="$__all")))

    return [
        dashboard.DatasourceVariable("datasource").label("data source").type("prometheus"),
        label_variable("model", "label_values(rollout_requests_total, model)"),
        label_variable("instance",
                       'label_values(rollout_requests_total{model=~"$model"}, instance)'),
    ]


def build() -> dashboard.Dashboard:
    """The rollout dashboard: acceptance, weight pushes, serving."""
    board = (dashboard.Dashboard("MTP rollout service").uid(UID)
             .description("Speculative-decoding acceptance, weight pushes and serving of the "
                          "MTP rollout service (generated by grafana/dashboards.py).")
             .tags(["rollout", "mtp", "vllm"]).editable().tooltip(DashboardCursorSync.CROSSHAIR)
             .time("now-1h", "now").refresh("30s").timezone("browser"))
    for variable in _variables():
        board = board.with_variable(variable)
    sections = [("Acceptance", _acceptance_panels()), ("Weights", _weight_panels()),
                ("Serving (vLLM)", _serving_panels())]
    for row_id, (title, panels) in enumerate(sections, start=100):
        board = board.with_row(dashboard.Row(title).id(row_id))
        for panel in panels:
            board = board.with_panel(panel)
    return board


def render() -> str:
    """The dashboard as the JSON that Grafana provisions (stable key order)."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
