"""The Ray Serve app: real Ray, two real vLLM CPU engine replicas, a real Prometheus.

Runs in the test process; ``rollout-service serve-ray`` runs as a child process
(it starts a local Ray with 2 CPUs and deploys the ingress, two engine replicas
and the weights coordinator), exactly as a user starts it. Prometheus finds
the replicas through the ingress's ``GET /metrics/targets`` (the scrape config
``deploy/prometheus/prometheus.yml`` ships). One app for the whole module;
the tests run in order: metrics, pushes, then a replica's engine is killed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import fmean

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.protocol.sse import read_events
from rollout_service.telemetry import queries
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    RAY_REPLICA_OPTIONS,
    WEIGHTS_TOKEN,
    run_prometheus,
    run_ray_service,
)
from trainer_client.push import WeightPusher

NUM_REPLICAS = 2
PROMPTS = [p for p, _ in arithmetic_prompts(12, seed=11)]
CONFIG = {
    "model": "embedded:tiny",
    "mtp": {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
    "api_key": API_KEY,
    "weights_token": WEIGHTS_TOKEN,
    "num_replicas": NUM_REPLICAS,
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 10.0,
    "retry_timeout_s": 60.0,
    "push_ack_timeout_s": 120.0,
    "metrics_host": "127.0.0.1",
    "ray_actor_options": RAY_REPLICA_OPTIONS,
}
MACRO_PARTS = ("rollout_spec_decode_request_accept_rate_sum",
               "rollout_spec_decode_request_accept_rate_count",
               "rollout_spec_decode_accepted_tokens_total",
               "rollout_spec_decode_draft_tokens_total",
               "rollout_spec_decode_request_accept_length_sum",
               "rollout_spec_decode_request_accept_length_count",
               "rollout_spec_decode_drafts_total", "rollout_requests_total")


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


@pytest.fixture(scope="module")
def ray_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """``rollout-service serve-ray`` with two engine replicas, both serving."""
    with run_ray_service(tmp_path_factory.mktemp("ray_service"), CONFIG) as proc:
        yield proc


@pytest.fixture(scope="module")
def ray_prometheus(ray_service: ServiceProcess, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[str]:
    """Prometheus discovering every replica through the ingress (HTTP SD)."""
    scrape = ("  - job_name: rollout\n    http_sd_configs:\n"
              f"      - url: {ray_service.url}/metrics/targets\n        refresh_interval: 1s\n")
    with run_prometheus(tmp_path_factory.mktemp("ray_prometheus"), scrape) as url:
        yield url


@pytest.fixture(scope="module")
def pusher(ray_service: ServiceProcess) -> Iterator[WeightPusher]:
    """One trainer-side pusher for the module: its segment outlives each push, so a
    replica that restarts can replay the last one from it."""
    with WeightPusher(ray_service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024) as p:
        yield p


async def _prom(url: str, query: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=30) as http:
        body = (await http.get(f"{url}/api/v1/query", params={"query": query})).json()
    assert body["status"] == "success", (query, body)
    return body["data"]["result"]


def _direct(url: str) -> dict[str, float]:
    """Each counter summed over every replica's own /metrics, read directly."""
    totals = dict.fromkeys(MACRO_PARTS, 0.0)
    for group in httpx.get(f"{url}/metrics/targets", timeout=30).json():
        text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=30).text
        for name in totals:
            totals[name] += sample_sum(text, name)
    return totals


async def _caught_up(prometheus: str, service_url: str) -> dict[str, float]:
    """Wait until Prometheus's sums over the replicas equal the replicas' own counts."""
    for _ in range(150):
        want = await asyncio.to_thread(_direct, service_url)
        up = await _prom(prometheus, 'up{job="rollout"} == 1')
        got = {n: sum(float(s["value"][1]) for s in await _prom(prometheus, n))
               for n in MACRO_PARTS}
        if len(up) == NUM_REPLICAS and got == want:
            return got
        await asyncio.sleep(0.3)
    raise AssertionError(f"Prometheus never caught up: {got} vs {want}")


def _client(url: str) -> RolloutClient:
    return RolloutClient(url, api_key=API_KEY)


async def test_prometheus_aggregates_both_replicas(ray_service: ServiceProcess,
                                                   ray_prometheus: str) -> None:
    before = await _caught_up(ray_prometheus, ray_service.url)
    short = [messages.GenerateRequest(prompt=p, max_tokens=1, seed=i)  # one token: no draft
             for i, p in enumerate(PROMPTS[:4])]
    long = [messages.GenerateRequest(prompt=p, max_tokens=12 + 6 * (i % 3), seed=i,
                                     ignore_eos=True) for i, p in enumerate(PROMPTS)]
    async with _client(ray_service.url) as client:
        responses = await asyncio.gather(*(client.generate(r) for r in short + long))
    assert {r.replica for r in responses} == {r["replica"] for r in
                                              health(ray_service.url)["replicas"]}, \
        "the mix must reach both replicas"
    after = await _caught_up(ray_prometheus, ray_service.url)
    per_instance = await _prom(ray_prometheus,
                               "increase(rollout_requests_total[5m]) > 0")
    assert len(per_instance) == NUM_REPLICAS
    delta = {n: after[n] - before[n] for n in MACRO_PARTS}
    spec = [o.spec_decode for r in responses for o in r.outputs]
    rates = [s.accept_rate for s in spec if s.accept_rate is not None]
    assert len(rates) < len(spec) and sum(s.num_accepted_tokens for s in spec) > 0
    assert delta["rollout_requests_total"] == len(spec)
    macro = (delta["rollout_spec_decode_request_accept_rate_sum"]
             / delta["rollout_spec_decode_request_accept_rate_count"])
    micro = (delta["rollout_spec_decode_accepted_tokens_total"]
             / delta["rollout_spec_decode_draft_tokens_total"])
    macro_length = (delta["rollout_spec_decode_request_accept_length_sum"]
                    / delta["rollout_spec_decode_request_accept_length_count"])
    assert macro == pytest.approx(fmean(rates), abs=1e-9)
    assert micro == pytest.approx(sum(s.num_accepted_tokens for s in spec)
                                  / sum(s.num_draft_tokens for s in spec), abs=1e-9)
    assert macro_length == pytest.approx(fmean(s.accept_length for s in spec), abs=1e-9)
    # The dashboards' own form over a window, aggregated across both replicas:
    (windowed,) = await _prom(ray_prometheus,
                              queries.micro_accept_rate(queries.Scope(window="10m")))
    assert 0.0 < float(windowed["value"][1]) <= 1.0
    # The ingress's own /metrics: the same counts, every replica's series labelled
    merged = httpx.get(f"{ray_service.url}/metrics", timeout=30).text
    assert {n: sample_sum(merged, n) for n in MACRO_PARTS} == await asyncio.to_thread(
        _direct, ray_service.url)
    assert {r["replica"] for r in health(ray_service.url)["replicas"]} <= {
        s.labels["replica"] for f in text_string_to_metric_families(merged)
        if f.name == "rollout_requests" for s in f.samples}


async def test_bad_requests_are_4xx_with_a_message(ray_service: ServiceProcess) -> None:
    with httpx.Client(base_url=ray_service.url, timeout=60) as http:
        denied = http.post("/generate", json={"prompt": "1 + 1"})
        assert denied.status_code == 401
        bad = http.post("/generate", json={"prompt_token_ids": [1, 10**7]},
                        headers={"authorization": f"Bearer {API_KEY}"})
        assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
        push = http.post("/weights/begin", json={"version": 1},
                         headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"})
        message = push.json()["error"]["message"]
        assert push.status_code == 400 and "params: required by transport 'shm'" in message, \
            message


async def test_every_dialect_reaches_the_replicas_and_control_reaches_all(
        ray_service: ServiceProcess) -> None:
    """vLLM's and SGLang's routes run in the ingress over the replicas; pause, resume and
    abort reach every replica (Ray Serve's ``DeploymentHandle.broadcast``)."""
    auth = {"authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=ray_service.url, timeout=120, headers=auth) as http:
        tokens = await http.post("/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "logprobs": 0}})
        assert tokens.status_code == 200, tokens.text
        assert len(tokens.json()["choices"][0]["logprobs"]["content"]) == 4
        batch = await http.post("/generate", json={
            "text": ["1 + 1 =", "2 + 2 ="], "sampling_params": {"max_new_tokens": 3}})
        assert [len(o["output_ids"]) for o in batch.json()] == [3, 3]
        completion = await http.post("/v1/completions", json={
            "prompt": [5, 6], "max_tokens": 3, "return_token_ids": True})
        assert len(completion.json()["choices"][0]["token_ids"]) == 3

        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        try:
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            loads = (await http.get("/v1/loads")).json()["loads"]
            assert len(loads) == NUM_REPLICAS   # one per replica
        finally:
            assert (await http.post("/resume")).status_code == 200
        assert (await http.get("/is_paused")).json() == {"is_paused": False}

        body = {"request_id": "long", "token_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}
        async with http.stream("POST", "/inference/v1/generate", json=body) as response:
            events = aiter(read_events(response.aiter_lines()))
            await anext(events)   # running on one of the replicas
            aborted = await http.post("/abort_requests", json={"request_ids": ["long"]})
            assert aborted.json()["aborted"] == 1
            reasons = [c["finish_reason"] async for e in events
                       for c in json.loads(e)["choices"]]
        assert reasons[-1] == "abort"


def _checksums(url: str) -> dict[str, dict[str, str]]:
    return httpx.get(f"{url}/weights/checksums", timeout=60,
                     headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"}).json()


async def _versions_by_replica(url: str, num_replicas: int) -> dict[str, set[str]]:
    """Weight versions in responses, by the replica that generated them (all seen)."""
    seen: dict[str, set[str]] = {}
    async with _client(url) as client:
        for i in range(60):
            batch = await asyncio.gather(*(client.generate(messages.GenerateRequest(
                prompt=PROMPTS[(i + j) % len(PROMPTS)], max_tokens=6, seed=j))
                for j in range(4)))
            for response in batch:
                seen.setdefault(response.replica, set()).update(
                    span.version for o in response.outputs for span in o.weight_versions)
            if len(seen) >= num_replicas:
                return seen
    raise AssertionError(f"responses came from {sorted(seen)} only")


async def test_a_push_reaches_both_replicas(ray_service: ServiceProcess,
                                            pusher: WeightPusher) -> None:
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    before = _checksums(ray_service.url)
    assert len(before) == NUM_REPLICAS
    broken = dict(original)
    name = next(iter(broken))
    broken[name] = broken[name][:1].clone()
    with pytest.raises(ServiceError) as rejected:
        await asyncio.to_thread(pusher.push, broken.items(), version=1)
    assert rejected.value.status == 400 and name in rejected.value.message
    assert _checksums(ray_service.url) == before, "a rejected push changed a replica"
    assert {(r["main_version"], r["draft_version"])
            for r in health(ray_service.url)["replicas"]} == {(None, None)}

    version = 1  # the served checkpoint again: versions move, outputs do not
    report = await asyncio.to_thread(pusher.push, original.items(), version=version)
    assert sorted(report.server.replicas) == sorted(before)
    body = health(ray_service.url)
    assert body["status"] == "ok" and body["weights"]["main_version"] == version
    assert {(r["main_version"], r["draft_version"]) for r in body["replicas"]} == \
        {(version, version)}
    seen = await _versions_by_replica(ray_service.url, NUM_REPLICAS)
    assert seen == {replica: {str(version)} for replica in before}
    with pytest.raises(ServiceError) as stale:  # same version again: refused, nothing moves
        await asyncio.to_thread(pusher.push, original.items(), version=version)
    assert stale.value.status == 409 and "not newer" in stale.value.message


def _kill_engine(replica_pid: int) -> list[int]:
    """SIGKILL the vLLM engine-core process(es) under one replica actor."""
    killed = []
    for child in psutil.Process(replica_pid).children(recursive=True):
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
            child.send_signal(signal.SIGKILL)
            killed.append(child.pid)
    return killed


async def test_a_replica_whose_engine_dies_is_replaced_and_catches_up(
        ray_service: ServiceProcess, pusher: WeightPusher) -> None:
    start = health(ray_service.url)
    assert start["status"] == "ok"
    version = start["weights"]["main_version"]
    assert version is not None, "runs after the push test"
    victim = start["replicas"][0]
    assert _kill_engine(victim["pid"]), "no engine-core process under the replica"
    statuses, victim_states = [], set()
    deadline = time.monotonic() + 420
    async with _client(ray_service.url) as client:
        while True:
            response = await client.generate(messages.GenerateRequest(prompt=PROMPTS[0],
                                                                      max_tokens=4))
            assert response.outputs[0].token_ids  # every request succeeds meanwhile
            body = health(ray_service.url)
            statuses.append(body["status"])
            victim_states.update(r["status"] for r in body["replicas"]
                                 if r["replica"] == victim["replica"])
            fresh = [r for r in body["replicas"] if r["replica"] not in
                     {s["replica"] for s in start["replicas"]}]
            if body["status"] == "ok" and fresh and fresh[0]["status"] == "ok":
                break
            assert time.monotonic() < deadline, (
                f"no replacement in time: {body}\n{ray_service.log_tail()}")
            await asyncio.sleep(1.0)
    assert "degraded" in statuses, statuses
    assert victim_states & {"unavailable", "gone"}, victim_states
    replacement = fresh[0]
    assert (replacement["main_version"], replacement["draft_version"]) == (version, version), \
        "the replacement did not replay the last push before serving"
    seen = await _versions_by_replica(ray_service.url, NUM_REPLICAS)
    assert seen.get(replacement["replica"]) == {str(version)}
    assert all(v == {str(version)} for v in seen.values())
