"""Waiting for an observable condition with a deadline: how every test waits for an
engine, a push, a scrape or a fake replica (never a bare ``sleep``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T], condition: Callable[[T], bool], *, timeout_s: float,
             interval_s: float = 0.2) -> T:
    """Probe until ``condition`` holds; return the value that satisfied it.

    Raises:
        TimeoutError: with the last value probed, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if condition(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s:g} s; last: {value!r}")
        time.sleep(interval_s)


async def until(probe: Callable[[], Awaitable[T]], condition: Callable[[T], bool], *,
                timeout_s: float, interval_s: float = 0.1) -> T:
    """:func:`wait_for` for async probes, without blocking the event loop.

    Raises:
        TimeoutError: with the last value probed, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if condition(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s:g} s; last: {value!r}")
        await asyncio.sleep(interval_s)


async def first_caught(attempt: Callable[[], Awaitable[T | None]], *, attempts: int = 3,
                       timeout_s: float = 90.0, what: str) -> T:
    """The first run of ``attempt`` that caught what it tried to (None: it did not): at
    least ``attempts`` runs, and more until ``timeout_s`` has passed. For a test that must
    catch a request still running: on the busy 2-core machine the test process can be
    starved until a request it just saw start has generated every token, and then no
    ordering of its calls can freeze or abort it. Starvation comes in bursts (a CI run
    once lost two tests' three attempts each beside another process's start), so the
    attempts go on for a while rather than a fixed number of times.

    Raises:
        AssertionError: no attempt caught it.
    """
    deadline = time.monotonic() + timeout_s
    tried = 0
    while tried < attempts or time.monotonic() < deadline:
        caught = await attempt()
        tried += 1
        if caught is not None:
            return caught
    raise AssertionError(f"{tried} attempts in {timeout_s:g} s or more, and {what} every time: "
                         "the test process was starved each time, or the service let the "
                         "request finish")
