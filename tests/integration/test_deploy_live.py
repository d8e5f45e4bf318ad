"""Deployment artifacts against the real service and Prometheus, and ``look``.

Runs in the test process. Every figure of ``rollout_service/telemetry/queries.py`` (in
several scopes) and every PromQL expression shipped in ``deploy/`` (recording rules,
alerts, the Grafana dashboard and its variables) and by ``look`` is evaluated by the
session's real Prometheus (tests/integration/conftest.py) scraping the real service,
after a known mix of requests and one weight push (the module-scoped ``mix``), so no
query names a series the service does not export; the recording rules equal the
figures computed from the responses. Every test that needs the service or Prometheus
lives here, so the mix runs once.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import httpx
import pytest
from safetensors.torch import load_file

from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.telemetry import catalogue, queries
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
from tests.integration.rollout_service.weights_support import next_version
from tests.support.deploy_artifacts import (
    COMPARISON,
    DIVISION,
    PLUS,
    _alerts,
    _dashboard,
    _dashboard_exprs,
    _expand_recorded,
    _metric_names,
    _recorded,
    _split_top,
    _substitute,
)
from trainer_client.push import WeightPusher

FIGURE_SCOPES = (
    queries.Scope(window="10m"),
    queries.Scope(window="10m", by=("model",)),
    queries.Scope(window="10m", model=".*", instance=".*", by=("instance",)),
)
"""How ``look``, the rules and the dashboard render figures; 10m holds the mix's push."""


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
