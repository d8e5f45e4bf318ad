"""The OpenAI routes as the official ``openai`` client sees them, on the real service
(vLLM CPU engine, MTP on): models, completions and chat, whole and streamed.

A streamed answer must say what the whole one says (same seed, same text), each
sequence must be counted once in Prometheus either way, and a client that goes away
mid-stream must leave the engine with nothing running.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rollout_service.client import RolloutClient
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import API_KEY, until

PROMPTS = [p for p, _ in arithmetic_prompts(4, seed=5)]
MODEL = "embedded:tiny"
SEQUENCE_COUNTERS = ("rollout_requests_total", "rollout_spec_decode_request_accept_length_count")
"""Each grows by one per finished sequence."""


@pytest.fixture
def oai(service: ServiceProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=API_KEY, max_retries=0)


async def counters(client: RolloutClient) -> dict[str, float]:
    text = await client.metrics_text()
    return {name: sample_sum(text, name) for name in SEQUENCE_COUNTERS}


async def grown(client: RolloutClient, before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in (await counters(client)).items()}


async def test_models_list_names_the_served_model(oai: openai.AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model",
                                                                     "mtp-rollout")]


async def test_streamed_completion_is_the_whole_one_and_counted_once(
        oai: openai.AsyncOpenAI, client: RolloutClient) -> None:
    params = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 24,
              "temperature": 1.0, "seed": 11}
    before = await counters(client)
    whole = await oai.completions.create(**params)
    assert await grown(client, before) == dict.fromkeys(SEQUENCE_COUNTERS, 4)

    before = await counters(client)
    texts = ["", "", "", ""]
    finished, usage = {}, None
    async for chunk in await oai.completions.create(
            **params, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = (choice.finish_reason, choice.model_extra["spec_decode"])
        if chunk.usage is not None:
            usage, acceptance = chunk.usage, chunk.model_extra["acceptance"]
    assert await grown(client, before) == dict.fromkeys(SEQUENCE_COUNTERS, 4)

    assert texts == [c.text for c in whole.choices]
    assert sorted(finished) == [0, 1, 2, 3]
    assert all(reason == "length" and stats["num_drafts"] > 0
               for reason, stats in finished.values())
    assert usage == whole.usage
    assert acceptance["num_sequences"] == 4


async def test_streamed_chat_is_the_whole_chat_and_counted_once(
        oai: openai.AsyncOpenAI, client: RolloutClient) -> None:
    params = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[2]}], "n": 2,
              "max_tokens": 16, "temperature": 0.8, "seed": 3}
    before = await counters(client)
    whole = await oai.chat.completions.create(**params)
    assert await grown(client, before) == dict.fromkeys(SEQUENCE_COUNTERS, 2)
    assert [c.message.role for c in whole.choices] == ["assistant"] * 2
    assert whole.model_extra["acceptance"]["num_sequences"] == 2

    before = await counters(client)
    texts, roles, reasons = ["", ""], {}, {}
    async for chunk in await oai.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            if choice.delta.role is not None:
                assert choice.index not in roles and choice.index not in reasons
                roles[choice.index] = choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
                assert choice.model_extra["spec_decode"]["num_drafts"] > 0
    assert await grown(client, before) == dict.fromkeys(SEQUENCE_COUNTERS, 2)
    assert roles == {0: "assistant", 1: "assistant"} and reasons == {0: "length", 1: "length"}
    assert texts == [c.message.content for c in whole.choices]


async def _num_running(client: RolloutClient) -> float:
    return sample_sum(await client.metrics_text(), "vllm:num_requests_running")


async def test_a_client_gone_mid_stream_leaves_nothing_running(
        service: ServiceProcess, client: RolloutClient) -> None:
    before = await counters(client)
    # Sixteen 900-token choices, not one: the test process was seen held off the CPU for
    # seconds on the 2-core CI machine while the engine ran, and a lone sequence finished
    # before the client's leaving reached the service.
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 900, "n": 16, "stream": True}
    async with httpx.AsyncClient(base_url=service.url, timeout=60,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = response.aiter_lines()
            assert (await anext(events)).startswith("data: {")  # the engine runs them
        # Leaving the block closed the connection mid-stream.
    await until(lambda: _num_running(client), lambda n: n == 0, timeout_s=30)
    assert await grown(client, before) == dict.fromkeys(SEQUENCE_COUNTERS, 0)  # not finished
    assert (await client.health()).status == "ok"


async def test_a_refused_stream_is_an_error_status_before_any_event(
        oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        await oai.completions.create(model=MODEL, prompt=[5, 10**6], stream=True)


async def test_seeded_choices_survive_a_chunked_prefill(oai: openai.AsyncOpenAI) -> None:
    """8 seeded choices of a 300-token prompt exceed one step's 2048 tokens, so a prefill
    is split: vLLM CPU's offset rewind of a seeded generator killed the engine there
    (rollout_service/engines/vllm/patches/cpu_seeded_prefill.py)."""
    prompt = [(7 * i) % 900 + 5 for i in range(300)]
    first, again = await asyncio.gather(*(oai.completions.create(
        model=MODEL, prompt=prompt, n=8, max_tokens=4, temperature=1.0, seed=17)
        for _ in range(2)))
    assert len(first.choices) == 8
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
