"""The rollout service's Grafana dashboard, built with grafana-foundation-sdk.

Runs on a developer's machine or in CI, never in the service: ``python -m
deploy.grafana.dashboards`` writes ``deploy/grafana/dashboards/rollout.json``,
which Grafana loads through ``deploy/grafana/provisioning/``. The committed JSON
must equal what this module generates (tests/integration/test_deploy_artifacts.py
checks it), so edit this file, not the JSON.

Every panel query comes from ``rollout_service/telemetry/queries.py``, rendered
with the dashboard's variables: ``$__rate_interval`` and ``{model=~"$model",
instance=~"$instance"}``. vLLM labels its own series (``vllm:*``) with its served
model name, not the service's ``model``, so the vLLM panels are filtered by
``$instance`` only, whose choices follow ``$model``. tests/integration/test_deploy_live.py
evaluates every query against a real Prometheus scraping the real service.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
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

from rollout_service.spec_control import REASONS
from rollout_service.telemetry import alerts, queries

OUTPUT = Path(__file__).parent / "dashboards" / "rollout.json"
UID = "mtp-rollout"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SCOPE = queries.Scope(window="$__rate_interval", model="$model", instance="$instance")
"""The acceptance panels: every selected replica summed."""
PER_INSTANCE = replace(SCOPE, by=("instance",))
PUSHES = replace(PER_INSTANCE, window=alerts.PUSH_WINDOW)
"""Weight pushes come once per training step, minutes apart: a rate window of a
few scrapes would show mostly gaps. The window matches the push alerts'."""


def _query(ref_id: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref_id).expr(expr).legend_format(legend).range()


def _timeseries(panel_id: int, title: str, description: str, unit: str,
                targets: list[prometheus.Dataquery], *, width: int = 12) -> timeseries.Panel:
    panel = (timeseries.Panel().id(panel_id).title(title).description(description)
             .datasource(DATASOURCE).unit(unit).height(8).span(width)
             .line_width(2).fill_opacity(10).span_nulls(False)
             .legend(common_builders.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).calcs(["lastNotNull", "mean"]))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    for target in targets:
        panel = panel.with_target(target)
    return panel


def _acceptance_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(1, "Accept rate: macro vs micro",
                    "Macro: mean of per-request accepted/drafted tokens over the requests "
                    "with drafts (each weighs the same; what a trainer logs); requests without "
                    "drafts have no rate and are left out. verl: the same mean with requests "
                    "without drafts counted as 0 (over every request with stats), as verl "
                    "logs it. Micro: all accepted / all drafted tokens (long answers "
                    "dominate).", "percentunit", [
                        _query("A", queries.macro_accept_rate(SCOPE), "macro"),
                        _query("B", queries.micro_accept_rate(SCOPE), "micro"),
                        _query("C", queries.verl_accept_rate(SCOPE), "macro, verl's convention"),
                    ]).min(0).max(1),
        _timeseries(2, "Accept length: macro vs micro",
                    "Tokens emitted per verify step, bonus token included. Macro: mean over "
                    "every request with stats, a request without drafts counting 1.0 (a wider "
                    "population than the macro accept rate's; verl counts such a request as "
                    "0). Micro: 1 + all accepted tokens / all drafts.", "none", [
                        _query("A", queries.macro_accept_length(SCOPE), "macro"),
                        _query("B", queries.micro_accept_length(SCOPE), "micro"),
                    ]).min(1),
        _timeseries(3, "Acceptance per draft position",
                    "Share of drafts whose token at this 0-based position was accepted "
                    "(acceptance is a prefix, so it falls with the position), over the drafts "
                    "of requests that reported per-position counts.", "percentunit", [
                        _query("A", queries.accept_rate_per_position(SCOPE),
                               "position {{position}}"),
                    ]).min(0).max(1),
        heatmap.Panel().id(4).title("Per-request accept rate")
        .description("How many requests finished with each accept rate (requests with drafts; "
                     "0.05-wide buckets). A bimodal shape means the macro mean hides two "
                     "populations.")
        .datasource(DATASOURCE).height(8).span(12)
        .with_target(prometheus.Dataquery().ref_id("A").range()
                     .expr(queries.accept_rate_distribution(replace(SCOPE, window="$__interval")))
                     .format(PromQueryFormat.HEATMAP).legend_format("{{le}}"))
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .y_axis(heatmap.YAxisConfig().unit("percentunit").decimals(2))
        .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
               .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
               .exponent(0.5).steps(64).fill("dark-orange"))
        .cell_values(heatmap.CellValues().unit("short")).show_tooltip().show_legend(),
        _timeseries(8, "Accept rate per request category",
                    "Macro and micro accept rate of each request category (the request's "
                    "'category' field: the service's allow-list or its first categories, the "
                    "rest 'other', requests without one 'none'). A drafter that fails on one "
                    "task shows here while the overall rate looks fine.", "percentunit", [
                        _query("A", queries.macro_accept_rate_by_category(SCOPE),
                               "macro {{category}}"),
                        _query("B", queries.micro_accept_rate_by_category(SCOPE),
                               "micro {{category}}"),
                    ]).min(0).max(1),
        _timeseries(5, "Requests without drafts / without stats / with invalid stats",
                    "Without drafts: finished with stats but no drafted token (e.g. "
                    "max_tokens=1); left out of the accept rate, accept length 1. Without "
                    "stats: the engine returned none (misconfiguration; see the alert). "
                    "Invalid stats: the engine's counts contradicted themselves (e.g. more "
                    "accepted than drafted tokens); served without stats, left out of every "
                    "figure.", "percentunit", [
                        _query("A", queries.share_without_drafts(SCOPE), "without drafts"),
                        _query("B", queries.share_without_stats(SCOPE), "without stats"),
                        _query("C", queries.share_with_invalid_stats(SCOPE), "invalid stats"),
                    ]).min(0).max(1),
    ]


def _cost_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(6, "Speculation: net speed-up",
                    "Estimated speed-up of decoding with drafts over decoding without: tokens "
                    "per verify step over those steps' cost in plain decode steps. The verify "
                    "cost ratio is the mean cost of a verify step: with the speculation "
                    "control, c(K, B) / c(0, B) from its measured step costs at the K each "
                    "step ran; otherwise the engine's start-up figure at k_max. Below 1, "
                    "speculation is a slow-down (alerted after 10m).",
                    "none", [
                        _query("A", queries.net_speedup(PER_INSTANCE), "net speed-up {{instance}}"),
                        _query("B", queries.verify_cost_ratio(PER_INSTANCE),
                               "verify cost ratio {{instance}}"),
                    ]).min(0),
        _timeseries(7, "Draft tokens: accepted vs rejected",
                    "Drafted tokens per second the target accepted, and those it rejected: "
                    "the rejected ones are work computed and thrown away.", "short", [
                        _query("A", queries.accepted_tokens_per_s(SCOPE), "accepted"),
                        _query("B", queries.rejected_tokens_per_s(SCOPE), "rejected"),
                    ]).axis_label("tokens / s").min(0),
    ]


def _drafter_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(9, "Drafter: rollout acceptance vs training accuracy, by weight version",
                    "Share of drafts accepted per draft position on the weights served now "
                    "(current) and before the last push (previous), each a total over that "
                    "version's sequences, beside the trainer's top-1 accuracy of the MTP head "
                    "on its batch for the same version (depth = position + 1). They estimate "
                    "the same thing: acceptance far below the trainer's accuracy means the "
                    "engine runs another drafter than the trainer trained; acceptance halved "
                    "by a push means the push broke it (both alerted).", "percentunit", [
                        _query("A", queries.acceptance_by_weights(SCOPE),
                               "rollout {{weights}} v{{version}} position {{position}}"),
                        _query("B", queries.trainer_mtp_accuracy(SCOPE),
                               "trainer v{{version}} position {{position}}"),
                    ], width=24).min(0).max(1),
    ]


def _weight_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(11, "Weight version: main vs drafter",
                    "Version served per role and replica; -1 before the first push. A drafter "
                    "behind main drafts for an older model (acceptance drops; alerted).", "none", [
                        _query("A", queries.weight_version(PER_INSTANCE), "{{role}} {{instance}}"),
                    ], width=8).decimals(0),
        _timeseries(12, "Weight push duration",
                    f"Pause-to-resume time of completed pushes over {PUSHES.window}: median and "
                    "p95 from the histogram, mean from _sum/_count.", "s", [
                        _query("A", queries.push_duration_quantile(PUSHES, 0.5),
                               "p50 {{instance}}"),
                        _query("B", queries.push_duration_quantile(PUSHES, 0.95),
                               "p95 {{instance}}"),
                        _query("C", queries.push_duration_mean(PUSHES), "mean {{instance}}"),
                    ], width=8),
        _timeseries(13, "Weight push outcomes",
                    "Pushes per minute by outcome: loaded, or refused before any change "
                    "(rejected), given up (aborted: trainer vanished or cancelled), failed.",
                    "short", [
                        _query("A", queries.push_outcomes_per_minute(replace(PUSHES, by=())),
                               "{{outcome}}"),
                    ], width=8).axis_label("pushes / min"),
    ]


def _speculation_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(31, "Draft tokens K in force per batch-size bucket",
                    "K the engine runs for batch sizes up to each bucket's edge, per replica "
                    "(docs/speculation-control.md). Without the controller: vLLM's fixed K "
                    "everywhere.", "none", [
                        _query("A", queries.speculation_k(PER_INSTANCE),
                               "B <= {{bucket}} {{instance}}"),
                    ], width=8).decimals(0),
        _timeseries(32, "Why each bucket runs its K",
                    f"1 for the reason in force per bucket: {', '.join(REASONS)}.", "none", [
                        _query("A", queries.speculation_reason(replace(SCOPE, by=())),
                               "B <= {{bucket}}: {{reason}}"),
                    ], width=8).decimals(0),
        _timeseries(33, "Drafter acceptance collapsed",
                    "1 while a replica's controller runs K = 0 everywhere because the drafter "
                    "stopped being accepted (stale or broken); a drafter push ends it.",
                    "none", [
                        _query("A", queries.speculation_collapsed(PER_INSTANCE), "{{instance}}"),
                    ], width=8).decimals(0).min(0).max(1),
    ]


def _serving_panels() -> list[Builder[Panel]]:
    return [
        _timeseries(21, "Generated tokens/s per instance",
                    "vLLM's vllm:generation_tokens_total; speculative decoding raises it by "
                    "about the accept length at equal batch size.", "short", [
                        _query("A", queries.generated_tokens_per_s(PER_INSTANCE), "{{instance}}"),
                    ]).axis_label("tokens / s"),
        _timeseries(22, "End-to-end request latency per instance",
                    "vLLM's vllm:e2e_request_latency_seconds (one engine request = one "
                    "sequence): median and p95.", "s", [
                        _query("A", queries.request_latency_quantile(PER_INSTANCE, 0.5),
                               "p50 {{instance}}"),
                        _query("B", queries.request_latency_quantile(PER_INSTANCE, 0.95),
                               "p95 {{instance}}"),
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
        label_variable("model", f"label_values({queries.REQUESTS}, model)"),
        label_variable("instance",
                       f'label_values({queries.REQUESTS}{{model=~"$model"}}, instance)'),
    ]


def build() -> dashboard.Dashboard:
    """The rollout dashboard: acceptance, weight pushes, speculation control, serving."""
    board = (dashboard.Dashboard("MTP rollout service").uid(UID)
             .description("Speculative-decoding acceptance, weight pushes, the K in force and "
                          "serving of the MTP rollout service (generated by "
                          "deploy/grafana/dashboards.py).")
             .tags(["rollout", "mtp", "vllm"]).editable().tooltip(DashboardCursorSync.CROSSHAIR)
             .time("now-1h", "now").refresh("30s").timezone("browser"))
    for variable in _variables():
        board = board.with_variable(variable)
    sections = [("Acceptance", _acceptance_panels()), ("What speculation costs", _cost_panels()),
                ("Drafter health", _drafter_panels()), ("Weights", _weight_panels()),
                ("Speculation control", _speculation_panels()),
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
