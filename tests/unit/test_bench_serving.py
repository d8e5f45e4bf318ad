"""The closed loop of ``bench/serving.py``: a level's concurrency held from start to tail."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.serving import closed_loop


@settings(deadline=None, max_examples=40)
@given(concurrency=st.integers(1, 16), num_requests=st.integers(0, 64), seed=st.integers(0, 99))
def test_closed_loop_keeps_the_concurrency_until_the_last_requests(
        concurrency: int, num_requests: int, seed: int) -> None:
    delays = random.Random(seed)
    started: list[int] = []
    in_flight_at_start: list[int] = []
    in_flight = 0

    async def one(i: int) -> int:
        nonlocal in_flight
        started.append(i)
        in_flight += 1
        in_flight_at_start.append(in_flight)
        # requests of unequal length finish out of order, as the engine's do
        await asyncio.sleep(delays.random() * 0.002)
        in_flight -= 1
        return i + 1

    tokens = asyncio.run(closed_loop(one, concurrency, num_requests))

    assert sorted(started) == list(range(num_requests)), "each request once"
    assert tokens == sum(range(1, num_requests + 1))
    assert max(in_flight_at_start, default=0) <= concurrency
    # once the first `concurrency` are sent, every later start replaces a finished one:
    # the engine sees `concurrency` requests until fewer than that are left to send
    assert all(n == min(concurrency, num_requests) for n in in_flight_at_start[concurrency:])
