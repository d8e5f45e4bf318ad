"""Run a Megatron check in a fresh spawned process and fail the test with its traceback.

Megatron keeps process-global state (parallel_state, CPU patches, RNG trackers), so
each model-level check runs in its own interpreter. The target reports through a
queue: ``None`` for success, else the formatted traceback.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest


def run_spawned(target: Callable[..., None], *args: Any, timeout_s: float) -> None:
    """Run ``target(*args, errors)`` in a spawned process; fail on error, death or timeout."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, errors))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.is_alive() and errors.empty() and time.monotonic() < deadline:
            time.sleep(0.2)
        if errors.empty() and not proc.is_alive():
            pytest.fail(f"spawned check died with exit code {proc.exitcode}")
        if errors.empty():
            pytest.fail(f"spawned check did not finish in {timeout_s:g} s")
        error = errors.get()
        assert error is None, error
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
