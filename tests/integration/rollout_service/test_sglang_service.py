"""The whole service (config -> engine -> HTTP API -> metrics) on the SGLang engine.

SGLang cannot serve on these machines, so the engine drives the FAKE SGLang
server of ``fake_sglang`` (a real HTTP server on loopback); see the README for
what has and has not run against a live SGLang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient

from rollout_service.api.app import create_app
from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings, build_sglang_server_args
from rollout_service.tools.launch import free_port
from tests.support.fake_sglang import FakeSGLang

SPEC_ARGS = build_sglang_server_args(MTPSettings(num_speculative_tokens=3), {})


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeSGLang, str]]:
    fake = FakeSGLang("0.5.23", model_path=str(ensure_model("tiny")), speculative=SPEC_ARGS)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake SGLang server did not start"
        time.sleep(0.05)
    yield fake, url
    server.should_exit = True
    thread.join(timeout=10)


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
        assert 'rollout_requests_total{engine="sglang",model="tiny"} 3.0' in metrics
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["engine"] == "sglang"
        bad = client.post("/generate", json={"prompt_token_ids": [1], "temperature": 9})
        assert bad.status_code == 400
