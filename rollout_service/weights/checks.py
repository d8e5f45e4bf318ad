"""The checks of a weight push: each a pure function of the announcement, the served
checkpoint and one update, shared by the standalone service and the Ray Serve weights
coordinator (through :class:`~rollout_service.weights.intake.PushIntake`), so both refuse
exactly the same pushes with the same messages.

Runs in the service process (or the coordinator's); reads no engine state.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.placement import (
    BroadcastLocation,
    CudaIpcLocation,
    ShmLocation,
    TensorPlacement,
    Transport,
)
from rollout_service.protocol.shm import segment_path
from rollout_service.protocol.store import BucketInfo
from rollout_service.protocol.tensors import TensorMeta


class PushError(Exception):
    """A push call that cannot proceed; ``status`` is the HTTP code to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[PushError], tuple[int, str]]:
        # Crosses Ray (coordinator -> ingress) intact, status included.
        return (PushError, (self.status, str(self)))


@dataclass(kw_only=True, slots=True)
class ActivePush:
    """A push between ``begin`` and its end (also held by the Ray Serve weights coordinator)."""

    push_id: str
    request: messages.PushBeginRequest
    expected: dict[str, TensorMeta]
    timeout_s: float
    """Aborted after this long without a call (the begin's, or the service's default)."""
    placements: dict[str, TensorPlacement] = field(default_factory=dict)
    buckets: list[BucketInfo] = field(default_factory=list)
    """``nccl``: the buckets received so far, in order."""
    last_call_s: float = field(default_factory=time.monotonic)
    is_loading: bool = False
    is_receiving: bool = False
    """``nccl``: an update call is waiting for its bucket's broadcast (no timeout then:
    the group's own timeout ends a stalled broadcast)."""

    @property
    def is_announced_per_update(self) -> bool:
        """Whether the updates name the tensors (begin announced none: the dialects)."""
        return self.request.params is None

    def ordered_placements(self) -> list[TensorPlacement]:
        """The tensors that arrived, in the checkpoint's (or the announcement's) order."""
        return [self.placements[name] for name in self.expected if name in self.placements]

    def state(self) -> messages.ActivePushState:
        req = self.request
        return messages.ActivePushState(
            push_id=self.push_id, client=req.client, target=req.target, version=req.version,
            group_id=req.group_id, num_buckets=len(self.buckets),
            stream_bytes=self.buckets[-1].end if self.buckets else 0,
            num_tensors=len(self.placements))


def check_target(target: messages.PushTarget, *, has_draft: bool) -> None:
    """Refuse a push that names the drafter where no drafter can load it.

    Args:
        target: the push's target.
        has_draft: whether the engine has a drafter a push can load
            (``EngineInfo.has_pushable_drafter``).

    Raises:
        PushError(400): ``draft`` or ``both`` without such a drafter, naming ``target``.
    """
    if target != "main" and not has_draft:
        raise PushError(400, f"target: {target!r} loads the drafter, and this service has "
                             "none a push can load (speculative decoding off, or a drafter "
                             "other than the checkpoint's MTP layers: n-gram, suffix, a "
                             "separate model); push with target 'main'")


def validate_announcement(req: messages.PushBeginRequest, checkpoint: dict[str, TensorMeta],
                          *, transport: Transport = "shm") -> dict[str, TensorMeta]:
    """The announced tensors, checked against the checkpoint; first problem raises.

    A push carries every checkpoint tensor: the engine reloads whole layers, and
    an RL step changes every trained tensor anyway.

    Args:
        req: the announcement.
        checkpoint: the served checkpoint's tensors.
        transport: the service's configured transport (its engine loads only that one).

    Raises:
        PushError(400): another transport, unknown, duplicate, missing, mis-shaped or
            mis-typed tensors, sizes that do not add up, or (shm) a missing segment.
    """
    if req.transport != transport:
        raise PushError(400, f"transport: {req.transport!r} is not this service's weights "
                             f"transport {transport!r} (weights_transport in its config)")
    if req.params is None:  # each update names its tensors, checked there
        return dict(checkpoint)
    assert req.total_bytes is not None  # wire validation: required with params
    announced: dict[str, TensorMeta] = {}
    for spec in req.params:
        expected = checkpoint.get(spec.name)
        if expected is None:
            raise PushError(400, f"params: tensor {spec.name!r} is not in the served model")
        if spec.name in announced:
            raise PushError(400, f"params: tensor {spec.name!r} is announced twice")
        if tuple(spec.shape) != expected.shape:
            raise PushError(400, f"params: tensor {spec.name!r} has shape {spec.shape}, the "
                                 f"model expects {list(expected.shape)}")
        if spec.dtype != expected.dtype:
            raise PushError(400, f"params: tensor {spec.name!r} has dtype {spec.dtype}, the "
                                 f"model expects {expected.dtype}")
        announced[spec.name] = expected
    missing = sorted(set(checkpoint) - set(announced))
    if missing:
        raise PushError(400, f"params: tensor {missing[0]!r} is missing ({len(missing)} "
                             "missing in all); a push carries every tensor of the model")
    total = sum(meta.nbytes for meta in announced.values())
    if req.total_bytes != total:
        raise PushError(400, f"total_bytes: {req.total_bytes} announced, the tensors hold {total}")
    if req.transport == "shm":
        _validate_segment(req, total)
    return announced


def _validate_segment(req: messages.PushBeginRequest, total: int) -> None:
    assert req.segment is not None and req.segment_bytes is not None  # wire validation
    if req.segment_bytes < total:
        raise PushError(400, f"segment_bytes: {req.segment_bytes} cannot hold {total} bytes")
    try:
        actual = os.stat(segment_path(req.segment)).st_size
    except (ValueError, FileNotFoundError) as exc:
        raise PushError(400, f"segment: {req.segment!r} does not exist on this host "
                             f"({exc})") from exc
    if actual < req.segment_bytes:
        raise PushError(400, f"segment_bytes: {req.segment_bytes} announced, the segment "
                             f"holds {actual}")


def validate_placement(push: ActivePush, placement: TensorPlacement,
                       buckets: list[BucketInfo] | None = None) -> None:
    """Check one bucket entry against the announcement and the push's transport
    (the segment's name and bounds, the staging buffer's or the broadcast bucket's
    bounds; a CUDA IPC handle's shape and dtype are checked by the placement itself).

    Raises:
        PushError(400): naming the tensor.
    """
    name = placement.name
    meta = push.expected.get(name)
    is_per_update = push.is_announced_per_update
    placed, announced = (("is", "the served model has") if is_per_update
                         else ("is placed as", "begin announced"))
    if meta is None:
        raise PushError(400, f"tensors: {name!r} is not in the served model"
                        if push.is_announced_per_update else
                        f"tensors: {name!r} was not announced in begin")
    if name in push.placements:
        raise PushError(400, f"tensors: {name!r} was already sent in this push")
    if placement.meta != meta:
        raise PushError(400, f"tensors: {name!r} {placed} {placement.dtype} "
                             f"{list(placement.shape)}, {announced} {meta.dtype} "
                             f"{list(meta.shape)}")
    req = push.request
    if placement.transport != req.transport:
        raise PushError(400, f"tensors: {name!r} lies in {placement.transport!r}, and the "
                             f"push's transport is {req.transport!r}")
    location = placement.location
    if isinstance(location, CudaIpcLocation):
        if location.handle is None:  # in the push's staging buffer
            if req.cuda_ipc_buffer is None:
                raise PushError(400, f"tensors: {name!r} has no handle, and begin announced "
                                     "no cuda_ipc_buffer for it to lie in")
            _check_span(name, location.offset, placement, req.cuda_ipc_buffer.nbytes,
                        "staging buffer (cuda_ipc_buffer)")
        return
    if isinstance(location, BroadcastLocation):
        assert buckets  # nccl: check_bucket required them
        last = buckets[-1]
        _check_span(name, location.offset, placement, last.end,
                    f"stream received with bucket {last.index}")
        _check_received(name, location.offset, location.offset + placement.nbytes,
                        [*push.buckets, *buckets])
        return
    if not isinstance(location, ShmLocation):
        return
    assert req.segment_bytes is not None  # shm: required by message validation
    if location.segment != req.segment:
        raise PushError(400, f"tensors: {name!r} lies in segment {location.segment!r}, the "
                             f"push announced {req.segment!r}")
    _check_span(name, location.offset, placement, req.segment_bytes, "segment")


def _check_received(name: str, start: int, end: int, buckets: list[BucketInfo]) -> None:
    """The tensor's bytes all arrived in the push's buckets (which may leave gaps in the
    stream: the frameworks' raw buckets sit at aligned offsets)."""
    position = start
    for bucket in buckets:
        if bucket.offset <= position < bucket.end:
            position = bucket.end
        if position >= end:
            return
    raise PushError(400, f"tensors: {name!r} [{start}, {end}) is not all in the buckets "
                         f"received (from byte {position} on)")


def _check_span(name: str, offset: int, placement: TensorPlacement, size: int,
                where: str) -> None:
    """The tensor's bytes are aligned to its elements and lie inside ``size`` bytes."""
    if offset % placement.element_bytes:
        raise PushError(400, f"tensors: {name!r} offset {offset} is not aligned to "
                             f"its {placement.element_bytes}-byte {placement.dtype} elements")
    end = offset + placement.nbytes
    if end > size:
        raise PushError(400, f"tensors: {name!r} [{offset}, {end}) lies outside the "
                             f"{size}-byte {where}")


def check_no_overlap(placements: Iterable[TensorPlacement],
                     cuda_ipc_buffer: CudaIpcHandle | None = None) -> None:
    """Raises PushError(400) naming the first tensor that overlaps its predecessor in
    the segment, the broadcast buffer, or a CUDA IPC byte buffer (one export holding
    several tensors: a placement's own, or the push's ``cuda_ipc_buffer``)."""
    by_memory: dict[object, list[tuple[int, int, str]]] = defaultdict(list)
    for p in placements:
        location = p.location
        key: object = location.transport
        if isinstance(location, CudaIpcLocation):
            handle = location.handle or cuda_ipc_buffer
            assert handle is not None  # validate_placement refused a placement without one
            key = handle.export_key
        by_memory[key].append((location.offset, location.offset + p.nbytes, p.name))
    for key, spans in by_memory.items():
        where = {"shm": "the segment", "nccl": "the broadcast stream"}.get(
            str(key), "its CUDA IPC buffer")
        spans.sort()
        for (_, before_end, before), (after_start, _, after) in zip(spans, spans[1:]):
            if after_start < before_end:
                raise PushError(400, f"tensors: {after!r} overlaps {before!r} in {where}")


def check_bucket(push: ActivePush, req: messages.PushUpdateRequest) -> list[BucketInfo]:
    """An update's buckets: required for ``nccl`` (the next ones in order, each starting
    at or after the previous one's end), refused for the other transports (empty list).

    Raises:
        PushError(400): naming ``bucket`` (or ``buckets``).
    """
    transport = push.request.transport
    buckets = req.all_buckets
    if transport != "nccl":
        if buckets:
            raise PushError(400, f"bucket: not used by transport {transport!r}; leave it out")
        return []
    if not buckets:
        raise PushError(400, "bucket: required by transport 'nccl' (the bucket the trainer "
                             "broadcasts during this update: index, nbytes, checksum)")
    index = len(push.buckets)
    start = push.buckets[-1].end if push.buckets else 0
    for bucket in buckets:
        if bucket.index != index:
            raise PushError(400, f"bucket: index {bucket.index} is not the push's next "
                                 f"bucket ({index})")
        if bucket.offset < start:
            raise PushError(400, f"bucket: offset {bucket.offset} lies before the end of "
                                 f"the last bucket ({start})")
        index, start = index + 1, bucket.end
    return buckets
