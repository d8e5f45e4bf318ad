"""The timed rounds of ``bench/speculation.py``: the decaying rollout's workload, the
modes (a round, with a pin before it or a profiler around it) and the interleaved
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

from bench.profiling import start_profiler, stop_profiler
from bench.quiet import before_round, rest_level
from bench.serving import HttpMode
from rollout_service.client import RolloutClient
from rollout_service.protocol import messages
from rollout_service.protocol.speculation import SpeculationControlStatus


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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mode:
    """One mode of :func:`interleaved`: ``setup`` before each of its rounds, untimed, then
    ``run``, timed, then ``after``, untimed."""

    run: Round
    setup: Callable[[], Awaitable[object]] | None = None
    after: Callable[[], Awaitable[object]] | None = None


class Frozen:
    """The pin of :data:`FROZEN`."""


FROZEN = Frozen()
"""A mode's pin: the controller's own schedule (``controller_k`` per bucket) as it stands
before the round. The mode runs the K the controller chose without its deciding during
the round: where ``controller`` runs slower than this mode, what costs is the controller
running, not the K it chose (on the H100 the controller ran below pinned K = 3 on a
rollout where its schedule was K = 3 above 4 running: docs/speculation-benchmark.md)."""

Pin = dict[int, int] | Frozen | None
"""What a mode pins before its rounds: a schedule, :data:`FROZEN`, or None (the
controller decides)."""


def with_pin(client: RolloutClient, schedule: Pin, run: Round) -> Mode:
    """``run`` with ``schedule`` pinned before it; the pin is in force when its call
    returns, and its time is not the round's."""
    async def pin() -> None:
        if isinstance(schedule, Frozen):
            await client.pin_schedule(await controller_schedule(client))
        else:
            await client.pin_schedule(schedule)

    return Mode(run=run, setup=pin)


async def controller_schedule(client: RolloutClient) -> dict[int, int]:
    """The controller's own K per bucket upper edge (``/health``; shown while pinned too)."""
    return {b.batch_size: b.controller_k for b in (await control_status(client)).buckets}


async def control_status(client: RolloutClient) -> SpeculationControlStatus:
    """The service's ``speculation_control`` in ``/health``.

    Raises:
        ValueError: the service runs no speculation control.
    """
    control = (await client.health()).speculation_control
    if control is None:
        raise ValueError("the service runs no speculation control")
    return control


def watched(client: RolloutClient, run: Round, report: Callable[[str], None]) -> Mode:
    """``run`` unpinned (the controller decides), with what its engine ran during each run
    reported: how many schedules the engine took while the run lasted, and the one in
    force at its end. A pinned mode's K cannot change mid-round; the controller's can,
    and on the H100 its rounds ran below the pinned K it showed after them
    (docs/speculation-benchmark.md): this says whether its schedule moved meanwhile."""
    applied: list[int] = []

    async def setup() -> None:  # the unpin answers with the state: no second read
        applied.append((await client.pin_schedule(None)).num_applied)

    async def after() -> None:
        control = await control_status(client)
        schedule = ", ".join(f"B<={e.batch_size}: {e.k}" for e in control.engine_schedule or ())
        report(f"{control.num_applied - applied.pop()} schedules applied during the run; "
               f"in force at its end: {schedule or 'none'}")

    return Mode(run=run, setup=setup, after=after)


def profiled(mode: Mode, pid: int, out_dir: Path, label: str) -> Mode:
    """``mode`` with its run under py-spy, the service ``pid`` and its engine core, one
    profile per run (``<label>-<n>.collapsed.txt``). Attaching and writing take seconds and
    sampling slows the process: a profiled mode's rates are for the profile, not for the
    table."""
    calls = 0

    async def profiled_run() -> int:
        nonlocal calls
        calls += 1
        profiler = start_profiler(pid, out_dir, f"{label}-{calls}", subprocesses=True)
        try:
            return await mode.run()
        finally:
            await asyncio.to_thread(stop_profiler, profiler)

    return Mode(run=profiled_run, setup=mode.setup)


def level_round(http: HttpMode, concurrency: int, waves: int) -> Round:
    """``concurrency`` requests in flight (closed loop) for ``concurrency * waves``
    requests: one wave is the whole round at ``waves=1``, under a second at c = 16 on a
    GPU, so its prefill and its last requests' tail weigh in the spread."""
    return lambda: http.run_round(concurrency, concurrency * waves)


def prompts_needed(levels: list[int], waves: int, rollout_prompts: int) -> int:
    """Distinct prompts for the largest level's round and for the rollout."""
    return max(max(levels, default=0) * waves, rollout_prompts)


def levels_arg(text: str) -> list[int]:
    """``--concurrency``: comma-separated levels; an empty string runs none (the rollout
    alone, as ``LEVELS= bash tools/gpu/batch.sh spec-bench`` asks)."""
    return [int(c) for c in text.split(",") if c.strip()]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutTail:
    """The end of one rollout (a round's wave): a decaying rollout's time is its longest
    sequences' time, so a mode that loses there loses the round."""

    num_sequences: int
    makespan_s: float
    tail_s: float
    """From the finish of the last sequence outside the tail to the rollout's end."""
    num_tail: int
    tail_drafts: int
    tail_accepted: int

    def __str__(self) -> str:
        drafts = (f"accepting {self.tail_accepted / self.tail_drafts:.3f} of their "
                  f"{self.tail_drafts} draft tokens" if self.tail_drafts else "no drafts")
        return (f"the last {self.num_tail} of {self.num_sequences} sequences took the "
                f"rollout's final {self.tail_s:.2f} of {self.makespan_s:.2f} s, {drafts}")


def rollout_tail(finishes: list[tuple[float, dict[str, Any]]], num_tail: int = 4
                 ) -> RolloutTail:
    """The tail of a rollout from ``(finish time since the rollout's start, the service's
    answer)`` per sequence: the ``num_tail`` last to finish."""
    ordered = sorted(finishes, key=lambda finish: finish[0])
    tail = ordered[-num_tail:]
    before = ordered[-num_tail - 1][0] if len(ordered) > num_tail else 0.0
    stats = [answer["outputs"][0].get("spec_decode") or {} for _, answer in tail]
    return RolloutTail(num_sequences=len(ordered), makespan_s=ordered[-1][0],
                       tail_s=ordered[-1][0] - before, num_tail=len(tail),
                       tail_drafts=sum(s.get("num_draft_tokens", 0) for s in stats),
                       tail_accepted=sum(s.get("num_accepted_tokens", 0) for s in stats))


def rollout_round(http: HttpMode, rollout: Rollout, temperature: float,
                  report: Callable[[RolloutTail], None], *, waves: int = 1) -> Round:
    """``waves`` rollouts back to back, each every prompt of ``rollout`` at once, each to its
    own length (wave w seeds prompt i with ``w * len(prompts) + i``); ``report`` gets each
    wave's :class:`RolloutTail` (the service's native API only: its answers carry the
    drafts). One wave of 512 prompts ran 2.5 s on an H100, and its rounds spread by 10%
    or more."""
    num = len(rollout.prompts)

    def body(i: int, wave: int) -> dict[str, Any]:
        return messages.GenerateRequest(
            prompt=rollout.prompts[i], max_tokens=rollout.lengths[i], temperature=temperature,
            seed=wave * num + i, ignore_eos=True).model_dump(exclude_none=True)

    async def one(i: int, wave: int, start: float) -> tuple[float, dict[str, Any]]:
        answer = await http.answer(body(i, wave))
        return time.perf_counter() - start, answer

    async def run() -> int:
        tokens = 0
        for wave in range(waves):
            start = time.perf_counter()
            finishes = await asyncio.gather(*(one(i, wave, start) for i in range(num)))
            report(rollout_tail(list(finishes)))
            tokens += sum(http.count(answer) for _, answer in finishes)
        return tokens

    return run


def round_order(names: list[str], r: int) -> list[str]:
    """The modes' order in round ``r`` (from 0): rotated by ``r // 2``, and reversed in
    odd rounds, so over each pair of rounds a mode runs once before and once after each
    neighbour. Rotation alone keeps neighbours in one order: on the H100 ``frozen`` ran
    right after ``controller``, on the same engine, in every round (2026-12-07), so a
    cost of that slot could not be told from a cost of the mode."""
    shift = (r // 2) % len(names)
    rotated = names[shift:] + names[:shift]
    return rotated[::-1] if r % 2 else rotated


async def interleaved(modes: dict[str, Mode], num_rounds: int, label: str,
                      console: Console) -> dict[str, list[float]]:
    """One warm-up per mode, then ``num_rounds`` rounds in :func:`round_order`; tokens/s
    per round, in the modes' order of ``modes``. Each
    timed round starts once the mode's setup is done and the bench's servers are back at
    rest (``bench/quiet.py``: the server of the round before may still be busy)."""
    names = list(modes)
    began = time.perf_counter()
    for mode in modes.values():
        if mode.setup is not None:
            await mode.setup()
        await mode.run()
        if mode.after is not None:
            await mode.after()
    at_rest = await rest_level()
    rates: dict[str, list[float]] = {m: [] for m in names}
    for r in range(num_rounds):
        order = round_order(names, r)
        for name in order:
            if modes[name].setup is not None:
                await modes[name].setup()
            if (busy := await before_round(at_rest)) is not None:
                console.print(f"  {label} round {r + 1}, {name}: {busy}")
            start = time.perf_counter()
            tokens = await modes[name].run()
            rates[name].append(tokens / (time.perf_counter() - start))
            if modes[name].after is not None:
                await modes[name].after()
        console.print(f"  {label} round {r + 1}: " + ", ".join(  # in the order they ran
            f"{m} {rates[m][-1]:.0f}" for m in order) + " tok/s")
    # what a workload costs in wall-clock, warm-ups, pins and waits for rest included:
    # what a device call's plan has to fit in
    console.print(f"  {label}: warm-ups and {num_rounds} rounds of {len(names)} modes in "
                  f"{time.perf_counter() - began:.0f} s")
    return rates
