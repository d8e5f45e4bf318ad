"""The ``nccl`` transport's pieces that need no engine, on real gloo between threads: the
trainer-owned group, each bucket's in-band header and checksum, the workers' ring and
stored copy, the intake's bucket checks, and the service's group (owner, lease, ranks)
over a FAKE engine (named below: only the engine's RPCs are faked, the store and the
counters are real).

The whole path through the real CPU engine is
``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rollout_service.engines.base import BucketReceive, WorkerReceive
from rollout_service.engines.vllm.bucket_receiver import PushReceiver, Ring
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import (
    HEADER_MAGIC,
    BucketRefused,
    FrameHeader,
    Group,
    GroupSpec,
    Rendezvous,
    bucket_checksum,
    checksum_hex,
    join,
)
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.store import BucketInfo, check_store_dir
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.weights.checks import ActivePush, PushError, check_bucket
from rollout_service.weights.intake import PushIntake
from tests.support.waiting import until, wait_for

CHECKPOINT = {"w": TensorMeta(shape=(4, 3), dtype="bfloat16"),
              "b": TensorMeta(shape=(3,), dtype="float32")}


@pytest.fixture(scope="module")
def rendezvous() -> Rendezvous:
    return Rendezvous("127.0.0.1", 30.0)  # the trainer's store, as long as this object lives


_groups = iter(range(10**6))


def spec(rendezvous: Rendezvous, world_size: int, timeout_s: float = 10.0,
         rank_offset: int = 1) -> GroupSpec:
    return GroupSpec(group_id=f"g{next(_groups)}", master_address=rendezvous.address,
                     master_port=rendezvous.port, world_size=world_size,
                     rank_offset=rank_offset, backend="gloo", timeout_s=timeout_s)


def joined(group: GroupSpec) -> dict[int, Group]:
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


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` on a thread; its result or exception lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def header_of(payload: torch.Tensor, index: int = 0) -> FrameHeader:
    return FrameHeader(nbytes=payload.numel(), checksum=bucket_checksum(payload), index=index)


def reference_checksum(data: bytes) -> int:
    """The checksum's definition, in plain Python."""
    words = [int.from_bytes(data[i:i + 8], "little", signed=True)
             for i in range(0, len(data), 8)]
    s1 = sum(words)
    s2 = sum((i + 1) * w for i, w in enumerate(words))
    return ((s1 & (2**64 - 1)) * 0x9E3779B97F4A7C15 + s2) & (2**64 - 1)


def test_the_checksum_is_its_definition_and_catches_a_stale_tail() -> None:
    data = torch.randint(0, 256, (8 * 3000,), dtype=torch.uint8)
    assert bucket_checksum(data) == reference_checksum(data.numpy().tobytes())
    torn = data.clone()
    torn[-16:] = 0  # what a short broadcast leaves: the slot's old tail
    assert bucket_checksum(torn) != bucket_checksum(data)
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    assert bucket_checksum(swapped) != bucket_checksum(data)
    with pytest.raises(ValueError, match="nbytes: 12 is not a multiple of 8"):
        bucket_checksum(data[:12])


def test_every_worker_of_every_server_receives_one_broadcast(rendezvous: Rendezvous) -> None:
    """Two servers (rank offsets 1 and 3, two workers each) in one group: the trainer
    sends each bucket once; every worker has its bytes, and each server's counter in the
    store counts only its own workers."""
    group = spec(rendezvous, world_size=5)
    members = joined(group)
    payload = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    header = header_of(payload)
    slots = {r: torch.zeros(8192, dtype=torch.uint8) for r in range(1, 5)}
    for r in (3, 4):  # the second server's workers count under its own offset
        members[r].spec = GroupSpec(**{**group.as_dict(), "rank_offset": 3})
    receivers = [in_thread(lambda r=r: members[r].receive_bucket(slots[r], "p/0", header))
                 for r in range(1, 5)]
    members[0].send_bucket(payload, "p/0", index=0, checksum=header.checksum)
    for thread, out in receivers:
        thread.join(30)
        assert torch.equal(out[0], payload)  # type: ignore[arg-type]
    store = dist.PrefixStore(group.group_id, dist.TCPStore(
        group.master_address, group.master_port, None, False, datetime.timedelta(seconds=10)))
    assert store.add("finished/p/0/1", 0) == 2 and store.add("finished/p/0/3", 0) == 2


def _send_raw(trainer: Group, header: list[int], payload: torch.Tensor, key: str) -> None:
    """A misbehaving trainer: its own header, then its own payload."""
    trainer._wait_ready(key, lambda: False)
    trainer.broadcast(torch.tensor(header, dtype=torch.int64))
    trainer.broadcast(payload)


def test_a_broadcast_shorter_than_announced_is_refused_by_its_checksum(
        rendezvous: Rendezvous) -> None:
    """gloo takes fewer bytes than were posted without a word (the slot's old tail stays):
    the checksum refuses the bucket, and the group still serves the next one."""
    members = joined(spec(rendezvous, world_size=2))
    payload = torch.randint(1, 256, (1024,), dtype=torch.uint8)
    announced = header_of(payload)
    slot = torch.full((2048,), 7, dtype=torch.uint8)
    thread, out = in_thread(lambda: members[1].receive_bucket(slot, "p/0", announced))
    _send_raw(members[0], [HEADER_MAGIC, 1024, announced.checksum - (1 << 64)
                           if announced.checksum >= 1 << 63 else announced.checksum, 0],
              payload[:512], "p/0")
    thread.join(30)
    assert isinstance(out[0], BucketRefused) and not out[0].must_leave
    assert "checksum" in str(out[0])
    thread, out = in_thread(lambda: members[1].receive_bucket(slot, "p/1", announced))
    members[0].send_bucket(payload, "p/1", index=0, checksum=announced.checksum)
    thread.join(30)
    assert torch.equal(out[0], payload)  # type: ignore[arg-type]


def test_a_broadcast_longer_than_the_slot_is_refused_and_nothing_dies(
        rendezvous: Rendezvous) -> None:
    """gloo aborts the process on a message longer than the receive posted for it, so the
    worker reads the header first and leaves the group instead of receiving: the
    trainer's send fails, and this very process (the worker's) lives on."""
    members = joined(spec(rendezvous, world_size=2, timeout_s=10.0))
    announced = FrameHeader(nbytes=1024, checksum=0, index=0)
    slot = torch.zeros(1024, dtype=torch.uint8)
    thread, out = in_thread(lambda: members[1].receive_bucket(slot, "p/0", announced))
    big = torch.ones(1 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        members[0].send_bucket(big, "p/0", index=0, checksum=bucket_checksum(big))
    thread.join(30)
    assert isinstance(out[0], BucketRefused) and out[0].must_leave
    assert "more than the 1024-byte slot" in str(out[0])


def test_a_header_other_than_announced_is_received_and_refused(rendezvous: Rendezvous) -> None:
    members = joined(spec(rendezvous, world_size=2))
    payload = torch.randint(0, 256, (512,), dtype=torch.uint8)
    slot = torch.zeros(1024, dtype=torch.uint8)
    announced = FrameHeader(nbytes=256, checksum=bucket_checksum(payload[:256]), index=0)
    thread, out = in_thread(lambda: members[1].receive_bucket(slot, "p/0", announced))
    members[0].send_bucket(payload, "p/0", index=0, checksum=bucket_checksum(payload))
    thread.join(30)
    assert isinstance(out[0], BucketRefused) and not out[0].must_leave
    assert "the update announced bucket 0 of 256 bytes" in str(out[0])


def test_a_trainer_whose_workers_never_receive_fails_naming_them(
        rendezvous: Rendezvous) -> None:
    members = joined(spec(rendezvous, world_size=3, timeout_s=2.0))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"bucket p/0: 0 of 2 workers started receiving "
                                           r"\(within 2 s\)"):
        members[0].send_bucket(torch.zeros(8, dtype=torch.uint8), "p/0", index=0, checksum=0)
    assert time.monotonic() - start < 30


def test_a_refused_update_ends_the_trainers_wait_at_once(rendezvous: Rendezvous) -> None:
    members = joined(spec(rendezvous, world_size=2, timeout_s=60.0))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the update was refused"):
        members[0].send_bucket(torch.zeros(8, dtype=torch.uint8), "p/0", index=0, checksum=0,
                               is_cancelled=lambda: time.monotonic() > start + 0.5)
    assert time.monotonic() - start < 10


def test_a_worker_whose_trainer_never_sends_fails_within_the_timeout(
        rendezvous: Rendezvous) -> None:
    members = joined(spec(rendezvous, world_size=2, timeout_s=2.0))
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        members[1].receive_bucket(torch.zeros(64, dtype=torch.uint8), "p/0",
                                  FrameHeader(nbytes=64, checksum=0, index=0))
    assert time.monotonic() - start < 30


def test_the_ring_holds_at_most_its_slots_and_blocks_past_them() -> None:
    ring = Ring(1024, 2, torch.device("cpu"))
    first, second = ring.acquire(1.0), ring.acquire(1.0)
    with pytest.raises(RuntimeError, match="no free ring slot within 0.2 s"):
        ring.acquire(0.2)
    ring.release(first)
    assert ring.acquire(1.0) is first
    assert ring.peak_bytes == 2048 and second.numel() == 1024


def test_a_workers_receive_stores_the_stream_in_its_ring_of_two(
        rendezvous: Rendezvous, tmp_path: Path) -> None:
    """Five buckets through two 1 KiB slots: the writer's stored copy is the trainer's
    stream byte for byte, the other worker only checks, and neither held more than its two
    slots."""
    members = joined(spec(rendezvous, world_size=3))
    stream = torch.randint(0, 256, (4 * 1024 + 512,), dtype=torch.uint8)
    store = tmp_path / "push.bin"
    plan = BucketReceive(push_id="p", store_path=str(store), slot_bytes=1024, num_slots=2)
    receivers = {r: PushReceiver(members[r], plan, device=torch.device("cpu"),
                                 is_writer=r == 1) for r in (1, 2)}
    buckets = [BucketInfo(index=i, offset=o, nbytes=min(1024, stream.numel() - o),
                          checksum=checksum_hex(bucket_checksum(stream[o:o + 1024])))
               for i, o in enumerate(range(0, stream.numel(), 1024))]
    for bucket in buckets:
        for receiver in receivers.values():
            receiver.start(bucket)
        payload = stream[bucket.offset:bucket.end]
        members[0].send_bucket(payload, f"p/{bucket.index}", index=bucket.index,
                               checksum=bucket.checksum_value)
    for receiver in receivers.values():
        state, peak = wait_for(lambda r=receiver: r.report(len(buckets)),
                               lambda report: report[0] != "running", timeout_s=30)
        assert state == "done" and peak <= 2 * 1024
        receiver.close()
    assert store.read_bytes() == stream.numpy().tobytes()


def test_a_refused_bucket_is_reported_and_stops_the_push(
        rendezvous: Rendezvous, tmp_path: Path) -> None:
    members = joined(spec(rendezvous, world_size=2))
    plan = BucketReceive(push_id="p", store_path=str(tmp_path / "x.bin"), slot_bytes=256,
                         num_slots=2)
    receiver = PushReceiver(members[1], plan, device=torch.device("cpu"), is_writer=True)
    payload = torch.randint(0, 256, (256,), dtype=torch.uint8)
    receiver.start(BucketInfo(index=0, offset=0, nbytes=256, checksum="0" * 16))
    members[0].send_bucket(payload, "p/0", index=0, checksum=0)
    state = wait_for(lambda: receiver.bucket_state(0), lambda s: s != "running", timeout_s=30)
    assert state.startswith("refused: ") and "checksum" in state
    assert receiver.report(1)[0] == state
    receiver.close()


def _torch_style_trainer(spec: GroupSpec, tensors: list[torch.Tensor]) -> None:
    """A trainer as slime and AReaL make theirs (SGLang's ``init_custom_process_group``:
    torch's own rendezvous and custom group, one plain broadcast per tensor, no header)."""
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{spec.master_address}:{spec.master_port}", 0,
                                  spec.world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(spec.world_size, 0, [], "gloo",
                                      PrefixStore(spec.group_id, store),
                                      group_name=spec.group_id, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(spec.world_size)}
    for tensor in tensors:
        dist.broadcast(tensor, 0, group=pg)


def test_a_torch_style_trainer_reaches_the_receivers_tensor_by_tensor(
        tmp_path: Path) -> None:
    """The frameworks' framing (the dialects' routes): a trainer of torch's own making that
    broadcasts each tensor on its own, no header, no checksum; the workers join its group
    as torch lays it out, receive each tensor as a raw bucket at its 64-byte aligned
    offset, and the writer's stored copy holds each at that offset; the service reads
    its workers' counts through the same layout."""
    from rollout_service.protocol.broadcast import StoreCounters
    from rollout_service.tools.launch import free_port

    spec = GroupSpec(group_id="weight_update_group", master_address="127.0.0.1",
                     master_port=free_port(), world_size=3, rank_offset=1, backend="gloo",
                     timeout_s=20.0, style="torch")
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (100, 30, 64)]
    offsets = [0, 128, 192]  # each at a 64-byte boundary: gaps between them
    trainer, out = in_thread(lambda: _torch_style_trainer(spec, tensors))
    members = {}
    threads = [threading.Thread(target=lambda r=r: members.__setitem__(r, join(spec, r)))
               for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(members) == {1, 2}
    plan = BucketReceive(push_id="p", store_path=str(tmp_path / "p.bin"), slot_bytes=128,
                         num_slots=2)
    receivers = {r: PushReceiver(members[r], plan, device=torch.device("cpu"),
                                 is_writer=r == 1) for r in (1, 2)}
    for index, (tensor, offset) in enumerate(zip(tensors, offsets, strict=True)):
        for receiver in receivers.values():
            receiver.start(BucketInfo(index=index, offset=offset, nbytes=tensor.numel(),
                                      checksum=None))
    trainer.join(60)
    assert out == [None], out
    for receiver in receivers.values():
        state, _ = wait_for(lambda r=receiver: r.report(3), lambda report: report[0] != "running",
                            timeout_s=30)
        assert state == "done"
        receiver.close()
    stored = (tmp_path / "p.bin").read_bytes()
    for tensor, offset in zip(tensors, offsets, strict=True):
        assert stored[offset:offset + tensor.numel()] == tensor.numpy().tobytes()
    assert StoreCounters(spec).finished("p/2") == 2


# ---- the intake's bucket checks --------------------------------------------------


def begin(**changes: object) -> messages.PushBeginRequest:
    body = {"version": 3, "transport": "nccl", "group_id": "g", "total_bytes": 36,
            "params": [{"name": n, "shape": list(m.shape), "dtype": m.dtype}
                       for n, m in CHECKPOINT.items()]}
    body.update(changes)
    return messages.PushBeginRequest.model_validate(body)


def at(name: str, offset: int) -> TensorPlacement:
    meta = CHECKPOINT[name]
    return TensorPlacement(name=name, dtype=meta.dtype, shape=meta.shape,
                           location=BroadcastLocation(offset=offset))


def bucket(index: int, offset: int, nbytes: int) -> BucketInfo:
    return BucketInfo(index=index, offset=offset, nbytes=nbytes, checksum="0" * 16)


async def test_buckets_follow_one_another_and_placements_lie_in_what_arrived() -> None:
    intake = PushIntake(CHECKPOINT, timeout_s=60.0, has_draft=True, transport="nccl")
    push_id = intake.begin(begin(), {"main": None, "draft": None}).push_id
    update = messages.PushUpdateRequest
    check_bucket(intake.get(push_id), update(push_id=push_id, bucket=bucket(0, 8, 32)))
    with pytest.raises(PushError, match="bucket: required by transport 'nccl'"):
        check_bucket(intake.get(push_id), update(push_id=push_id, tensors=[at("w", 0)]))
    # 'w' (24 bytes) lies in bucket 0; 'b' starts there and ends in bucket 1
    intake.update(update(push_id=push_id, tensors=[at("w", 0)], bucket=bucket(0, 0, 32)))
    with pytest.raises(PushError, match="bucket: offset 16 lies before the end of the last"):
        check_bucket(intake.get(push_id), update(push_id=push_id, bucket=bucket(1, 16, 8)))
    with pytest.raises(PushError, match=r"\[32, 44\) lies outside the 40-byte stream received"):
        intake.update(update(push_id=push_id, tensors=[at("b", 32)], bucket=bucket(1, 32, 8)))
    assert intake.active is None  # a bad placement rejects the push
    push_id = intake.begin(begin(), {"main": None, "draft": None}).push_id
    intake.update(update(push_id=push_id, bucket=bucket(0, 0, 32)))  # no tensor ends here
    intake.update(update(push_id=push_id, tensors=[at("w", 0), at("b", 32)],
                         bucket=bucket(1, 32, 32)))
    assert [b.index for b in intake.start_loading(push_id).buckets] == [0, 1]
    intake.end(intake.active, "aborted", "next case")  # type: ignore[arg-type]
    push_id = intake.begin(begin(), {"main": None, "draft": None}).push_id
    intake.update(update(push_id=push_id, bucket=bucket(0, 0, 16)))
    with pytest.raises(PushError, match=r"'w' \[8, 32\) is not all in the buckets received"):
        intake.update(update(push_id=push_id, tensors=[at("w", 8)], bucket=bucket(1, 32, 32)))


def test_a_bucket_is_refused_on_other_transports() -> None:
    request = begin(transport="cuda_ipc", group_id=None)
    push = ActivePush(push_id="p", request=request, expected=dict(CHECKPOINT), timeout_s=60)
    with pytest.raises(PushError, match="bucket: not used by transport 'cuda_ipc'"):
        check_bucket(push, messages.PushUpdateRequest(push_id="p", bucket=bucket(0, 0, 8)))


def test_the_store_dir_is_never_shared_memory(tmp_path: Path) -> None:
    assert check_store_dir(tmp_path / "a" / "b").is_dir()
    with pytest.raises(ValueError, match="weights_store_dir: /dev/shm/x is under /dev/shm"):
        check_store_dir(Path("/dev/shm/x"))


# ---- the service's group, over a FAKE engine -------------------------------------


class FakeWorkers:
    """FAKE :class:`~rollout_service.engines.base.BroadcastEngine`: two workers that join
    at once and whose receive of a bucket ends ``receive_s`` after it starts, counted in
    the trainer's real store as the real workers count themselves (``Group.
    receive_bucket``); it records when its workers' bucket states were asked."""

    num_workers = 2
    group_backend = "gloo"

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
    body = {"group_id": f"trainer-{next(_groups)}", "master_address": rendezvous.address,
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
    with pytest.raises(PushError, match="backend: 'nccl' cannot run on this engine's workers"):
        await groups.create(group_request(rendezvous, backend="nccl"))
    with pytest.raises(PushError, match="master_address: the trainer's store at "):
        await groups.create(group_request(rendezvous, master_port=1, timeout_s=1.0))
    assert groups.current is None


def test_the_group_request_states_its_bounds() -> None:
    good = {"group_id": "t1", "master_address": "10.0.0.1", "master_port": 29500,
            "world_size": 9, "rank_offset": 1}
    messages.WeightGroupRequest.model_validate(good)
    for field, value in [("group_id", "a/b"), ("world_size", 1), ("rank_offset", 0),
                         ("master_port", 70000), ("num_buckets", 9), ("bucket_bytes", 8)]:
        with pytest.raises(ValueError, match=field):
            messages.WeightGroupRequest.model_validate({**good, field: value})


def test_the_shm_check_sees_a_segment_the_push_maps() -> None:
    """The integration tests' proof that a push touches no /dev/shm would pass vacuously
    if the sampler saw nothing: a segment mapped and let go inside the block is seen."""
    import os

    from rollout_service.protocol.shm import Segment
    from tests.support.shm_usage import new_shm_files

    with new_shm_files(lambda: [os.getpid()]) as usage:
        with Segment.create("mtp-rollout-test-shm-check", 4096) as segment:
            segment.tensor(0, torch.uint8, (8,)).fill_(1)
            mapped_at = usage.num_samples
            wait_for(lambda: usage.num_samples, lambda n: n >= mapped_at + 2, timeout_s=30,
                     interval_s=0.01)
    assert "/dev/shm/mtp-rollout-test-shm-check" in usage.new
