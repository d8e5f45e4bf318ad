"""The ``nccl`` transport's workers, on real gloo between threads: the ring of slots a
worker receives buckets into, the stored copy its writer keeps, the refusal of a bad
bucket, and a trainer of torch's own making (the dialects' framing: one broadcast per
tensor, no header) reaching the same receivers. Needs no engine.

Every rank is a thread of this process (``tests/support/broadcast_groups.py``). The group
and its buckets' checks are ``test_broadcast_group.py``; the whole path through the real
CPU engine is ``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rollout_service.engines.broadcast_engine import BucketReceive
from rollout_service.engines.bucket_receiver import PushReceiver, Ring
from rollout_service.protocol.broadcast import (
    GroupSpec,
    Rendezvous,
    bucket_checksum,
    checksum_hex,
    join,
)
from rollout_service.protocol.store import BucketInfo
from tests.support.broadcast_groups import in_thread, joined, spec
from tests.support.waiting import wait_for


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
