"""The weights coordinator's fan-out rules, driven in the test process without Ray.

The coordinator is plain asyncio (``rollout_service/serve/coordinator.py``); here its
replicas are FAKE stand-ins (``FakeReplica``) that poll and answer like engine
replicas but fail on demand: a real replica cannot be made to fail exactly one
load. The real path (two vLLM replicas behind Ray Serve) is test_serve.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.protocol.placement import ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.tensors import checkpoint_tensors
from rollout_service.serve import coordinator as coordinator_module
from rollout_service.serve.coordinator import CommandResult, WeightsCoordinator
from rollout_service.weights.intake import PushError
from tests.support.waiting import until
from trainer_client.push import layout

CHECKPOINT = checkpoint_tensors(Path(ensure_model("tiny")))
TIMINGS = messages.PushTimings(pause_s=0, load_main_s=0, finalize_main_s=0, load_draft_s=0,
                               finalize_draft_s=0, resume_s=0, total_s=0.1)


class FakeReplica:
    """FAKE engine replica: registers, polls, and answers each load with ``answer``
    (None: never answers). Like an engine replica, a load moves its versions and it
    reports ``lagging`` until a commit tells it the deployment's versions, which it
    records and acknowledges with its report (unless ``answers_commits`` is off); each
    poll's commands reach it ``latency_s`` after the coordinator hands them out (Ray's
    round trip, which a real replica's commit also waits out)."""

    def __init__(self, coordinator: WeightsCoordinator, name: str,
                 answer: CommandResult | None,
                 speculation: messages.SpeculationInfo | None = None, *,
                 latency_s: float = 0.0, answers_commits: bool = True) -> None:
        self.coordinator, self.name, self.answer = coordinator, name, answer
        self.speculation = speculation
        self.latency_s, self.answers_commits = latency_s, answers_commits
        self.versions: tuple[int | None, int | None] = (None, None)
        self.expected: tuple[int | None, int | None] = (None, None)
        self.committed: tuple[int | None, int | None] | None = None

    async def run(self) -> None:
        snapshot = await self.coordinator.register(self.report())
        self.expected = (snapshot.main_version, snapshot.draft_version)
        await self.coordinator.replayed(self.name)
        while True:
            commands = await self.coordinator.poll(self.report())
            if commands and self.latency_s:
                await asyncio.sleep(self.latency_s)
            for command in commands:
                if command.kind == "commit":
                    self.committed = self.expected = (command.main_version,
                                                      command.draft_version)
                    if self.answers_commits:
                        await self.coordinator.ack(self.name, command.id, CommandResult(
                            ok=True, report=self.report()))
                elif command.kind == "load" and self.answer is not None:
                    if self.answer.ok:
                        version = command.push.begin.version
                        self.versions = (version, version)
                    await self.coordinator.ack(self.name, command.id, self.answer)

    def report(self) -> messages.ReplicaHealth:
        return messages.ReplicaHealth(replica=self.name,
                                      status="ok" if self.versions == self.expected
                                      else "lagging",
                                      main_version=self.versions[0],
                                      draft_version=self.versions[1],
                                      speculation=self.speculation)


@pytest.fixture
def segment() -> Iterator[Segment]:
    sizes = [meta.nbytes for meta in CHECKPOINT.values()]
    _, nbytes = layout(sizes)
    with Segment.create("mtp-rollout-test-coordinator", nbytes) as seg:
        yield seg


def _placements(segment: Segment) -> list[TensorPlacement]:
    names = list(CHECKPOINT)
    offsets, _ = layout([CHECKPOINT[n].nbytes for n in names])
    return [TensorPlacement(name=n, dtype=CHECKPOINT[n].dtype, shape=CHECKPOINT[n].shape,
                            location=ShmLocation(segment=segment.name, offset=o))
            for n, o in zip(names, offsets, strict=True)]


async def _begin(coordinator: WeightsCoordinator, segment: Segment, version: int
                 ) -> messages.PushBeginResponse:
    return await coordinator.begin(messages.PushBeginRequest(
        version=version, segment=segment.name, segment_bytes=segment.nbytes,
        total_bytes=sum(m.nbytes for m in CHECKPOINT.values()),
        params=[messages.ParamSpec(name=n, shape=list(m.shape), dtype=m.dtype)
                for n, m in CHECKPOINT.items()]))


async def _push(coordinator: WeightsCoordinator, segment: Segment, version: int
                ) -> messages.PushFinishResponse:
    begun = await _begin(coordinator, segment, version)
    await coordinator.update(messages.PushUpdateRequest(push_id=begun.push_id,
                                                        tensors=_placements(segment)))
    return await coordinator.finish(messages.PushFinishRequest(push_id=begun.push_id))


async def _with(answers: dict[str, CommandResult | None], ack_timeout_s: float = 5.0,
                push_timeout_s: float = 10.0, **fake: Any
                ) -> tuple[WeightsCoordinator, dict[str, FakeReplica], list[asyncio.Task]]:
    coordinator = WeightsCoordinator(CHECKPOINT, has_draft=True, push_timeout_s=push_timeout_s,
                                     ack_timeout_s=ack_timeout_s)
    replicas = {n: FakeReplica(coordinator, n, a, **fake) for n, a in answers.items()}
    tasks = [asyncio.create_task(r.run()) for r in replicas.values()]
    await _until_registered(coordinator, len(replicas))
    return coordinator, replicas, tasks


async def _until_registered(coordinator: WeightsCoordinator, count: int) -> None:
    async def registered() -> int:
        return len(coordinator.replicas())

    await until(registered, lambda n: n >= count, timeout_s=30, interval_s=0.01)


def _served(coordinator: WeightsCoordinator) -> set[tuple[int | None, int | None, str]]:
    """What ``/health`` lists for the replicas: each one's versions and status."""
    return {(r.main_version, r.draft_version, r.status) for r in coordinator.replicas()}


LOADED = CommandResult(ok=True, finish=messages.PushFinishResponse(
    version=1, target="both", num_bytes=1, timings=TIMINGS, num_requests_held=3))


async def test_every_replica_loads_then_all_commit(segment: Segment) -> None:
    coordinator, replicas, tasks = await _with({"a": LOADED, "b": LOADED})
    finished = await _push(coordinator, segment, version=1)
    assert sorted(finished.replicas) == ["a", "b"]
    assert finished.num_requests_held == 6  # every replica's held requests crossed the push
    assert {r.committed for r in replicas.values()} == {(1, 1)}
    assert coordinator.status().consistent and coordinator.status().main_version == 1
    for task in tasks:
        task.cancel()


async def test_when_a_push_returns_every_replica_reports_the_committed_versions(
        segment: Segment) -> None:
    """``finish`` returns once every replica has applied the commit and answered with
    its state: ``/health`` (``replicas()``) then lists each at the new versions, ``ok``.
    Each replica's polls bring its state one poll late (here ``latency_s``), so without
    those answers a replica showed its versions from before the load, or ``lagging``."""
    coordinator, replicas, tasks = await _with({"a": LOADED, "b": LOADED}, latency_s=0.3)
    await _push(coordinator, segment, version=1)
    assert _served(coordinator) == {(1, 1, "ok")}
    assert {r.committed for r in replicas.values()} == {(1, 1)}
    for task in tasks:
        task.cancel()


async def test_a_commit_left_unanswered_fails_no_push(segment: Segment,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The versions are the deployment's once a replica loaded them: a replica that does
    not answer its commit (within a shortened deadline here) is logged, not failed."""
    monkeypatch.setattr(coordinator_module, "COMMIT_ACK_TIMEOUT_S", 0.5)
    coordinator, replicas, tasks = await _with({"a": LOADED}, answers_commits=False)
    finished = await _push(coordinator, segment, version=1)
    assert finished.replicas == ["a"] and replicas["a"].committed == (1, 1)
    assert coordinator.status().main_version == 1
    assert coordinator.status().last_push.outcome == "loaded"
    for task in tasks:
        task.cancel()


async def test_an_answer_from_an_unknown_replica_adds_nothing() -> None:
    """A commit's answer carries a report; from a replica the coordinator does not know
    (forgotten after :data:`KEEP_GONE_S`, or never seen) it lists nothing."""
    coordinator = WeightsCoordinator(CHECKPOINT, has_draft=True, push_timeout_s=10.0,
                                     ack_timeout_s=5.0)
    await coordinator.ack("stranger", "c1", CommandResult(ok=True, report=(
        messages.ReplicaHealth(replica="stranger", status="ok", main_version=1))))
    assert coordinator.replicas() == []


async def test_a_replica_failing_names_it_and_the_others_roll_forward(segment: Segment
                                                                       ) -> None:
    died = CommandResult(ok=False, status=500, message="the engine failed while loading")
    coordinator, replicas, tasks = await _with({"a": LOADED, "b": died})
    with pytest.raises(PushError) as failed:
        await _push(coordinator, segment, version=1)
    assert failed.value.status == 500
    assert "replica b: the engine failed while loading" in str(failed.value)
    assert "loaded on a" in str(failed.value)
    # the deployment's version moved with the replica that loaded; b must refuse (lagging)
    assert {r.committed for r in replicas.values()} == {(1, 1)}
    assert replicas["b"].versions == (None, None)
    assert _served(coordinator) == {(1, 1, "ok"), (None, None, "lagging")}
    status = coordinator.status()
    assert status.main_version == 1 and not status.consistent
    assert status.last_push.outcome == "failed"
    for task in tasks:
        task.cancel()


async def test_no_replica_loading_changes_nothing_and_a_silent_one_times_out(
        segment: Segment) -> None:
    refused = CommandResult(ok=False, status=409, message="version: 1 is not newer")
    coordinator, _, tasks = await _with({"a": refused, "b": None}, ack_timeout_s=1.5)
    with pytest.raises(PushError) as failed:
        await _push(coordinator, segment, version=1)
    assert failed.value.status == 504
    assert "replica a: version: 1 is not newer" in str(failed.value)
    assert "replica b: no answer within push_ack_timeout_s" in str(failed.value)
    assert coordinator.status().main_version is None
    assert coordinator.status().last_push.outcome == "failed"
    for task in tasks:
        task.cancel()


async def test_a_bad_announcement_never_reaches_a_replica(segment: Segment) -> None:
    coordinator, replicas, tasks = await _with({"a": LOADED})
    with pytest.raises(PushError) as rejected:
        await coordinator.begin(messages.PushBeginRequest(
            version=1, segment=segment.name, segment_bytes=segment.nbytes, total_bytes=1,
            params=[messages.ParamSpec(name="nope", shape=[1], dtype="bfloat16")]))
    assert rejected.value.status == 400 and "'nope'" in str(rejected.value)
    assert coordinator.status().active_push_id is None
    assert replicas["a"].versions == (None, None)
    for task in tasks:
        task.cancel()


async def test_a_replica_joining_during_a_long_push_replays_nothing(segment: Segment) -> None:
    """A push kept open past the registration wait may be rewriting the segment: the
    joining replica must not replay the last push from it (it would load a mix)."""
    coordinator, _, tasks = await _with({"a": LOADED}, push_timeout_s=1.0)
    await _push(coordinator, segment, version=1)  # the push a replica would replay
    begun = await _begin(coordinator, segment, version=2)
    joining = asyncio.create_task(coordinator.register(messages.ReplicaHealth(
        replica="late", status="starting")))
    slots = iter(_placements(segment))
    while not joining.done():  # a slow trainer, alive: one tensor every 0.3 s
        await coordinator.update(messages.PushUpdateRequest(push_id=begun.push_id,
                                                            tensors=[next(slots)]))
        await asyncio.sleep(0.3)
    snapshot = joining.result()
    assert snapshot.last_push is None
    assert snapshot.main_version == 1
    assert coordinator.status().active_push_id == begun.push_id
    for task in tasks:
        task.cancel()


async def test_a_drafter_push_is_refused_at_begin_when_a_replica_has_no_pushable_drafter(
        segment: Segment) -> None:
    """An engine drafting with n-grams has no drafter weights: ``both`` must be refused
    before any replica is asked to load, ``main`` still goes through."""
    coordinator = WeightsCoordinator(CHECKPOINT, has_draft=True, push_timeout_s=10.0,
                                     ack_timeout_s=5.0)
    ngram = messages.SpeculationInfo(is_enabled=True, method="ngram", num_speculative_tokens=2,
                                     has_pushable_drafter=False)
    mtp = ngram.model_copy(update={"method": "mtp", "has_pushable_drafter": True})
    replicas = [FakeReplica(coordinator, "a", LOADED, mtp),
                FakeReplica(coordinator, "b", LOADED, ngram)]
    tasks = [asyncio.create_task(r.run()) for r in replicas]
    await _until_registered(coordinator, 2)
    with pytest.raises(PushError, match="target: 'both' needs a drafter a push can load; "
                                        "replica b") as refused:
        await _begin(coordinator, segment, version=1)
    assert refused.value.status == 400
    assert coordinator.status().last_push.outcome == "rejected"
    assert coordinator.status().active_push_id is None
    assert [r.versions for r in replicas] == [(None, None), (None, None)]
    begun = await coordinator.begin(messages.PushBeginRequest(
        version=1, target="main", segment=segment.name, segment_bytes=segment.nbytes,
        total_bytes=sum(m.nbytes for m in CHECKPOINT.values()),
        params=[messages.ParamSpec(name=n, shape=list(m.shape), dtype=m.dtype)
                for n, m in CHECKPOINT.items()]))
    assert coordinator.status().active_push_id == begun.push_id
    for task in tasks:
        task.cancel()
