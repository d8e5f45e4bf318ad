"""The engine-start deadline kills what the start spawned, and only that.

A start is modelled by what vLLM's front end does: spawn a process and block on it. The
real engine's case is tests/integration/rollout_service/test_engine_start.py.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from rollout_service.engines.start_deadline import EngineStartTimeout, StartDeadline


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"])


def test_a_start_past_its_deadline_has_its_processes_killed_and_says_so() -> None:
    before = sleeper()  # not the start's: it must survive
    try:
        with pytest.raises(EngineStartTimeout, match="engine_start_timeout_s: the engine did "
                                                     "not start within 0.2 s") as info:
            with StartDeadline(0.2):
                started = sleeper()
                started.wait(timeout=60)  # blocks until the deadline's watchdog kills it
                raise RuntimeError("Engine core initialization failed")  # as vLLM does then
        assert started.returncode == -signal.SIGKILL
        assert isinstance(info.value.__cause__, RuntimeError)
        assert before.poll() is None
    finally:
        before.kill()


def test_a_start_within_its_deadline_keeps_its_processes() -> None:
    with StartDeadline(60):
        started = sleeper()
    try:
        assert started.poll() is None
    finally:
        started.kill()
