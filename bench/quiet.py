"""Before a timed round: wait until the bench's processes are idle.

Runs in the bench's process, between two interleaved rounds (``bench/serving.py``,
``bench/speculation_rounds.py``). It watches this process and every process below it:
the servers the bench started, their engine cores and workers.

Why: a server is not idle when its round's last response arrives. On the 2-core CPU
machine an idle vLLM CPU engine kept one core busy for about a second after its round
(its workers polling for the next step), and the next mode's round, on another server,
ran on what was left: the spec engine's K = 0 measured 20-22 tok/s right after
spec-off's round and 27-29 after one of its own (small model, c = 1, four pairs). With
the modes' order rotated, that penalty lands on whichever mode follows the other server,
so with fewer rounds than modes it biases the ratios instead of averaging out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import psutil

IDLE_CORES = 0.25
"""CPU use of the whole tree, in cores, below which it counts as idle (an idle service
and its engine measured 0-0.04 here)."""
WINDOW_S = 0.25
"""Each measurement of the tree's CPU use spans this long."""
TIMEOUT_S = 5.0
"""Give up waiting after this long: a tree that never gets quiet (an engine that polls
for good) must not stall the bench; the caller says so."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Quiet:
    """What one wait found."""

    is_quiet: bool
    """The tree went below :data:`IDLE_CORES` before the timeout."""
    waited_s: float
    cores: float
    """The tree's CPU use in the last window, in cores."""


def _tree_cpu_s(root: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) of ``root`` and each process below it, by pid."""
    seconds: dict[int, float] = {}
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:  # ended between the listing and the read
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


async def until_quiet(root: psutil.Process | None = None, *, idle_cores: float = IDLE_CORES,
                      window_s: float = WINDOW_S, timeout_s: float = TIMEOUT_S) -> Quiet:
    """Wait until the tree of ``root`` (default: this process) uses at most ``idle_cores``
    over one ``window_s`` (processes that start or end within a window count for the part
    they share), or ``timeout_s`` passes."""
    root, started = root or psutil.Process(), time.monotonic()
    while True:
        before = _tree_cpu_s(root)
        await asyncio.sleep(window_s)
        after = _tree_cpu_s(root)
        cores = sum(after[pid] - before[pid] for pid in after.keys() & before.keys()) / window_s
        waited_s = time.monotonic() - started
        if cores <= idle_cores or waited_s >= timeout_s:
            return Quiet(is_quiet=cores <= idle_cores, waited_s=waited_s, cores=cores)
