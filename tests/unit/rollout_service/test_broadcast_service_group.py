"""The service's side of the ``nccl`` transport, over a FAKE engine (``FakeWorkers``: only
the engine's RPCs are faked, the trainer's store and its counters are real): the group
has one owner until released, a lease that ends an idle owner's hold, ranks that must fit
the trainer's world, a store that must answer, the request's bounds, and a bucket waited
for in the store before the workers are asked.

The trainer's store is the ``rendezvous`` fixture (``conftest.py``). The whole path through
the real CPU engine is ``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from rollout_service.engines.broadcast_engine import BucketReceive, WorkerReceive
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import GroupSpec, Rendezvous
from rollout_service.protocol.store import BucketInfo
from rollout_service.weights.checks import PushError
from tests.support.broadcast_groups import bucket, group_numbers
from tests.support.waiting import until


class FakeWorkers:
    """FAKE :class:`~rollout_service.engines.broadcast_engine.BroadcastEngine`: two
    workers that join at once and whose receive of a bucket ends ``receive_s`` after it
    starts, counted in the trainer's real store as the real workers count themselves
    (``Group.receive_bucket``); it records when its workers' bucket states were asked."""

    num_workers = 2
    group_backends = ("gloo",)

    def __init__(self, receive_s: float = 0.0) -> None:
        self.receive_s = receive_s
        self.asks: list[float] = []
        self.left = 0
        self._spec: GroupSpec | None = None
        self._ended = threading.Event()

    async def join_group(self, spec: GroupSpec) -> None:
        self._spec = spec

    async def group_state(self, group_id: str) -> list[str]:
        return ["done"] * self.num_workers

    async def leave_group(self) -> None:
        self.left += 1

    async def start_bucket(self, receive: BucketReceive, bucket: BucketInfo) -> None:
        assert self._spec is not None
        store = dist.PrefixStore(self._spec.group_id, dist.TCPStore(
            self._spec.master_address, self._spec.master_port, None, False,
            datetime.timedelta(seconds=10)))

        def receive_it() -> None:
            time.sleep(self.receive_s)  # the broadcast, as long as it takes
            self._ended.set()
            for _ in range(self.num_workers):
                store.add(f"finished/{receive.push_id}/{bucket.index}/"
                          f"{self._spec.rank_offset}", 1)  # type: ignore[union-attr]

        threading.Thread(target=receive_it, daemon=True).start()

    async def bucket_states(self, push_id: str, index: int) -> list[str]:
        self.asks.append(time.monotonic())
        return ["done" if self._ended.is_set() else "running"] * self.num_workers

    async def receive_reports(self, push_id: str, num_buckets: int) -> list[WorkerReceive]:
        return [WorkerReceive(state="done", peak_bytes=64)] * self.num_workers


def group_request(rendezvous: Rendezvous, **changes: object) -> messages.WeightGroupRequest:
    body = {"group_id": f"trainer-{next(group_numbers)}", "master_address": rendezvous.address,
            "master_port": rendezvous.port, "world_size": 3}
    body.update(changes)
    return messages.WeightGroupRequest.model_validate(body)


def groups_of(engine: FakeWorkers, tmp_path: Path, lease_s: float = 600.0):  # noqa: ANN201
    from rollout_service.weights.group import WeightGroups
    from rollout_service.weights.stored_copies import StoredCopies

    return WeightGroups(engine, StoredCopies(tmp_path), timeout_s=10.0,  # type: ignore[arg-type]
                        lease_s=lease_s, bucket_bytes=1024, num_buckets=2)


async def test_a_bucket_is_waited_for_in_the_store_and_the_workers_asked_once_done(
        rendezvous: Rendezvous, tmp_path: Path) -> None:
    """vLLM's workers busy-wait for a second after each RPC, so asking them during a
    broadcast kept both spinning and starved the trainer on a 2-core machine. The service
    waits in the trainer's store instead: a 0.6 s receive is seen done, and the workers are
    asked only after it ended."""
    workers = FakeWorkers(receive_s=0.6)
    groups = groups_of(workers, tmp_path)
    await groups.create(group_request(rendezvous))
    started = time.monotonic()
    await groups.receive_bucket("push-1", bucket(0, 0, 64))
    assert workers.asks and all(t >= started + 0.6 for t in workers.asks), workers.asks
    assert len(workers.asks) <= 3, len(workers.asks)


async def test_a_group_has_one_owner_until_released(rendezvous: Rendezvous,
                                                    tmp_path: Path) -> None:
    workers = FakeWorkers()
    groups = groups_of(workers, tmp_path)
    first = await groups.create(group_request(rendezvous))
    assert (first.rank_offset, first.num_ranks, first.bucket_bytes) == (1, 2, 1024)
    with pytest.raises(PushError, match=f"group_id: this service is in group "
                                        f"'{first.group_id}'") as refused:
        await groups.create(group_request(rendezvous))
    assert refused.value.status == 409
    with pytest.raises(PushError, match="is not this service's current") as wrong:
        await groups.release("someone-else")
    assert wrong.value.status == 404
    await groups.release(first.group_id)
    assert workers.left == 1 and groups.current is None
    assert (await groups.create(group_request(rendezvous))).group_id != first.group_id


async def test_a_group_without_calls_is_released_after_its_lease(
        rendezvous: Rendezvous, tmp_path: Path) -> None:
    groups = groups_of(FakeWorkers(), tmp_path)
    await groups.create(group_request(rendezvous, lease_s=0.5))
    await until(lambda: _current(groups), lambda current: current is None, timeout_s=30)
    await groups.create(group_request(rendezvous))  # a second owner, now welcome


async def _current(groups) -> object:  # noqa: ANN001
    return groups.current


async def test_ranks_must_fit_the_world_and_the_store_must_answer(
        rendezvous: Rendezvous, tmp_path: Path) -> None:
    groups = groups_of(FakeWorkers(), tmp_path)
    with pytest.raises(PushError, match="world_size: 2 cannot hold this service's 2 ranks "
                                        "from rank_offset 1"):
        await groups.create(group_request(rendezvous, world_size=2))
    with pytest.raises(PushError, match="backend: 'nccl' cannot run on this engine's workers "
                                        r"\(they run 'gloo'\)"):
        await groups.create(group_request(rendezvous, backend="nccl"))
    with pytest.raises(PushError, match="master_address: the trainer's store at "):
        await groups.create(group_request(rendezvous, master_port=1, timeout_s=1.0))
    assert groups.current is None


async def test_a_trainer_picks_among_the_engines_backends(rendezvous: Rendezvous,
                                                          tmp_path: Path) -> None:
    """An SGLang server's rank on CUDA joins ``nccl`` unless the trainer asks for ``gloo``
    (a trainer on the server's only GPU): the group, its answer and its state say which."""
    workers = FakeWorkers()
    workers.group_backends = ("nccl", "gloo")  # type: ignore[misc]
    groups = groups_of(workers, tmp_path)
    assert groups.state().backend == "nccl"
    answer = await groups.create(group_request(rendezvous, backend="gloo"))
    assert answer.backend == "gloo" and workers._spec is not None
    assert workers._spec.backend == "gloo" and groups.state().backend == "gloo"
    await groups.release(answer.group_id)
    answer = await groups.create(group_request(rendezvous))
    assert answer.backend == "nccl" and workers._spec.backend == "nccl"


def test_the_group_request_states_its_bounds() -> None:
    good = {"group_id": "t1", "master_address": "10.0.0.1", "master_port": 29500,
            "world_size": 9, "rank_offset": 1}
    messages.WeightGroupRequest.model_validate(good)
    for field, value in [("group_id", "a/b"), ("world_size", 1), ("rank_offset", 0),
                         ("master_port", 70000), ("num_buckets", 9), ("bucket_bytes", 8)]:
        with pytest.raises(ValueError, match=field):
            messages.WeightGroupRequest.model_validate({**good, field: value})
