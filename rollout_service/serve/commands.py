"""What the weights coordinator and the engine replicas say to each other (Ray Serve).

Plain pydantic messages, no Ray import: the coordinator (``coordinator.py``) queues
:class:`Command` values for each replica, which long-polls for them and answers each with
a :class:`CommandResult`; a registering replica gets a :class:`Snapshot`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from rollout_service.protocol import messages
from rollout_service.protocol.placement import TensorPlacement
from rollout_service.protocol.store import BucketInfo


class StoredPush(BaseModel):
    """A whole, validated push: its announcement, where each tensor lies and (``nccl``)
    the buckets it arrived in, with their checksums."""

    push_id: str
    begin: messages.PushBeginRequest
    placements: list[TensorPlacement]
    buckets: list[BucketInfo] = Field(default_factory=list)
    copy_checksums: dict[int, str] = Field(default_factory=dict)
    """``nccl``, the buckets that came without a checksum (the frameworks' framing): each
    one's checksum as the holders' writers computed it on arrival, by index: what a
    replica fetching a holder's copy checks those buckets by."""


class Command(BaseModel):
    """One instruction for one replica: the ``shm`` and ``nccl`` loads and commits, and the
    ``nccl`` group's join, leave, buckets and catch-up from a peer (``group_fanout.py``)."""

    id: str
    kind: Literal["load", "commit", "checksums", "group_join", "group_leave", "bucket",
                  "fetch"]
    push: StoredPush | None = None
    main_version: int | None = None
    draft_version: int | None = None
    group: messages.WeightGroupRequest | None = None
    """``group_join``: the trainer's group, at this replica's own rank offset."""
    push_id: str | None = None
    buckets: list[BucketInfo] = Field(default_factory=list)
    """``bucket``: an update's buckets, received in order."""
    peers: list[str] = Field(default_factory=list)
    """``fetch``: the stored-copy addresses of replicas that serve ``push``."""


class CommandResult(BaseModel):
    """A replica's answer to a command (``status`` is the HTTP code of its failure)."""

    ok: bool
    status: int = 200
    message: str = ""
    finish: messages.PushFinishResponse | None = None
    checksums: dict[str, str] | None = None
    copy_checksums: dict[int, str] | None = None
    """``load``, ``nccl``: the replica's stored copy's ``StoredPush.copy_checksums``."""
    report: messages.ReplicaHealth | None = None
    """``commit``: the replica's state right after it applied the command, so the
    coordinator's view of it (``/health``) is not one poll behind when the push returns."""


class Snapshot(BaseModel):
    """What a registering replica must serve before it takes requests: the versions, the
    last push, and (``nccl``) where peers serve its stored copy."""

    main_version: int | None
    draft_version: int | None
    last_push: StoredPush | None
    peers: list[str] = Field(default_factory=list)
