"""Run a Megatron check in a fresh spawned process and fail the test with its traceback.

Megatron keeps process-global state (parallel_state, CPU patches, RNG trackers), so
each model-level check runs in its own interpreter. The target reports through a
queue: ``None`` for success, else the formatted traceback.
"""

from __future__ import annotations

import atexit
import multiprocessing
import queue
import shutil
import tempfile
import time
import traceback
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


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float) -> dict[int, Any]:
    """Run ``target(rank, *args)`` in ``world_size`` spawned processes; their returns by rank.

    A rank's exception fails the test with its traceback; a rank that dies, hangs past
    ``timeout_s`` or never reports fails it too (the others are killed)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(target, rank, args, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline, outcome = time.monotonic() + timeout_s, {}
    num_grace_polls = 4  # a rank's report can trail its exit through the queue's pipe
    try:
        while len(outcome) < world_size:
            try:
                rank, error, value = results.get(timeout=0.5)
            except queue.Empty:
                is_dead = any(not p.is_alive() for r, p in enumerate(procs) if r not in outcome)
                num_grace_polls -= is_dead
                if time.monotonic() > deadline or num_grace_polls <= 0:
                    pytest.fail(f"ranks reported {sorted(outcome)} of {world_size} in time; "
                                f"exit codes {[p.exitcode for p in procs]}")
                continue
            assert error is None, f"rank {rank}: {error}"
            outcome[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return outcome


def _report(target: Callable[..., Any], rank: int, args: tuple, results: Any) -> None:
    try:
        value = target(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, f"{exc!r}\n{traceback.format_exc()}", None))
        return
    results.put((rank, None, value))


def rendezvous_address() -> str:
    """A ``file://`` rendezvous address for ``torch.distributed.init_process_group``: a
    new file in a new temporary folder, which the ranks' store creates and removes.

    Not a free TCP port: a port found free here is bound by rank 0 only seconds later,
    once its interpreter has started, and a test run beside another took it meanwhile
    (EADDRINUSE in a clean-clone run, 2026-12-02). A file cannot be taken.
    """
    folder = tempfile.mkdtemp(prefix="rollout-rendezvous-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # what killed ranks leave
    return f"file://{folder}/store"
