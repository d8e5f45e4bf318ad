"""The ``nccl`` transport's trainer-owned group, on real gloo between threads: each
bucket's in-band header and checksum, and what a group does with a bucket that comes
short, long or other than announced, or not at all. Needs no engine.

Every rank is a thread of this process (``tests/support/broadcast_groups.py``). The
workers' ring and stored copy are ``test_broadcast_receive.py``; the whole path through
the real CPU engine is ``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from rollout_service.protocol.broadcast import (
    HEADER_MAGIC,
    BucketRefused,
    FrameHeader,
    Group,
    GroupSpec,
    Rendezvous,
    bucket_checksum,
)
from tests.support.broadcast_groups import in_thread, joined, spec


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
