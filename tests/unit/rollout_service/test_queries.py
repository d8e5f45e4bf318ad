"""The PromQL of ``telemetry/queries.py``: its rendering, the series it reads, the docs table.

Evaluation against a real Prometheus is in ``tests/integration/test_deploy_live.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rollout_service.protocol.messages import TrainingStats
from rollout_service.telemetry import alerts, catalogue, queries
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.telemetry.drafter import DrafterHealth
from rollout_service.telemetry.speculation import SpeculationMetrics
from rollout_service.telemetry.weights import WeightMetrics

DOCS = Path(__file__).resolve().parents[3] / "docs" / "telemetry.md"
RULES = queries.Scope(window="5m", by=("model",))
DASHBOARD = queries.Scope(window="$__rate_interval", model="$model", instance="$instance")


def _every_expression() -> list[str]:
    scopes = (catalogue.DOCS_SCOPE, RULES, DASHBOARD)
    return [*(f.query(s) for f in catalogue.FIGURES for s in scopes),
            *(alert() for alert in alerts.ALERTS)]


def test_ratio_sums_numerator_and_denominator_before_dividing() -> None:
    assert queries.micro_accept_rate(RULES) == (
        "sum by (model) (rate(rollout_spec_decode_accepted_tokens_total[5m]))"
        " / sum by (model) (rate(rollout_spec_decode_draft_tokens_total[5m]))")
    assert queries.macro_accept_rate(queries.Scope(window="1m")) == (
        "sum(rate(rollout_spec_decode_request_accept_rate_sum[1m]))"
        " / sum(rate(rollout_spec_decode_request_accept_rate_count[1m]))")


def test_per_position_keeps_position_on_top_of_the_scope() -> None:
    # The denominator: drafts of the requests that reported per-position counts.
    assert queries.accept_rate_per_position(RULES) == (
        "sum by (model, position) (rate(rollout_spec_decode_accepted_per_position_total[5m]))"
        " / ignoring (position) group_left sum by (model) "
        "(rate(rollout_spec_decode_drafts_with_positions_total[5m]))")


def test_verl_accept_rate_divides_by_every_request_with_stats() -> None:
    assert queries.verl_accept_rate(RULES) == (
        "sum by (model) (rate(rollout_spec_decode_request_accept_rate_sum[5m]))"
        " / sum by (model) (rate(rollout_spec_decode_request_accept_length_count[5m]))")


def test_the_net_speedup_prices_each_verify_step_at_its_own_ratio() -> None:
    """Counters of verify steps weighed by their sequence's ratio (the K it ran), never the
    start-up gauge measured at k_max: the slow-down alert reads the same."""
    assert queries.net_speedup(RULES) == (
        "sum by (model) (rate(rollout_spec_decode_costed_tokens_total[5m]))"
        " / sum by (model) (rate(rollout_spec_decode_verify_cost_total[5m]))")
    assert queries.verify_cost_ratio(RULES) == (
        "sum by (model) (rate(rollout_spec_decode_verify_cost_total[5m]))"
        " / sum by (model) (rate(rollout_spec_decode_costed_drafts_total[5m]))")
    assert "verify_cost_ratio" not in alerts.alert_speculation_slowdown()


def test_dashboard_matchers_select_model_only_on_the_service_series() -> None:
    selector = '{model=~"$model", instance=~"$instance"}'
    assert f"rollout_requests_total{selector}[$__rate_interval]" in \
        queries.share_without_drafts(DASHBOARD)
    latency = queries.request_latency_quantile(DASHBOARD, 0.5)
    assert 'vllm:e2e_request_latency_seconds_bucket{instance=~"$instance"}' in latency
    assert "model" not in latency


def test_offset_applies_to_every_range() -> None:
    expr = queries.macro_accept_rate(queries.Scope(window="5m", offset="1h"))
    assert expr.count("[5m] offset 1h") == 2


def test_every_rollout_series_read_is_exported() -> None:
    registry = CollectorRegistry()
    SpecDecodeMetrics(registry=registry, model="m", engine="vllm", num_speculative_tokens=2,
                      verify_cost_ratio=1.5)
    WeightMetrics(registry=registry, model="m", engine="vllm")
    drafter = DrafterHealth(registry=registry, model="m", engine="vllm",
                            num_speculative_tokens=2)
    drafter.loaded(1, TrainingStats(version=0, mtp_accuracy=[0.5], num_tokens=1))
    SpeculationMetrics(registry=registry, model="m", engine="vllm", buckets=[1, 8],
                       reasons=["pinned"])
    exported = {sample.name for family in registry.collect() for sample in family.samples}
    read = {name for expr in _every_expression()
            for name in re.findall(r"\brollout_\w+", expr)}
    assert read and read <= exported, read - exported


def test_every_figure_has_a_meaning_and_a_unit() -> None:
    for figure in catalogue.FIGURES:
        assert figure.meaning and figure.unit, figure.name
    assert len({f.name for f in catalogue.FIGURES}) == len(catalogue.FIGURES)


def test_docs_table_is_generated() -> None:
    text = DOCS.read_text()
    assert text == catalogue.replace_table(text), (
        "the PromQL table in docs/telemetry.md differs from queries.py: run "
        "`python -m rollout_service.telemetry.queries docs/telemetry.md`")


def test_docs_table_escapes_pipes() -> None:
    row = next(line for line in catalogue.markdown_table().splitlines()
               if line.startswith("| unsuccessful pushes"))
    assert row.count("|") - row.count("\\|") == 5  # four cells


def test_replace_table_refuses_text_without_markers() -> None:
    with pytest.raises(ValueError, match="PromQL table"):
        catalogue.replace_table("# no table here\n")
