"""``serve/start_lock.py``: replicas naming one lock file start their engines one at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout_service.serve.start_lock import one_start_at_a_time


async def _starts(paths: list[Path | None]) -> list[tuple[str, int]]:
    """Each replica's engine start (a short sleep) under its lock; the events in order."""
    events: list[tuple[str, int]] = []

    async def replica(i: int, path: Path | None) -> None:
        async with one_start_at_a_time(path):
            events.append(("start", i))
            await asyncio.sleep(0.05)
            events.append(("end", i))

    await asyncio.gather(*(replica(i, p) for i, p in enumerate(paths)))
    return events


def test_replicas_naming_one_lock_never_start_together(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "engine-start.lock"
    events = asyncio.run(_starts([lock, lock, lock]))
    # each start ends before the next one begins
    assert [kind for kind, _ in events] == ["start", "end"] * 3
    assert sorted(i for kind, i in events if kind == "start") == [0, 1, 2]


def test_without_a_lock_or_with_different_ones_they_start_together(tmp_path: Path) -> None:
    for paths in ([None, None], [tmp_path / "a.lock", tmp_path / "b.lock"]):
        events = asyncio.run(_starts(paths))
        assert [kind for kind, _ in events] == ["start", "start", "end", "end"]


def test_a_lock_whose_holder_failed_is_free_again(tmp_path: Path) -> None:
    lock = tmp_path / "engine-start.lock"

    async def failing_start() -> None:
        async with one_start_at_a_time(lock):
            raise RuntimeError("engine died at start")

    async def both() -> list[tuple[str, int]]:
        try:
            await failing_start()
        except RuntimeError:
            pass
        return await asyncio.wait_for(_starts([lock]), timeout=5)

    assert asyncio.run(both()) == [("start", 0), ("end", 0)]
