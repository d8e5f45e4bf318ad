"""``service.gather_or_cancel``: a request's sequences, together or not at all."""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.service import gather_or_cancel


async def own_task() -> asyncio.Task[object] | None:
    return asyncio.current_task()


async def test_one_sequence_runs_in_the_callers_task() -> None:
    """No task and no turn of the event loop between a request and its engine call: in a
    burst the turn is every other arrival's callbacks."""
    assert await gather_or_cancel([own_task()]) == [asyncio.current_task()]


async def test_several_sequences_run_as_tasks_of_their_own() -> None:
    tasks = await gather_or_cancel([own_task(), own_task()])
    assert len(set(tasks)) == 2 and asyncio.current_task() not in tasks


async def test_one_sequences_failure_is_raised_as_it_is() -> None:
    async def fails() -> int:
        raise ValueError("the engine refused it")

    with pytest.raises(ValueError, match="the engine refused it"):
        await gather_or_cancel([fails()])


async def test_the_first_failure_cancels_the_others_and_is_raised_alone() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def runs_until_cancelled() -> int:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async def fails() -> int:
        await started.wait()
        raise ValueError("the second sequence failed")

    with pytest.raises(ValueError, match="the second sequence failed"):
        await gather_or_cancel([runs_until_cancelled(), fails()])
    assert cancelled.is_set()
