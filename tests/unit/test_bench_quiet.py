"""``bench/quiet.py``: a timed round waits while a process below the root is busy."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from bench.quiet import until_quiet
from tests.support.waiting import wait_for

SPIN_IN_A_CHILD = ("import subprocess, sys; "
                   "subprocess.run([sys.executable, '-c', 'while True: pass'])")


@pytest.fixture
def busy_tree() -> Iterator[psutil.Process]:
    """A process whose child spins on one core; yields the parent."""
    parent = subprocess.Popen([sys.executable, "-c", SPIN_IN_A_CHILD])
    root = psutil.Process(parent.pid)
    try:
        wait_for(root.children, lambda children: len(children) == 1, timeout_s=60)
        yield root
    finally:
        for process in (*root.children(recursive=True), root):
            process.kill()
        parent.wait(timeout=60)


async def test_a_spinning_child_keeps_the_tree_busy_until_it_stops(
        busy_tree: psutil.Process) -> None:
    busy = await until_quiet(busy_tree, timeout_s=1.0)
    assert not busy.is_quiet and busy.cores > 0.25 and busy.waited_s >= 1.0
    [spinner] = busy_tree.children()
    spinner.kill()
    spinner.wait(timeout=60)
    quiet = await until_quiet(busy_tree, timeout_s=60.0)
    assert quiet.is_quiet and quiet.cores <= 0.25
