"""OpenAI completions and chat over the service (``completions.py``), whole and streamed,
on a FAKE streaming engine: the chunk order, the telemetry of each finished sequence
(once), a refusal before the first chunk, and closing a stream mid-way.

The engine is a FAKE because the point is the service's bookkeeping around any engine;
the real engine's streams are tests/integration/rollout_service/test_openai.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rollout_service.completions import OpenAICompletions
from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from rollout_service.engines.base import (
    ChatTurn,
    EngineInfo,
    GenerationDelta,
    GenerationResult,
    InvalidRequestError,
    SamplingOptions,
)
from rollout_service.engines.chat import NO_TEMPLATE
from rollout_service.local import build_local_service
from rollout_service.protocol import openai
from rollout_service.protocol.acceptance import SpecDecodeStats

INFO = EngineInfo(model="tiny", engine="vllm", model_path=str(Path(ensure_model("tiny"))),
                  max_model_len=64, vocab_size=1024, num_speculative_tokens=2,
                  speculative_method="mtp", has_pushable_drafter=True)
STATS = SpecDecodeStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=1,
                        num_verify_steps=2, accepted_per_position=(1, 0))
LABELS = {"model": "tiny", "engine": "vllm", "category": "none"}


class FakeStreamingEngine:
    """FAKE engine: a sequence is the letters after its seed (``max_tokens`` of them), one
    delta per token; a prompt ``"bad"`` is refused. Records how every stream ended."""

    def __init__(self, info: EngineInfo = INFO, *, step_s: float = 0.0,
                 has_template: bool = True) -> None:
        self.info = info
        self.step_s = step_s
        self.has_template = has_template
        self.endings: dict[str, str] = {}
        self.chat_turns: list[ChatTurn] = []

    def _result(self, prompt: str | list[int], sampling: SamplingOptions) -> GenerationResult:
        if prompt == "bad":
            raise InvalidRequestError("prompt: refused")
        start = sampling.seed or 0
        ids = tuple((start + i) % 26 for i in range(sampling.max_tokens))
        return GenerationResult(
            prompt_token_ids=(1, 2, 3) if isinstance(prompt, str) else tuple(prompt),
            token_ids=ids, text="".join(chr(97 + t) for t in ids), finish_reason="length",
            logprobs=None, weight_versions=(), spec_decode=STATS)

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        return self._result(prompt, sampling)

    async def stream(self, prompt: str | list[int], sampling: SamplingOptions,
                     request_id: str) -> AsyncIterator[GenerationDelta]:
        self.endings[request_id] = "aborted"
        try:
            result = self._result(prompt, sampling)
        except InvalidRequestError:
            self.endings[request_id] = "refused"
            raise
        for i, token in enumerate(result.token_ids):
            await asyncio.sleep(self.step_s)
            is_last = i == len(result.token_ids) - 1
            yield GenerationDelta(text=result.text[i], token_ids=(token,),
                                  result=result if is_last else None)
        self.endings[request_id] = "finished"

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        if not self.has_template:
            raise InvalidRequestError(NO_TEMPLATE)
        self.chat_turns = list(turns)
        return [7] * (4 * len(turns))


def completions_on(engine: FakeStreamingEngine) -> tuple[OpenAICompletions, CollectorRegistry]:
    service, registry = build_local_service(engine, ServiceConfig())  # type: ignore[arg-type]
    return OpenAICompletions(service), registry


def num_finished(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("rollout_requests_total", LABELS)


def completion(**fields: object) -> openai.CompletionRequest:
    return openai.CompletionRequest.model_validate({"model": "tiny", **fields})


async def test_a_stream_says_what_the_whole_answer_says_and_counts_each_sequence_once() -> None:
    completions, registry = completions_on(FakeStreamingEngine())
    req = completion(prompt=["1 +", "2 +"], n=2, max_tokens=5, seed=3,
                     stream_options={"include_usage": True})
    whole = await completions.complete(req)
    assert num_finished(registry) == 4
    texts, finished, last = ["", "", "", ""], {}, None
    async for chunk in completions.complete_stream(req):
        assert chunk.id.startswith("cmpl-") and chunk.model == "tiny"
        for choice in chunk.choices:
            assert choice.index not in finished, "nothing after a choice's final chunk"
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.spec_decode
        last = chunk
    assert num_finished(registry) == 8
    assert texts == [c.text for c in whole.choices] == ["defgh", "efghi"] * 2
    assert sorted(finished) == [0, 1, 2, 3]
    assert all(spec.num_drafts == 2 for spec in finished.values())
    assert last.choices == [] and last.usage == whole.usage and last.acceptance == whole.acceptance
    assert whole.usage.prompt_tokens == 6  # each prompt once


async def test_without_include_usage_no_usage_chunk() -> None:
    completions, _ = completions_on(FakeStreamingEngine())
    chunks = [c async for c in completions.complete_stream(completion(prompt="1", max_tokens=2))]
    assert [c.choices[0].text for c in chunks] == ["a", "b"]
    assert all(c.usage is None and c.acceptance is None for c in chunks)


async def test_a_refusal_raises_before_the_first_chunk_and_aborts_the_rest() -> None:
    engine = FakeStreamingEngine(step_s=0.01)
    completions, registry = completions_on(engine)
    chunks = completions.complete_stream(completion(prompt=["1 +", "bad"], n=2, max_tokens=50))
    with pytest.raises(InvalidRequestError, match="refused"):
        await anext(chunks)
    assert sorted(engine.endings.values()) == ["aborted", "aborted", "refused", "refused"]
    assert num_finished(registry) == 0


async def test_closing_a_stream_aborts_every_sequence_still_running() -> None:
    engine = FakeStreamingEngine(step_s=0.01)
    completions, registry = completions_on(engine)
    chunks = completions.complete_stream(completion(prompt="1 +", n=3, max_tokens=500))
    first = await anext(chunks)
    assert first.choices[0].text
    await chunks.aclose()
    assert list(engine.endings.values()) == ["aborted"] * 3
    assert num_finished(registry) == 0


async def test_chat_streams_the_role_first_then_the_text() -> None:
    engine = FakeStreamingEngine()
    completions, registry = completions_on(engine)
    req = openai.ChatCompletionRequest.model_validate({
        "model": "tiny", "n": 2, "max_completion_tokens": 3, "seed": 1,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "1 + 1"}]}]})
    chunks = [c async for c in completions.chat_stream(req)]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    texts = ["", ""]
    for c in chunks[2:]:
        assert c.choices[0].delta.role is None
        texts[c.choices[0].index] += c.choices[0].delta.content
    whole = await completions.chat(req)
    assert texts == [c.message.content for c in whole.choices] == ["bcd", "cde"]
    assert engine.chat_turns == [ChatTurn(role="system", content="be brief"),
                                 ChatTurn(role="user", content="1 + 1")]
    assert num_finished(registry) == 4


async def test_chat_without_max_tokens_fills_the_context() -> None:
    completions, _ = completions_on(FakeStreamingEngine(replace(INFO, max_model_len=40)))
    whole = await completions.chat(openai.ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}))
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 36


async def test_chat_on_a_checkpoint_without_a_template_names_the_field() -> None:
    completions, _ = completions_on(FakeStreamingEngine(has_template=False))
    req = openai.ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(InvalidRequestError, match="^messages: .*chat template"):
        await completions.chat(req)
    with pytest.raises(InvalidRequestError, match="^messages: "):
        await anext(completions.chat_stream(req))
