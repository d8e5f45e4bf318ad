"""The ``nccl`` weight-transfer backend, inside vLLM's worker processes.

Each worker joins the trainer's collective group as ``rank_offset + its rank`` (the
trainer is rank 0 and hosts the rendezvous; ``protocol/broadcast.py``) and, during each
``/weights/update`` of a push, receives the trainer's bucket into a slot of a
fixed-size ring, checks its length and checksum, and (the server's first worker) writes
it into the push's stored copy on disk (``bucket_receiver.py``). Once every bucket has
arrived, ``/weights/finish`` loads the main model and the drafter from views of that
file (``transfer.LoadSession``, in place or by reload as for the other backends): the
drafter receives nothing a second time, no worker ever holds the whole checkpoint in
memory, and a broadcast that fails half-way loads nothing at all.

Joining and receiving block on the other ranks, so both run on threads of their own
(``engines/group_member.py``, the worker's rank of the group):
vLLM's engine core keeps stepping while a worker waits for the trainer. The service
follows a join through the workers' state (``rollout_group_state`` of
``worker_ext.py``) and a bucket through the trainer's store, where each worker counts
itself when its receive ends, asking the workers how it ended only then.

Registered under the name ``rollout_nccl`` by :mod:`rollout_service.engines.vllm.plugin`
(vLLM's own ``nccl`` backend is another thing: the trainer's packed chunks received
and loaded inside ``update_weights``, with no length or checksum of their own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo

from rollout_service.engines.broadcast_engine import BucketReceive
from rollout_service.engines.group_member import GroupMember
from rollout_service.engines.vllm.transfer import PushUpdateInfo, SessionLoads
from rollout_service.protocol.broadcast import GroupSpec
from rollout_service.protocol.placement import BroadcastLocation
from rollout_service.protocol.shm import PinnedSegment, Segment
from rollout_service.protocol.store import BucketInfo, map_store

logger = logging.getLogger(__name__)


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """Nothing at start-up: groups are joined at run time (``rollout_group_join``)."""


class BroadcastWeightTransferEngine(SessionLoads,
                                    WeightTransferEngine[BroadcastInitInfo, PushUpdateInfo]):
    """Receives a push bucket by bucket and loads main and drafter from its stored copy."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = PushUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._member = GroupMember(self.device)
        self._mapped: tuple[str, Segment, PinnedSegment | None] | None = None

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        pass

    # ---- the group and its buckets (worker_ext.py calls these; group_member.py) -------

    def join_group(self, spec: dict[str, Any], rank: int, is_writer: bool) -> None:
        """Start joining the group ``spec`` as ``rank`` (returns at once); an earlier
        group is let go."""
        self._member.join_group(GroupSpec(**spec), rank, is_writer=is_writer)

    def group_state(self, group_id: str) -> str:
        return self._member.group_state(group_id)

    def leave_group(self) -> None:
        self._member.leave_group()

    def start_bucket(self, receive: dict[str, Any], bucket: dict[str, Any]) -> None:
        self._member.start_bucket(BucketReceive(**receive), BucketInfo.model_validate(bucket))

    def bucket_state(self, push_id: str, index: int) -> str:
        return self._member.bucket_state(push_id, index)

    def receive_report(self, push_id: str, num_buckets: int) -> dict[str, Any]:
        """:meth:`GroupMember.receive_report`, ``copy_checksums`` keyed by the bucket's
        index as a string (the RPC's encoding keeps string keys only)."""
        report = self._member.receive_report(push_id, num_buckets)
        return {"state": report.state, "peak_bytes": report.peak_bytes,
                "copy_checksums": {str(i): c for i, c in report.copy_checksums.items()}}

    # ---- vLLM's weight-update session (SessionLoads) -------------------------------

    def receive_weights(self, update_info: PushUpdateInfo) -> None:  # type: ignore[override]
        update_info.check_transport("nccl")
        store = update_info.store_ref
        if store is None:
            raise ValueError(f"push {update_info.push_id}: no stored copy to load from")
        mapped = self._map(store.path)
        try:
            tensors = []
            for placement in update_info.placements:
                location = placement.location
                assert isinstance(location, BroadcastLocation)  # checked by PushUpdateInfo
                tensors.append((placement.name, mapped.tensor(
                    location.offset, getattr(torch, placement.dtype), placement.shape)))
            self._load(update_info, "nccl", tensors)
        finally:
            if update_info.is_last_load:
                self._unmap()

    def _map(self, path: str) -> Segment:
        """The stored copy, mapped once for both of a push's loads (and on CUDA pinned,
        so its host-to-device copies run as DMA, as for the ``shm`` segment)."""
        if self._mapped is None or self._mapped[0] != path:
            self._unmap()
            segment = map_store(path)
            pinned = None
            if self.device.type == "cuda":
                try:
                    pinned = PinnedSegment(segment)
                except RuntimeError as exc:
                    logger.warning("loading from %s unpinned (slower): %s", path, exc)
            self._mapped = (path, segment, pinned)
        return self._mapped[1]

    def _unmap(self) -> None:
        if self._mapped is not None:
            _, segment, pinned = self._mapped
            if pinned is not None:
                pinned.close()
            segment.close()
            self._mapped = None

    def shutdown(self) -> None:
        self.leave_group()
        self._unmap()
