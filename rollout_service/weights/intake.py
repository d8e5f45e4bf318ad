"""The part of a weight push before any byte loads: announce, collect, validate.

Runs in the service process (standalone: under the ``/weights/*`` handlers,
through ``manager``; Ray Serve: in the weights coordinator). A push is
``begin`` (announce every tensor) -> ``update`` x N (buckets written into the
trainer's shared-memory segment, buckets of CUDA IPC handles, or buckets the trainer
broadcasts during the call, ``nccl``) -> ``finish`` (load) or ``abort``. The service
runs one transport, ``weights_transport`` in its config; a push announcing another is
refused at ``begin``. The checks themselves are ``checks.py``.

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
import time
import uuid

from rollout_service.engines.base import WeightUpdate
from rollout_service.protocol import messages
from rollout_service.protocol.placement import Transport
from rollout_service.protocol.store import StoreRef
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.checks import (  # re-exported: the intake's callers use them
    ActivePush,
    PushError,
    check_bucket,
    check_no_overlap,
    check_target,
    validate_announcement,
    validate_placement,
)

__all__ = ["ActivePush", "PushError", "PushIntake", "build_update", "check_bucket",
           "check_no_overlap", "check_target", "validate_announcement",
           "validate_placement"]

logger = logging.getLogger(__name__)


def build_update(push: ActivePush, store: StoreRef | None = None) -> WeightUpdate:
    """What the engine loads: the validated, complete stream of one push, in
    announcement order (``nccl``: from ``store``, the server's received copy)."""
    req = push.request
    return WeightUpdate(push_id=push.push_id, target=req.target, transport=req.transport,
                        tensors=tuple(push.ordered_placements()),
                        cuda_ipc_buffer=req.cuda_ipc_buffer, store=store)


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
        self.max_tensor_bytes = max((m.nbytes for m in checkpoint.values()), default=0)
        """The largest tensor: the smallest slot a per-tensor broadcast fits in."""
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
        check_newer(req.version, req.target, versions)
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
            buckets = check_bucket(push, req)
            for placement in req.tensors:
                validate_placement(push, placement, buckets)
                push.placements[placement.name] = placement
            push.buckets.extend(buckets)
        except PushError as exc:
            self.end(push, "rejected", str(exc))
            raise
        return messages.PushUpdateResponse(num_received=len(push.placements),
                                           num_expected=len(push.expected))

    def abort(self, req: messages.PushAbortRequest) -> None:
        self.end(self.get(req.push_id), "aborted", req.reason)

    def start_loading(self, push_id: str, *, version: int | None = None,
                      versions: dict[str, int | None] | None = None) -> ActivePush:
        """The complete, validated push, now loading (no timeout, no further calls).

        Args:
            version: the version to serve instead of begin's (checked against
                ``versions``, the served version per role).

        Raises:
            PushError: 400 for a tensor never sent, or overlapping tensors; 409 for a
                version not newer than the served one (rejected, nothing loads).
        """
        push = self.get(push_id)
        try:
            missing = sorted(set(push.expected) - set(push.placements))
            is_partial_ok = push.is_announced_per_update and push.request.target == "draft"
            if missing and not (is_partial_ok and push.placements):
                raise PushError(400, f"finish: tensor {missing[0]!r} was never sent "
                                     f"({len(missing)} missing in all)")
            check_no_overlap(push.placements.values(), push.request.cuda_ipc_buffer)
            if version is not None:
                check_newer(version, push.request.target, versions or {})
            if version is not None or push.is_announced_per_update:
                push.request = as_announced(push, version)
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
            if remaining <= 0 and not push.is_receiving:
                break
            await asyncio.sleep(remaining if remaining > 0 else 1.0)
        if self.active is push and not push.is_loading and not push.is_receiving:
            self.end(push, "aborted", f"no call from the trainer for {push.timeout_s:g} s; "
                                      "nothing was loaded, the old weights are still served")


def as_announced(push: ActivePush, version: int | None) -> messages.PushBeginRequest:
    """``push``'s begin as if it had announced what arrived (its params and total bytes,
    when its updates named the tensors) and the version it serves: a valid announcement,
    which every later step takes as any push's (under Ray Serve the replicas' load and a
    restarting replica's replay get it in a ``StoredPush``, whose validation runs its
    checks again)."""
    req = push.request
    update: dict[str, object] = {"version": req.version if version is None else version}
    if req.params is None:
        placed = push.ordered_placements()
        update["params"] = [messages.ParamSpec(name=p.name, shape=list(p.shape), dtype=p.dtype)
                            for p in placed]
        update["total_bytes"] = sum(p.nbytes for p in placed)
    return req.model_copy(update=update)


def check_newer(version: int, target: messages.PushTarget,
                versions: dict[str, int | None]) -> None:
    """Raises PushError(409) unless ``version`` is newer than the served version of every
    model ``target`` names."""
    for role in messages.push_roles(target):
        current = versions.get(role)
        if current is not None and version <= current:
            raise PushError(409, f"version: {version} is not newer than the {role} "
                                 f"model's version {current}")
