"""Who holds generation paused: a client's pause route, and the weight pushes.

Runs in the service process (standalone, and in each Ray Serve engine replica). The RL
frameworks pause around their own weight updates (vLLM's ``POST /pause`` ... ``/resume``,
SGLang's ``/pause_generation`` ... ``/continue_generation``), and a push of this service
pauses the engine for its load too. Each is a *holder*: the engine pauses when the first
one holds and resumes only when the last one lets go, so a push inside a client's pause
does not resume generation behind the client's back, and a client's ``resume`` during a
push does not resume an engine that is loading.
"""

from __future__ import annotations

import asyncio
from typing import Literal, Protocol

from rollout_service.protocol.messages import PauseMode

Holder = Literal["client", "push"]
"""``client``: the dialects' pause routes (one holder, however many calls); ``push``: a
weight push's load."""


class Pausable(Protocol):
    """What the gate drives: the engine's own pause (``engines.base.Engine``)."""

    async def pause(self, mode: PauseMode = "wait") -> int: ...

    async def resume(self) -> None: ...


class PauseGate:
    """The engine's pause, held by several holders (module docstring).

    Args:
        engine: the engine whose scheduler pauses.
    """

    def __init__(self, engine: Pausable) -> None:
        self._engine = engine
        self._holders: dict[Holder, PauseMode] = {}
        self._lock = asyncio.Lock()

    @property
    def is_paused(self) -> bool:
        return bool(self._holders)

    @property
    def mode(self) -> PauseMode | None:
        """The mode the engine paused in (the first holder's); None when running."""
        return next(iter(self._holders.values()), None)

    async def hold(self, holder: Holder, mode: PauseMode) -> int:
        """Pause for ``holder`` (again: no change, but ``abort`` aborts what is running).

        Returns:
            The requests unfinished once paused (``Engine.pause``); 0 when the engine was
            paused already and nothing changed.
        """
        async with self._lock:
            if not self._holders:
                held = await self._engine.pause(mode)
            elif mode == "abort":
                # Already paused: what runs (frozen, or draining) is aborted now; the
                # engine stays paused. New requests stay queued until the last release.
                held = await self._engine.pause("abort")
            else:
                held = 0
            self._holders.setdefault(holder, mode)
            return held

    async def release(self, holder: Holder) -> bool:
        """Let go for ``holder``; the engine resumes when no holder is left.

        Returns:
            Whether the engine resumed.
        """
        async with self._lock:
            if self._holders.pop(holder, None) is None or self._holders:
                return False
            await self._engine.resume()
            return True
