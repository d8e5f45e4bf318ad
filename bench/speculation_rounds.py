"""The timed rounds of ``bench/speculation.py``: the decaying rollout's workload, the
wrappers a mode's round runs in (a pin first, a profiler around it) and the interleaved
schedule that times every mode round by round.

Runs in the bench's process; the services are its children (``bench/serving_http.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from bench.serving import HttpMode, start_profiler, stop_profiler
from rollout_service.client import RolloutClient
from rollout_service.protocol import messages


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """The decaying rollout: one request per prompt, each with its own length."""

    prompts: tuple[str, ...]
    lengths: tuple[int, ...]


def rollout_lengths(num: int, max_tokens: int, *, seed: int = 0, shape: float = 1.2,
                    min_tokens: int = 8) -> tuple[int, ...]:
    """Long-tailed response lengths: ``min_tokens * (1 + Pareto(shape))``, capped at
    ``max_tokens`` (most responses short, a few long: concurrency decays to 1)."""
    rng = np.random.default_rng(seed)
    raw = min_tokens * (1.0 + rng.pareto(shape, size=num))
    return tuple(int(min(max_tokens, max(1, round(x)))) for x in raw)


Round = Callable[[], Awaitable[int]]
"""One timed unit of work: ``await round() -> tokens generated``."""


def with_pin(client: RolloutClient, schedule: dict[int, int] | None, run: Round) -> Round:
    """``run`` with ``schedule`` pinned first (None: the controller decides)."""

    async def pinned_run() -> int:
        await client.pin_schedule(schedule)
        return await run()

    return pinned_run


def profiled(run: Round, pid: int, out_dir: Path, label: str) -> Round:
    """``run`` under py-spy, the service ``pid`` and its engine core, one profile per call
    (``<label>-<n>.collapsed.txt``). Attaching and writing take seconds and sampling slows
    the process: a profiled mode's rates are for the profile, not for the table."""
    calls = 0

    async def profiled_run() -> int:
        nonlocal calls
        calls += 1
        profiler = start_profiler(pid, out_dir, f"{label}-{calls}", subprocesses=True)
        try:
            return await run()
        finally:
            await asyncio.to_thread(stop_profiler, profiler)

    return profiled_run


def rollout_round(http: HttpMode, rollout: Rollout, temperature: float) -> Round:
    """Every prompt of ``rollout`` at once, each to its own length."""

    def body(i: int) -> dict[str, Any]:
        return messages.GenerateRequest(
            prompt=rollout.prompts[i], max_tokens=rollout.lengths[i], temperature=temperature,
            seed=i, ignore_eos=True).model_dump(exclude_none=True)

    async def run() -> int:
        return sum(await asyncio.gather(*(http.send(body(i))
                                          for i in range(len(rollout.prompts)))))

    return run


async def interleaved(rounds: dict[str, Round], num_rounds: int, label: str,
                      console: Console) -> dict[str, list[float]]:
    """One warm-up per mode, then ``num_rounds`` rotated rounds; tokens/s per round."""
    modes = list(rounds)
    for mode in modes:
        await rounds[mode]()
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(num_rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            start = time.perf_counter()
            tokens = await rounds[mode]()
            rates[mode].append(tokens / (time.perf_counter() - start))
        console.print(f"  {label} round {r + 1}: " + ", ".join(
            f"{m} {rates[m][-1]:.0f}" for m in modes) + " tok/s")
    return rates
