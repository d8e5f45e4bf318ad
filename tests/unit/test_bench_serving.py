"""The workload of ``bench/serving.py``: a level's concurrency held from start to tail by
the closed loop, and each request's own length with ``--length-spread``."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.serving import closed_loop
from bench.serving_http import Workload, service_request, spread_lengths


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


@settings(deadline=None, max_examples=30)
@given(mean=st.integers(1, 512), spread=st.floats(0.0, 0.95))
def test_spread_lengths_stay_in_their_band_and_are_the_same_each_time(
        mean: int, spread: float) -> None:
    lengths = spread_lengths(256, mean, spread)
    assert lengths == spread_lengths(256, mean, spread), "every mode and round alike"
    if spread == 0:
        assert lengths == ()
        return
    assert len(lengths) == 256
    assert all(max(1, round(mean * (1 - spread))) <= n <= round(mean * (1 + spread)) + 1
               for n in lengths)


def test_every_dialect_sends_each_request_its_own_length() -> None:
    """A mode that sent the mean would compare a uniform workload with a spread one."""
    lengths = spread_lengths(8, 100, 0.5)
    workload = Workload(prompts=tuple(f"p{i}" for i in range(8)), max_tokens=100,
                        temperature=1.0, lengths=lengths)
    assert len(set(lengths)) > 1
    sent = {
        "service": lambda body: body["max_tokens"],
        "service-openai": lambda body: body["max_tokens"],
        "service-sglang": lambda body: body["sampling_params"]["max_new_tokens"],
    }
    for mode, tokens in sent.items():
        body, _ = service_request(mode, workload, "m")
        assert [tokens(body(i)) for i in range(8)] == list(lengths), mode


def test_a_spread_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="length spread"):
        spread_lengths(4, 100, 1.0)
