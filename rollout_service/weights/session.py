"""One weight push at a time: validate, collect, load, version — or change nothing.

Runs in the service process, driven by the ``/weights/*`` handlers. A push is
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
from dataclasses import dataclass, field

from rollout_service import wire
from rollout_service.engines.base import Engine, LoadTimings, WeightUpdate
from rollout_service.weights.checkpoint import DTYPE_BYTES, TensorMeta
from rollout_service.weights.cuda_ipc import CudaIpcHandle
from rollout_service.weights.metrics import WeightMetrics
from rollout_service.weights.shm import segment_path

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
    request: wire.PushBeginRequest
    expected: dict[str, TensorMeta]
    slots: dict[str, wire.TensorSlot] = field(default_factory=dict)
    last_call_s: float = field(default_factory=time.monotonic)
    is_loading: bool = False


def validate_announcement(req: wire.PushBeginRequest, checkpoint: dict[str, TensorMeta],
                          *, transport: wire.Transport = "shm") -> dict[str, TensorMeta]:
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
    return announced


def _validate_segment(req: wire.PushBeginRequest, total: int) -> None:
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


def validate_slot(push: ActivePush, slot: wire.TensorSlot) -> None:
    """Check one bucket entry against the announcement and the push's transport
    (the segment's bounds, or the CUDA IPC handle's shape and dtype).

    Raises:
        PushError(400): naming the tensor.
    """
    meta = push.expected.get(slot.name)
    if meta is None:
        raise PushError(400, f"tensors: {slot.name!r} was not announced in begin")
    if slot.name in push.slots:
        raise PushError(400, f"tensors: {slot.name!r} was already sent in this push")
    if slot.nbytes != meta.nbytes:
        raise PushError(400, f"tensors: {slot.name!r} has {slot.nbytes} bytes, its shape and "
                             f"dtype need {meta.nbytes}")
    transport = push.request.transport
    if transport == "cuda_ipc":
        if slot.cuda_ipc is None:
            raise PushError(400, f"tensors: {slot.name!r} has no 'cuda_ipc' handle, and the "
                                 "push's transport is 'cuda_ipc'")
        try:
            slot.cuda_ipc.check_matches(meta.shape, meta.dtype)
        except ValueError as exc:
            raise PushError(400, f"tensors: {slot.name!r} cuda_ipc.{exc}") from exc
        return
    if slot.offset is None:
        raise PushError(400, f"tensors: {slot.name!r} has no 'offset', and the push's "
                             f"transport is {transport!r}")
    assert push.request.segment_bytes is not None  # shm: required by wire validation
    if slot.offset % DTYPE_BYTES[meta.dtype]:
        raise PushError(400, f"tensors: {slot.name!r} offset {slot.offset} is not aligned to "
                             f"its {DTYPE_BYTES[meta.dtype]}-byte {meta.dtype} elements")
    if slot.offset + slot.nbytes > push.request.segment_bytes:
        raise PushError(400, f"tensors: {slot.name!r} [{slot.offset}, "
                             f"{slot.offset + slot.nbytes}) lies outside the "
                             f"{push.request.segment_bytes}-byte segment")


def check_no_overlap(slots: list[wire.TensorSlot]) -> None:
    """Raises PushError(400) naming the first tensor that overlaps its predecessor
    in the segment (slots without an offset, CUDA IPC handles, are not in one)."""
    ordered = sorted((s for s in slots if s.offset is not None), key=_offset)
    for before, after in zip(ordered, ordered[1:]):
        if _offset(after) < _offset(before) + before.nbytes:
            raise PushError(400, f"tensors: {after.name!r} overlaps {before.name!r} in the "
                                 "segment")


def _offset(slot: wire.TensorSlot) -> int:
    assert slot.offset is not None
    return slot.offset


def build_update(push: ActivePush) -> WeightUpdate:
    """What the engine loads: the validated, complete stream of one push."""
    req = push.request
    tensors = tuple((name, meta.dtype, meta.shape, push.slots[name].offset)
                    for name, meta in push.expected.items())
    handles: list[CudaIpcHandle] = []
    if req.transport == "cuda_ipc":
        for name in push.expected:
            handle = push.slots[name].cuda_ipc
            assert handle is not None  # validate_slot
            handles.append(handle)
    return WeightUpdate(segment=req.segment, tensors=tensors, cuda_ipc_handles=tuple(handles),
                        push_id=push.push_id, target=req.target)


class PushIntake:
    """The part of a push before any byte loads: begin, buckets, abort, expiry.

    Shared by the standalone service (:class:`WeightPushManager`, one engine) and the
    Ray Serve weights coordinator (every replica), so both refuse exactly the same
    pushes with the same messages. Its methods do not await: under asyncio each one
    is atomic, and callers add locks only around the load itself.

    Args:
        checkpoint: the served checkpoint's tensors (names as the loader accepts).
        timeout_s: a push with no call for this long is aborted.
        has_draft: whether the engines serve an MTP drafter.
        transport: the transport the engines were started with.
        metrics: push outcome counters, or None.
    """

    def __init__(self, checkpoint: dict[str, TensorMeta], *, timeout_s: float,
                 has_draft: bool, transport: wire.Transport = "shm",
                 metrics: WeightMetrics | None = None) -> None:
        self._checkpoint = checkpoint
        self._timeout_s = timeout_s
        self._has_draft = has_draft
        self._transport = transport
        self._metrics = metrics
        self._watchdog: asyncio.Task[None] | None = None
        self.active: ActivePush | None = None
        self.last_push: wire.LastPush | None = None

    def begin(self, req: wire.PushBeginRequest,
              versions: dict[str, int | None]) -> wire.PushBeginResponse:
        """Validate the announcement against the checkpoint and ``versions`` (the served
        version per role); the push becomes :attr:`active`.

        Raises:
            PushError: 409 for a concurrent push or an old version, 400 for a bad
                announcement (recorded as rejected).
        """
        if self.active is not None:
            raise PushError(409, f"push {self.active.push_id} is in progress; one push at "
                                 "a time")
        if req.target != "main" and not self._has_draft:
            raise PushError(400, f"target: {req.target!r} needs an MTP drafter, and this "
                                 "service runs without speculative decoding (use 'main')")
        for role in roles(req.target):
            current = versions[role]
            if current is not None and req.version <= current:
                raise PushError(409, f"version: {req.version} is not newer than the {role} "
                                     f"model's version {current}")
        try:
            expected = validate_announcement(req, self._checkpoint, transport=self._transport)
        except PushError as exc:
            self.record(req, "rejected", str(exc))
            raise
        self.active = ActivePush(push_id=uuid.uuid4().hex, request=req, expected=expected)
        self._watchdog = asyncio.create_task(self._expire(self.active))
        return wire.PushBeginResponse(push_id=self.active.push_id, timeout_s=self._timeout_s)

    def get(self, push_id: str) -> ActivePush:
        """The active push if ``push_id`` names it and it is not loading; a call resets
        its timeout."""
        push = self.active
        if push is None or push.push_id != push_id:
            raise PushError(404, f"push_id: {push_id!r} is not the active push "
                                 f"(active: {push.push_id if push else None})")
        if push.is_loading:
            raise PushError(409, f"push {push_id} is already loading")
        push.last_call_s = time.monotonic()
        return push

    def update(self, req: wire.PushUpdateRequest) -> wire.PushUpdateResponse:
        """Record one bucket; a bad entry rejects the whole push."""
        push = self.get(req.push_id)
        try:
            for slot in req.tensors:
                validate_slot(push, slot)
                push.slots[slot.name] = slot
        except PushError as exc:
            self.end(push, "rejected", str(exc))
            raise
        return wire.PushUpdateResponse(num_received=len(push.slots),
                                       num_expected=len(push.expected))

    def abort(self, req: wire.PushAbortRequest) -> None:
        self.end(self.get(req.push_id), "aborted", req.reason)

    def start_loading(self, push_id: str) -> ActivePush:
        """The complete, validated push, now loading (no timeout, no further calls).

        Raises:
            PushError(400): a tensor never sent, or overlapping tensors (rejected).
        """
        push = self.get(push_id)
        try:
            missing = sorted(set(push.expected) - set(push.slots))
            if missing:
                raise PushError(400, f"finish: tensor {missing[0]!r} was never sent "
                                     f"({len(missing)} missing in all)")
            check_no_overlap(list(push.slots.values()))
        except PushError as exc:
            self.end(push, "rejected", str(exc))
            raise
        push.is_loading = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        return push

    def record(self, req: wire.PushBeginRequest, outcome: str, detail: str) -> None:
        """Remember how a push ended (``/weights/status``), count it, log failures."""
        self.last_push = wire.LastPush(version=req.version, target=req.target,
                                       outcome=outcome, detail=detail)  # type: ignore[arg-type]
        if self._metrics is not None:
            self._metrics.count_outcome(outcome)
        if outcome != "loaded":
            logger.warning("weight push %s (version %d): %s", outcome, req.version, detail)

    def end(self, push: ActivePush, outcome: str, detail: str) -> None:
        """Record ``push``'s outcome; it is no longer active."""
        self.record(push.request, outcome, detail)
        if self.active is push:
            self.active = None
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None

    async def _expire(self, push: ActivePush) -> None:
        """Abort ``push`` once it has gone ``timeout_s`` without a call."""
        while True:
            remaining = push.last_call_s + self._timeout_s - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.sleep(remaining)
        if self.active is push and not push.is_loading:
            self.end(push, "aborted", f"no call from the trainer for {self._timeout_s:g} s; "
                                      "nothing was loaded, the old weights are still served")


def roles(target: wire.PushTarget) -> list[str]:
    """The models a push target names."""
    return {"main": ["main"], "draft": ["draft"], "both": ["main", "draft"]}[target]


class WeightPushManager:
    """Owns the push protocol and the served weight versions of one engine.

    Args:
        engine: the engine to load into.
        checkpoint: the served checkpoint's tensors (names as the loader accepts).
        metrics: version gauges and push counters.
        timeout_s: a push with no call for this long is aborted.
        has_draft: whether the engine serves an MTP drafter.
        transport: the transport the engine was started with (``weights_transport``).
    """

    def __init__(self, engine: Engine, checkpoint: dict[str, TensorMeta],
                 metrics: WeightMetrics, *, timeout_s: float, has_draft: bool,
                 transport: wire.Transport = "shm") -> None:
        self._engine = engine
        self._metrics = metrics
        self._intake = PushIntake(checkpoint, timeout_s=timeout_s, has_draft=has_draft,
                                  transport=transport, metrics=metrics)
        self._lock = asyncio.Lock()
        self.main_version: int | None = None
        self.draft_version: int | None = None
        self.is_consistent = True

    @property
    def last_push(self) -> wire.LastPush | None:
        return self._intake.last_push

    def status(self) -> wire.WeightStatus:
        active = self._intake.active
        return wire.WeightStatus(
            main_version=self.main_version, draft_version=self.draft_version,
            active_push_id=active.push_id if active else None,
            consistent=self.is_consistent, last_push=self._intake.last_push)

    async def get_status(self) -> wire.WeightStatus:
        """:meth:`status` for the HTTP handler (the Ray Serve ingress's is a remote call)."""
        return self.status()

    async def begin(self, req: wire.PushBeginRequest) -> wire.PushBeginResponse:
        async with self._lock:
            return self._intake.begin(req, {"main": self.main_version,
                                            "draft": self.draft_version})

    async def update(self, req: wire.PushUpdateRequest) -> wire.PushUpdateResponse:
        async with self._lock:
            return self._intake.update(req)

    async def abort(self, req: wire.PushAbortRequest) -> wire.WeightStatus:
        async with self._lock:
            self._intake.abort(req)
            return self.status()

    async def finish(self, req: wire.PushFinishRequest) -> wire.PushFinishResponse:
        async with self._lock:
            push = self._intake.start_loading(req.push_id)
            try:
                timings = await self._load(push)
            except Exception as exc:
                self.is_consistent = False
                self._intake.end(push, "failed", f"engine failed while loading: {exc}")
                logger.exception("weight load failed; generation refused until a full push")
                raise PushError(500, f"the engine failed while loading; generation is refused "
                                     f"until a complete push succeeds: {exc}") from exc
            self.is_consistent = True
            for role in roles(push.request.target):
                setattr(self, f"{role}_version", push.request.version)
                self._metrics.set_version(role, push.request.version)
            self._metrics.observe_push(push.request.total_bytes, timings.total_s)
            self._intake.end(push, "loaded", f"{push.request.total_bytes} bytes in "
                                             f"{timings.total_s:.3f} s")
            return wire.PushFinishResponse(version=push.request.version,
                                           target=push.request.target,
                                           num_bytes=push.request.total_bytes, timings=timings)

    async def _load(self, push: ActivePush) -> wire.PushTimings:
        req = push.request
        update = build_update(push)
        no_load = LoadTimings(load_s=0.0, finalize_s=0.0)
        main = draft = no_load
        t0 = time.perf_counter()
        await self._engine.pause(req.pause_mode)
        t1 = time.perf_counter()
        try:
            if req.target in ("main", "both"):
                main = await self._engine.load_weights(update, draft=False,
                                                       version=str(req.version))
            if req.target in ("draft", "both"):
                # Version spans label what produced the tokens: the main model's weights
                # (verification keeps the output distribution the target's alone).
                draft = await self._engine.load_weights(update, draft=True, version=None)
            t2 = time.perf_counter()
            await self._engine.reset_prefix_cache()
        finally:
            await self._engine.resume()
        t3 = time.perf_counter()
        return wire.PushTimings(pause_s=t1 - t0, load_main_s=main.load_s,
                                finalize_main_s=main.finalize_s, load_draft_s=draft.load_s,
                                finalize_draft_s=draft.finalize_s, resume_s=t3 - t2,
                                total_s=t3 - t0)
