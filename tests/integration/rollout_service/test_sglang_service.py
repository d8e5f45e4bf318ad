"""The whole service (config -> engine -> HTTP API -> metrics) on the SGLang engine.

SGLang cannot serve on these machines, so the engine drives the FAKE SGLang
server of ``fake_sglang`` (a real HTTP server on loopback); see the README for
what has and has not run against a live SGLang. A ``cuda_ipc`` push goes to a fake
that reads each payload without CUDA (``sglang_cuda_ipc_payloads``); the handles are
made-up bytes, no GPU memory is shared.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from rollout_service.api.app import create_app
from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import ByteBufferHandle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.tensors import checkpoint_tensors
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import wait_for
from tests.support.fake_sglang import FakeSGLang
from tests.support.loopback_server import serving
from tests.support.sglang_cuda_ipc_payloads import PayloadReadingFake, stand_in_for_sglang
from tests.support.sglang_on_fake import SPEC_ARGS
from trainer_client.push import layout


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


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


def test_a_cuda_ipc_push_loads_both_models_and_a_refused_one_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's HTTP calls of a staged ``cuda_ipc`` push (``WeightPusher`` needs CUDA);
    the fake reads what SGLang's worker would rebuild and slice."""
    stand_in_for_sglang(monkeypatch)
    fake = PayloadReadingFake("0.5.23", model_path=str(ensure_model("tiny")),
                              speculative=SPEC_ARGS)
    tensors = checkpoint_tensors(fake.model_path)
    offsets, num_bytes = layout([meta.nbytes for meta in tensors.values()])
    staging = ByteBufferHandle(
        gpu_uuid="GPU-00000000-1111-2222-3333-444444444444", shape=[num_bytes], stride=[1],
        storage_offset=0, dtype="uint8", storage_handle=b64(bytes(range(64))),
        storage_size_bytes=num_bytes, storage_offset_bytes=0,
        ref_counter_handle=b64(b"/torch_12_34"), ref_counter_offset=5,
        event_handle=b64(bytes(64)), event_sync_required=True)
    placements = [TensorPlacement(name=name, dtype=meta.dtype, shape=meta.shape,
                                  location=CudaIpcLocation(offset=offset))
                  for (name, meta), offset in zip(tensors.items(), offsets)]
    token = "weights-token"
    with serving(fake.app) as url:
        config = ServiceConfig(model=fake.model_path, engine="sglang", engine_url=url,
                               served_model_name="tiny", weights_transport="cuda_ipc",
                               weights_token=token)
        with TestClient(create_app(config), headers={"authorization": f"Bearer {token}"}
                        ) as client:
            def push(version: int, sent: list[TensorPlacement]) -> httpx.Response:
                begin = client.post("/weights/begin", json=messages.PushBeginRequest(
                    version=version, target="both", transport="cuda_ipc",
                    cuda_ipc_buffer=staging, total_bytes=sum(m.nbytes for m in tensors.values()),
                    params=[messages.ParamSpec(name=n, shape=list(m.shape), dtype=m.dtype)
                            for n, m in tensors.items()]).model_dump(mode="json"))
                assert begin.status_code == 200, begin.text
                push_id = begin.json()["push_id"]
                update = client.post("/weights/update", json=messages.PushUpdateRequest(
                    push_id=push_id, tensors=sent).model_dump(mode="json"))
                if update.status_code != 200:
                    return update
                return client.post("/weights/finish", json={"push_id": push_id})

            first, last = placements[0], placements[-1]
            mixed = [first.model_copy(update={"location": ShmLocation(
                segment="mtp-rollout-push-0123456789ab", offset=0)}), *placements[1:]]
            refused = push(1, mixed)
            assert refused.status_code == 400, refused.text
            assert f"{first.name!r} lies in 'shm', and the push's transport is 'cuda_ipc'" \
                in refused.text
            wrong = [*placements[:-1], last.model_copy(update={"dtype": "float32"})]
            assert push(1, wrong).status_code == 400
            assert fake.loads == [] and "/update_weights_from_tensor" not in fake.routes_called()

            finished = push(1, placements)
            assert finished.status_code == 200, finished.text
            status = client.get("/weights/status").json()
            assert (status["main_version"], status["draft_version"]) == (1, 1)
    # one request for both models: the staging buffer's export is opened once
    assert [(load.selector, load.weight_version) for load in fake.loads] == [("all", "1")]
    for load in fake.loads:
        [payload] = load.payloads  # TP 1
        assert payload["flattened_tensor"].args == staging.to_rebuild_args(staging.gpu_uuid)
        assert [(m.name, tuple(m.shape), str(m.dtype), m.start_idx, m.end_idx) for m in
                payload["metadata"]] == [
            (p.name, p.shape, f"torch.{p.dtype}", p.location.offset,
             p.location.offset + p.nbytes) for p in placements]
