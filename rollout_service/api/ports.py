"""What the HTTP handlers call: protocols met standalone and under Ray Serve.

Standalone, :class:`Rollouts`, :class:`~rollout_service.choices.Sequences` and
:class:`GenerationControl` are a :class:`~rollout_service.service.RolloutService`,
:class:`Completions` an :class:`~rollout_service.completions.OpenAICompletions` on it
and :class:`WeightPushes` its
:class:`~rollout_service.weights.manager.WeightPushManager`, in this process.
Behind Ray Serve (``serve.app``) they are the ingress's ``ReplicatedService`` and
``ReplicatedCompletions`` (route to engine replicas), ``CoordinatorPushes`` (calls
the weights coordinator) and the replicas' metrics merged into one page. The
handlers know only these protocols.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from rollout_service.choices import Sequences
from rollout_service.protocol import messages, openai
from rollout_service.protocol.speculation import SpeculationControlStatus

WeightChecksums = dict[str, str] | dict[str, dict[str, str]]
"""SHA-256 per model (``main``, ``draft``); under Ray Serve, per replica, then per model."""


class Rollouts(Protocol):
    """Generation, health and checksums."""

    async def generate(self, req: messages.GenerateRequest) -> messages.GenerateResponse: ...

    async def generate_batch(self, batch: messages.BatchGenerateRequest
                             ) -> messages.BatchGenerateResponse: ...

    async def health(self) -> tuple[messages.HealthResponse, int]:
        """The health body and its HTTP status."""
        ...

    async def weight_checksums(self) -> WeightChecksums: ...


class Completions(Protocol):
    """OpenAI's completions and chat, whole or streamed.

    A stream is an async generator of chunks whose first chunk comes once the request
    is served (a refusal raises from the first ``anext``, before any byte is sent);
    closing it aborts what still runs.
    """

    async def complete(self, req: openai.CompletionRequest) -> openai.CompletionResponse: ...

    def complete_stream(self, req: openai.CompletionRequest
                        ) -> AsyncGenerator[openai.CompletionChunk, None]: ...

    async def chat(self, req: openai.ChatCompletionRequest
                   ) -> openai.ChatCompletionResponse: ...

    def chat_stream(self, req: openai.ChatCompletionRequest
                    ) -> AsyncGenerator[openai.ChatCompletionChunk, None]: ...


class GenerationControl(Protocol):
    """The dialects' pause, resume, abort and cache routes, over every engine of the app
    (standalone: :class:`~rollout_service.service.RolloutService`; Ray Serve: broadcast to
    every replica)."""

    async def pause(self, mode: messages.PauseMode) -> int:
        """Pause for the client; the requests unfinished once paused."""
        ...

    async def resume(self) -> bool:
        """End the client's pause; whether generation resumed (a push may still hold it)."""
        ...

    async def is_paused(self) -> bool: ...

    async def abort(self, client_ids: Sequence[str] | None = None) -> int:
        """Abort the sequences of these client ids (None: all); engine requests told."""
        ...

    async def reset_prefix_cache(self) -> bool: ...

    async def num_running(self) -> list[int]:
        """Engine requests running now, per engine (Ray Serve: per replica)."""
        ...


class WeightPushes(Protocol):
    """The weight-push protocol (``/weights/*``)."""

    async def begin(self, req: messages.PushBeginRequest) -> messages.PushBeginResponse: ...

    async def update(self, req: messages.PushUpdateRequest) -> messages.PushUpdateResponse: ...

    async def finish(self, req: messages.PushFinishRequest) -> messages.PushFinishResponse: ...

    async def abort(self, req: messages.PushAbortRequest) -> messages.WeightStatus: ...

    async def get_status(self) -> messages.WeightStatus: ...

    async def create_group(self, req: messages.WeightGroupRequest
                           ) -> messages.WeightGroupResponse:
        """Join the trainer's collective group for the ``nccl`` transport
        (``POST /weights/group``)."""
        ...

    async def release_group(self, req: messages.WeightGroupRelease
                            ) -> messages.WeightGroupState:
        """Let the trainer's group go (``POST /weights/group/release``)."""
        ...

    async def group_state(self) -> messages.WeightGroupState:
        """The ranks this service needs and its current group (``GET /weights/group/state``)."""
        ...


class SchedulePins(Protocol):
    """``POST /speculation/schedule``: pin a K schedule over the speculation controller."""

    async def pin_schedule(self, schedule: dict[int, int] | None
                           ) -> SpeculationControlStatus: ...


class MetricsPage(Protocol):
    """``GET /metrics``: the Prometheus exposition text this app answers with."""

    async def render(self) -> bytes: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class AppState:
    """What the app serves, opened in ``lifespan``."""

    rollouts: Rollouts
    completions: Completions
    sequences: Sequences
    """What the dialects' translations call (vLLM's token-in/token-out, SGLang's)."""
    control: GenerationControl
    weights: WeightPushes
    metrics: MetricsPage
    speculation: SchedulePins | None = None
    """Standalone only (the service's own speculation control); None answers 403."""
