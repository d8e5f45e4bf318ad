"""The service object: HTTP messages in, engine calls out, telemetry on the way.

Runs in the rollout service process, between the FastAPI handlers (``api``)
and an :class:`~rollout_service.engines.base.Engine`. Every sequence is one
engine request (``n`` fans out), and each finished sequence is observed into
the Prometheus metrics exactly once, here. A sequence whose engine returned
contradictory stats is counted there and answered without stats; it never fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from rollout_service.engines.base import (
    Engine,
    EngineInfo,
    EngineUnavailableError,
    GenerationResult,
    InvalidRequestError,
    SamplingOptions,
)
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import SpecDecodeStats, summarize
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.weights.manager import WeightPushManager

T = TypeVar("T")


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the rest (vLLM aborts them) and re-raise it."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(aw) for aw in aws]  # type: ignore[arg-type]
    except BaseExceptionGroup as group_error:
        raise _first_leaf(group_error) from None
    return [task.result() for task in tasks]


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def sampling_options(req: messages.SamplingFields, index: int) -> SamplingOptions:
    """Engine sampling options for sequence ``index`` of a request."""
    return SamplingOptions(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=None if req.seed is None else req.seed + index,
        stop=tuple(req.stop), ignore_eos=req.ignore_eos, logprobs=req.logprobs)


def reported_stats(result: GenerationResult) -> SpecDecodeStats | None:
    """The stats a response carries for ``result``: none when the engine gave none or
    contradictory ones (the exporter counts those apart)."""
    stats = result.spec_decode
    return stats if isinstance(stats, SpecDecodeStats) else None


def to_spec_info(stats: SpecDecodeStats | None) -> messages.SpecDecodeInfo | None:
    if stats is None:
        return None
    return messages.SpecDecodeInfo(
        num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens, num_verify_steps=stats.num_verify_steps,
        accepted_per_position=list(stats.accepted_per_position),
        accept_rate=stats.accept_rate, accept_length=stats.accept_length)


def to_summary(results: Sequence[GenerationResult]) -> messages.AcceptanceSummary:
    return summarize(reported_stats(r) for r in results)


def to_sequence(index: int, result: GenerationResult) -> messages.SequenceOutput:
    return messages.SequenceOutput(
        index=index, token_ids=list(result.token_ids), text=result.text,
        finish_reason=result.finish_reason,
        logprobs=None if result.logprobs is None else list(result.logprobs),
        weight_versions=list(result.weight_versions),
        spec_decode=to_spec_info(reported_stats(result)))


def speculation_info(info: EngineInfo) -> messages.SpeculationInfo:
    """What ``/health`` says about the engine's speculative decoding."""
    return messages.SpeculationInfo(
        is_enabled=info.num_speculative_tokens > 0, method=info.speculative_method,
        num_speculative_tokens=info.num_speculative_tokens,
        has_pushable_drafter=info.has_pushable_drafter)


class RolloutService:
    """Generation on one engine, with per-request acceptance telemetry."""

    def __init__(self, engine: Engine, metrics: SpecDecodeMetrics,
                 weights: WeightPushManager) -> None:
        self.engine = engine
        self.metrics = metrics
        self.weights = weights

    async def health(self) -> tuple[messages.HealthResponse, int]:
        """The health body and HTTP status: 503 if the engine is dead or weights are torn."""
        info = self.engine.info
        detail = None
        try:
            await self.engine.health()
        except EngineUnavailableError as exc:
            detail = str(exc)
        if detail is None and not self.weights.is_consistent:
            detail = "a weight load failed midway; generation is refused until a full push"
        body = messages.HealthResponse(status="ok" if detail is None else "unavailable",
                                       model=info.model, engine=info.engine,
                                       weights=self.weights.status(),
                                       speculation=speculation_info(info), detail=detail)
        return body, 200 if detail is None else 503

    async def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of the main model's and the drafter's parameters."""
        return await self.engine.weight_checksums()

    async def _sequence(self, prompt: str | list[int], sampling: SamplingOptions,
                        request_id: str) -> GenerationResult:
        if not self.weights.is_consistent:
            raise EngineUnavailableError("a weight load failed midway; generation is refused "
                                         "until a complete weight push succeeds")
        result = await self.engine.generate(prompt, sampling, request_id)
        self.metrics.observe(result.spec_decode)
        return result

    async def _sequences(self, req: messages.GenerateRequest, request_id: str
                         ) -> list[GenerationResult]:
        prompt = req.prompt if req.prompt is not None else req.prompt_token_ids
        assert prompt is not None
        return await gather_or_cancel([
            self._sequence(prompt, sampling_options(req, i), f"{request_id}-{i}")
            for i in range(req.n)])

    async def generate(self, req: messages.GenerateRequest) -> messages.GenerateResponse:
        """Sample ``req.n`` sequences for one prompt."""
        request_id = uuid.uuid4().hex
        results = await self._sequences(req, request_id)
        return self._response(request_id, results)

    async def generate_batch(self, batch: messages.BatchGenerateRequest
                             ) -> messages.BatchGenerateResponse:
        """Run every request concurrently; one failure fails the batch (others abort)."""
        ids = [uuid.uuid4().hex for _ in batch.requests]
        per_request = await gather_or_cancel(
            [self._sequences(req, rid) for req, rid in zip(batch.requests, ids)])
        return messages.BatchGenerateResponse(
            responses=[self._response(rid, results) for rid, results in zip(ids, per_request)],
            acceptance=to_summary([r for results in per_request for r in results]))

    @staticmethod
    def _response(request_id: str, results: list[GenerationResult]) -> messages.GenerateResponse:
        return messages.GenerateResponse(
            request_id=request_id, prompt_token_ids=list(results[0].prompt_token_ids),
            outputs=[to_sequence(i, r) for i, r in enumerate(results)],
            acceptance=to_summary(results))

    async def complete(self, req: messages.CompletionRequest) -> messages.CompletionResponse:
        """OpenAI ``/v1/completions``: every prompt times ``n``, choices in that order."""
        prompts = _completion_prompts(req.prompt)
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = messages.SamplingFields(max_tokens=req.max_tokens, temperature=req.temperature,
                                           top_p=req.top_p, seed=req.seed, stop=stop)
        results = await gather_or_cancel([
            self._sequence(prompt, sampling_options(sampling, i), f"{request_id}-{p}-{i}")
            for p, prompt in enumerate(prompts) for i in range(req.n)])
        num_prompt_tokens = sum(len(results[p * req.n].prompt_token_ids)
                                for p in range(len(prompts)))
        num_completion_tokens = sum(len(r.token_ids) for r in results)
        return messages.CompletionResponse(
            id=request_id, created=int(time.time()), model=self.engine.info.model,
            choices=[messages.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason)
                     for i, r in enumerate(results)],
            usage=messages.CompletionUsage(prompt_tokens=num_prompt_tokens,
                                           completion_tokens=num_completion_tokens,
                                           total_tokens=num_prompt_tokens + num_completion_tokens),
            acceptance=to_summary(results))


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                        ) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: empty list")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
