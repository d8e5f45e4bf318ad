"""The whole service (config -> engine -> HTTP API -> metrics) on the SGLang engine.

SGLang cannot serve on these machines, so the engine drives the FAKE SGLang
server of ``fake_sglang`` (a real HTTP server on loopback); see the README for
what has and has not run against a live SGLang.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollout_service.api.app import create_app
from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings, build_sglang_server_args
from rollout_service.tools.launch import free_port
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import wait_for
from tests.support.fake_sglang import FakeSGLang

SPEC_ARGS = build_sglang_server_args(MTPSettings(num_speculative_tokens=3), {})


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` under uvicorn on loopback, in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeSGLang, str]]:
    fake = FakeSGLang("0.5.23", model_path=str(ensure_model("tiny")), speculative=SPEC_ARGS)
    with serving(fake.app) as url:
        yield fake, url


def test_service_serves_and_exports_on_sglang(fake_server: tuple[FakeSGLang, str]) -> None:
    fake, url = fake_server
    config = ServiceConfig(model=fake.model_path, engine="sglang", engine_url=url,
                           served_model_name="tiny")
    with TestClient(create_app(config)) as client:
        response = client.post("/generate", json={"prompt_token_ids": [1, 2, 3], "n": 3,
                                                  "max_tokens": 12, "temperature": 0.0})
        assert response.status_code == 200, response.text
        body = response.json()
        stats = [o["spec_decode"] for o in body["outputs"]]
        assert all(s is not None and s["num_verify_steps"] > 0 for s in stats)
        assert body["acceptance"]["num_sequences"] == 3
        assert "/generate" in fake.routes_called()
        metrics = client.get("/metrics").text
        assert 'rollout_requests_total{category="none",engine="sglang",model="tiny"} 3.0' in metrics
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["engine"] == "sglang"
        bad = client.post("/generate", json={"prompt_token_ids": [1], "temperature": 9})
        assert bad.status_code == 400


def test_streams_and_chat_through_the_service_on_sglang(
        fake_server: tuple[FakeSGLang, str]) -> None:
    fake, url = fake_server
    config = ServiceConfig(model=fake.model_path, engine="sglang", engine_url=url,
                           served_model_name="tiny")
    with serving(create_app(config)) as service_url:
        oai = openai.OpenAI(base_url=f"{service_url}/v1", api_key="none", max_retries=0)
        params = {"model": "tiny", "prompt": [[1, 2, 3]], "n": 2, "max_tokens": 9}
        whole = oai.completions.create(**params)
        requests = sample_sum(httpx.get(f"{service_url}/metrics").text, "rollout_requests_total")
        texts = ["", ""]
        for chunk in oai.completions.create(**params, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text for c in whole.choices]
        metrics = httpx.get(f"{service_url}/metrics").text
        assert sample_sum(metrics, "rollout_requests_total") == requests + 2

        chat = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True) if c.choices)
        assert len(chat) == 4

        fake.stream_step_s = 0.05
        with httpx.stream("POST", f"{service_url}/v1/completions", json={
                **params, "n": 1, "max_tokens": 200, "stream": True}) as response:
            assert next(response.iter_lines()).startswith("data: {")
        wait_for(lambda: (fake.num_streaming, len(fake.aborted)), lambda s: s == (0, 1),
                 timeout_s=30)


async def test_more_requests_run_at_once_than_an_http_pool_of_100_holds(
        fake_server: tuple[FakeSGLang, str]) -> None:
    """150 requests at once all reach SGLang together. httpx's default pool (100
    connections) held the service at 100 running requests on a live SGLang (H200); here the
    fake holds every request until 150 run at once, which a capped pool never reaches."""
    fake, url = fake_server
    fake.hold_until_running = 150
    config = ServiceConfig(model=fake.model_path, engine="sglang", engine_url=url,
                           served_model_name="tiny")
    with serving(create_app(config)) as service_url:
        async with httpx.AsyncClient(base_url=service_url, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as http:
            responses = await asyncio.gather(*(
                http.post("/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 4})
                for _ in range(fake.hold_until_running)))
    assert [r.status_code for r in responses] == [200] * fake.hold_until_running
    assert fake.max_running == fake.hold_until_running


def test_chat_on_a_checkpoint_without_a_template_is_400(tmp_path: Path) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(ensure_model("tiny"), model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    fake = FakeSGLang("0.5.23", model_path=str(model), speculative=SPEC_ARGS)
    with serving(fake.app) as url:
        config = ServiceConfig(model=str(model), engine="sglang", engine_url=url)
        with TestClient(create_app(config)) as client:
            response = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages: the served checkpoint "
                                                          "has no chat template")
