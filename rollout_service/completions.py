"""OpenAI's completions and chat, as vLLM's OpenAI server answers them, over the service.

Runs in the rollout service process (standalone, or the Ray Serve ingress), between the
OpenAI router (``api/openai.py``) and the :class:`~rollout_service.choices.Sequences` of
the service: every choice is one sequence of the service, so each carries its own
acceptance and is observed into Prometheus exactly once, streamed or not. Choices are
ordered prompt by prompt, ``n`` per prompt (OpenAI's order). vLLM's sampling extensions
are translated in ``sampling``; its response extensions (``token_ids``,
``prompt_token_ids``, ``prompt_logprobs``, ``stop_reason``, ``metrics``) and the
logprobs are shaped in ``logprob_views``.

A stream runs its sequences concurrently and yields OpenAI chunks as deltas arrive: a
chunk per delta with text (or tokens, when the call asked for token ids or logprobs),
the final chunk of each choice with its ``finish_reason`` and ``spec_decode``, then the
usage chunk when asked for. The first chunk comes only once every sequence has produced
its first delta, so a request the engine refuses fails before the response begins (a
400, not an error event); closing the stream aborts every sequence still running.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from rollout_service.choices import Choice, Sequences, check_model
from rollout_service.engines.base import ChatTurn, EngineInfo, GenerationDelta, GenerationResult
from rollout_service.logprob_views import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from rollout_service.protocol import openai
from rollout_service.sampling import speculative_decoding_metrics, vllm_sampling_options
from rollout_service.service import reported_stats, to_spec_info, to_summary

OpenAIRequest = openai.CompletionRequest | openai.ChatCompletionRequest


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of single prompts (validation made each
    non-empty)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def num_logprobs(req: OpenAIRequest) -> int | None:
    """The top-N of a call's output logprobs (None: none asked for)."""
    if isinstance(req, openai.CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def is_echoed(req: OpenAIRequest) -> bool:
    return isinstance(req, openai.CompletionRequest) and req.echo


def fan_out(prompts: Sequence[str | list[int]], req: OpenAIRequest, max_tokens: int,
            request_id: str) -> list[Choice]:
    """``req.n`` choices per prompt, in OpenAI's order; choice ``i`` of a prompt uses
    ``seed + i``; all abortable by the call's ``request_id`` (vLLM's field, or the id).
    With ``echo`` the prompt's logprobs default to the output's top N (vLLM's rule)."""
    client_id = req.request_id or request_id
    num_top = num_logprobs(req)
    prompt_top = req.prompt_logprobs
    if prompt_top is None and is_echoed(req):
        prompt_top = num_top
    return [Choice(prompt=prompt, request_id=f"{request_id}-{p}-{i}", category=req.category,
                   client_id=client_id, sampling=replace(vllm_sampling_options(
                       req, max_tokens=max_tokens, temperature=req.temperature,
                       top_p=req.top_p, seed=None if req.seed is None else req.seed + i,
                       stop=req.stop, logprobs=num_top), prompt_logprobs=prompt_top))
            for p, prompt in enumerate(prompts) for i in range(req.n)]


def usage(results: Sequence[GenerationResult], n: int) -> openai.CompletionUsage:
    """Token counts of a call: each prompt counted once (its first choice's)."""
    num_prompt = sum(len(r.prompt_token_ids) for r in results[::n])
    num_completion = sum(len(r.token_ids) for r in results)
    return openai.CompletionUsage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                                  total_tokens=num_prompt + num_completion)


def finish_reason(result: GenerationResult) -> openai.FinishReason:
    return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"


def request_metrics(results: Sequence[GenerationResult], info: EngineInfo
                    ) -> openai.RequestMetrics | None:
    """vLLM's ``metrics``: only for a call of one sequence, as vLLM gives them."""
    if len(results) != 1:
        return None
    stats = speculative_decoding_metrics(reported_stats(results[0]),
                                         info.num_speculative_tokens)
    return None if stats is None else openai.RequestMetrics(speculative_decoding=stats)


def _role_choice(index: int) -> openai.ChatStreamChoice:
    """A chat choice's first chunk: the role, as OpenAI sends it."""
    return openai.ChatStreamChoice(index=index, finish_reason=None,
                                   delta=openai.ChatDelta(role="assistant", content=""))


class OpenAICompletions:
    """``/v1/completions`` and ``/v1/chat/completions`` on one
    :class:`~rollout_service.choices.Sequences`."""

    def __init__(self, service: Sequences) -> None:
        self._service = service

    async def _info(self, req: OpenAIRequest) -> EngineInfo:
        info = await self._service.engine_info()
        check_model(req.model, info.model)
        return info

    def _names(self, req: OpenAIRequest) -> TokenNames:
        return TokenNames(self._service.decode_tokens,
                          as_token_ids=bool(req.return_tokens_as_token_ids))

    async def _stream(self, choices: Sequence[Choice], results: dict[int, GenerationResult],
                      *, every_delta: bool) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """The deltas worth a chunk (with text, tokens when ``every_delta``, or the last of
        a choice); each choice's result lands in ``results``."""
        async with aclosing(self._service.stream(choices)) as deltas:
            async for index, delta in deltas:
                if delta.result is not None:
                    results[index] = delta.result
                elif not delta.text and not (every_delta and delta.token_ids):
                    continue
                yield index, delta

    def _choice_fields(self, req: OpenAIRequest, result: GenerationResult | None
                       ) -> dict[str, Any]:
        """vLLM's and this service's fields of a finished choice (or a chunk's: None)."""
        if result is None:
            return {"finish_reason": None}
        return {"finish_reason": finish_reason(result), "stop_reason": result.stop_reason,
                "spec_decode": to_spec_info(reported_stats(result))}

    # ---- /v1/completions ------------------------------------------------------------

    async def _echoes(self, req: openai.CompletionRequest, prompts: Sequence[str | list[int]]
                      ) -> list[str]:
        """Each prompt's text as ``echo`` repeats it ("" without echo)."""
        if not req.echo:
            return [""] * len(prompts)
        return [p if isinstance(p, str) else await self._service.decode(p) for p in prompts]

    async def complete(self, req: openai.CompletionRequest) -> openai.CompletionResponse:
        """Every prompt times ``n``, choices in that order."""
        info = await self._info(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = completion_prompts(req.prompt)
        results = await self._service.run(fan_out(prompts, req, req.max_tokens, request_id))
        echoes = await self._echoes(req, prompts)
        names = self._names(req)
        if req.logprobs is not None or req.prompt_logprobs is not None or req.echo:
            await names.learn([lps for r in results for lps in (r.logprobs, r.prompt_logprobs)],
                              [t for r in results for t in r.prompt_token_ids] if req.echo
                              else ())
        return openai.CompletionResponse(
            id=request_id, created=int(time.time()), model=info.model,
            choices=[openai.CompletionChoice(
                index=i, text=echoes[i // req.n] + r.text, **self._choice_fields(req, r),
                logprobs=None if r.logprobs is None or req.logprobs is None
                else completion_logprobs(r.logprobs, names, req.logprobs, echoed=(
                    r.prompt_token_ids, r.prompt_logprobs or [None] * len(r.prompt_token_ids))
                    if req.echo else None),
                token_ids=list(r.token_ids) if req.return_token_ids else None,
                prompt_token_ids=list(r.prompt_token_ids) if req.return_token_ids else None,
                prompt_logprobs=None if r.prompt_logprobs is None
                else prompt_logprobs(r.prompt_logprobs, names))
                for i, r in enumerate(results)],
            usage=usage(results, req.n), metrics=request_metrics(results, info),
            acceptance=to_summary(results))

    async def complete_stream(self, req: openai.CompletionRequest
                              ) -> AsyncGenerator[openai.CompletionChunk, None]:
        """:meth:`complete` as chunks (module docstring)."""
        info = await self._info(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = completion_prompts(req.prompt)
        choices = fan_out(prompts, req, req.max_tokens, request_id)
        header = {"id": request_id, "created": int(time.time()), "model": info.model}
        results: dict[int, GenerationResult] = {}
        names, offsets, started = self._names(req), [0] * len(choices), set()
        every_delta = bool(req.return_token_ids) or req.logprobs is not None or req.echo
        async with aclosing(self._stream(choices, results, every_delta=every_delta)) as deltas:
            async for index, delta in deltas:
                is_first = index not in started
                started.add(index)
                # echo: the prompt (and its logprobs) lead the choice's first chunk
                echo = is_first and req.echo and delta.prompt_token_ids is not None
                text = delta.text
                if echo:
                    prompt = prompts[index // req.n]
                    text = (prompt if isinstance(prompt, str)
                            else await self._service.decode(prompt)) + text
                logprobs = None
                if req.logprobs is not None:
                    prompt_ids = delta.prompt_token_ids or ()
                    await names.learn([delta.logprobs], prompt_ids if echo else ())
                    logprobs = completion_logprobs(
                        delta.logprobs, names, req.logprobs, text_offset=offsets[index],
                        echoed=(prompt_ids, [None] * len(prompt_ids)) if echo else None)
                offsets[index] += len(text)
                yield openai.CompletionChunk(**header, choices=[openai.CompletionStreamChoice(
                    index=index, text=text, logprobs=logprobs,
                    **self._choice_fields(req, delta.result),
                    token_ids=list(delta.token_ids) if req.return_token_ids else None,
                    prompt_token_ids=_list(delta.prompt_token_ids)
                    if req.return_token_ids and is_first else None)])
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            yield openai.CompletionChunk(**header, choices=[], usage=usage(ordered, req.n),
                                         metrics=request_metrics(ordered, info),
                                         acceptance=to_summary(ordered))

    # ---- /v1/chat/completions -------------------------------------------------------

    async def _chat_choices(self, req: openai.ChatCompletionRequest, info: EngineInfo,
                            request_id: str) -> list[Choice]:
        prompt_ids = await self._service.chat_prompt(
            [ChatTurn(role=m.role, content=m.text) for m in req.messages])
        max_tokens = (req.max_completion_tokens or req.max_tokens
                      or max(1, info.max_model_len - len(prompt_ids)))
        return fan_out([prompt_ids], req, max_tokens, request_id)

    async def chat(self, req: openai.ChatCompletionRequest) -> openai.ChatCompletionResponse:
        """``n`` answers to one conversation."""
        info = await self._info(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        results = await self._service.run(await self._chat_choices(req, info, request_id))
        names = self._names(req)
        if req.logprobs or req.prompt_logprobs is not None:
            await names.learn([lps for r in results for lps in (r.logprobs, r.prompt_logprobs)])
        first = results[0]
        return openai.ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=info.model,
            choices=[openai.ChatChoice(
                index=i, message=openai.AssistantMessage(content=r.text),
                **self._choice_fields(req, r),
                logprobs=chat_logprobs(r.logprobs, names) if req.logprobs and r.logprobs
                is not None else None,
                token_ids=list(r.token_ids) if req.return_token_ids else None)
                for i, r in enumerate(results)],
            prompt_token_ids=list(first.prompt_token_ids) if req.return_token_ids else None,
            prompt_logprobs=None if first.prompt_logprobs is None
            else prompt_logprobs(first.prompt_logprobs, names),
            usage=usage(results, req.n), metrics=request_metrics(results, info),
            acceptance=to_summary(results))

    async def chat_stream(self, req: openai.ChatCompletionRequest
                          ) -> AsyncGenerator[openai.ChatCompletionChunk, None]:
        """:meth:`chat` as chunks: each choice's first chunk carries the role."""
        info = await self._info(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await self._chat_choices(req, info, request_id)
        header = {"id": request_id, "created": int(time.time()), "model": info.model}
        results: dict[int, GenerationResult] = {}
        names, is_first = self._names(req), True
        every_delta = bool(req.return_token_ids) or req.logprobs
        async with aclosing(self._stream(choices, results, every_delta=every_delta)) as deltas:
            async for index, delta in deltas:
                if is_first:  # every choice has started: the request is served
                    is_first = False
                    prompt_ids = (_list(delta.prompt_token_ids)
                                  if req.return_token_ids else None)
                    for i in range(len(choices)):
                        yield openai.ChatCompletionChunk(
                            **header, choices=[_role_choice(i)],
                            prompt_token_ids=prompt_ids if i == 0 else None)
                logprobs = None
                if req.logprobs:
                    await names.learn([delta.logprobs])
                    logprobs = chat_logprobs(delta.logprobs, names)
                yield openai.ChatCompletionChunk(**header, choices=[openai.ChatStreamChoice(
                    index=index, delta=openai.ChatDelta(content=delta.text), logprobs=logprobs,
                    **self._choice_fields(req, delta.result),
                    token_ids=list(delta.token_ids) if req.return_token_ids else None)])
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            yield openai.ChatCompletionChunk(**header, choices=[], usage=usage(ordered, req.n),
                                             metrics=request_metrics(ordered, info),
                                             acceptance=to_summary(ordered))


def _list(ids: Sequence[int] | None) -> list[int] | None:
    return None if ids is None else list(ids)
