"""A serving benchmark's rounds and what each cost in CPU (``bench/serving.py``).

Runs in the benchmark's process. Modes are measured round by round in rotating order,
each round once the servers are back at rest (``bench/quiet.py``), and charged the CPU
of the processes it runs through (:class:`FrontEnd`): a front end's CPU per request is
how long its one event loop takes to hand a wave of requests on, one after another, so
two front ends in a row (the service, then the SGLang server it launched) show as two
such stages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

import psutil
from rich.console import Console

from bench.quiet import before_round, rest_level

RoundFn = Callable[[int, int], Awaitable[int]]
"""``run_round(concurrency, num_requests) -> tokens generated``."""


@dataclasses.dataclass(frozen=True, slots=True)
class FrontEnd:
    """The processes whose CPU a mode's round is charged: ``pids``, the mode's front end
    (the ones that run vLLM's output handler and the HTTP server: this process for
    ``asyncllm``, the server's otherwise, Serve's proxy, ingress and engine replicas for
    ``ray-serve``); ``engine_pid``, for a service in front of an SGLang server it
    launched, that server's own front end (its HTTP server and tokenizer manager), a
    second stage every request crosses."""

    pids: tuple[int, ...]
    engine_pid: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RoundCpu:
    """One mode's round: the CPU seconds the bench process (the client; for ``asyncllm``
    also the front end), the busiest front-end process and the engine's front end
    (:class:`FrontEnd`; None without one) used, the round's wall seconds and requests."""

    client_s: float
    front_end_s: float
    engine_front_end_s: float | None
    wall_s: float
    num_requests: int


@dataclasses.dataclass(kw_only=True, slots=True)
class Rates:
    """Per-round figures of each mode at one concurrency, in round order: tokens/s and
    the CPU its processes used (:class:`RoundCpu`). In cores (1.0 = one core busy the
    whole round), a front end near 1.0 is a saturated event loop, as is a client near 1.0;
    per request, a front end's CPU is how long its one event loop takes to hand a wave of
    requests to the engine, one after another."""

    by_mode: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    cpu: dict[str, list[RoundCpu]] = dataclasses.field(default_factory=dict)

    def add(self, mode: str, rate: float, cpu: RoundCpu) -> None:
        self.by_mode.setdefault(mode, []).append(rate)
        self.cpu.setdefault(mode, []).append(cpu)

    def client_cores(self, mode: str) -> list[float]:
        return [c.client_s / c.wall_s for c in self.cpu[mode]]

    def front_end_cores(self, mode: str) -> list[float]:
        return [c.front_end_s / c.wall_s for c in self.cpu[mode]]

    def front_end_ms(self, mode: str) -> list[float]:
        """The busiest front-end process's CPU ms per request, per round."""
        return [1e3 * c.front_end_s / c.num_requests for c in self.cpu[mode]]

    def engine_front_end_ms(self, mode: str) -> list[float] | None:
        """The engine's front end's CPU ms per request, per round; None: the mode has none."""
        if self.cpu[mode][0].engine_front_end_s is None:
            return None
        return [1e3 * (c.engine_front_end_s or 0.0) / c.num_requests for c in self.cpu[mode]]


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure(rounds: dict[str, RoundFn], front_ends: dict[str, FrontEnd],
                  concurrency: int, num_requests: int, num_rounds: int,
                  console: Console) -> Rates:
    """A warm-up round per mode, then ``num_rounds`` rounds with the modes' order rotated;
    each round ``num_requests`` requests, ``concurrency`` in flight, started once the
    servers are back at rest (``bench/quiet.py``); each charged its processes' CPU
    (``front_ends``, :class:`FrontEnd`)."""
    modes = list(rounds)
    for mode in modes:
        await rounds[mode](concurrency, num_requests)
    at_rest = await rest_level()
    rates = Rates()
    for r in range(num_rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            if (busy := await before_round(at_rest)) is not None:
                console.print(f"  c={concurrency} round {r + 1}, {mode}: {busy}")
            meter = CpuMeter(front_ends[mode])
            start = time.perf_counter()
            tokens = await rounds[mode](concurrency, num_requests)
            wall = time.perf_counter() - start
            rates.add(mode, tokens / wall, meter.read(wall, num_requests))
        console.print(f"  c={concurrency} round {r + 1}: " + ", ".join(
            f"{m} {rates.by_mode[m][-1]:.0f} (front end {rates.front_end_cores(m)[-1]:.2f} "
            f"cores, {rates.front_end_ms(m)[-1]:.3f} ms/request"
            + (f", engine's {engine[-1]:.3f}"
               if (engine := rates.engine_front_end_ms(m)) is not None else "")
            + f"; client {rates.client_cores(m)[-1]:.2f} cores)" for m in modes) + " tok/s")
    return rates


class CpuMeter:
    """CPU seconds since construction of this process and a :class:`FrontEnd`'s."""

    def __init__(self, front_end: FrontEnd) -> None:
        self._me = psutil.Process()
        self._front = [psutil.Process(pid) for pid in front_end.pids]
        self._engine = (psutil.Process(front_end.engine_pid)
                        if front_end.engine_pid is not None else None)
        self._client_0 = cpu_seconds(self._me)
        self._front_0 = [cpu_seconds(p) for p in self._front]
        self._engine_0 = cpu_seconds(self._engine) if self._engine is not None else 0.0

    def read(self, wall_s: float, num_requests: int) -> RoundCpu:
        engine = (cpu_seconds(self._engine) - self._engine_0
                  if self._engine is not None else None)
        return RoundCpu(client_s=cpu_seconds(self._me) - self._client_0,
                        front_end_s=max(cpu_seconds(p) - s
                                        for p, s in zip(self._front, self._front_0)),
                        engine_front_end_s=engine, wall_s=wall_s, num_requests=num_requests)
