"""The rollout service's Prometheus recording rules and alerts, generated from Python.

Runs on a developer's machine or in CI, never in the service: ``python -m
deploy.prometheus.rules`` writes ``deploy/prometheus/rules.yml``, which
``prometheus.yml`` loads. Every expression comes from
``rollout_service/telemetry/queries.py`` and ``alerts.py``; this module names them, and
gives each alert its severity and annotations. The committed YAML must equal what this
module generates (tests/integration/test_deploy_artifacts.py checks it, checks it with
promtool and unit-tests each alert; tests/integration/test_deploy_live.py evaluates
every expression against a real Prometheus), so edit this file, queries.py or
alerts.py, not the YAML.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from rollout_service.telemetry import alerts, queries

OUTPUT = Path(__file__).parent / "rules.yml"
SCOPE = queries.Scope(window="5m", by=("model",))
"""Recording rules: 5m rates per model, summed over replicas."""
RECORDED = {
    f"rollout:spec_decode_{name}:rate{SCOPE.window}": figure(SCOPE) for name, figure in (
        ("macro_accept_rate", queries.macro_accept_rate),
        ("verl_accept_rate", queries.verl_accept_rate),
        ("micro_accept_rate", queries.micro_accept_rate),
        ("macro_accept_length", queries.macro_accept_length),
        ("micro_accept_length", queries.micro_accept_length),
        ("accept_rate_per_position", queries.accept_rate_per_position),
    )
}
"""Recorded series name -> expression."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alert:
    """One alerting rule."""

    name: str
    expr: str
    severity: str
    """``critical`` or ``warning``."""
    summary: str
    description: str
    """Folded into one paragraph in the YAML; Prometheus templates allowed."""
    for_s: str | None = None
    """How long the condition must hold (``5m``); None fires at once."""


ALERTS = (
    Alert(name="RolloutAcceptRateDroppedAfterWeightPush",
          expr=alerts.alert_accept_rate_dropped_after_push(), for_s="2m", severity="critical",
          summary="Drafter acceptance of {{ $labels.model }} halved by a weight push",
          description=(
              "The drafts of {{ $labels.model }} on recently pushed weights are accepted at "
              "the first position {{ $value | humanizePercentage }} of the time, less than "
              "half the best level of the last 15 minutes. A push broke the drafter (zeroed "
              "or mis-converted MTP weights) or left it behind a moving policy: compare "
              "rollout_weight_version by role and GET /weights/checksums; rollouts are "
              "slower but their tokens are unaffected.")),
    Alert(name="RolloutAcceptanceBelowTrainingAccuracy",
          expr=alerts.alert_acceptance_below_training_accuracy(), for_s="2m",
          severity="critical",
          summary="Rollout acceptance of {{ $labels.model }} far below its training accuracy",
          description=(
              "A recent weight version of {{ $labels.model }} has its drafts accepted at the "
              "first position only {{ $value | humanizePercentage }} as often as the "
              "trainer's top-1 accuracy of the MTP head for the same version "
              "(rollout_trainer_mtp_accuracy; the dashboard's drafter panel shows which "
              "version). The two estimate the same quantity on "
              "the same policy's samples: the drafter the engine runs is not the drafter the "
              "trainer trained. Check the trainer's export of the MTP layers (names, the "
              "order of the input projection's halves) and that pushes target both.")),
    Alert(name="RolloutDrafterVersionBehindMain",
          expr=alerts.alert_drafter_behind_main(), for_s="5m", severity="warning",
          summary="MTP drafter of {{ $labels.model }} on {{ $labels.instance }} is behind main",
          description=(
              "On {{ $labels.instance }} the drafter has served a weight version {{ $value }} "
              "behind the main model's for 5m. Drafts then come from an older model and "
              "acceptance falls. Push with target=\"both\" (WeightPusher.push), or check the "
              "trainer's drafter export.")),
    Alert(name="RolloutWeightPushFailed",
          expr=alerts.alert_push_unsuccessful(), severity="warning",
          summary="Weight push {{ $labels.outcome }} on {{ $labels.instance }}",
          description=(
              "{{ $value | humanize }} weight push(es) to {{ $labels.model }} on "
              "{{ $labels.instance }} ended {{ $labels.outcome }} in the last 15m; the replica "
              "keeps serving its previous version. rejected: the trainer announced "
              "names/shapes/dtypes the model does not have; aborted: the trainer vanished or "
              "cancelled mid-push; failed: the engine could not load the weights (see the "
              "service log and GET /weights/status).")),
    Alert(name="RolloutWeightPushSlow",
          expr=alerts.alert_push_slow(), severity="warning",
          summary="Weight pushes on {{ $labels.instance }} take {{ $value | humanizeDuration }}",
          description=(
              "Completed weight pushes to {{ $labels.model }} on {{ $labels.instance }} took "
              "{{ $value | humanizeDuration }} on average over 15m (pause to resume; the "
              "replica generates nothing meanwhile). Check the push's bucket size, shared "
              "memory and the engine's load time.")),
    Alert(name="RolloutSpecDecodeStatsMissing",
          expr=alerts.alert_stats_missing(), for_s="5m", severity="warning",
          summary="Engine on {{ $labels.instance }} returns no spec-decode stats",
          description=(
              "Requests to {{ $labels.model }} on {{ $labels.instance }} finish without "
              "per-request speculative-decoding stats, so acceptance figures leave them out. "
              "The engine likely runs with per_request_spec_decode_metrics=\"none\" or a "
              "version without per-request stats; see the service log's warning.")),
    Alert(name="RolloutSpeculationSlowdown",
          expr=alerts.alert_speculation_slowdown(), for_s="10m", severity="warning",
          summary="Speculation slows {{ $labels.model }} on {{ $labels.instance }} down",
          description=(
              "On {{ $labels.instance }} the estimated net speed-up of speculative decoding "
              "has been {{ $value | humanize }} for 10m: tokens per verify step over the "
              "cost of those steps in plain decode steps (rollout_spec_decode_verify_cost_"
              "total: with the speculation control, at the K each step ran) is below 1, so "
              "decoding without drafts would be faster. Either acceptance fell (see the "
              "acceptance alerts) or the batch is large enough that verifying drafts costs "
              "more than it saves: lower num_speculative_tokens, enable "
              "speculation_control, or turn speculation off for this load.")),
    Alert(name="RolloutServiceDown",
          expr=alerts.alert_service_down(), for_s="2m", severity="critical",
          summary="Rollout service {{ $labels.instance }} is not scraped",
          description=(
              "Prometheus cannot scrape /metrics of {{ $labels.instance }} for 2m: the replica "
              "is down or unreachable, and every other rollout alert is blind to it.")),
)

HEADER = """\
# Recording rules and alerts of the MTP rollout service.
#
# GENERATED by deploy/prometheus/rules.py from rollout_service/telemetry/queries.py and
# alerts.py (`python -m deploy.prometheus.rules`); edit those, not this file. docs/telemetry.md
# defines every figure. Ratios sum numerator and denominator over replicas before
# dividing, so they are exact across replicas.
"""


def _alert(alert: Alert) -> dict[str, object]:
    rule: dict[str, object] = {"alert": alert.name, "expr": alert.expr}
    if alert.for_s is not None:
        rule["for"] = alert.for_s
    rule["labels"] = {"severity": alert.severity}
    rule["annotations"] = {"summary": alert.summary, "description": alert.description}
    return rule


def rule_groups(for_overrides: Mapping[str, str] | None = None) -> dict[str, object]:
    """The rule file's content, as Prometheus reads it.

    Args:
        for_overrides: test-time only: alert name -> the ``for`` duration to use instead
            (``bench/chaos.py`` shortens them so a run of a minute can fire them); the
            expressions are never changed. The committed ``rules.yml`` has none.

    Raises:
        ValueError: an override names no alert.
    """
    overrides = dict(for_overrides or {})
    unknown = set(overrides) - {alert.name for alert in ALERTS}
    if unknown:
        raise ValueError(f"for_overrides: no alert named {sorted(unknown)}")
    alerts = [replace(a, for_s=overrides.get(a.name, a.for_s)) for a in ALERTS]
    return {"groups": [
        {"name": "rollout_spec_decode",
         "rules": [{"record": name, "expr": expr} for name, expr in RECORDED.items()]},
        {"name": "rollout_alerts", "rules": [_alert(alert) for alert in alerts]},
    ]}


WIDTH = 96
_BREAK_BEFORE = {"/", "<", ">", "==", "-", "and", "or", "unless"}


def _expr_lines(expr: str) -> list[str]:
    """``expr`` split before its top-level binary operators (but ``> 0`` stays on its
    line), then wrapped: PromQL ignores the line breaks a folded block adds."""
    lines: list[list[str]] = [[]]
    depth = 0
    words = expr.split(" ")
    for i, word in enumerate(words):
        is_last_a_number = i + 2 == len(words) and words[-1].replace(".", "").isdigit()
        if depth == 0 and word in _BREAK_BEFORE and lines[-1] and not is_last_a_number:
            lines.append([])
        lines[-1].append(word)
        depth += sum(word.count(c) for c in "([{") - sum(word.count(c) for c in ")]}")
    return [part for line in lines for part in _wrap(" ".join(line))]


_KEEP_TOGETHER = re.compile(
    r"\{\{.*?\}\}|\w+ (?:by|on|ignoring) \([^)]*\)|\] offset \w+")
"""Never broken: a template (``{{ $value | humanize }}``), ``sum by (...)``, ``] offset 1h``."""


def _wrap(text: str) -> list[str]:
    protected = _KEEP_TOGETHER.sub(lambda m: m[0].replace(" ", "\0"), text)
    return [line.replace("\0", " ") for line in textwrap.wrap(
        protected, WIDTH - 8, break_long_words=False, break_on_hyphens=False)]


def _block(key: str, lines: list[str], indent: str) -> list[str]:
    """A folded block scalar: its lines join back with single spaces."""
    return [f"{indent}{key}: >-", *(f"{indent}  {line}" for line in lines)]


def _rule_lines(rule: dict[str, object]) -> list[str]:
    (kind, name), *_ = rule.items()
    lines = [f"      - {kind}: {name}", *_block("expr", _expr_lines(str(rule["expr"])), " " * 8)]
    if "for" in rule:
        lines.append(f"        for: {rule['for']}")
    if "labels" in rule:
        lines += ["        labels:", f"          severity: {rule['labels']['severity']}"]
    if "annotations" in rule:
        annotations = rule["annotations"]
        lines += ["        annotations:",
                  f"          summary: {json.dumps(annotations['summary'])}",
                  *_block("description", _wrap(annotations["description"]), " " * 10)]
    return lines


def render(for_overrides: Mapping[str, str] | None = None) -> str:
    """``rules.yml``: :func:`rule_groups` in block style, expressions and descriptions
    as folded blocks (PyYAML's own folding breaks lines at odd places); ``for_overrides``
    as there (test-time only)."""
    lines = [HEADER.rstrip("\n"), "groups:"]
    for i, group in enumerate(rule_groups(for_overrides)["groups"]):
        lines += [""] * (i > 0) + [f"  - name: {group['name']}", "    rules:"]
        for j, rule in enumerate(group["rules"]):
            lines += [""] * ("alert" in rule and j > 0) + _rule_lines(rule)
    return "\n".join(lines) + "\n"


def main() -> None:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
