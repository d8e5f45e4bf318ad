"""Deployment artifacts without a service: Prometheus config and rules, the Grafana dashboard.

Runs in the test process. promtool checks ``deploy/prometheus/`` and unit-tests
each alert's condition on synthetic series; the committed dashboard and rule
file must be what ``deploy/grafana/dashboards.py`` and ``deploy/prometheus/rules.py``
generate; the test-time override changes only the ``for``; the rules alert on every
condition of ``queries``; and every dashboard query uses its variables. Evaluating these
expressions against a real Prometheus is tests/integration/test_deploy_live.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.grafana import dashboards
from deploy.prometheus import rules
from rollout_service.telemetry import alerts
from tests.support.deploy_artifacts import (
    DASHBOARD_JSON,
    PROMETHEUS_YML,
    RULES_YML,
    _alerts,
    _dashboard_exprs,
)


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: run the tests with `make test`, which installs it "
                    "(Debian package 'prometheus')")
    return binary



def test_promtool_accepts_config_and_rules() -> None:
    promtool = _promtool()
    for command in (["check", "config", str(PROMETHEUS_YML)],
                    ["check", "rules", str(RULES_YML)]):
        result = subprocess.run([promtool, *command], check=False, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stdout + result.stderr


SERIES = 'model="{model}", instance="{instance}", job="rollout", engine="vllm"'


def _series(name: str, values: str, model: str = "m", instance: str = "a",
            **extra: str) -> dict[str, str]:
    labels = SERIES.format(model=model, instance=instance)
    labels += "".join(f', {k}="{v}"' for k, v in extra.items())
    return {"series": f"{name}{{{labels}}}", "values": values}


PUSHES = "rollout_weight_pushes_total"
W_DRAFTS = "rollout_spec_decode_weights_drafts"
W_ACCEPTED = "rollout_spec_decode_weights_accepted_per_position"
PUSH_S = "rollout_weight_push_duration_seconds"

def _drop_after_push() -> list[dict[str, str]]:
    """Three models served version 1 (accepted 0.7 at position 0) for 10m, then a push:
    version 1 moves to 'previous' and version 2 is served. m: version 2 accepts 0.1;
    n: 0.5 (less, not halved); o: 0.1, but over 30 drafts only."""
    series = []
    for model, accepted, drafts in (("m", 10, 100), ("n", 50, 100), ("o", 3, 30)):
        series += [
            _series(W_DRAFTS, "100x10 stale", model=model, weights="current", version="1"),
            _series(W_ACCEPTED, "70x10 stale", model=model, weights="current", version="1",
                    position="0"),
            _series(W_DRAFTS, "_x10 100x10", model=model, weights="previous", version="1"),
            _series(W_ACCEPTED, "_x10 70x10", model=model, weights="previous", version="1",
                    position="0"),
            _series(W_DRAFTS, f"_x10 {drafts}x10", model=model, weights="current",
                    version="2"),
            _series(W_ACCEPTED, f"_x10 {accepted}x10", model=model, weights="current",
                    version="2", position="0"),
        ]
    return series


ALERT_CASES: dict[str, tuple[list[dict[str, str]], str, str, str]] = {
    # alert: (input series at 1m steps, eval time, grouping label, the one value firing)
    "RolloutAcceptRateDroppedAfterWeightPush": (_drop_after_push(), "15m", "model", "m"),
    "RolloutAcceptanceBelowTrainingAccuracy": ([
        # m: version 3 accepted 0.2 where the trainer measured 0.8; n: 0.6 vs 0.8;
        # o: 0.1 vs 0.8 over 10 drafts only
        *(_series(W_DRAFTS, f"{d}x10", model=m, weights="previous", version="3")
          for m, d in (("m", 100), ("n", 100), ("o", 10))),
        *(_series(W_ACCEPTED, f"{a}x10", model=m, weights="previous", version="3", position="0")
          for m, a in (("m", 20), ("n", 60), ("o", 1))),
        _series(W_DRAFTS, "100x10", weights="current", version="4"),
        _series(W_ACCEPTED, "20x10", weights="current", version="4", position="0"),
        *(_series("rollout_trainer_mtp_accuracy", "0.8x10", model=m, version="3", position="0")
          for m in "mno"),
    ], "5m", "model", "m"),
    "RolloutDrafterVersionBehindMain": ([
        _series("rollout_weight_version", "3x10", role="main"),
        _series("rollout_weight_version", "2x10", role="draft"),
        _series("rollout_weight_version", "3x10", instance="b", role="main"),
        _series("rollout_weight_version", "3x10", instance="b", role="draft"),
    ], "10m", "instance", "a"),
    "RolloutWeightPushFailed": ([
        _series(PUSHES, "0x10 1x5", outcome="failed"),
        _series(PUSHES, "0+1x15", instance="b", outcome="loaded"),
        _series(PUSHES, "0x15", instance="b", outcome="failed"),
    ], "12m", "instance", "a"),
    "RolloutWeightPushSlow": ([
        _series(f"{PUSH_S}_sum", "0+8x15"),  # one 40 s push every 5m
        _series(f"{PUSH_S}_count", "0+0.2x15"),
        _series(f"{PUSH_S}_sum", "0+1x15", instance="b"),  # 5 s pushes
        _series(f"{PUSH_S}_count", "0+0.2x15", instance="b"),
    ], "15m", "instance", "a"),
    "RolloutSpecDecodeStatsMissing": ([
        _series("rollout_spec_decode_missing_stats_requests_total", "0+1x10"),
        _series("rollout_requests_total", "0+2x10"),
        _series("rollout_spec_decode_missing_stats_requests_total", "0x10", instance="b"),
        _series("rollout_requests_total", "0+2x10", instance="b"),
    ], "10m", "instance", "a"),
    "RolloutSpeculationSlowdown": ([
        # Both engines measured 2 decode steps per verify step at start-up, at K = k_max.
        # a: 1.1 tokens per verify step at 1.3 each (a slow-down); b: the controller runs
        # K = 1, 1.5 tokens per step at its measured 1.2 (pays: 1.25, where the start-up
        # figure made it 0.75); c: no ratio at all (SGLang), no value.
        *(_series(f"rollout_spec_decode_{name}_total", values, instance=instance)
          for instance, series in (
              ("a", (("drafts", "0+4x15"), ("accepted_tokens", "0+0.4x15"),
                     ("costed_drafts", "0+4x15"), ("costed_tokens", "0+4.4x15"),
                     ("verify_cost", "0+5.2x15"))),
              ("b", (("drafts", "0+4x15"), ("accepted_tokens", "0+2x15"),
                     ("costed_drafts", "0+4x15"), ("costed_tokens", "0+6x15"),
                     ("verify_cost", "0+4.8x15"))),
              ("c", (("drafts", "0+4x15"), ("accepted_tokens", "0+0.4x15"),
                     ("costed_drafts", "0x15"), ("costed_tokens", "0x15"),
                     ("verify_cost", "0x15"))))
          for name, values in series),
        *(_series("rollout_spec_decode_verify_cost_ratio", "2x15", instance=i) for i in "ab"),
    ], "10m", "instance", "a"),
    "RolloutServiceDown": ([
        {"series": 'up{job="rollout", instance="a"}', "values": "0x5"},
        {"series": 'up{job="rollout", instance="b"}', "values": "1x5"},
    ], "5m", "instance", "a"),
}


def test_every_alert_is_unit_tested() -> None:
    assert set(ALERT_CASES) == set(_alerts())


def test_alert_conditions_hold_only_when_they_should(tmp_path: Path) -> None:
    """promtool evaluates the rules over synthetic series: each alert's condition
    holds for the one case it is meant for and not for its near misses (the
    ``for`` durations are Prometheus's own logic and are not re-tested)."""
    alerts = _alerts()
    tests = [{
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{
            "expr": f"count by ({label}) ({alerts[name]})",
            "eval_time": eval_time,
            "exp_samples": [{"labels": f'{{{label}="{value}"}}', "value": 1}],
        }],
    } for name, (series, eval_time, label, value) in ALERT_CASES.items()]
    unit = tmp_path / "rules_test.yml"
    unit.write_text(yaml.safe_dump({"rule_files": [str(RULES_YML)],
                                    "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([_promtool(), "test", "rules", str(unit)],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_dashboard_is_generated() -> None:
    assert DASHBOARD_JSON.read_text() == dashboards.render(), (
        "deploy/grafana/dashboards/rollout.json differs from deploy/grafana/dashboards.py: "
        "run `python -m deploy.grafana.dashboards` (never edit the JSON by hand)")


def test_committed_rules_are_generated() -> None:
    assert RULES_YML.read_text() == rules.render(), (
        "deploy/prometheus/rules.yml differs from deploy/prometheus/rules.py: "
        "run `python -m deploy.prometheus.rules` (never edit the YAML by hand)")
    assert yaml.safe_load(RULES_YML.read_text()) == rules.rule_groups()


def test_test_time_override_changes_only_the_waiting() -> None:
    """bench/chaos.py's rules: the committed expressions, another ``for``."""
    overrides = {alert.name: "5s" for alert in rules.ALERTS}
    shortened = yaml.safe_load(rules.render(overrides))["groups"]
    committed = yaml.safe_load(RULES_YML.read_text())["groups"]
    for short, long in zip(shortened, committed, strict=True):
        for a, b in zip(short["rules"], long["rules"], strict=True):
            assert a["expr"] == b["expr"]
            assert a.get("for", "5s") == "5s" and {k: v for k, v in a.items() if k != "for"} \
                == {k: v for k, v in b.items() if k != "for"}
    with pytest.raises(ValueError, match="NoSuchAlert"):
        rules.render({"NoSuchAlert": "1s"})


def test_rules_alert_on_every_condition_of_queries() -> None:
    assert sorted(_alerts().values()) == sorted(alert() for alert in alerts.ALERTS)


def test_dashboard_queries_use_its_variables() -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    for expr in exprs:
        assert 'instance=~"$instance"' in expr, expr
        if "rollout_" in expr:
            assert 'model=~"$model"' in expr, expr
