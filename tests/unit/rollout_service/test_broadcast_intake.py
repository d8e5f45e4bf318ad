"""The service's intake of an ``nccl`` push: each update's bucket checked against the
stream received so far and the tensors placed in it, a bucket refused on the other
transports, and the two guards that keep a push off shared memory (the store directory
is never under ``/dev/shm``; the integration tests' ``/dev/shm`` sampler sees a segment
mapped and let go). In the test process, no group and no engine.

The whole path through the real CPU engine is
``tests/integration/rollout_service/test_broadcast_push.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_service.protocol import messages
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.store import check_store_dir
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.weights.checks import ActivePush, PushError, check_bucket
from rollout_service.weights.intake import PushIntake
from tests.support.broadcast_groups import bucket
from tests.support.waiting import wait_for

CHECKPOINT = {"w": TensorMeta(shape=(4, 3), dtype="bfloat16"),
              "b": TensorMeta(shape=(3,), dtype="float32")}


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
