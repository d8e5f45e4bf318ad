"""The weights coordinator: one push from the trainer reaches every engine replica.

Runs as a one-replica Ray Serve deployment (``serve/app.py`` wraps this class; no Ray
import here). The replicas come to the coordinator: each registers in its constructor
and then long-polls :meth:`WeightsCoordinator.poll` for commands (load a push, commit a
version, report checksums; ``nccl``: join the trainer's group, receive a bucket, fetch a
peer's stored copy), answering each with :meth:`ack`. Every poll also carries the
replica's state, so the coordinator knows who is alive and what each serves (``/health``
shows it). Why not Ray Serve's ``DeploymentHandle.broadcast`` (Ray 2.60, alpha): a push
must reach a known set of replicas by name (the group's members, each at its own rank
offset) and a replica that dies must fail it by name, where a broadcast reaches the
replicas its router sees running at the call and does not say which answered; and the
poll's reports (registration, versions) are what a push is checked against anyway.

A push from the trainer goes through the ingress to here. ``begin`` and
``update`` are validated exactly as the standalone service validates them
(``weights/intake.py``) and only buffered (JSON, small). ``finish`` hands the
whole push to every live replica, waits for all acks, then sends every replica a
``commit`` with the deployment's versions and waits (briefly) for those acks too;
replicas hold new requests from the moment they start loading until that commit, so
no replica generates with the new version while another still serves the old one.
Each commit's ack carries the replica's state after it, so when ``finish`` returns,
every replica has committed and ``/health`` shows each as it is now, not as its
last poll before the commit.

When some replicas loaded and others failed, the ones that loaded keep the new
version (it is the deployment's version now), the push fails naming the others,
and those refuse generation ("lagging") until the next push rolls them forward.
A replica that (re)starts registers, gets the deployment's versions and the last
push, and replays it before it serves: from the trainer's segment (``shm``), or from a
peer replica's stored copy, bucket by bucket with the trainer's checksums (``nccl``; the
trainer takes no part).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollout_service.protocol import messages
from rollout_service.protocol.placement import Transport
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.serve.commands import (  # re-exported: the replicas' side imports them
    Command,
    CommandResult,
    Snapshot,
    StoredPush,
)
from rollout_service.serve.group_fanout import GroupFanOut, GroupRoutes, GroupSettings
from rollout_service.serve.replica_mailbox import ReplicaMailbox
from rollout_service.weights.intake import ActivePush, PushError, PushIntake

__all__ = ["Command", "CommandResult", "Snapshot", "StoredPush", "WeightsCoordinator"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

COMMIT_ACK_TIMEOUT_S = 5.0
"""How long a push waits for each replica's answer to its ``commit``. Applying one loads
nothing (the versions change and the gate opens), so a live replica answers within a
poll's round trip; the trainer's push waits on it, and a missing answer fails nothing
(``WeightsCoordinator._commit``), so this is short, not ``push_ack_timeout_s``."""


class WeightsCoordinator(ReplicaMailbox, GroupRoutes):
    """Holds the deployment's weight versions and fans pushes out to replicas.

    Args:
        checkpoint: the served checkpoint's tensors (pushes are validated against it).
        has_draft: whether the engines serve an MTP drafter.
        push_timeout_s: a push with no trainer call for this long is aborted.
        ack_timeout_s: a replica that has not acknowledged a command by then fails it.
    """

    def __init__(self, checkpoint: dict[str, TensorMeta], *, has_draft: bool,
                 push_timeout_s: float, ack_timeout_s: float, transport: Transport = "shm",
                 group: GroupSettings | None = None) -> None:
        self._intake = PushIntake(checkpoint, timeout_s=push_timeout_s, has_draft=has_draft,
                                  transport=transport)
        self.groups = GroupFanOut(self, group) if transport == "nccl" else None
        """The ``nccl`` transport's group over every replica (None for ``shm``)."""
        super().__init__(ack_timeout_s=ack_timeout_s)
        self._push_timeout_s = push_timeout_s
        self._lock = asyncio.Lock()  # one finish or registration at a time
        self.main_version: int | None = None
        self.draft_version: int | None = None
        self._last_stored: StoredPush | None = None
        self._holders: list[str] = []
        """``nccl``: the replicas whose stored copy is the last push's."""
        self._unfinished: set[asyncio.Task[Any]] = set()

    # ---- replica side ------------------------------------------------------------

    async def register(self, report: messages.ReplicaHealth) -> Snapshot:
        """Join the fan-out set; returns the versions to serve and the push to replay.

        Waits for an active push to end, so the snapshot's segment bytes are the
        last pushed version; until :meth:`replayed`, new pushes wait at ``begin``.
        A push still open after that wait (a slow trainer) may be overwriting the
        segment, so nothing is replayed then: the replica is registered, lags, and
        that push's ``finish`` brings it up to date with the others.
        """
        is_idle = await self._wait(lambda: self._intake.active is None, self._push_timeout_s + 5)
        async with self._lock:
            replica = self._touch(report)
            replica.is_registered = True
            last_push = self._last_stored if is_idle and self._intake.active is None else None
            replica.is_replaying = last_push is not None
            return Snapshot(main_version=self.main_version, draft_version=self.draft_version,
                            last_push=last_push, peers=self.peers())

    def peers(self) -> list[str]:
        """Where live replicas serve the last ``nccl`` push's stored copy."""
        return [s.report.store_address for r, s in self._live()
                if r in self._holders and s.report.store_address]

    async def replayed(self, replica_id: str) -> None:
        """The replica is done reading the trainer's segment."""
        if replica_id in self._replicas:
            self._replicas[replica_id].is_replaying = False

    # ---- ingress side: the push protocol ----------------------------------------

    async def begin(self, req: messages.PushBeginRequest) -> messages.PushBeginResponse:
        """Validate the announcement; nothing reaches a replica yet.

        Raises:
            PushError: 409 for a concurrent push, an old version, or a replica still
                replaying the last push; 400 for a bad announcement.
        """
        if self._intake.active is not None:  # before waiting on replays
            raise PushError(409, f"push {self._intake.active.push_id} is in progress; one "
                                 "push at a time")

        def replaying() -> list[str]:
            return [r for r, s in self._live() if s.is_replaying]

        if not await self._wait(lambda: not replaying(), self._ack_timeout_s):
            raise PushError(409, f"replica {replaying()[0]} is still loading the last push "
                                 "(from the trainer's segment or a peer's stored copy); retry")
        if self.groups is not None and req.transport == "nccl":
            assert req.group_id is not None  # nccl: required by message validation
            await self.groups.check_joined(req.group_id)
        self._check_drafters(req)
        return self._intake.begin(req, {"main": self.main_version,
                                        "draft": self.draft_version})

    def _check_drafters(self, req: messages.PushBeginRequest) -> None:
        """Refuse a drafter push at ``begin`` when a replica's engine has no drafter a push
        can load (each engine decides, e.g. n-gram drafting has none); nothing is recorded
        as begun and no replica is touched."""
        if req.target == "main":
            return
        lacking = [r for r, s in self._live() if s.is_registered and s.report.speculation
                   is not None and not s.report.speculation.has_pushable_drafter]
        if lacking:
            speculation = self._replicas[lacking[0]].report.speculation
            method = speculation.method if speculation is not None else None
            detail = (f"target: {req.target!r} needs a drafter a push can load; replica "
                      f"{lacking[0]}'s engine has none (speculative method {method!r}); "
                      "push target 'main'")
            self._intake.record(req, "rejected", detail)
            raise PushError(400, detail)

    async def update(self, req: messages.PushUpdateRequest) -> messages.PushUpdateResponse:
        if self.groups is None:
            return self._intake.update(req)
        return await self._to_the_end(self.groups.update(self._intake, req))

    async def _to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` to its end even if this call is cancelled: Ray Serve cancels a
        request whose HTTP client went away, all the way into this deployment, and a
        trainer that dies during an update or a finish must still have its push ended
        (nothing loaded, the group closed) or committed, not left for the timeouts."""
        task = asyncio.ensure_future(work)
        self._unfinished.add(task)
        task.add_done_callback(self._unfinished.discard)
        return await asyncio.shield(task)

    async def abort(self, req: messages.PushAbortRequest) -> messages.WeightStatus:
        self._intake.abort(req)
        return self.status()

    @property
    def intake(self) -> PushIntake:
        return self._intake

    async def finish(self, req: messages.PushFinishRequest) -> messages.PushFinishResponse:
        """Have every live replica load the push, then commit the new versions.

        Raises:
            PushError: naming the replicas that did not load it.
        """
        push = self._intake.start_loading(req.push_id, version=req.version, versions={
            "main": self.main_version, "draft": self.draft_version})
        return await self._to_the_end(self._finish(push))

    async def _finish(self, push: ActivePush) -> messages.PushFinishResponse:
        async with self._lock:
            try:
                return await self._fan_out(push)
            finally:
                if self._intake.active is push:
                    self._intake.active = None

    async def _fan_out(self, push: ActivePush) -> messages.PushFinishResponse:
        req = push.request
        targets = [r for r, s in self._live() if s.is_registered
                   and s.report.status != "unavailable"]
        if self.groups is not None:  # only the group's members received the buckets
            targets = [r for r in targets if r in self.groups.member_ids()]
        if not targets:
            self._intake.record(req, "failed", "no live replica")
            raise PushError(503, "no live engine replica to load the push")
        stored = StoredPush(push_id=push.push_id, begin=req,
                            placements=push.ordered_placements(),
                            buckets=list(push.buckets))
        results = await self._send(targets, Command(id=uuid.uuid4().hex, kind="load",
                                                    push=stored))
        loaded = [r for r in targets if results[r].ok]
        failed = {r: results[r] for r in targets if not results[r].ok}
        if loaded:
            for role in messages.push_roles(req.target):
                setattr(self, f"{role}_version", req.version)
            self._last_stored, self._holders = (stored, loaded) if self.groups is None else \
                self.groups.sources(stored, {r: results[r] for r in loaded})
            stored = self._last_stored
        await self._commit()
        if failed:
            names = "; ".join(f"replica {r}: {res.message}" for r, res in failed.items())
            if loaded:
                detail = (f"version {req.version} loaded on {', '.join(loaded)} but not on "
                          f"{', '.join(failed)} ({names}); those refuse generation until the "
                          "next push (push a newer version to roll them forward)")
                self._intake.record(req, "failed", detail)
                raise PushError(500, detail)
            status = max(res.status for res in failed.values())
            self._intake.record(req, "rejected" if status < 500 else "failed", names)
            raise PushError(status, f"no replica loaded version {req.version}: {names}")
        finishes = [results[r].finish for r in loaded]
        slowest = max(finishes, key=lambda f: f.timings.total_s if f else 0.0)
        assert slowest is not None
        self._intake.record(req, "loaded", f"{req.total_bytes} bytes on {len(loaded)} replicas")
        held = sum(f.num_requests_held for f in finishes if f is not None)
        peaks = [peak for f in finishes if f is not None for peak in f.receive_peak_bytes or ()]
        if self.groups is not None:
            self.groups.catch_up(stored, loaded)
        return slowest.model_copy(update={"replicas": loaded, "num_requests_held": held,
                                          "receive_peak_bytes": peaks or None})

    async def _commit(self) -> None:
        """Every registered live replica (not only the push's targets: one that failed
        must learn it lags) takes the deployment's versions and opens its gate; each
        answers with its state, so when the trainer's push returns ``/health`` shows
        every replica as it is after the commit, not as its last poll before it. A
        missing answer fails nothing: the versions are the deployment's already, and a
        replica that died is reported gone by the liveness rule."""
        commit = Command(id=uuid.uuid4().hex, kind="commit", main_version=self.main_version,
                         draft_version=self.draft_version)
        registered = [r for r, s in self._live() if s.is_registered]
        results = await self.collect(self.dispatch(registered, commit), commit.id,
                                     timeout_s=COMMIT_ACK_TIMEOUT_S)
        for replica_id, result in results.items():
            if not result.ok:
                logger.warning("replica %s did not answer the commit of versions (main, "
                               "draft) %s: %s", replica_id,
                               (self.main_version, self.draft_version), result.message)

    async def checksums(self) -> dict[str, dict[str, str]]:
        """Every live replica's parameter digests (``main``, ``draft``), by replica."""
        targets = [r for r, s in self._live() if s.is_registered
                   and s.report.status != "unavailable"]
        results = await self._send(targets, Command(id=uuid.uuid4().hex, kind="checksums"))
        return {r: results[r].checksums or {"error": results[r].message} for r in targets}

    # ---- views -------------------------------------------------------------------

    def status(self) -> messages.WeightStatus:
        consistent = all(s.report.main_version == self.main_version
                         and s.report.draft_version == self.draft_version
                         for _, s in self._live() if s.is_registered)
        return messages.WeightStatus(
            main_version=self.main_version, draft_version=self.draft_version,
            active_push_id=self._intake.active.push_id if self._intake.active else None,
            active_push=self._intake.active.state() if self._intake.active else None,
            consistent=consistent, last_push=self._intake.last_push)

    # ---- helpers -----------------------------------------------------------------

    async def _wait(self, condition: object, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True
