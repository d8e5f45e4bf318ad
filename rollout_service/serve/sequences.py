"""The ingress's side of the service's sequences and generation control, under Ray Serve.

Runs in the Ray Serve ingress replica. Every dialect's translation (OpenAI's and vLLM's
routes, SGLang's ``/generate``) runs here over :class:`ReplicatedSequences`: a call's
choices go to one engine replica together (retried on another while the one reached
cannot serve, until its first delta when streamed), which generates and observes them as
a standalone service would. The control routes (pause, resume, abort, cache reset) reach
every replica at once through Ray Serve's ``DeploymentHandle.broadcast``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from rollout_service.choices import Choice
from rollout_service.engines.base import ChatTurn, EngineInfo, GenerationDelta, GenerationResult
from rollout_service.protocol.messages import PauseMode

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from rollout_service.serve.app import Replicas


class ReplicatedSequences:
    """:class:`~rollout_service.choices.Sequences` over the engine replicas."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas
        self._info: EngineInfo | None = None

    async def run(self, choices: Sequence[Choice]) -> list[GenerationResult]:
        return await self._replicas.call("run_choices", list(choices))

    def stream(self, choices: Sequence[Choice]
               ) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
        return self._replicas.stream("stream_choices", list(choices))

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        return await self._replicas.call("chat_prompt", list(turns))

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return await self._replicas.call("decode_tokens", list(token_ids))

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self._replicas.call("encode", (text, add_special_tokens))

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self._replicas.call("decode", list(token_ids))

    async def engine_info(self) -> EngineInfo:
        """One replica's (every replica serves the same checkpoint), asked once."""
        if self._info is None:
            self._info = await self._replicas.call("engine_info", None)
        return self._info


class BroadcastControl:
    """:class:`~rollout_service.api.ports.GenerationControl` over every engine replica.

    A replica that starts after a pause is not paused (it has nothing the client froze).
    """

    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = engine

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await self._engine.broadcast(method, *args).results_async()

    async def pause(self, mode: PauseMode) -> int:
        return sum(await self._all("pause", mode))

    async def resume(self) -> bool:
        return any(await self._all("resume"))

    async def is_paused(self) -> bool:
        return any(await self._all("is_paused"))

    async def abort(self, client_ids: Sequence[str] | None = None) -> int:
        return sum(await self._all("abort", None if client_ids is None else list(client_ids)))

    async def reset_prefix_cache(self) -> bool:
        return all(await self._all("reset_prefix_cache"))

    async def num_running(self) -> list[int]:
        return [n for counts in await self._all("num_running") for n in counts]
