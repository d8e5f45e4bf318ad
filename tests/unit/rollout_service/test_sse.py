"""Server-sent events: the framing both ways (``protocol/sse.py``) and the OpenAI router's
streams (``api/openai.py``) over a FAKE completions port (no engine)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_service.api.app import create_app
from rollout_service.api.openai import EventStreamResponse
from rollout_service.api.ports import AppState
from rollout_service.config import ServiceConfig
from rollout_service.engines.base import InvalidRequestError
from rollout_service.protocol import openai
from rollout_service.protocol.sse import DONE, DONE_EVENT, encode_event, read_events

API_KEY = "k"


async def lines(*chunks: str) -> AsyncIterator[str]:
    for chunk in chunks:
        for line in chunk.splitlines(keepends=True):
            yield line


async def events(*chunks: str) -> list[str]:
    return [event async for event in read_events(lines(*chunks))]


def test_an_event_is_one_data_line_and_a_blank_one() -> None:
    assert encode_event('{"a": 1}') == b'data: {"a": 1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"
    with pytest.raises(ValueError, match="one line"):
        encode_event('{"a":\n1}')


async def test_read_events_stops_at_done_and_follows_the_sse_rules() -> None:
    stream = ('data: {"a": 1}\n\n'
              ': a comment\n'
              'event: message\nid: 7\ndata:{"b":\ndata: 2}\n\n'
              'data: [DONE]\n\n'
              'data: after\n\n')
    assert await events(stream) == ['{"a": 1}', '{"b":\n2}']
    assert await events('data: x\r\n\r\n', 'data: last') == ["x", "last"]
    assert await events(f"data: {DONE}") == []


def chunk(index: int, text: str, finish_reason: str | None = None) -> openai.CompletionChunk:
    return openai.CompletionChunk(id="cmpl-1", created=1, model="m", choices=[
        openai.CompletionStreamChoice(index=index, text=text, finish_reason=finish_reason)])


class FakeCompletions:
    """FAKE :class:`~rollout_service.api.ports.Completions`: streams ``texts`` as chunks,
    failing with ``failure`` after ``fail_after`` of them; records how each stream ended."""

    def __init__(self, texts: list[str], *, failure: Exception | None = None,
                 fail_after: int = 0, step_s: float = 0.0) -> None:
        self.texts = texts
        self.failure = failure
        self.fail_after = fail_after
        self.step_s = step_s
        self.endings: list[str] = []

    async def complete_stream(self, req: openai.CompletionRequest
                              ) -> AsyncGenerator[openai.CompletionChunk, None]:
        ending = "closed"
        try:
            for i, text in enumerate(self.texts):
                if self.failure is not None and i == self.fail_after:
                    ending = "failed"
                    raise self.failure
                await asyncio.sleep(self.step_s)
                yield chunk(0, text, "length" if i == len(self.texts) - 1 else None)
            ending = "finished"
        finally:
            self.endings.append(ending)


def client_of(completions: FakeCompletions) -> TestClient:
    @asynccontextmanager
    async def state() -> AsyncIterator[AppState]:
        yield AppState(rollouts=None, completions=completions, weights=None,  # type: ignore
                       sequences=None, control=None, metrics=None)  # type: ignore[arg-type]

    app = create_app(ServiceConfig(api_key=API_KEY), open_state=state)
    return TestClient(app, headers={"authorization": f"Bearer {API_KEY}"})


BODY = {"model": "m", "prompt": "1 + 1", "stream": True}


def test_a_stream_is_events_of_chunks_then_done() -> None:
    fake = FakeCompletions([" 2", "!"])
    with client_of(fake) as client:
        response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == f"data: {DONE}"
    data = [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]
    assert [d["choices"][0]["text"] for d in data] == [" 2", "!"]
    assert [d["choices"][0]["finish_reason"] for d in data] == [None, "length"]
    assert fake.endings == ["finished"]


def test_a_refusal_before_the_first_chunk_is_an_error_status() -> None:
    fake = FakeCompletions([" 2"], failure=InvalidRequestError("prompt: too long"))
    with client_of(fake) as client:
        response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"] == {"message": "prompt: too long",
                                        "type": "invalid_request_error", "code": 400}
    assert fake.endings == ["failed"]


def test_a_failure_after_the_first_chunk_is_an_error_event_before_done() -> None:
    fake = FakeCompletions([" 2", "!"], failure=RuntimeError("engine lost"), fail_after=1)
    with client_of(fake) as client:
        response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 200
    blocks = [b.removeprefix("data: ") for b in response.text.split("\n\n") if b]
    assert json.loads(blocks[0])["choices"][0]["text"] == " 2"
    assert json.loads(blocks[1])["error"] == {"message": "RuntimeError: engine lost",
                                              "type": "internal_error", "code": 500}
    assert blocks[2] == DONE


async def test_a_client_gone_mid_stream_closes_the_chunks() -> None:
    """Uvicorn's HTTP protocols speak ASGI 2.3: Starlette listens for the disconnect and
    cancels the sending; the chunks are closed (what aborts the engine requests)."""
    fake = FakeCompletions([f"{i} " for i in range(1000)], step_s=0.01)
    chunks = fake.complete_stream(openai.CompletionRequest.model_validate(BODY))
    response = EventStreamResponse(await anext(chunks), chunks)
    sent: list[dict[str, Any]] = []
    two_sent = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 3:  # the start and two events
            two_sent.set()

    async def receive() -> dict[str, Any]:
        await two_sent.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await asyncio.wait_for(response(scope, receive, send), timeout=10)
    assert fake.endings == ["closed"]
    assert len(sent) < 10
