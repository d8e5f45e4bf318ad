"""The ``nccl`` transport's pieces that need no engine: the group on gloo between two
threads, the announcement's fields, the placements' checks and the config.

The whole path through the real CPU engine is
``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import Group, GroupSpec, Rendezvous, join, new_group_id
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.weights.intake import (
    ActivePush,
    PushError,
    check_no_overlap,
    validate_announcement,
    validate_placement,
)

CHECKPOINT = {"w": TensorMeta(shape=(4, 3), dtype="bfloat16"),
              "b": TensorMeta(shape=(3,), dtype="float32")}


@pytest.fixture(scope="module")
def rendezvous() -> Rendezvous:
    return Rendezvous("127.0.0.1", 10.0)  # the store's server lives as long as this object


def spec(rendezvous: Rendezvous, world_size: int, timeout_s: float = 10.0) -> GroupSpec:
    return GroupSpec(group_id=new_group_id(), master_address=rendezvous.address,
                     master_port=rendezvous.port, world_size=world_size, backend="gloo",
                     timeout_s=timeout_s)


def observer(group: GroupSpec) -> dist.Store:
    """A store client of ``group``'s keys that is no rank's."""
    return dist.PrefixStore(group.group_id, dist.TCPStore(
        group.master_address, group.master_port, None, False,
        datetime.timedelta(seconds=group.timeout_s)))


def test_every_rank_receives_the_trainers_bytes(rendezvous: Rendezvous) -> None:
    group = spec(rendezvous, world_size=3)
    sent = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    received: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        member = join(group, rank=r)
        buffer = sent.clone() if r == 0 else torch.zeros_like(sent)
        member.broadcast(buffer)
        received[r] = buffer

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(received) == {0, 1, 2}
    assert all(torch.equal(b, sent) for b in received.values())


def test_the_trainer_sends_once_every_worker_is_receiving(rendezvous: Rendezvous) -> None:
    """The workers start receiving one after the other, the second seconds late; the
    trainer, which called send first, sends only once both are receiving."""
    group = spec(rendezvous, world_size=3)
    sent = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    members = _joined(group)
    received: dict[int, torch.Tensor] = {}
    receiving_at: dict[int, float] = {}
    sent_by: list[float] = []

    def trainer() -> None:
        members[0].send(sent.clone(), "push-1")
        sent_by.append(time.monotonic())

    def worker(r: int) -> None:
        buffer = torch.zeros_like(sent)
        receiving_at[r] = time.monotonic()
        members[r].receive(buffer, "push-1")
        received[r] = buffer

    sender = threading.Thread(target=trainer)
    sender.start()
    first = threading.Thread(target=worker, args=(1,))
    first.start()
    # The second worker starts once the first is counted in the store and the trainer
    # is still waiting (it has sent nothing yet). An observer's own store client: the
    # trainer's is blocked in its wait, and a client is one socket.
    store = observer(group)
    deadline = time.monotonic() + 30
    while store.add("receiving/push-1", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sent_by and 1 not in received
    worker(2)
    for t in (sender, first):
        t.join(60)
    assert torch.equal(received[1], sent) and torch.equal(received[2], sent)
    assert sent_by[0] > receiving_at[2]


def test_a_trainer_whose_workers_never_receive_fails_naming_them(
        rendezvous: Rendezvous) -> None:
    group = spec(rendezvous, world_size=3, timeout_s=2.0)
    members = _joined(group)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="broadcast push-2: 0 of 2 workers started "
                                           "receiving within 2 s"):
        members[0].send(torch.zeros(8, dtype=torch.uint8), "push-2")
    assert time.monotonic() - start < 30


def _joined(group: GroupSpec) -> dict[int, Group]:
    """Every rank of ``group`` joined, each from a thread of its own."""
    members: dict[int, Group] = {}
    threads = [threading.Thread(target=lambda r=r: members.__setitem__(r, join(group, r)))
               for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(members) == set(range(group.world_size))
    return members


def test_a_receiver_whose_trainer_never_sends_fails_within_the_timeout(
        rendezvous: Rendezvous) -> None:
    group = spec(rendezvous, world_size=2, timeout_s=2.0)
    members = {}
    threads = [threading.Thread(target=lambda r=r: members.__setitem__(r, join(group, r)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        members[1].broadcast(torch.zeros(8, dtype=torch.uint8))
    assert time.monotonic() - start < 30


def begin(**changes: object) -> messages.PushBeginRequest:
    body = {"version": 3, "transport": "nccl", "group_id": "g", "broadcast_bytes": 64,
            "total_bytes": 36, "params": [{"name": n, "shape": list(m.shape), "dtype": m.dtype}
                                          for n, m in CHECKPOINT.items()]}
    body.update(changes)
    return messages.PushBeginRequest.model_validate(body)


def at(name: str, offset: int) -> TensorPlacement:
    meta = CHECKPOINT[name]
    return TensorPlacement(name=name, dtype=meta.dtype, shape=meta.shape,
                           location=BroadcastLocation(offset=offset))


def test_announcement_fields_follow_the_transport() -> None:
    with pytest.raises(ValidationError, match="group_id: required by transport 'nccl'"):
        begin(group_id=None)
    with pytest.raises(ValidationError, match="broadcast_bytes: required by transport 'nccl'"):
        begin(broadcast_bytes=None)
    with pytest.raises(ValidationError, match="group_id: not used by transport 'shm'"):
        begin(transport="shm", segment="mtp-x", segment_bytes=64, broadcast_bytes=None)
    with pytest.raises(PushError, match="broadcast_bytes: 16 cannot hold 36 bytes"):
        validate_announcement(begin(broadcast_bytes=16), CHECKPOINT, transport="nccl")


def test_placements_lie_aligned_inside_the_buffer_without_overlap() -> None:
    request = begin()
    push = ActivePush(push_id="p", request=request,
                      expected=validate_announcement(request, CHECKPOINT, transport="nccl"),
                      timeout_s=60.0)
    validate_placement(push, at("w", 0))
    validate_placement(push, at("b", 32))
    with pytest.raises(PushError, match="offset 2 is not aligned to its 4-byte float32"):
        validate_placement(push, at("b", 2))
    with pytest.raises(PushError, match=r"\[56, 68\) lies outside the 64-byte broadcast"):
        validate_placement(push, at("b", 56))
    check_no_overlap([at("w", 0), at("b", 24)])
    with pytest.raises(PushError, match="'b' overlaps 'w' in the broadcast buffer"):
        check_no_overlap([at("w", 0), at("b", 20)])


def test_the_config_names_where_trainers_meet() -> None:
    assert ServiceConfig(weights_transport="nccl").group_address == "127.0.0.1"
    assert ServiceConfig(weights_transport="nccl", host="10.1.2.3").group_address == "10.1.2.3"
    assert ServiceConfig(weights_transport="nccl", host="0.0.0.0",
                         weights_group_address="node7").group_address == "node7"
    with pytest.raises(ValidationError, match="weights_transport: 'nccl' is built for engine "
                                              "'vllm' only"):
        ServiceConfig(engine="sglang", weights_transport="nccl")


class FakeWorkers:
    """A fake :class:`~rollout_service.engines.base.BroadcastEngine`: two workers that
    join at once and whose receive ends ``receive_s`` after it starts, counted in the
    group's real rendezvous store as the real workers do (``Group.receive``); it records
    when it was asked for its workers' state."""

    num_workers = 2
    group_backend = "gloo"

    def __init__(self, receive_s: float) -> None:
        self.receive_s = receive_s
        self.asks: list[float] = []
        self._spec: GroupSpec | None = None
        self._ended = threading.Event()

    async def join_group(self, spec: GroupSpec) -> None:
        self._spec = spec

    async def group_state(self, group_id: str) -> list[str]:
        return ["done"] * self.num_workers

    async def start_receive(self, push_id: str, group_id: str, nbytes: int) -> None:
        assert self._spec is not None and self._spec.group_id == group_id
        store = observer(self._spec)

        def receive() -> None:
            time.sleep(self.receive_s)  # the broadcast, as long as it takes
            self._ended.set()
            for _ in range(self.num_workers):
                store.add(f"finished/{push_id}", 1)

        threading.Thread(target=receive, daemon=True).start()

    async def receive_state(self, push_id: str) -> list[str]:
        self.asks.append(time.monotonic())
        return ["done" if self._ended.is_set() else "running"] * self.num_workers


async def test_a_receive_is_waited_for_in_the_store_and_the_workers_asked_once() -> None:
    """vLLM's workers busy-wait for a second after each RPC, so asking them during a
    broadcast kept both spinning and starved the trainer on a 2-core machine (a TP = 2
    push stalled until the group's timeout). The service waits in its store instead: a
    0.6 s receive is seen done, and the workers are asked only after it ended."""
    from rollout_service.weights.group import WeightGroups

    workers = FakeWorkers(receive_s=0.6)
    groups = WeightGroups(workers, address="127.0.0.1", timeout_s=10.0)  # type: ignore[arg-type]
    group = await groups.create()
    started = time.monotonic()
    seconds = await groups.receive("push-1", group.group_id, 64)
    assert seconds >= 0.6
    assert workers.asks and all(t >= started + 0.6 for t in workers.asks), workers.asks
    assert len(workers.asks) <= 3, len(workers.asks)
