"""One call's sequences: what a dialect asks the service to generate, and their streams.

Runs in the service process (standalone, or the Ray Serve ingress and engine replicas:
a :class:`Choice` is what crosses from the ingress to a replica). Every dialect (the
native API, vLLM's OpenAI and token-in/token-out routes, SGLang's ``/generate``) turns a
request into choices, one engine request each, so each carries its own acceptance; the
service runs them (``RolloutService.run`` / ``stream``) and the dialect shapes the results.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from rollout_service.engines.base import EngineInfo
from rollout_service.engines.sequences import (
    ChatTurn,
    GenerationDelta,
    GenerationResult,
    SamplingOptions,
)
from rollout_service.protocol.messages import WeightStatus


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
    client_id: str | None = None
    """The id the client aborts it by (vLLM's ``request_id``, SGLang's ``rid``; every
    choice of a call shares it); None: the engine request id."""


class Sequences(Protocol):
    """What the dialects' translations call: standalone the
    :class:`~rollout_service.service.RolloutService`; under Ray Serve the ingress's
    ``ReplicatedSequences``, which runs a call's choices on one engine replica."""

    async def run(self, choices: Sequence[Choice]) -> list[GenerationResult]:
        """Every choice, concurrently; the first failure aborts the others and raises."""
        ...

    def stream(self, choices: Sequence[Choice]
               ) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
        """``(index, delta)`` in arrival order, the first once every choice has produced
        one (a refusal raises from the first ``anext``); closing it aborts the rest."""
        ...

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        """A conversation as prompt token ids, by the served checkpoint's chat template."""
        ...

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text on its own."""
        ...

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text`` as the served checkpoint's tokenizer splits it."""
        ...

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text."""
        ...

    async def engine_info(self) -> EngineInfo:
        """The served engine's facts (model name, context length, K)."""
        ...


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


class UnknownModelError(LookupError):
    """A request named a model other than the served one (404, as vLLM answers)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


DEFAULT_WEIGHT_VERSION = "default"
"""The weight version vLLM and SGLang label the weights they started with (before any
push), in responses and in their weight-version routes alike."""


def weight_version_label(status: WeightStatus) -> str:
    """The main model's served version as the engines label it in responses."""
    version = status.main_version
    return DEFAULT_WEIGHT_VERSION if version is None else str(version)


def check_model(model: str | None, served: str) -> None:
    """vLLM's rule: ``model`` may be left out; otherwise it must be the served name.

    Raises:
        UnknownModelError: another name.
    """
    if model is not None and model != served:
        raise UnknownModelError(model)
