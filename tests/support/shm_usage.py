"""Which files under /dev/shm a set of processes maps or holds open, sampled while a push
runs: how the tests show that a ``nccl`` push touches no shared memory.

Only the processes of the push are looked at (the service's or the replicas' process
trees and the trainer's), from ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``: the machine's
other processes (another test run's engines) create their own files under /dev/shm at any
time, which a listing of the directory would blame on the push.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

SHM = "/dev/shm/"


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes map or hold open now."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SHM):
                        found.add(fields[5].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM):
                    found.add(target)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


class ShmUsage:
    """What :func:`new_shm_files` found: ``new`` (complete once its block ended) and how
    many samples it took so far."""

    def __init__(self) -> None:
        self.new: set[str] = set()
        self.num_samples = 0


@contextmanager
def new_shm_files(pids: Callable[[], list[int]], interval_s: float = 0.02
                  ) -> Iterator[ShmUsage]:
    """Yield a :class:`ShmUsage` whose ``new``, once the block ends, holds every /dev/shm
    file the processes ``pids()`` mapped or opened while it ran and not before (sampled
    every ``interval_s``, and once more at the end)."""
    before = shm_files(pids())
    usage, seen = ShmUsage(), set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            seen.update(shm_files(pids()))
            usage.num_samples += 1

    sampler = threading.Thread(target=sample, daemon=True, name="shm-sampler")
    sampler.start()
    try:
        yield usage
    finally:
        stop.set()
        sampler.join(10)
        seen.update(shm_files(pids()))
        usage.new.update(seen - before)
