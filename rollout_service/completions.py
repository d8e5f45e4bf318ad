"""OpenAI's completions and chat over the rollout service, whole or streamed.

Runs in the rollout service process (standalone, and in each Ray Serve engine
replica), between the OpenAI router (``api/openai.py``) and
:class:`~rollout_service.service.RolloutService`: every choice is one sequence of the
service, so each carries its own acceptance and is observed into Prometheus exactly
once, streamed or not. Choices are ordered prompt by prompt, ``n`` per prompt
(OpenAI's order).

A stream runs its sequences concurrently (:class:`MergedStreams`) and yields OpenAI
chunks as deltas arrive: a chunk per delta with text, the final chunk of each choice
with its ``finish_reason`` and ``spec_decode``, then the usage chunk when asked for.
The first chunk comes only once every sequence has produced its first delta, so a
request the engine refuses fails before the response begins (a 400, not an error
event); closing the stream aborts every sequence still running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from rollout_service.engines.base import (
    ChatTurn,
    GenerationDelta,
    GenerationResult,
    SamplingOptions,
)
from rollout_service.protocol import openai
from rollout_service.service import (
    RolloutService,
    gather_or_cancel,
    reported_stats,
    to_spec_info,
    to_summary,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One choice to generate: one engine request."""

    prompt: str | list[int]
    """Text or token ids."""
    sampling: SamplingOptions
    """Its sampling (its own seed)."""
    request_id: str
    """The engine request id."""
    category: str | None = None
    """The request's ``category`` (its acceptance series' label), if it named one."""


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of single prompts (validation made each
    non-empty)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def fan_out(prompts: Sequence[str | list[int]], req: openai.CompletionRequest
            | openai.ChatCompletionRequest, max_tokens: int, request_id: str) -> list[Choice]:
    """``req.n`` choices per prompt, in OpenAI's order; choice ``i`` of a prompt uses
    ``seed + i``."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return [Choice(prompt=prompt, request_id=f"{request_id}-{p}-{i}", sampling=SamplingOptions(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=stop,
        seed=None if req.seed is None else req.seed + i), category=req.category)
        for p, prompt in enumerate(prompts) for i in range(req.n)]


def usage(results: Sequence[GenerationResult], n: int) -> openai.CompletionUsage:
    """Token counts of a call: each prompt counted once (its first choice's)."""
    num_prompt = sum(len(r.prompt_token_ids) for r in results[::n])
    num_completion = sum(len(r.token_ids) for r in results)
    return openai.CompletionUsage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                                  total_tokens=num_prompt + num_completion)


def finish_reason(result: GenerationResult) -> openai.FinishReason:
    return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"


def _final_fields(delta: GenerationDelta) -> dict[str, object]:
    """A stream choice's ``finish_reason`` and ``spec_decode``: set on its last delta."""
    result = delta.result
    if result is None:
        return {"finish_reason": None, "spec_decode": None}
    return {"finish_reason": finish_reason(result),
            "spec_decode": to_spec_info(reported_stats(result))}


def _role_choice(index: int) -> openai.ChatStreamChoice:
    """A chat choice's first chunk: the role, as OpenAI sends it."""
    return openai.ChatStreamChoice(index=index, finish_reason=None,
                                   delta=openai.ChatDelta(role="assistant", content=""))


class MergedStreams:
    """Several sequences streamed concurrently: their deltas in arrival order, each with
    its sequence's index. Create it inside the event loop that consumes it."""

    def __init__(self, streams: Sequence[AsyncIterator[GenerationDelta]]) -> None:
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | Exception | None]] = \
            asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    self._queue.put_nowait((index, delta))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def deltas(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """``(index, delta)`` as they arrive; the first once every sequence has produced
        one (or ended).

        Raises:
            Exception: the first sequence's failure; the others are aborted.
        """
        num_streams = len(self._tasks)
        started: set[int] = set()
        held: list[tuple[int, GenerationDelta]] = []
        num_ended = 0
        try:
            while num_ended < num_streams:
                index, item = await self._queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    num_ended += 1
                    started.add(index)
                elif len(started) < num_streams:
                    held.append((index, item))
                    started.add(index)
                else:
                    yield index, item
                if held and len(started) == num_streams:
                    for event in held:
                        yield event
                    held = []
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Abort every sequence still running and wait for the engine to have done so."""
        for task in self._tasks:
            task.cancel()
        # Shielded: a cancelled caller (a client that went away) still aborts them all.
        await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))


class OpenAICompletions:
    """``/v1/completions`` and ``/v1/chat/completions`` on one :class:`RolloutService`."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    @property
    def _model(self) -> str:
        return self._service.info.model

    async def _generate(self, choices: Sequence[Choice]) -> list[GenerationResult]:
        return await gather_or_cancel([self._service.sequence(c.prompt, c.sampling, c.request_id,
                                                              category=c.category)
                                       for c in choices])

    async def _stream(self, choices: Sequence[Choice], results: dict[int, GenerationResult]
                      ) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """The deltas worth a chunk (with text, or the last of a choice), the first once every
        choice has started; each choice's result lands in ``results``."""
        streams = MergedStreams([self._service.stream_sequence(c.prompt, c.sampling,
                                                               c.request_id, category=c.category)
                                 for c in choices])
        async with aclosing(streams.deltas()) as deltas:
            async for index, delta in deltas:
                if delta.result is not None:
                    results[index] = delta.result
                elif not delta.text:
                    continue
                yield index, delta

    async def complete(self, req: openai.CompletionRequest) -> openai.CompletionResponse:
        """Every prompt times ``n``, choices in that order."""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        results = await self._generate(
            fan_out(completion_prompts(req.prompt), req, req.max_tokens, request_id))
        return openai.CompletionResponse(
            id=request_id, created=int(time.time()), model=self._model,
            choices=[openai.CompletionChoice(index=i, text=r.text, finish_reason=finish_reason(r),
                                             spec_decode=to_spec_info(reported_stats(r)))
                     for i, r in enumerate(results)],
            usage=usage(results, req.n), acceptance=to_summary(results))

    async def complete_stream(self, req: openai.CompletionRequest
                              ) -> AsyncGenerator[openai.CompletionChunk, None]:
        """:meth:`complete` as chunks (module docstring)."""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = fan_out(completion_prompts(req.prompt), req, req.max_tokens, request_id)
        header = {"id": request_id, "created": int(time.time()), "model": self._model}
        results: dict[int, GenerationResult] = {}
        async with aclosing(self._stream(choices, results)) as deltas:
            async for index, delta in deltas:
                yield openai.CompletionChunk(**header, choices=[openai.CompletionStreamChoice(
                    index=index, text=delta.text, **_final_fields(delta))])
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            yield openai.CompletionChunk(**header, choices=[], usage=usage(ordered, req.n),
                                         acceptance=to_summary(ordered))

    async def _chat_choices(self, req: openai.ChatCompletionRequest,
                            request_id: str) -> list[Choice]:
        prompt_ids = await self._service.chat_prompt(
            [ChatTurn(role=m.role, content=m.text) for m in req.messages])
        max_tokens = (req.max_completion_tokens or req.max_tokens
                      or max(1, self._service.info.max_model_len - len(prompt_ids)))
        return fan_out([prompt_ids], req, max_tokens, request_id)

    async def chat(self, req: openai.ChatCompletionRequest) -> openai.ChatCompletionResponse:
        """``n`` answers to one conversation."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        results = await self._generate(await self._chat_choices(req, request_id))
        return openai.ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=self._model,
            choices=[openai.ChatChoice(index=i, message=openai.AssistantMessage(content=r.text),
                                       finish_reason=finish_reason(r),
                                       spec_decode=to_spec_info(reported_stats(r)))
                     for i, r in enumerate(results)],
            usage=usage(results, req.n), acceptance=to_summary(results))

    async def chat_stream(self, req: openai.ChatCompletionRequest
                          ) -> AsyncGenerator[openai.ChatCompletionChunk, None]:
        """:meth:`chat` as chunks: each choice's first chunk carries the role."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await self._chat_choices(req, request_id)
        header = {"id": request_id, "created": int(time.time()), "model": self._model}
        results: dict[int, GenerationResult] = {}
        is_first = True
        async with aclosing(self._stream(choices, results)) as deltas:
            async for index, delta in deltas:
                if is_first:  # every choice has started: the request is served
                    is_first = False
                    for i in range(len(choices)):
                        yield openai.ChatCompletionChunk(**header, choices=[_role_choice(i)])
                yield openai.ChatCompletionChunk(**header, choices=[openai.ChatStreamChoice(
                    index=index, delta=openai.ChatDelta(content=delta.text),
                    **_final_fields(delta))])
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            yield openai.ChatCompletionChunk(**header, choices=[], usage=usage(ordered, req.n),
                                             acceptance=to_summary(ordered))
