"""A replica's stored copy fetched by a peer (``serve/peer_store.py``), for buckets of the
frameworks' framing, which come without a checksum: the writer computes one as each
arrives, the coordinator keeps the holders' (``GroupFanOut.sources``), and a peer's fetch
checks the copy by it. Real gloo between threads, a real stored copy on disk, a real
HTTP server; no engine.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rollout_service.engines.broadcast_engine import BucketReceive
from rollout_service.engines.bucket_receiver import PushReceiver
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import Group, GroupSpec, Rendezvous, join
from rollout_service.protocol.store import (
    BucketInfo,
    StoreRef,
    bucket_checksum,
    checksum_hex,
    copy_checksum,
)
from rollout_service.serve.commands import CommandResult, StoredPush
from rollout_service.serve.group_fanout import GroupFanOut, GroupSettings
from rollout_service.serve.peer_store import StoreServer, fetch_store
from rollout_service.weights.stored_copies import StoredCopies
from tests.support.waiting import wait_for

TOKEN = "peer-token"
SIZES = (100, 30, 64)
"""Tensors of a framework's sync, one broadcast each: none a multiple of 8 but the last."""
OFFSETS = (0, 128, 192)
"""Each at a 64-byte boundary of the push's stream, as the dialects lay them out."""


def test_the_copy_checksum_pads_a_partial_word_with_zeros() -> None:
    data = torch.randint(0, 256, (8 * 9 + 5,), dtype=torch.uint8)
    padded = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
    assert copy_checksum(data) == bucket_checksum(padded)
    assert copy_checksum(padded) == bucket_checksum(padded)  # whole words: the same
    assert copy_checksum(data) != copy_checksum(data[:-1])


def _joined(spec: GroupSpec) -> dict[int, Group]:
    members: dict[int, Group] = {}
    threads = [threading.Thread(target=lambda r=r: members.__setitem__(r, join(spec, r)))
               for r in range(spec.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(members) == set(range(spec.world_size))
    return members


@pytest.fixture
def holder(tmp_path: Path) -> tuple[StoredCopies, list[BucketInfo], list[torch.Tensor]]:
    """A server that received a push of raw buckets and committed its stored copy with the
    checksums its writer computed as they arrived."""
    rendezvous = Rendezvous("127.0.0.1", 30.0)
    spec = GroupSpec(group_id="raw", master_address=rendezvous.address,
                     master_port=rendezvous.port, world_size=2, rank_offset=1,
                     backend="gloo", timeout_s=20.0)
    members = _joined(spec)
    copies = StoredCopies(tmp_path / "holder")
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in SIZES]
    buckets = [BucketInfo(index=i, offset=o, nbytes=n, checksum=None)
               for i, (o, n) in enumerate(zip(OFFSETS, SIZES, strict=True))]
    receiver = PushReceiver(members[1], BucketReceive(
        push_id="p", store_path=copies.path("p"), slot_bytes=128, num_slots=2),
        device=torch.device("cpu"), is_writer=True)
    for bucket in buckets:
        receiver.start(bucket)
    for tensor in tensors:
        members[0].broadcast(tensor)
    state, _ = wait_for(lambda: receiver.report(len(buckets)),
                        lambda report: report[0] != "running", timeout_s=30)
    assert state == "done"
    checksums = receiver.copy_checksums()
    receiver.close()
    assert checksums == {i: checksum_hex(copy_checksum(t)) for i, t in enumerate(tensors)}
    copies.commit(StoreRef(path=copies.path("p"), buckets=tuple(buckets)), checksums)
    return copies, buckets, tensors


def test_a_peer_fetches_a_copy_of_raw_buckets_checked_by_the_writers_checksums(
        holder: tuple[StoredCopies, list[BucketInfo], list[torch.Tensor]],
        tmp_path: Path) -> None:
    copies, buckets, tensors = holder
    server = StoreServer(copies, TOKEN, "127.0.0.1")
    try:
        peer = f"127.0.0.1:{server.port}"
        out = tmp_path / "fetched.bin"
        assert fetch_store([peer], TOKEN, "p", buckets, str(out),
                           copy_checksums=copies.committed_checksums) == peer
        fetched = out.read_bytes()
        for tensor, offset in zip(tensors, OFFSETS, strict=True):
            assert fetched[offset:offset + tensor.numel()] == tensor.numpy().tobytes()
        with pytest.raises(RuntimeError, match="bucket 0: no checksum to check"):
            fetch_store([peer], TOKEN, "p", buckets, str(out))
        with open(copies.path("p"), "r+b") as f:  # the holder's copy goes bad on its disk
            f.seek(OFFSETS[1] + 3)
            f.write(bytes([fetched[OFFSETS[1] + 3] ^ 0xFF]))
        with pytest.raises(RuntimeError, match="bucket 1: checksum [0-9a-f]{16}, its "
                                               "holders' on arrival"):
            fetch_store([peer], TOKEN, "p", buckets, str(out),
                        copy_checksums=copies.committed_checksums)
    finally:
        server.close()


def _stored(*buckets: BucketInfo) -> StoredPush:
    begin = messages.PushBeginRequest(version=1, transport="nccl", group_id="g")
    return StoredPush(push_id="p", begin=begin, placements=[], buckets=list(buckets))


def test_the_coordinator_takes_the_holders_checksums_and_no_holder_that_disagrees() -> None:
    """What a later replica checks a framework's push by: the checksums the holders'
    writers computed; a holder whose writer saw other bytes is no source, and without a
    checksum for every unchecksummed bucket no holder is."""
    fanout = GroupFanOut(None, GroupSettings(  # type: ignore[arg-type]
        timeout_s=1.0, lease_s=1.0, bucket_bytes=64, num_buckets=2))
    raw = _stored(BucketInfo(index=0, offset=0, nbytes=6, checksum=None),
                  BucketInfo(index=1, offset=64, nbytes=8, checksum="0" * 16))
    same, other = {0: "a" * 16}, {0: "b" * 16}
    push, holders = fanout.sources(raw, {
        "r1": CommandResult(ok=True, copy_checksums=same),
        "r2": CommandResult(ok=True, copy_checksums=same),
        "r3": CommandResult(ok=True, copy_checksums=other)})
    assert push.copy_checksums == same and holders == ["r1", "r2"]
    assert fanout.sources(raw, {"r1": CommandResult(ok=True)}) == (raw, [])
    checked = _stored(BucketInfo(index=0, offset=0, nbytes=8, checksum="0" * 16))
    assert fanout.sources(checked, {"r1": CommandResult(ok=True)}) == (checked, ["r1"])
