"""The service object: HTTP messages in, engine calls out, telemetry on the way.

Runs in the rollout service process, between the FastAPI handlers (``api``: the native
API and every dialect) and an :class:`~rollout_service.engines.base.Engine`. Every
sequence is one engine request (``n`` fans out), generated whole
(:meth:`RolloutService.sequence`, :meth:`RolloutService.run`) or streamed
(:meth:`RolloutService.stream_sequence`, :meth:`RolloutService.stream`), and each finished
sequence is observed into the Prometheus metrics exactly once, here, whichever dialect
asked for it. A sequence whose engine returned contradictory stats is counted there and
answered without stats; it never fails; an aborted one is counted as aborted. With the
speculation control (``spec_control``), each finished sequence also goes to it, which
decides the K schedule and applies it in the background.

The generation control of the dialects lives here too: pause and resume (a holder of the
:class:`~rollout_service.pausing.PauseGate` the weight pushes share), and aborts by the
id a client gave (every running sequence is tracked under it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import TypeVar

from rollout_service.choices import Choice, MergedStreams
from rollout_service.engines.base import (
    ChatTurn,
    Engine,
    EngineInfo,
    EngineUnavailableError,
    GenerationDelta,
    GenerationResult,
    SamplingOptions,
)
from rollout_service.pausing import PauseGate
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import (
    SpecDecodeStats,
    summarize,
    summarize_by_category,
)
from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.spec_control import SpeculationControl
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.weights.manager import WeightPushManager

T = TypeVar("T")


class SpeculationControlOff(RuntimeError):
    """A call for the speculation control on a service that runs none (403)."""


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the rest (vLLM aborts them) and re-raise it.

    One awaitable (a request of one sequence, the usual rollout request) runs inline, not
    as a task: its engine request leaves in the same turn of the event loop that received
    it, where a task would wait behind every callback of a burst of arrivals first."""
    if len(aws) == 1:
        return [await aws[0]]
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
        stop=tuple(req.stop), ignore_eos=req.ignore_eos, logprobs=0 if req.logprobs else None)


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
        accept_rate=stats.accept_rate, accept_length=stats.accept_length,
        num_rejected_tokens=stats.num_rejected_tokens,
        verify_cost_ratio=stats.verify_cost_ratio, net_speedup=stats.net_speedup)


def to_summary(results: Sequence[GenerationResult]) -> messages.AcceptanceSummary:
    return summarize(reported_stats(r) for r in results)


def to_sequence(index: int, result: GenerationResult) -> messages.SequenceOutput:
    return messages.SequenceOutput(
        index=index, token_ids=list(result.token_ids), text=result.text,
        finish_reason=result.finish_reason,
        logprobs=None if result.logprobs is None else [p.token.logprob for p in result.logprobs],
        weight_versions=list(result.weight_versions),
        spec_decode=to_spec_info(reported_stats(result)))


def speculation_info(info: EngineInfo) -> messages.SpeculationInfo:
    """What ``/health`` says about the engine's speculative decoding."""
    return messages.SpeculationInfo(
        is_enabled=info.num_speculative_tokens > 0, method=info.speculative_method,
        num_speculative_tokens=info.num_speculative_tokens,
        has_pushable_drafter=info.has_pushable_drafter,
        verify_cost_ratio=info.verify_cost_ratio)


class RolloutService:
    """Generation on one engine, with per-request acceptance telemetry."""

    def __init__(self, engine: Engine, metrics: SpecDecodeMetrics,
                 weights: WeightPushManager, speculation: SpeculationControl | None = None,
                 pauses: PauseGate | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.weights = weights
        self.speculation = speculation
        self.pauses = pauses or PauseGate(engine)
        """Shared with the weight pushes (``local.build_local_service``)."""
        self._running: dict[str, set[str]] = {}
        """Client id -> the engine requests running under it."""

    async def start(self) -> None:
        """Before serving: the speculation control's first schedule and calibration."""
        if self.speculation is not None:
            await self.speculation.start()

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
        control = None if self.speculation is None else self.speculation.status()
        body = messages.HealthResponse(status="ok" if detail is None else "unavailable",
                                       model=info.model, engine=info.engine,
                                       weights=self.weights.status(),
                                       speculation=speculation_info(info),
                                       speculation_control=control, detail=detail)
        return body, 200 if detail is None else 503

    async def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of the main model's and the drafter's parameters."""
        return await self.engine.weight_checksums()

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    async def engine_info(self) -> EngineInfo:
        return self.engine.info

    def _check_consistent(self) -> None:
        if not self.weights.is_consistent:
            raise EngineUnavailableError("a weight load failed midway; generation is refused "
                                         "until a complete weight push succeeds")

    @contextmanager
    def _tracked(self, client_id: str, request_id: str) -> Iterator[None]:
        """``request_id`` runs under ``client_id`` (what :meth:`abort` finds) meanwhile."""
        self._running.setdefault(client_id, set()).add(request_id)
        try:
            yield
        finally:
            running = self._running[client_id]
            running.discard(request_id)
            if not running:
                del self._running[client_id]

    async def sequence(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str, *, category: str | None = None,
                       client_id: str | None = None) -> GenerationResult:
        """One sequence, observed once finished (under ``category``, if the request named
        one); abortable by ``client_id`` (default: ``request_id``) while it runs."""
        self._check_consistent()
        with self._tracked(client_id or request_id, request_id):
            result = await self.engine.generate(prompt, sampling, request_id)
        return self._observe(result, category)

    async def stream_sequence(self, prompt: str | list[int], sampling: SamplingOptions,
                              request_id: str, *, category: str | None = None,
                              client_id: str | None = None
                              ) -> AsyncIterator[GenerationDelta]:
        """One sequence as it is produced, observed once when its last delta arrives (before
        it is passed on); closing the iterator earlier aborts it, and it is not observed."""
        self._check_consistent()
        with self._tracked(client_id or request_id, request_id):
            async with aclosing(self.engine.stream(prompt, sampling, request_id)) as deltas:
                async for delta in deltas:
                    if delta.result is not None:
                        delta = replace(delta, result=self._observe(delta.result, category))
                    yield delta

    async def run(self, choices: Sequence[Choice]) -> list[GenerationResult]:
        """Every choice of one call, concurrently; the first failure aborts the others."""
        return await gather_or_cancel([
            self.sequence(c.prompt, c.sampling, c.request_id, category=c.category,
                          client_id=c.client_id) for c in choices])

    async def stream(self, choices: Sequence[Choice]
                     ) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
        """The choices' deltas as ``(index, delta)`` in arrival order, the first once every
        choice has produced one (a refusal raises before anything is yielded); closing it
        aborts what still runs."""
        streams = MergedStreams([
            self.stream_sequence(c.prompt, c.sampling, c.request_id, category=c.category,
                                 client_id=c.client_id) for c in choices])
        async with aclosing(streams.deltas()) as deltas:
            async for item in deltas:
                yield item

    # ---- generation control (the dialects' pause, resume and abort routes) ------------

    async def abort(self, client_ids: Sequence[str] | None = None) -> int:
        """Abort the sequences running under these client ids (None: every running one);
        each answers with finish reason ``abort`` and the tokens it had.

        Returns:
            The engine requests told to abort (unknown or finished ids count nothing).
        """
        keys = list(self._running) if client_ids is None else client_ids
        request_ids = [r for key in keys for r in self._running.get(key, ())]
        await self.engine.abort(request_ids)
        return len(request_ids)

    async def pause(self, mode: messages.PauseMode) -> int:
        """Pause generation for the client (``wait``: drain, ``abort``: abort what runs,
        ``keep``: freeze it); new requests wait. Again while paused: no change, but
        ``abort`` aborts what was kept.

        Returns:
            The requests unfinished once paused.
        """
        return await self.pauses.hold("client", mode)

    async def resume(self) -> bool:
        """The client's pause ends; generation resumes unless a push still holds it.

        Returns:
            Whether generation resumed now.
        """
        return await self.pauses.release("client")

    async def is_paused(self) -> bool:
        return self.pauses.is_paused

    async def num_running(self) -> list[int]:
        """The engine requests running now (one engine: one count)."""
        return [sum(len(ids) for ids in self._running.values())]

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False when the engine refused (running requests hold
        cached blocks: retry, or pause first)."""
        return await self.engine.reset_prefix_cache()

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text on its own (logprobs shown by token)."""
        return await self.engine.decode_tokens(token_ids)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.engine.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self.engine.decode(token_ids)

    def _observe(self, result: GenerationResult, category: str | None) -> GenerationResult:
        """Count a finished sequence; returns it as answered: with the speculation control,
        its verify cost ratio is that of the K its steps ran (``SpeculationControl.costed``)."""
        if self.speculation is not None:
            result = self.speculation.observe(result)
        self.metrics.observe(result.spec_decode, category, is_aborted=result.is_aborted)
        return result

    async def pin_schedule(self, schedule: dict[int, int] | None) -> SpeculationControlStatus:
        """Run ``schedule`` (batch size -> K) whatever the controller decides; None unpins.

        Raises:
            SpeculationControlOff: the service runs no speculation control.
            ScheduleRefusedError: the engine refused it; the schedule in force stays.
        """
        if self.speculation is None:
            raise SpeculationControlOff("speculation control is off "
                                        "(speculation_control.enabled): vLLM runs a fixed K")
        return await self.speculation.pin(schedule)

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        """A conversation as prompt token ids, by the served checkpoint's chat template."""
        return await self.engine.chat_prompt(turns)

    async def _sequences(self, req: messages.GenerateRequest, request_id: str
                         ) -> list[GenerationResult]:
        prompt = req.prompt if req.prompt is not None else req.prompt_token_ids
        assert prompt is not None
        return await self.run([
            Choice(prompt=prompt, sampling=sampling_options(req, i),
                   request_id=f"{request_id}-{i}", category=req.category, client_id=request_id)
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
            acceptance=to_summary([r for results in per_request for r in results]),
            acceptance_by_category=summarize_by_category(
                (req.category, reported_stats(r))
                for req, results in zip(batch.requests, per_request) for r in results))

    @staticmethod
    def _response(request_id: str, results: list[GenerationResult]) -> messages.GenerateResponse:
        return messages.GenerateResponse(
            request_id=request_id, prompt_token_ids=list(results[0].prompt_token_ids),
            outputs=[to_sequence(i, r) for i, r in enumerate(results)],
            acceptance=to_summary(results))
