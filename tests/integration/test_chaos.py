"""Chaos: a broken or stale drafter, or lost stats, in a real RL loop raises its alert from a
real Prometheus running the project's rules, within 60 s or 256 requests; the healthy
control run raises none.

One run of ``bench/chaos.py`` for the module (its own service, on a checkpoint generated
with its own drafter noise, a trainer and a Prometheus; about seven minutes on two cores).
Every case is a test of its own, reading that run's results.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import CASES, CaseResult, ChaosConfig, run_chaos

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CaseResult]:
    config = ChaosConfig(workdir=Path(tmp_path_factory.mktemp("chaos")))
    return {r.case.name: r for r in run_chaos(config)}


def test_healthy_control_raises_no_alert(results: dict[str, CaseResult]) -> None:
    control = results["control"]
    assert control.other_alerts == [], control
    assert control.num_requests >= 64, "the control run must have served traffic"
    assert control.figures["macro accept rate (1m)"] >= 0.5, control.figures


@pytest.mark.parametrize("name", [c.name for c in CASES if c.alert is not None])
def test_fault_raises_its_alert_in_time(results: dict[str, CaseResult], name: str) -> None:
    result = results[name]
    assert result.fired_after_s is not None, result
    assert result.fired_after_s <= 60.0 and result.fired_after_requests <= 256, result
