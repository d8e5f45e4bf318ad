"""``bench/quiet.py``: a timed round waits while a process below the root is busy, and
``bench/speculation_rounds.interleaved`` waits for it, a mode's setup outside the timer."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from rich.console import Console

from bench import speculation_rounds
from bench.quiet import rest_level, until_quiet
from bench.speculation_rounds import Mode, interleaved
from tests.support.waiting import wait_for

SPIN = "while True: pass"
LEVEL = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
         "time.sleep(600)")
"""A process that starts ``child`` and stays alive."""


def has_ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def busy_tree() -> Iterator[psutil.Process]:
    """A process, its idle child, and that child's child spinning on one core: yields the
    top one (the spinner is two levels below it, as an engine's workers are below the
    bench)."""
    top = subprocess.Popen([sys.executable, "-c", LEVEL.format(child=LEVEL.format(
        child=SPIN))])
    root = psutil.Process(top.pid)
    try:
        wait_for(lambda: root.children(recursive=True), lambda below: len(below) == 2,
                 timeout_s=60)
        yield root
    finally:
        for process in (*root.children(recursive=True), root):
            process.kill()
        top.wait(timeout=60)


async def test_a_spinning_grandchild_keeps_the_tree_busy_until_it_stops(
        busy_tree: psutil.Process) -> None:
    busy = await until_quiet(busy_tree, timeout_s=1.0)
    assert not busy.is_quiet and busy.cores > 0.25 and busy.waited_s >= 1.0
    [child] = busy_tree.children()
    [spinner] = child.children()
    spinner.kill()  # a zombie then, its parent sleeping: it uses no CPU
    wait_for(lambda: has_ended(spinner), bool, timeout_s=60)
    assert child.is_running()  # the tree lives on, at rest
    quiet = await until_quiet(busy_tree, timeout_s=60.0)
    assert quiet.is_quiet and quiet.cores <= 0.25
    assert await rest_level(busy_tree, duration_s=0.5) <= 0.25


async def test_a_round_starts_after_its_setup_and_the_wait_and_only_it_is_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The setup (a pin) and the wait run before each timed round, outside its timer."""
    events: list[str] = []

    async def at_rest() -> float:
        return 0.0

    async def wait(level: float) -> None:
        events.append("wait")

    monkeypatch.setattr(speculation_rounds, "rest_level", at_rest)
    monkeypatch.setattr(speculation_rounds, "before_round", wait)

    def mode(name: str) -> Mode:
        async def setup() -> None:
            events.append(f"setup {name}")
            time.sleep(0.3)  # a slow pin: timed, it would cap the rate at 333 tok/s

        async def run() -> int:
            events.append(f"run {name}")
            return 100

        return Mode(run=run, setup=setup)

    rates = await interleaved({"a": mode("a"), "b": mode("b")}, 2, "test", Console(quiet=True))
    warm_up = ["setup a", "run a", "setup b", "run b"]
    assert events == [*warm_up, "setup a", "wait", "run a", "setup b", "wait", "run b",
                      "setup b", "wait", "run b", "setup a", "wait", "run a"]
    assert all(rate > 400 for rate in rates["a"] + rates["b"])  # 100 tokens in < 0.25 s
