"""One engine's served weights: the push protocol in front, the loads behind.

Runs in the service process. Standalone, the ``/weights/*`` router drives
:class:`WeightPushManager` through ``begin`` / ``update`` / ``finish`` /
``abort`` (validated by :class:`~rollout_service.weights.intake.PushIntake`).
Under Ray Serve the weights coordinator validates a push once for the whole
deployment and each replica calls :meth:`WeightPushManager.load` with the result.

A load reads like the protocol: pause generation, load the main model, load the
drafter from the same placements, reset the prefix cache, resume. An engine
failure in the middle of a load marks the weights inconsistent: generation is
refused (503) until a complete push succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from rollout_service.engines.base import Engine, WeightUpdate
from rollout_service.pausing import PauseGate
from rollout_service.protocol import messages
from rollout_service.protocol.placement import TensorPlacement, Transport
from rollout_service.protocol.store import StoreRef
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.group import WeightGroups
from rollout_service.weights.intake import (
    PushError,
    PushIntake,
    build_update,
    check_bucket,
    check_target,
)

logger = logging.getLogger(__name__)


class WeightPushManager:
    """Owns the push protocol and the served weight versions of one engine.

    Args:
        engine: the engine to load into.
        checkpoint: the served checkpoint's tensors (names as the loader accepts).
        metrics: version gauges and push counters.
        timeout_s: a push with no call for this long is aborted.
        has_draft: whether the engine has a drafter a push can load
            (``EngineInfo.has_pushable_drafter``).
        transport: the transport the engine was started with (``weights_transport``).
        groups: the ``nccl`` transport's groups (None for the other transports).
        pauses: the engine's pause, shared with the service's pause routes (a push inside
            a client's pause leaves generation paused); default: the push's own.
    """

    def __init__(self, engine: Engine, checkpoint: dict[str, TensorMeta],
                 metrics: WeightMetrics, *, timeout_s: float, has_draft: bool,
                 transport: Transport = "shm", groups: WeightGroups | None = None,
                 pauses: PauseGate | None = None) -> None:
        self._engine = engine
        self._pauses = pauses or PauseGate(engine)
        self._transport = transport
        self._groups = groups
        self._has_draft = has_draft
        self._metrics = metrics
        self._intake = PushIntake(checkpoint, timeout_s=timeout_s, has_draft=has_draft,
                                  transport=transport, metrics=metrics)
        self._lock = asyncio.Lock()
        self.main_version: int | None = None
        self.draft_version: int | None = None
        self.is_consistent = True

    def status(self) -> messages.WeightStatus:
        active = self._intake.active
        return messages.WeightStatus(
            main_version=self.main_version, draft_version=self.draft_version,
            active_push_id=active.push_id if active else None,
            active_push=active.state() if active else None,
            consistent=self.is_consistent, last_push=self._intake.last_push)

    async def get_status(self) -> messages.WeightStatus:
        """:meth:`status` for the HTTP handler (the Ray Serve ingress's is a remote call)."""
        return self.status()

    # ---- the push protocol (standalone service) ------------------------------------

    @property
    def groups(self) -> WeightGroups | None:
        """The ``nccl`` transport's group (None for the other transports)."""
        return self._groups

    def _need_groups(self) -> WeightGroups:
        if self._groups is None:
            raise PushError(403, f"weights_transport: this service takes "
                                 f"{self._transport!r} pushes; weight groups are for "
                                 "'nccl'")
        return self._groups

    async def group_state(self) -> messages.WeightGroupState:
        return self._need_groups().state().model_copy(update={
            "max_tensor_bytes": self._intake.max_tensor_bytes})

    async def create_group(self, req: messages.WeightGroupRequest
                           ) -> messages.WeightGroupResponse:
        """Join the trainer's ``nccl`` group.

        Raises:
            PushError: 403 for another transport (groups are off by configuration), 409
                while a push is in progress or another group lives, 400 for bad fields.
        """
        async with self._lock:
            groups = self._need_groups()
            if self._intake.active is not None:
                raise PushError(409, f"push {self._intake.active.push_id} is in progress")
            return await groups.create(req)

    async def release_group(self, req: messages.WeightGroupRelease
                            ) -> messages.WeightGroupState:
        async with self._lock:
            groups = self._need_groups()
            active = self._intake.active
            if active is not None and active.request.group_id == req.group_id:
                self._intake.end(active, "aborted", f"its group {req.group_id!r} was released")
                groups.discard(active.push_id)
            return await groups.release(req.group_id)

    async def begin(self, req: messages.PushBeginRequest) -> messages.PushBeginResponse:
        async with self._lock:
            if req.transport == "nccl" and self._groups is not None:
                assert req.group_id is not None  # nccl: required by message validation
                await self._groups.check_joined(req.group_id)
            return self._intake.begin(req, self._versions())

    def _versions(self) -> dict[str, int | None]:
        return {"main": self.main_version, "draft": self.draft_version}

    async def update(self, req: messages.PushUpdateRequest) -> messages.PushUpdateResponse:
        async with self._lock:
            if self._groups is None:
                return self._intake.update(req)
            return await self._update_broadcast(self._groups, req)

    async def _update_broadcast(self, groups: WeightGroups, req: messages.PushUpdateRequest
                                ) -> messages.PushUpdateResponse:
        """``update`` for ``nccl``: the trainer broadcasts the bucket as this runs. Its
        placements are checked first; a bucket refused for them is still received (and
        dropped), so that the trainer's broadcast ends; one whose framing is wrong is
        refused before any worker receives."""
        push = self._intake.get(req.push_id)
        try:
            buckets = check_bucket(push, req)
        except PushError as exc:
            self._intake.end(push, "rejected", str(exc))
            groups.discard(push.push_id)
            raise
        try:
            response = self._intake.update(req)
        except PushError as refusal:
            with contextlib.suppress(PushError):
                await groups.receive_buckets(push.push_id, buckets)
            groups.discard(push.push_id)
            raise refusal
        push.is_receiving = True
        try:
            await groups.receive_buckets(push.push_id, buckets)
        except PushError as exc:
            self._intake.end(push, "rejected" if exc.status < 500 and exc.status != 408
                             else "failed", str(exc))
            groups.discard(push.push_id)
            raise
        finally:
            push.is_receiving = False
            push.last_call_s = time.monotonic()
        return response

    async def abort(self, req: messages.PushAbortRequest) -> messages.WeightStatus:
        async with self._lock:
            self._intake.abort(req)
            if self._groups is not None:
                self._groups.discard(req.push_id)
            return self.status()

    async def finish(self, req: messages.PushFinishRequest) -> messages.PushFinishResponse:
        """Load the complete push; its outcome is recorded for ``/weights/status``.

        Raises:
            PushError: 400 for an incomplete push (nothing loaded), 500 for an engine
                failure while loading (weights inconsistent until the next push).
        """
        async with self._lock:
            if self._groups is not None:
                return await self._finish_broadcast(self._groups, req)
            push = self._intake.start_loading(req.push_id, version=req.version,
                                              versions=self._versions())
            try:
                finished = await self._apply(push.request, build_update(push))
            except PushError as exc:
                self._intake.end(push, "failed", str(exc))
                raise
            self._intake.end(push, "loaded", f"{finished.num_bytes} bytes in "
                                             f"{finished.timings.total_s:.3f} s")
            return finished

    async def _finish_broadcast(self, groups: WeightGroups, req: messages.PushFinishRequest
                                ) -> messages.PushFinishResponse:
        """``finish`` for ``nccl``: every bucket arrived during the updates; once the
        stored copy is written, the push loads from it as any other."""
        try:
            push = self._intake.start_loading(req.push_id, version=req.version,
                                              versions=self._versions())
        except PushError as exc:
            if exc.status in (400, 409):  # incomplete, overlapping, old: nothing loads
                groups.discard(req.push_id)
            raise
        try:
            received = await groups.finish_receive(push.push_id, push.buckets)
            finished = await self._apply(push.request, build_update(push, received.store))
        except PushError as exc:
            self._intake.end(push, "failed", str(exc))
            groups.discard(push.push_id)
            raise
        groups.copies.commit(received.store, received.copy_checksums)
        self._intake.end(push, "loaded", f"{finished.num_bytes} bytes received in "
                                         f"{received.receive_s:.3f} s, loaded in "
                                         f"{finished.timings.total_s:.3f} s")
        timings = finished.timings.model_copy(update={"receive_s": received.receive_s})
        return finished.model_copy(update={"timings": timings,
                                           "receive_peak_bytes": received.peak_bytes})

    # ---- already validated pushes (Ray Serve replicas) -----------------------------

    async def load(self, begin: messages.PushBeginRequest, placements: list[TensorPlacement],
                   *, push_id: str, store: StoreRef | None = None
                   ) -> messages.PushFinishResponse:
        """Load a push the weights coordinator has validated for the whole deployment
        (``nccl``: from ``store``, this replica's received or fetched copy).

        Raises:
            PushError: 400 for a drafter target without a drafter a push can load (nothing
                loaded; the coordinator decides before any engine exists), 500 for an engine
                failure while loading.
        """
        check_target(begin.target, has_draft=self._has_draft)
        async with self._lock:
            update = WeightUpdate(push_id=push_id, target=begin.target,
                                  transport=begin.transport, tensors=tuple(placements),
                                  store=store)
            return await self._apply(begin, update)

    # ---- the load itself -----------------------------------------------------------

    async def _apply(self, req: messages.PushBeginRequest, update: WeightUpdate
                     ) -> messages.PushFinishResponse:
        """Load ``update``, then serve ``req.version`` for every model it targets."""
        try:
            timings, held = await self._load(req.pause_mode, update, version=str(req.version))
        except Exception as exc:
            self.is_consistent = False
            logger.exception("weight load failed; generation refused until a full push")
            raise PushError(500, f"the engine failed while loading; generation is refused "
                                 f"until a complete push succeeds: {exc}") from exc
        self.is_consistent = True
        for role in messages.push_roles(req.target):
            setattr(self, f"{role}_version", req.version)
            self._metrics.set_version(role, req.version)
        self._metrics.loaded(self.main_version or 0, req.training_stats)
        self._metrics.observe_push(req.total_bytes, timings.total_s)
        return messages.PushFinishResponse(version=req.version, target=req.target,
                                           num_bytes=req.total_bytes, timings=timings,
                                           num_requests_held=held)

    async def _load(self, pause_mode: messages.PauseMode, update: WeightUpdate, *,
                    version: str) -> tuple[messages.PushTimings, int]:
        """Pause, load, resume: the timings, and the requests held across the load."""
        t0 = time.perf_counter()
        held = await self._pauses.hold("push", pause_mode)
        t1 = time.perf_counter()
        try:
            loads = await self._engine.load_weights(update, version=version)
            t2 = time.perf_counter()
            await self._engine.reset_prefix_cache()
        finally:
            await self._pauses.release("push")
        t3 = time.perf_counter()
        return messages.PushTimings(pause_s=t1 - t0, load_main_s=loads.main.load_s,
                                    finalize_main_s=loads.main.finalize_s,
                                    load_draft_s=loads.draft.load_s,
                                    finalize_draft_s=loads.draft.finalize_s, resume_s=t3 - t2,
                                    total_s=t3 - t0), held
