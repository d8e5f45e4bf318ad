"""The weights coordinator's ``nccl`` side: the trainer's group spread over every engine
replica, and each bucket received by all of them at once.

Runs inside the coordinator (``coordinator.py``; plain asyncio, no Ray import).
``POST /weights/group`` reaches :meth:`GroupFanOut.create` through the ingress: the
replicas serving the current version become the group's members, one after the other
from the trainer's ``rank_offset`` (each takes its engine's workers' ranks), and each gets
a ``group_join`` command at its own offset. ``begin`` waits for every member's join; each
``update`` sends every member its bucket (the trainer broadcasts it once, to all of them)
and answers once all have it checked; ``finish`` has the members load from their stored
copies (the coordinator's ``_fan_out``), then sends every other serving replica a
``fetch`` from a member's copy, so a replica that was not in the group (it started
later, or failed a load) catches up without the trainer.

A member that fails a bucket or dies fails the push on every replica (none has loaded
anything) and, unless every member only refused the bucket, closes the group on all of
them at once (a stalled receive would otherwise wait out the group's timeout); the
trainer makes a new group, sized for the replicas then serving (``GET /weights/group/state``).
A group has one owner: another is refused (409) until it is released or its lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_service.protocol import messages
from rollout_service.serve.commands import Command, CommandResult, StoredPush
from rollout_service.weights.checks import PushError, check_bucket

if TYPE_CHECKING:
    from rollout_service.serve.coordinator import WeightsCoordinator
    from rollout_service.weights.intake import PushIntake

logger = logging.getLogger(__name__)

MEMBER_LEASE_S = 7 * 86400.0
"""The lease each member's own group gets: members never let a group go by themselves,
the coordinator does (its lease is the trainer's)."""
ACK_MARGIN_S = 60.0
"""Past the group's timeout, how long the coordinator waits for a member's answer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSettings:
    """The service's defaults for a group's fields (``weights_group_*`` and
    ``weights_bucket_bytes`` / ``weights_num_buckets`` of the config)."""

    timeout_s: float
    lease_s: float
    bucket_bytes: int
    num_buckets: int


@dataclass(kw_only=True, slots=True)
class _Group:
    response: messages.WeightGroupResponse
    joins: dict[str, asyncio.Future[CommandResult]]
    last_used_s: float = field(default_factory=time.monotonic)
    is_joined: bool = False


class GroupFanOut:
    """The deployment's one group (module docstring)."""

    def __init__(self, coordinator: WeightsCoordinator, settings: GroupSettings) -> None:
        self._coordinator = coordinator
        self._settings = settings
        self._group: _Group | None = None
        self._lease: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()

    def member_ids(self) -> list[str]:
        return [] if self._group is None else [
            m.replica for m in self._group.response.members or ()]

    def _serving(self) -> list[tuple[str, messages.ReplicaHealth]]:
        return [(r, report) for r, report in self._coordinator.live_registered()
                if report.status == "ok" and report.group_ranks]

    def state(self) -> messages.WeightGroupState:
        serving = self._serving()
        return messages.WeightGroupState(
            num_ranks=sum(report.group_ranks or 0 for _, report in serving),
            backend=next((report.group_backend for _, report in serving
                          if report.group_backend), "gloo"),
            current=None if self._group is None else self._group.response)

    async def create(self, req: messages.WeightGroupRequest) -> messages.WeightGroupResponse:
        """The serving replicas join the trainer's group, one after the other from
        ``req.rank_offset``; returns at once (``begin`` waits for the joins).

        Raises:
            PushError: 409 while another group lives or a push runs, 400 for ranks that
                do not fit the world or a backend the engines cannot run, 503 without a
                serving replica.
        """
        if self._group is not None:
            raise PushError(409, f"group_id: the deployment is in group "
                                 f"{self._group.response.group_id!r} (its owner releases it "
                                 "with POST /weights/group/release, or it is released after "
                                 f"{self._group.response.lease_s:g} s without a call); one "
                                 "group at a time")
        if self._coordinator.intake.active is not None:
            raise PushError(409, f"push {self._coordinator.intake.active.push_id} is in "
                                 "progress")
        serving = self._serving()
        if not serving:
            raise PushError(503, "no engine replica serves the current weights to join a "
                                 "group")
        num_ranks = sum(report.group_ranks or 0 for _, report in serving)
        if req.rank_offset + num_ranks > req.world_size:
            raise PushError(400, f"world_size: {req.world_size} cannot hold the deployment's "
                                 f"{num_ranks} ranks ({len(serving)} replicas) from "
                                 f"rank_offset {req.rank_offset}")
        backends = {report.group_backend for _, report in serving}
        backend = backends.pop() if len(backends) == 1 else None
        if backend is None or (req.backend is not None and req.backend != backend):
            raise PushError(400, f"backend: {req.backend!r} cannot run on every replica's "
                                 f"workers ({sorted(str(b) for b in backends | {backend})})")
        settings = self._settings
        timeout_s = req.timeout_s or settings.timeout_s
        members, commands, offset = [], {}, req.rank_offset
        for replica_id, report in serving:
            assert report.group_ranks is not None
            members.append(messages.GroupMember(replica=replica_id, rank_offset=offset,
                                                num_ranks=report.group_ranks))
            commands[replica_id] = Command(id=uuid.uuid4().hex, kind="group_join",
                                           group=req.model_copy(update={
                                               "rank_offset": offset, "timeout_s": timeout_s,
                                               "lease_s": MEMBER_LEASE_S,
                                               "bucket_bytes": req.bucket_bytes
                                               or settings.bucket_bytes,
                                               "num_buckets": req.num_buckets
                                               or settings.num_buckets}))
            offset += report.group_ranks
        response = messages.WeightGroupResponse(
            group_id=req.group_id, master_address=req.master_address,
            master_port=req.master_port, world_size=req.world_size,
            rank_offset=req.rank_offset, num_ranks=num_ranks, backend=backend,
            timeout_s=timeout_s, lease_s=req.lease_s or settings.lease_s,
            bucket_bytes=req.bucket_bytes or settings.bucket_bytes,
            num_buckets=req.num_buckets or settings.num_buckets, members=members)
        self._group = _Group(response=response, joins=self._coordinator.send_each(commands))
        self._lease = asyncio.create_task(self._expire(self._group))
        return response

    async def release(self, group_id: str) -> messages.WeightGroupState:
        """The owner lets its group go; a push in it is aborted (nothing loaded).

        Raises:
            PushError(404): not the deployment's group.
        """
        self._current(group_id, status=404)
        intake = self._coordinator.intake
        if intake.active is not None and intake.active.request.group_id == group_id:
            intake.end(intake.active, "aborted", f"its group {group_id!r} was released")
        await self.close()
        return self.state()

    async def check_joined(self, group_id: str) -> None:
        """``begin``: every member has joined and is alive.

        Raises:
            PushError(409): not the current group, or a member's join failed or it is
                gone (the group is closed: make a new one).
        """
        group = self._current(group_id, status=409)
        group.last_used_s = time.monotonic()
        if not group.is_joined:
            results = await self._coordinator.collect(
                group.joins, timeout_s=group.response.timeout_s + ACK_MARGIN_S)
            failed = {r: result for r, result in results.items() if not result.ok}
            if failed:
                await self.close()
                raise PushError(409, f"group_id: the join of {group_id!r} failed ("
                                     + _named(failed) + "); make a new group")
            group.is_joined = True
        gone = [r for r in self.member_ids() if not self._coordinator.is_alive(r)]
        if gone:
            await self.close()
            raise PushError(409, f"group_id: replica {gone[0]} of group {group_id!r} is gone; "
                                 "make a new group (GET /weights/group/state says its ranks)")

    async def update(self, intake: PushIntake, req: messages.PushUpdateRequest
                     ) -> messages.PushUpdateResponse:
        """One bucket: checked as the standalone service checks it, then received by every
        member while the trainer broadcasts it. A bucket refused for its placements is
        still received (and dropped), so the trainer's broadcast ends.

        Raises:
            PushError: the bucket's or a member's refusal (400), a broken broadcast or a
                member gone (408, 503); nothing loaded on any replica.
        """
        push = intake.get(req.push_id)
        group = self._group
        try:
            buckets = check_bucket(push, req)
            if group is None or group.response.group_id != push.request.group_id:
                raise PushError(409, f"group_id: the push's group {push.request.group_id!r} "
                                     "is closed; make a new group")
            for bucket in buckets:
                if bucket.nbytes > group.response.bucket_bytes:
                    if bucket.checksum is None:  # no header: the trainer broadcasts regardless
                        await self.close()
                    raise PushError(400, f"bucket: {bucket.nbytes} bytes is more than the "
                                         f"group's bucket_bytes {group.response.bucket_bytes}")
        except PushError as exc:
            intake.end(push, "rejected", str(exc))
            raise
        refusal, response = None, None
        try:
            response = intake.update(req)
        except PushError as exc:
            refusal = exc
        push.is_receiving = True
        try:
            failed = await self._receive(group, Command(
                id=uuid.uuid4().hex, kind="bucket", push_id=push.push_id, buckets=buckets),
                num_buckets=len(buckets))
        finally:
            push.is_receiving = False
            push.last_call_s = group.last_used_s = time.monotonic()
        if refusal is not None:
            raise refusal
        if failed:
            status = max(result.status for result in failed.values())
            detail = (f"broadcast: bucket {buckets[-1].index} failed on {_named(failed)}; nothing "
                      "was loaded on any replica, the old weights are still served")
            intake.end(push, "rejected" if status == 400 else "failed", detail)
            raise PushError(status, detail)
        assert response is not None
        return response

    async def _receive(self, group: _Group, command: Command, *, num_buckets: int = 1
                       ) -> dict[str, CommandResult]:
        """Every member's receive of one bucket; the failed ones. At the first failure that
        breaks the group the coordinator closes it on every member and answers at once,
        collecting the others' answers in the background: a member whose receive is
        blocked in gloo ends only when the trainer closes its sockets (neither abort nor
        shutdown of a gloo group ends a pending receive), which the trainer does as soon
        as its broadcast fails or its update is answered with a failure."""
        futures = self._coordinator.dispatch(self.member_ids(), command)
        collected = asyncio.ensure_future(self._coordinator.collect(
            futures, command.id,
            timeout_s=group.response.timeout_s * num_buckets + ACK_MARGIN_S))
        while not collected.done():
            pending = [f for f in futures.values() if not f.done()]
            await asyncio.wait([collected, *pending], timeout=0.5,
                               return_when=asyncio.FIRST_COMPLETED)
            done = {r: f.result() for r, f in futures.items() if f.done()}
            if any(not result.ok and _breaks(result) for result in done.values()):
                self._in_background(collected)
                await self.close()
                return {r: result for r, result in done.items() if not result.ok}
        failed = {r: result for r, result in collected.result().items() if not result.ok}
        if any(_breaks(result) for result in failed.values()):
            await self.close()
        return failed

    def sources(self, push: StoredPush, holders: dict[str, CommandResult]
                ) -> tuple[StoredPush, list[str]]:
        """``push`` as a later replica fetches it, and the holders whose copy it may fetch.
        A bucket that came without a checksum (the frameworks' framing) is checked by the
        one the first holder's writer computed as it arrived; a holder whose writer saw
        other bytes (one broadcast reached the replicas differently, which nothing else
        would show) is no source, nor is any when a bucket has no checksum at all."""
        raw = [b.index for b in push.buckets if b.checksum is None]
        if not raw:
            return push, list(holders)
        sums = {r: result.copy_checksums or {} for r, result in holders.items()}
        first = next(iter(sums.values()))
        if any(i not in first for i in raw):
            logger.error("push %s: no stored checksum of buckets %s; replicas that "
                         "(re)start cannot fetch it from a peer", push.push_id,
                         [i for i in raw if i not in first])
            return push, []
        agreeing = [r for r, s in sums.items() if all(s.get(i) == first[i] for i in raw)]
        if len(agreeing) < len(holders):
            logger.error("push %s: replicas %s stored other bytes than %s; they serve no "
                         "peer", push.push_id, sorted(set(holders) - set(agreeing)),
                         agreeing[0])
        return push.model_copy(update={"copy_checksums": {i: first[i] for i in raw}}), agreeing

    def catch_up(self, push: StoredPush, holders: list[str]) -> None:
        """After ``push`` committed on ``holders``: every other serving replica fetches a
        holder's stored copy and loads it (in the background; each reports on its own)."""
        peers = self._coordinator.peers()
        behind = [r for r, _ in self._coordinator.live_registered() if r not in holders]
        if behind and peers:
            command = Command(id=uuid.uuid4().hex, kind="fetch", push=push, peers=peers)
            self._in_background(self._coordinator.collect(
                self._coordinator.dispatch(behind, command), command.id))

    async def close(self) -> None:
        """No group: every member leaves it (at once, a receive in it ends)."""
        if self._lease is not None and self._lease is not asyncio.current_task():
            self._lease.cancel()
        self._lease = None
        members, self._group = self.member_ids(), None
        alive = [r for r in members if self._coordinator.is_alive(r)]
        if alive:
            command = Command(id=uuid.uuid4().hex, kind="group_leave")
            self._in_background(self._coordinator.collect(
                self._coordinator.dispatch(alive, command), command.id))

    def _current(self, group_id: str, *, status: int) -> _Group:
        if self._group is None or self._group.response.group_id != group_id:
            current = self._group.response.group_id if self._group else None
            raise PushError(status, f"group_id: {group_id!r} is not the deployment's current "
                                    f"weight group ({current!r}); POST /weights/group joins "
                                    "one")
        return self._group

    async def _expire(self, group: _Group) -> None:
        while self._group is group:
            remaining = group.last_used_s + group.response.lease_s - time.monotonic()
            if remaining <= 0:
                logger.warning("weight group %s released: no call for %g s",
                               group.response.group_id, group.response.lease_s)
                await self.close()
                return
            await asyncio.sleep(remaining)

    def _in_background(self, work: object) -> None:
        task = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or _log_failure(t))


class GroupRoutes:
    """The coordinator's calls for ``/weights/group`` (a base of ``WeightsCoordinator``,
    whose ``groups`` is its :class:`GroupFanOut`, or None for ``shm``)."""

    groups: GroupFanOut | None
    intake: PushIntake

    def _need_groups(self) -> GroupFanOut:
        if self.groups is None:
            raise PushError(403, "weights_transport: this deployment takes 'shm' pushes; "
                                 "weight groups are for 'nccl'")
        return self.groups

    async def create_group(self, req: messages.WeightGroupRequest
                           ) -> messages.WeightGroupResponse:
        return await self._need_groups().create(req)

    async def release_group(self, req: messages.WeightGroupRelease
                            ) -> messages.WeightGroupState:
        return await self._need_groups().release(req.group_id)

    async def group_state(self) -> messages.WeightGroupState:
        return self._need_groups().state().model_copy(update={
            "max_tensor_bytes": self.intake.max_tensor_bytes})


def _breaks(result: CommandResult) -> bool:
    """Whether a member's failure broke the group (anything but a refusal it survived)."""
    return result.status != 400 or "the group is closed" in result.message


def _named(results: dict[str, CommandResult]) -> str:
    return "; ".join(f"replica {r}: {result.message}" for r, result in results.items())


def _log_failure(task: asyncio.Task[object]) -> None:
    with contextlib.suppress(Exception):
        if task.exception() is not None:
            logger.warning("weights group command failed: %r", task.exception())
