"""Deployment artifacts: Prometheus config and rules, the Grafana dashboard, ``look``.

Runs in the test process. promtool checks ``deploy/prometheus/`` and unit-tests
each alert's condition on synthetic series; the committed dashboard and rule
file must be what ``deploy/grafana/dashboards.py`` and ``deploy/prometheus/rules.py``
generate; and every figure of ``rollout_service/telemetry/queries.py`` (in several
scopes) and every PromQL expression shipped in ``deploy/`` and by ``look`` is
evaluated by the session's real Prometheus (tests/integration/conftest.py)
scraping the real service, after a known mix of requests and one weight push,
so no query names a series the service does not export.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import httpx
import pytest
import yaml
from safetensors.torch import load_file

from deploy.grafana import dashboards
from deploy.prometheus import rules
from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.telemetry import alerts, catalogue, queries
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    WEIGHTS_TOKEN,
    until,
    wait_for,
)
from tests.integration.rollout_service.test_api import (
    _prometheus_caught_up,
    _prometheus_value,
    outputs,
)
from tests.integration.rollout_service.test_weights import next_version
from trainer_client.push import WeightPusher

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES_YML = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD_JSON = ROOT / "deploy" / "grafana" / "dashboards" / "rollout.json"
WINDOW = "1m"
"""What Grafana's ``$__rate_interval`` and ``$__interval`` stand for here."""
DASHBOARD_VARIABLES = {"$__rate_interval": WINDOW, "$__interval": WINDOW,
                       "$model": ".*", "$instance": ".*"}
FIGURE_SCOPES = (
    queries.Scope(window="10m"),
    queries.Scope(window="10m", by=("model",)),
    queries.Scope(window="10m", model=".*", instance=".*", by=("instance",)),
)
"""How ``look``, the rules and the dashboard render figures; 10m holds the mix's push."""
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "and", "or", "unless", "inf", "nan"}
COMPARISON = re.compile(  # a top-level comparison or set operator and its modifiers
    r"(?:==|!=|>=|<=|>|<|\b(?:and|or|unless)\b)(?:\s*bool)?"
    r"(?:\s*\b(?:on|ignoring)\s*\x00+)?(?:\s*\b(?:group_left|group_right)\b(?:\s*\x00+)?)?")
DIVISION = re.compile(
    r"/(?:\s*\b(?:on|ignoring)\s*\x00+)?(?:\s*\b(?:group_left|group_right)\b(?:\s*\x00+)?)?")
PLUS = re.compile(r"\+")


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: run the tests with `make test`, which installs it "
                    "(Debian package 'prometheus')")
    return binary


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_YML.read_text())["groups"]
            for rule in group["rules"]]


def _recorded() -> dict[str, str]:
    return {r["record"]: r["expr"] for r in _rules() if "record" in r}


def _alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for r in _rules() if "alert" in r}


def _dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


def _dashboard_exprs() -> list[str]:
    """Every ``expr`` anywhere in the dashboard (panel targets, annotations)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(_dashboard())
    return found


def _substitute(expr: str) -> str:
    for name in sorted(DASHBOARD_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, DASHBOARD_VARIABLES[name])
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


def _split_top(expr: str, operator: re.Pattern[str]) -> list[str]:
    """Split ``expr`` at ``operator`` outside brackets and strings."""
    flat, depth, quote = [], 0, None
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
            flat.append("\x00")
        elif ch in "\"'`":
            quote = ch
            flat.append("\x00")
        else:
            depth += (ch in "([{") - (ch in ")]}")
            flat.append(ch if depth == 0 and ch not in ")]}" else "\x00")
    parts, start = [], 0
    for match in operator.finditer("".join(flat)):
        parts.append(expr[start:match.start()].strip())
        start = match.end()
    return [*parts, expr[start:].strip()]


def _expand_recorded(expr: str) -> str:
    """Replace recorded series by their expressions (the test Prometheus has no rules)."""
    for name, recorded in _recorded().items():
        expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", f"({recorded})", expr)
    return expr


def _metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(GROUPING, " ", text)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", text)
    return {n for n in names if n not in KEYWORDS}


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


# ---- against the real service and Prometheus -------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Mix:
    """A known mix of requests and a weight push, seen by Prometheus."""

    seqs: list[messages.SequenceOutput]
    version: int
    """The pushed weight version."""
    before: dict[str, dict[str, float]]
    """Instant values of each recording rule's parts before the mix (see ``_parts``)."""
    after: dict[str, dict[str, float]]
    at: float
    """Unix time when Prometheus had scraped everything: queries are evaluated there."""


async def _vector(url: str, query: str, at: float) -> list[dict]:
    async with httpx.AsyncClient(timeout=30) as http:
        body = (await http.get(f"{url}/api/v1/query",
                               params={"query": query, "time": at})).json()
    assert body["status"] == "success", (query, body)
    assert body["data"]["resultType"] == "vector", (query, body)
    return body["data"]["result"]


def _parts(expr: str) -> tuple[float, str, str]:
    """``c + A / B`` (c optional) of a recording rule, counters read instantly."""
    constant, ratio = 0.0, expr
    head, *tail = _split_top(expr, PLUS)
    if tail:
        constant, ratio = float(head), " + ".join(tail)
    numerator, denominator = _split_top(ratio, DIVISION)
    instant = re.compile(r"rate\(\s*([^()\[]+?)\[[^\]]+\]\s*\)")
    return constant, instant.sub(r"\1", numerator), instant.sub(r"\1", denominator)


async def _read_parts(url: str, at: float) -> dict[str, dict[str, float]]:
    """Per rule: numerator series by their ``position`` label (or ""), and "den"."""
    values: dict[str, dict[str, float]] = {}
    for name, expr in _recorded().items():
        _, numerator, denominator = _parts(expr)
        (den,) = await _vector(url, denominator, at)
        values[name] = {"den": float(den["value"][1])}
        for sample in await _vector(url, numerator, at):
            values[name][sample["metric"].get("position", "")] = float(sample["value"][1])
    return values


PROMPTS = [p for p, _ in arithmetic_prompts(8, seed=5)]
VLLM_FINISHED = "vllm:e2e_request_latency_seconds_count"
"""vLLM's own count of finished requests (one per sequence)."""


async def _vllm_scraped(prometheus: str, client: RolloutClient, at_least: float) -> None:
    """Wait until vLLM's own series count ``at_least`` finished requests (they reach its
    logger just after the outputs) and Prometheus has scraped that count."""
    async def finished() -> float:
        return sample_sum(await client.metrics_text(), VLLM_FINISHED)

    count = await until(finished, lambda n: n >= at_least, timeout_s=60)
    await until(lambda: _prometheus_value(prometheus, f"sum({VLLM_FINISHED})"),
                lambda scraped: scraped == count, timeout_s=60, interval_s=0.2)


@pytest.fixture(scope="module")
async def mix(service: ServiceProcess, prometheus: str) -> AsyncIterator[Mix]:
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    async with RolloutClient(service.url, api_key=API_KEY) as client:
        # The weights served before the push draft at least MIN_DRAFTS times, so the
        # drafter-health alerts compare them (their operands have data).
        await asyncio.gather(*(client.generate(messages.GenerateRequest(
            prompt=p, max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)))
        await _prometheus_caught_up(prometheus, client)
        before = await _read_parts(prometheus, time.time())
        num_finished = sample_sum(await client.metrics_text(), VLLM_FINISHED)
        version = next_version(service)
        with WeightPusher(service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024) as pusher:
            # the served checkpoint again: weight series move, outputs do not
            # with the trainer's stats of the weights served before it
            stats = messages.TrainingStats(version=version - 1, mtp_accuracy=[0.7],
                                           num_tokens=100)
            await asyncio.to_thread(pusher.push, original.items(), version=version,
                                    target="both", training_stats=stats)
        short = [messages.GenerateRequest(prompt=p, max_tokens=1, temperature=1.0, seed=i)
                 for i, p in enumerate(PROMPTS[:4])]  # one token: no draft
        long = [messages.GenerateRequest(prompt=p, max_tokens=16 + 8 * (i % 3), temperature=1.0,
                                     seed=i, ignore_eos=True) for i, p in enumerate(PROMPTS)]
        responses = await asyncio.gather(*(client.generate(r) for r in short + long))
        await _prometheus_caught_up(prometheus, client)
        await _vllm_scraped(prometheus, client, num_finished + len(short + long))
        at = time.time()
        yield Mix(seqs=outputs(list(responses)), version=version, before=before,
                  after=await _read_parts(prometheus, at), at=at)


def _expected_figures(seqs: list[messages.SequenceOutput]) -> dict[str, Callable[[str], float]]:
    """Per recording rule, the figure computed from the responses (by position)."""
    spec = [o.spec_decode for o in seqs]
    assert all(s is not None for s in spec)
    rates = [s.accept_rate for s in spec if s.accept_rate is not None]
    num_drafts = sum(s.num_drafts for s in spec)
    num_position_drafts = sum(s.num_drafts for s in spec if s.accepted_per_position)
    accepted = sum(s.num_accepted_tokens for s in spec)
    return {
        "rollout:spec_decode_macro_accept_rate:rate5m": lambda _: fmean(rates),
        "rollout:spec_decode_verl_accept_rate:rate5m":  # no drafts counts 0
            lambda _: fmean(s.accept_rate or 0.0 for s in spec),
        "rollout:spec_decode_micro_accept_rate:rate5m":
            lambda _: accepted / sum(s.num_draft_tokens for s in spec),
        "rollout:spec_decode_macro_accept_length:rate5m":
            lambda _: fmean(s.accept_length for s in spec),
        "rollout:spec_decode_micro_accept_length:rate5m": lambda _: 1 + accepted / num_drafts,
        "rollout:spec_decode_accept_rate_per_position:rate5m":
            lambda position: sum(s.accepted_per_position[int(position)] for s in spec
                                 if s.num_drafts) / num_position_drafts,
    }


async def test_recording_rules_equal_figures_of_the_responses(mix: Mix) -> None:
    spec = [o.spec_decode for o in mix.seqs]
    assert any(s.accept_rate is None for s in spec), "the mix must hold requests without drafts"
    assert any(s.num_accepted_tokens > 0 for s in spec), "the drafter must be accepted sometimes"
    expected = _expected_figures(mix.seqs)
    assert set(expected) == set(_recorded())
    for name, expr in _recorded().items():
        constant = _parts(expr)[0]
        den = mix.after[name]["den"] - mix.before[name]["den"]
        keys = set(mix.after[name]) - {"den"}
        if name.endswith("per_position:rate5m"):
            assert keys == {str(i) for i in range(NUM_SPECULATIVE_TOKENS)}
        for key in keys:
            got = constant + (mix.after[name][key] - mix.before[name].get(key, 0.0)) / den
            assert got == pytest.approx(expected[name](key), abs=1e-6), (name, key)


def _assert_finite(result: list[dict], query: str) -> None:
    assert result, f"empty result for {query}"
    assert all(math.isfinite(float(s["value"][1])) for s in result), (query, result)


async def test_every_dashboard_query_has_data(mix: Mix, prometheus: str) -> None:
    for expr in _dashboard_exprs():
        query = _substitute(expr)
        _assert_finite(await _vector(prometheus, query, mix.at), query)


async def test_dashboard_variables_have_values(mix: Mix, prometheus: str) -> None:
    variables = [v for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} == {"model", "instance"}
    for variable in variables:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = _substitute(match[1]), match[2]
        async with httpx.AsyncClient(timeout=30) as http:
            body = (await http.get(f"{prometheus}/api/v1/label/{label}/values",
                                   params={"match[]": selector})).json()
        assert body["status"] == "success" and body["data"], (variable["name"], body)


async def test_every_figure_has_data_in_every_scope(mix: Mix, prometheus: str) -> None:
    """Every figure of ``queries.py``, whichever consumer renders it, has finite data."""
    for figure in catalogue.FIGURES:
        for scope in FIGURE_SCOPES:
            query = figure.query(scope)
            _assert_finite(await _vector(prometheus, query, mix.at), query)


async def test_every_recording_rule_has_data(mix: Mix, prometheus: str) -> None:
    for expr in _recorded().values():
        _assert_finite(await _vector(prometheus, expr, mix.at), expr)


async def test_every_alert_runs_and_its_operands_have_data(mix: Mix, prometheus: str) -> None:
    """Alert conditions are normally empty: each side of each comparison must run
    and hold data (a look-back ``offset`` is dropped: the service is younger)."""
    for name, expr in _alerts().items():
        expanded = _expand_recorded(expr)
        await _vector(prometheus, expanded, mix.at)  # parses and runs
        for operand in _split_top(expanded, COMPARISON):
            if re.fullmatch(r"[\d.]+", operand):
                continue
            query = re.sub(r"\s+offset\s+\w+", "", operand)
            # A subquery is evaluated at multiples of its resolution: the last one at or
            # before mix.at may predate the data; the next one sees it.
            step = re.search(r"\[\w+:(\d+)s\]", query)
            at = mix.at + (int(step[1]) if step else 0)
            assert await _vector(prometheus, query, at), (name, query)


async def test_every_referenced_series_exists(mix: Mix, prometheus: str) -> None:
    recorded = _recorded()
    figures = [f.query(scope) for f in catalogue.FIGURES for scope in FIGURE_SCOPES]
    exprs = [*_dashboard_exprs(), *recorded.values(), *_alerts().values(), *figures]
    names = set().union(*(_metric_names(e) for e in exprs))
    assert "vllm:e2e_request_latency_seconds_bucket" in names and "up" in names
    for name in sorted(names - set(recorded)):
        assert await _vector(prometheus, name, mix.at), f"no series {name}"


async def test_push_moved_the_weight_series(mix: Mix, prometheus: str) -> None:
    versions = await _vector(prometheus, "rollout_weight_version", mix.at)
    assert {s["metric"]["role"]: float(s["value"][1]) for s in versions} == \
        {"main": mix.version, "draft": mix.version}
    (loaded,) = await _vector(prometheus, queries.loaded_pushes(FIGURE_SCOPES[0]), mix.at)
    assert float(loaded["value"][1]) > 0, "the push must count as loaded"


def test_look_renders_the_key_panels_from_prometheus(service: ServiceProcess, prometheus: str,
                                                     tmp_path: Path) -> None:
    """`rollout-service look`: real Prometheus data into one PNG, every panel non-empty."""
    from PIL import Image

    from rollout_service.tools.look import PANELS, render_look

    def scraped(query: str) -> list[dict]:
        return httpx.get(f"{prometheus}/api/v1/query",
                         params={"query": query}).json()["data"]["result"]

    def value(query: str) -> float | None:
        result = scraped(query)
        return float(result[0]["value"][1]) if result else None

    # A scrape before the traffic, so rate() sees it change.
    wait_for(lambda: scraped("rollout_requests_total"), bool, timeout_s=60, interval_s=0.5)
    # A push carrying the trainer's accuracy (the served checkpoint again: outputs stay).
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    version = next_version(service)
    with WeightPusher(service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024) as pusher:
        pusher.push(original.items(), version=version, target="both",
                    training_stats=messages.TrainingStats(version=version - 1,
                                                          mtp_accuracy=[0.6], num_tokens=50))
    with httpx.Client(base_url=service.url, timeout=120,
                      headers={"authorization": f"Bearer {API_KEY}"}) as http:
        before = sample_sum(http.get("/metrics").text, VLLM_FINISHED)
        for i in range(4):  # traffic inside the rate window, whatever ran before
            assert http.post("/generate", json={"prompt_token_ids": [7 + i, 3], "seed": i,
                                                "max_tokens": 24}).status_code == 200
        # Every panel's series scraped after the traffic: the service's own counters, and
        # vLLM's once its logger has counted the four requests.
        page = wait_for(lambda: http.get("/metrics").text,
                        lambda text: sample_sum(text, VLLM_FINISHED) >= before + 4, timeout_s=60)
    for name in ("rollout_requests_total", VLLM_FINISHED, "rollout_trainer_mtp_accuracy"):
        want = sample_sum(page, name)
        wait_for(lambda: value(f"sum({name})"), lambda got: got == want, timeout_s=60)
    out = tmp_path / "look.png"
    data = render_look(prometheus, out, minutes=5, step_s=1, window="1m")
    assert set(data) == {p.title for p in PANELS}
    assert set(data[PANELS[2].title]) == {"main", "draft"}
    for title, series in data.items():
        for name, points in series.items():
            assert points, f"{title}: {name} has no data"
    macro = data[PANELS[0].title]["macro"]
    assert all(0.0 <= v <= 1.0 for _, v in macro)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.height >= 3 * 450


# ---- Ray Serve: deploy/serve.yaml and the KubeRay RayService -----------------------------

SERVE_YAML = ROOT / "deploy" / "serve.yaml"
RAYSERVICE_YAML = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


def test_serve_yaml_args_are_a_valid_app_config() -> None:
    from rollout_service.serve.config import parse_serve_config

    serve_config = yaml.safe_load(SERVE_YAML.read_text())
    (application,) = serve_config["applications"]
    assert application["import_path"] == "rollout_service.serve.app:app_builder"
    config = parse_serve_config(application["args"])
    assert config.mode == "rl" and config.autoscaling_config is None
    assert config.num_replicas >= 2


def test_rayservice_runs_the_same_serve_config() -> None:
    """The RayService's serveConfigV2 is deploy/serve.yaml (comments aside), and
    Prometheus discovers replicas through the serve service KubeRay creates for it."""
    rayservice = yaml.safe_load(RAYSERVICE_YAML.read_text())
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == \
        yaml.safe_load(SERVE_YAML.read_text())
    name = rayservice["metadata"]["name"]
    (job,) = [j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
              if j["job_name"] == "rollout"]
    port = yaml.safe_load(SERVE_YAML.read_text())["http_options"]["port"]
    assert job["http_sd_configs"][0]["url"] == \
        f"http://{name}-serve-svc:{port}/metrics/targets"
