"""Before a timed round: wait until the bench's processes are back at rest.

Runs in the bench's process, between two interleaved rounds (``bench/serving.py``,
``bench/speculation_rounds.py``). It watches this process and every process below it:
the servers the bench started, their engine cores and workers.

Why: a server is not at rest when its round's last response arrives. On the 2-core CPU
machine an idle vLLM CPU engine kept one core busy for about a second after its round
(its workers polling for the next step), and the next mode's round, on another server,
ran on what was left: the spec engine's K = 0 measured 20-22 tok/s right after
spec-off's round and 27-29 after one of its own (small model, c = 1, four pairs). With
the modes' order rotated, that penalty lands on whichever mode follows the other server,
so with fewer rounds than modes it biases the ratios instead of averaging out.

At rest is relative: an SGLang scheduler started without ``--sleep-on-idle`` spins a core
for good (sgl-project/sglang issues #1730 and #9863), so the caller measures the tree's
level at rest once (:func:`rest_level`) and waits for that level plus
:data:`MARGIN_CORES`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import psutil

MARGIN_CORES = 0.25
"""CPU use above the level at rest, in cores, that still counts as at rest (an idle vLLM
service and its engine measured 0-0.04 cores here)."""
WINDOW_S = 0.1
"""Each measurement of the tree's CPU use spans this long (10 clock ticks of psutil's
CPU times); every timed round pays at least one."""
TIMEOUT_S = 5.0
"""Give up waiting after this long: a tree that does not settle must not stall the bench;
the caller says so."""
REST_S = 3.0
"""How long :func:`rest_level` watches: longer than a server's busy tail after a round."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Quiet:
    """What one wait found."""

    is_quiet: bool
    """The tree came down to the level asked before the timeout."""
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


async def _window_cores(root: psutil.Process, window_s: float) -> float:
    """The tree's CPU use over one window, in cores; a process that starts or ends within
    the window is not counted."""
    before, started = _tree_cpu_s(root), time.monotonic()
    await asyncio.sleep(window_s)
    after, elapsed_s = _tree_cpu_s(root), time.monotonic() - started
    return sum(after[pid] - before[pid] for pid in after.keys() & before.keys()) / elapsed_s


async def rest_level(root: psutil.Process | None = None, *, duration_s: float = REST_S,
                     window_s: float = WINDOW_S) -> float:
    """The CPU use of the tree of ``root`` (default: this process) at rest, in cores: the
    least of its windows over ``duration_s``. Call it with nothing running."""
    root, started, least = root or psutil.Process(), time.monotonic(), float("inf")
    while time.monotonic() - started < duration_s:
        least = min(least, await _window_cores(root, window_s))
    return least


async def until_quiet(root: psutil.Process | None = None, *, max_cores: float = MARGIN_CORES,
                      window_s: float = WINDOW_S, timeout_s: float = TIMEOUT_S) -> Quiet:
    """Wait until the tree of ``root`` (default: this process) uses at most ``max_cores``
    over one ``window_s``, or ``timeout_s`` passes."""
    root, started = root or psutil.Process(), time.monotonic()
    while True:
        cores = await _window_cores(root, window_s)
        waited_s = time.monotonic() - started
        if cores <= max_cores or waited_s >= timeout_s:
            return Quiet(is_quiet=cores <= max_cores, waited_s=waited_s, cores=cores)


async def before_round(at_rest: float) -> str | None:
    """Wait until the tree is back within :data:`MARGIN_CORES` of ``at_rest`` (its
    :func:`rest_level`); None once it is, else what the round starts with anyway."""
    quiet = await until_quiet(max_cores=at_rest + MARGIN_CORES)
    return None if quiet.is_quiet else (
        f"started with the servers at {quiet.cores:.2f} cores (at rest {at_rest:.2f}) after "
        f"{quiet.waited_s:.0f} s")
