"""The part of a weight push before any byte loads: announce, collect, validate.

Runs in the service process (standalone: under the ``/weights/*`` handlers,
through ``manager``; Ray Serve: in the weights coordinator). A push is
``begin`` (announce every tensor) -> ``update`` x N (buckets written into the
trainer's shared-memory segment, or buckets of CUDA IPC handles) -> ``finish``
(load) or ``abort``. The service runs one transport, ``weights_transport`` in its
config; a push announcing another is refused at ``begin``.

Consistency rule: the engine loads nothing until ``finish`` has seen the whole
announced stream, validated. Until then generation runs on the old weights, so
a rejected, aborted or abandoned push (no call within ``timeout_s``) leaves the
served weights and versions exactly as they were. Only an engine failure in the
middle of a load can leave a model half-written; the service then marks itself
inconsistent and refuses generation (503) until a complete push succeeds. It
never serves a mix silently.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout_service.engines.base import WeightUpdate
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
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics

logger = logging.getLogger(__name__)


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
    last_call_s: float = field(default_factory=time.monotonic)
    is_loading: bool = False


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
    if req.broadcast_bytes is not None and req.broadcast_bytes < total:
        raise PushError(400, f"broadcast_bytes: {req.broadcast_bytes} cannot hold {total} "
                             "bytes")
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


def validate_placement(push: ActivePush, placement: TensorPlacement) -> None:
    """Check one bucket entry against the announcement and the push's transport
    (the segment's name and bounds, the staging buffer's bounds; a CUDA IPC handle's
    shape and dtype are checked by the placement itself).

    Raises:
        PushError(400): naming the tensor.
    """
    name = placement.name
    meta = push.expected.get(name)
    if meta is None:
        raise PushError(400, f"tensors: {name!r} was not announced in begin")
    if name in push.placements:
        raise PushError(400, f"tensors: {name!r} was already sent in this push")
    if placement.meta != meta:
        raise PushError(400, f"tensors: {name!r} is placed as {placement.dtype} "
                             f"{list(placement.shape)}, begin announced {meta.dtype} "
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
        assert req.broadcast_bytes is not None  # nccl: required by message validation
        _check_span(name, location.offset, placement, req.broadcast_bytes, "broadcast buffer")
        return
    if not isinstance(location, ShmLocation):
        return
    assert req.segment_bytes is not None  # shm: required by message validation
    if location.segment != req.segment:
        raise PushError(400, f"tensors: {name!r} lies in segment {location.segment!r}, the "
                             f"push announced {req.segment!r}")
    _check_span(name, location.offset, placement, req.segment_bytes, "segment")


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
        where = {"shm": "the segment", "nccl": "the broadcast buffer"}.get(
            str(key), "its CUDA IPC buffer")
        spans.sort()
        for (_, before_end, before), (after_start, _, after) in zip(spans, spans[1:]):
            if after_start < before_end:
                raise PushError(400, f"tensors: {after!r} overlaps {before!r} in {where}")


def build_update(push: ActivePush) -> WeightUpdate:
    """What the engine loads: the validated, complete stream of one push, in
    announcement order."""
    req = push.request
    return WeightUpdate(push_id=push.push_id, target=req.target, transport=req.transport,
                        tensors=tuple(push.placements[name] for name in push.expected),
                        cuda_ipc_buffer=req.cuda_ipc_buffer)


class PushIntake:
    """The part of a push before any byte loads: begin, buckets, abort, expiry.

    Shared by the standalone service (:class:`WeightPushManager`, one engine) and the
    Ray Serve weights coordinator (every replica), so both refuse exactly the same
    pushes with the same messages. Its methods do not await: under asyncio each one
    is atomic, and callers add locks only around the load itself.

    Args:
        checkpoint: the served checkpoint's tensors (names as the loader accepts).
        timeout_s: a push with no call for this long is aborted, unless its begin asks
            for another timeout.
        has_draft: whether the engines have a drafter a push can load (an MTP drafter
            read from the served checkpoint: ``EngineInfo.has_pushable_drafter``).
        transport: the transport the engines were started with.
        metrics: push outcome counters, or None.
    """

    def __init__(self, checkpoint: dict[str, TensorMeta], *, timeout_s: float,
                 has_draft: bool, transport: Transport = "shm",
                 metrics: WeightMetrics | None = None) -> None:
        self._checkpoint = checkpoint
        self._timeout_s = timeout_s
        self._has_draft = has_draft
        self._transport = transport
        self._metrics = metrics
        self._watchdog: asyncio.Task[None] | None = None
        self.active: ActivePush | None = None
        self.last_push: messages.LastPush | None = None
        self._last_ended: tuple[str, str] | None = None
        """(push_id, outcome and detail) of the push that ended last: a call that comes
        after its push ended says why it ended, not only that it is not active."""

    def begin(self, req: messages.PushBeginRequest,
              versions: dict[str, int | None]) -> messages.PushBeginResponse:
        """Validate the announcement against the checkpoint and ``versions`` (the served
        version per role); the push becomes :attr:`active`.

        Raises:
            PushError: 409 for a concurrent push, an old version or training stats newer
                than the pushed version (the JSON schema cannot say it), 400 for a bad
                announcement or a drafter target without a pushable drafter (recorded as
                rejected).
        """
        if self.active is not None:
            raise PushError(409, f"push {self.active.push_id} is in progress; one push at "
                                 "a time")
        try:
            check_target(req.target, has_draft=self._has_draft)
        except PushError as exc:
            self.record(req, "rejected", str(exc))
            raise
        for role in roles(req.target):
            current = versions[role]
            if current is not None and req.version <= current:
                raise PushError(409, f"version: {req.version} is not newer than the {role} "
                                     f"model's version {current}")
        stats = req.training_stats
        if stats is not None and stats.version > req.version:
            raise PushError(409, f"training_stats.version: {stats.version} is newer than the "
                                 f"pushed version {req.version} (stats describe weights "
                                 "already trained)")
        try:
            expected = validate_announcement(req, self._checkpoint, transport=self._transport)
        except PushError as exc:
            self.record(req, "rejected", str(exc))
            raise
        timeout_s = req.timeout_s if req.timeout_s is not None else self._timeout_s
        self.active = ActivePush(push_id=uuid.uuid4().hex, request=req, expected=expected,
                                 timeout_s=timeout_s)
        self._watchdog = asyncio.create_task(self._expire(self.active))
        return messages.PushBeginResponse(push_id=self.active.push_id, timeout_s=timeout_s)

    def get(self, push_id: str) -> ActivePush:
        """The active push if ``push_id`` names it and it is not loading; a call resets
        its timeout."""
        push = self.active
        if push is None or push.push_id != push_id:
            ended = ""
            if self._last_ended is not None and self._last_ended[0] == push_id:
                ended = f"; it ended: {self._last_ended[1]}"
            raise PushError(404, f"push_id: {push_id!r} is not the active push "
                                 f"(active: {push.push_id if push else None}){ended}")
        if push.is_loading:
            raise PushError(409, f"push {push_id} is already loading")
        push.last_call_s = time.monotonic()
        return push

    def update(self, req: messages.PushUpdateRequest) -> messages.PushUpdateResponse:
        """Record one bucket; a bad entry rejects the whole push."""
        push = self.get(req.push_id)
        try:
            for placement in req.tensors:
                validate_placement(push, placement)
                push.placements[placement.name] = placement
        except PushError as exc:
            self.end(push, "rejected", str(exc))
            raise
        return messages.PushUpdateResponse(num_received=len(push.placements),
                                           num_expected=len(push.expected))

    def abort(self, req: messages.PushAbortRequest) -> None:
        self.end(self.get(req.push_id), "aborted", req.reason)

    def start_loading(self, push_id: str) -> ActivePush:
        """The complete, validated push, now loading (no timeout, no further calls).

        Raises:
            PushError(400): a tensor never sent, or overlapping tensors (rejected).
        """
        push = self.get(push_id)
        try:
            missing = sorted(set(push.expected) - set(push.placements))
            if missing:
                raise PushError(400, f"finish: tensor {missing[0]!r} was never sent "
                                     f"({len(missing)} missing in all)")
            check_no_overlap(push.placements.values(), push.request.cuda_ipc_buffer)
        except PushError as exc:
            self.end(push, "rejected", str(exc))
            raise
        push.is_loading = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        return push

    def record(self, req: messages.PushBeginRequest, outcome: str, detail: str) -> None:
        """Remember how a push ended (``/weights/status``), count it, log failures."""
        self.last_push = messages.LastPush(version=req.version, target=req.target,
                                           outcome=outcome, detail=detail)  # type: ignore[arg-type]
        if self._metrics is not None:
            self._metrics.count_outcome(outcome)
        if outcome != "loaded":
            logger.warning("weight push %s (version %d): %s", outcome, req.version, detail)

    def end(self, push: ActivePush, outcome: str, detail: str) -> None:
        """Record ``push``'s outcome; it is no longer active."""
        self.record(push.request, outcome, detail)
        self._last_ended = (push.push_id, f"{outcome}, {detail}")
        if self.active is push:
            self.active = None
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None

    async def _expire(self, push: ActivePush) -> None:
        """Abort ``push`` once it has gone its ``timeout_s`` without a call."""
        while True:
            remaining = push.last_call_s + push.timeout_s - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.sleep(remaining)
        if self.active is push and not push.is_loading:
            self.end(push, "aborted", f"no call from the trainer for {push.timeout_s:g} s; "
                                      "nothing was loaded, the old weights are still served")


def roles(target: messages.PushTarget) -> list[str]:
    """The models a push target names."""
    return {"main": ["main"], "draft": ["draft"], "both": ["main", "draft"]}[target]
