"""Token-in/token-out requests streamed in the background, for the tests that pause or
abort them (vLLM's dialect: ``/inference/v1/generate``)."""

from __future__ import annotations

import asyncio
import json

import httpx

from rollout_service.protocol.sse import read_events
from tests.support.waiting import first_caught

MODEL = "embedded:tiny"
PROMPT_IDS = [11, 12, 13, 14, 15]
LONG = 1000
"""Tokens of a request that is still running while a test pauses or aborts it (the context
is 1024; the tiny model writes a few hundred tokens a second on two cores)."""


async def num_running(http: httpx.AsyncClient) -> int:
    loads = (await http.get("/v1/loads")).json()["loads"]
    return sum(load["num_running_reqs"] for load in loads)


class Streamed:
    """One token-in/token-out request streamed in the background: ``first`` is set once
    its first tokens arrived (it runs in the engine), ``choice`` is its finished choice."""

    def __init__(self, http: httpx.AsyncClient, request_id: str, max_tokens: int,
                 **sampling: object) -> None:
        self.first = asyncio.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.weight_versions: list[dict] = []
        self._task = asyncio.ensure_future(self._run(http, {
            "request_id": request_id, "token_ids": PROMPT_IDS, "model": MODEL, "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, **sampling}}))

    async def _run(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/inference/v1/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for event in read_events(response.aiter_lines()):
                for choice in json.loads(event)["choices"]:
                    self.token_ids += choice["token_ids"]
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
                    self.weight_versions = choice["weight_versions"] or self.weight_versions
                self.first.set()

    async def started(self) -> Streamed:
        await asyncio.wait_for(self.first.wait(), 60)
        return self

    @property
    def is_done(self) -> bool:
        return self._task.done()

    async def finished(self) -> Streamed:
        await asyncio.wait_for(self._task, 120)
        return self


async def tokens_request(http: httpx.AsyncClient, request_id: str, max_tokens: int,
                         **sampling: object) -> httpx.Response:
    return await http.post("/inference/v1/generate", json={
        "request_id": request_id, "token_ids": PROMPT_IDS, "model": MODEL,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, **sampling}})


async def frozen(http: httpx.AsyncClient, request_id: str, **sampling: object) -> Streamed:
    """A request that a pause in mode keep found unfinished at the client (the service is
    left paused). It may still have finished in the engine just before the pause: each test
    checks its ending and tries again when it shows that (``first_caught``)."""
    async def attempt() -> Streamed | None:
        stream = await Streamed(http, request_id, LONG, **sampling).started()
        await http.post("/pause", params={"mode": "keep"})
        if stream.is_done:   # all generated before the pause came
            await http.post("/resume")
            return None
        return stream

    return await first_caught(attempt, what="the request finished before the pause")
