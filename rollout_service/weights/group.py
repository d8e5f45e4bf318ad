"""The ``nccl`` transport on the service side: the trainer's group, its owner and lease,
its workers' join, and each push's bucket receives.

Runs in the service process (standalone, or each Ray Serve replica's). ``POST
/weights/group`` names the trainer's rendezvous and this server's ``rank_offset``; the
engine's workers start joining on threads of their own. A group has one owner: while it
lives, a request for another is refused (409) until the owner releases it (``POST
/weights/group/release``) or it goes ``lease_s`` without a call, when it is released by
itself. A push names its group in ``begin``, which waits for the join to end. Each
``/weights/update`` of the push receives one bucket in every worker (the trainer
broadcasts it meanwhile) and answers once every worker has it checked; ``finish`` waits
until the stored copy is written and hands it to the load. A broadcast that breaks
closes the group: nothing of that push was loaded, and the trainer makes a new group for
the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollout_service.engines.broadcast_engine import BroadcastEngine, BucketReceive, WorkerReceive
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import GroupSpec, StoreCounters
from rollout_service.protocol.store import BucketInfo, StoreRef
from rollout_service.weights.checks import PushError
from rollout_service.weights.stored_copies import StoredCopies

FIRST_POLL_S = 0.002
"""The first wait between two asks how a join or a receive goes: of the workers (an RPC
to every worker, run between two engine steps) for a join, of the trainer's store for a
receive."""
MAX_POLL_S = 0.05
"""The wait doubles up to this: a bucket of a small model is seen done within
milliseconds, and a long join costs the engine, which keeps generating meanwhile, 20 RPCs
a second, not 500."""
WAIT_MARGIN_S = 30.0
"""Past the group's own timeout (which ends a worker's wait for a silent trainer), how
long the service waits for a worker that never reports."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReceivedPush:
    """A push whose every bucket arrived, was checked and stored: what its load needs."""

    store: StoreRef
    peak_bytes: list[int]
    """Per worker, the most bytes it held in receive buffers at once."""
    receive_s: float
    """Seconds spent in the updates' receives."""
    copy_checksums: dict[int, str]
    """The buckets that came without a checksum: each one's as the writer computed it on
    arrival (``StoredCopies.committed_checksums`` once the push loads)."""


class WeightGroups:
    """The service's one group (module docstring).

    Args:
        engine: the engine whose workers join.
        copies: where each push's received copy is stored.
        timeout_s: the join's and each broadcast's default timeout.
        lease_s: a group's default lease.
        bucket_bytes: the default largest bucket (a ring slot).
        num_buckets: the default ring slots per worker.
    """

    def __init__(self, engine: BroadcastEngine, copies: StoredCopies, *, timeout_s: float,
                 lease_s: float, bucket_bytes: int, num_buckets: int) -> None:
        self._engine = engine
        self.copies = copies
        self._defaults = (timeout_s, lease_s, bucket_bytes, num_buckets)
        self.current: messages.WeightGroupResponse | None = None
        self._spec: GroupSpec | None = None
        self._counters: StoreCounters | None = None
        self._joined = False
        self._last_used_s = 0.0
        self._lease: asyncio.Task[None] | None = None
        self._receive_s: dict[str, float] = {}
        self._receiving: str | None = None
        """The push whose buckets came last."""

    def state(self) -> messages.WeightGroupState:
        backend = (self.current.backend if self.current is not None
                   else self._engine.group_backends[0])
        return messages.WeightGroupState(num_ranks=self._engine.num_workers,
                                         backend=backend, current=self.current)

    async def create(self, req: messages.WeightGroupRequest) -> messages.WeightGroupResponse:
        """Join the trainer's group at ``req.rank_offset``; the workers start now.

        Raises:
            PushError: 409 while another group lives; 400 for ranks that do not fit the
                world, a backend the engine cannot run, or a store it cannot reach.
        """
        if self.current is not None:
            raise PushError(409, f"group_id: this service is in group "
                                 f"{self.current.group_id!r} (its owner releases it with "
                                 "POST /weights/group/release, or it is released after "
                                 f"{self.current.lease_s:g} s without a call); one group "
                                 "at a time")
        timeout_s, lease_s, bucket_bytes, num_buckets = self._defaults
        num_ranks, backends = self._engine.num_workers, self._engine.group_backends
        backend = backends[0] if req.backend is None else req.backend
        if req.rank_offset + num_ranks > req.world_size:
            raise PushError(400, f"world_size: {req.world_size} cannot hold this service's "
                                 f"{num_ranks} ranks from rank_offset {req.rank_offset}")
        if backend not in backends:
            raise PushError(400, f"backend: {backend!r} cannot run on this engine's "
                                 f"workers (they run {' or '.join(map(repr, backends))})")
        spec = GroupSpec(group_id=req.group_id, master_address=req.master_address,
                         master_port=req.master_port, world_size=req.world_size,
                         rank_offset=req.rank_offset, backend=backend,
                         timeout_s=req.timeout_s or timeout_s, style=req.rendezvous)
        try:
            counters = await asyncio.to_thread(StoreCounters, spec)
        except RuntimeError as exc:  # no store there within the timeout
            raise PushError(400, f"master_address: the trainer's store at "
                                 f"{spec.master_address}:{spec.master_port} cannot be "
                                 f"reached ({exc})") from exc
        await self._engine.join_group(spec)
        self._spec, self._counters, self._joined = spec, counters, False
        self.current = messages.WeightGroupResponse(
            group_id=spec.group_id, master_address=spec.master_address,
            master_port=spec.master_port, world_size=spec.world_size,
            rank_offset=spec.rank_offset, num_ranks=num_ranks, backend=backend,
            timeout_s=spec.timeout_s, lease_s=req.lease_s or lease_s,
            bucket_bytes=req.bucket_bytes or bucket_bytes,
            num_buckets=req.num_buckets or num_buckets)
        self._touch()
        self._lease = asyncio.create_task(self._expire(self.current))
        return self.current

    async def release(self, group_id: str) -> messages.WeightGroupState:
        """The owner lets its group go; the workers leave it.

        Raises:
            PushError(404): not this service's group.
        """
        self._check_current(group_id, status=404)
        await self.close()
        return self.state()

    def _check_current(self, group_id: str, *, status: int) -> messages.WeightGroupResponse:
        if self.current is None or self.current.group_id != group_id:
            current = self.current.group_id if self.current else None
            raise PushError(status, f"group_id: {group_id!r} is not this service's current "
                                    f"weight group ({current!r}); POST /weights/group joins "
                                    "one")
        return self.current

    async def check_joined(self, group_id: str) -> messages.WeightGroupResponse:
        """Wait (up to the group's timeout) until every worker has joined ``group_id``.

        Raises:
            PushError(409): not the current group, or its join failed (the group is
                closed: make a new one).
        """
        group = self._check_current(group_id, status=409)
        self._touch()
        if not self._joined:
            try:
                await self._until_done(lambda: self._engine.group_state(group_id),
                                       f"the workers' join of {group_id!r}")
            except RuntimeError as exc:
                await self.close()
                raise PushError(409, f"group_id: {exc} (did the trainer join?); make a new "
                                     "group") from exc
            self._joined = True
        return group

    async def receive_bucket(self, push_id: str, bucket: BucketInfo) -> None:
        """:meth:`receive_buckets` of one bucket."""
        await self.receive_buckets(push_id, [bucket])

    async def receive_buckets(self, push_id: str, buckets: list[BucketInfo]) -> None:
        """Receive an update's buckets of ``push_id`` in every worker, in order (the
        trainer broadcasts them as this runs: one, or the frameworks' several); returns
        once every worker has them checked.

        Raises:
            PushError: 400 when a worker refused one (not what the update announced), 408
                when the broadcast broke or stalled past the group's timeout; the group
                is closed when a worker had to leave it.
        """
        group, counters = self.current, self._counters
        assert group is not None and counters is not None  # begin checked the group
        for bucket in buckets:
            if bucket.nbytes > group.bucket_bytes:
                if bucket.checksum is None:  # no header: the trainer broadcasts it regardless
                    await self.close()
                raise PushError(400, f"bucket: {bucket.nbytes} bytes is more than the "
                                     f"group's bucket_bytes {group.bucket_bytes}")
        if push_id != self._receiving:
            # Under Ray Serve the coordinator ends a push it refused, aborted or timed out
            # without telling the replicas: what arrived of it goes when the next begins.
            if self._receiving is not None:
                self.discard(self._receiving)
            self._receiving = push_id
        self._touch()
        start = time.perf_counter()
        receive = BucketReceive(push_id=push_id, store_path=self.copies.path(push_id),
                                slot_bytes=group.bucket_bytes, num_slots=group.num_buckets)
        last = buckets[-1]
        key = f"{push_id}/{last.index}"
        deadline = time.monotonic() + group.timeout_s * len(buckets) + WAIT_MARGIN_S
        try:
            for bucket in buckets:  # each worker receives them in this order, one thread
                await self._engine.start_bucket(receive, bucket)
            num_workers = self._engine.num_workers
            await _poll(lambda: _at_least(counters, key, num_workers), deadline)
            states: list[str] = []

            async def settled() -> bool:  # a worker counts itself just before its state
                nonlocal states
                # A failed bucket fails every later one of the push on that worker, so
                # the last bucket's state tells how all of them went.
                states = await self._engine.bucket_states(push_id, last.index)
                return "running" not in states

            await _poll(settled, deadline)
        except RuntimeError as exc:
            await self.close()
            raise PushError(408, f"broadcast: bucket {last.index}: {exc}; nothing was "
                                 "loaded, the group is closed") from exc
        self._receive_s[push_id] = self._receive_s.get(push_id, 0.0) + (
            time.perf_counter() - start)
        self._touch()
        if all(s == "done" for s in states):
            return
        what = f"bucket {last.index}" if len(buckets) == 1 else (
            f"buckets {buckets[0].index}-{last.index}")
        await self._refuse(states, what)

    async def _refuse(self, states: list[str], what: str) -> None:
        """Raise for the workers that did not take ``what``. A bucket refused and dropped
        by every worker (not what its update announced) keeps the group; a broadcast that
        broke, or a refusal that made a worker leave, closes it."""
        named = "; ".join(f"worker {i}: {s}" for i, s in enumerate(states) if s != "done")
        is_refused = any(s.startswith("refused") for s in states)
        is_broken = any(not (s == "done" or s.startswith("refused: ")) for s in states)
        if not is_broken:
            raise PushError(400, f"broadcast: {what} refused ({named}); nothing was loaded, "
                                 "the old weights are still served")
        await self.close()
        raise PushError(400 if is_refused else 408, (
            f"broadcast: {what} failed ({named}); nothing was loaded, the old weights are "
            "still served; the group is closed (the next push needs a new one)"))

    async def finish_receive(self, push_id: str, buckets: list[BucketInfo]) -> ReceivedPush:
        """Once every worker has stored (the writer) or checked every bucket: the push's
        stored copy and how its receive went.

        Raises:
            PushError: as :meth:`receive_bucket`.
        """
        assert self.current is not None
        reports: list[WorkerReceive] = []
        deadline = time.monotonic() + self.current.timeout_s + WAIT_MARGIN_S

        async def ended() -> bool:
            nonlocal reports
            reports = await self._engine.receive_reports(push_id, len(buckets))
            return all(r.state != "running" for r in reports)

        if not await _poll(ended, deadline):
            await self.close()
            raise PushError(408, f"broadcast: the stored copy of push {push_id} was not "
                                 "written in time; nothing was loaded")
        if any(r.state != "done" for r in reports):
            await self._refuse([r.state for r in reports], f"push {push_id}")
        return ReceivedPush(
            store=StoreRef(path=self.copies.path(push_id), buckets=tuple(buckets)),
            peak_bytes=[r.peak_bytes for r in reports],
            receive_s=self._receive_s.pop(push_id, 0.0),
            copy_checksums={i: c for r in reports for i, c in r.copy_checksums.items()})

    def discard(self, push_id: str) -> None:
        """A push that did not load: what arrived of it goes."""
        self._receive_s.pop(push_id, None)
        self.copies.discard(push_id)

    async def close(self) -> None:
        """No current group: the workers leave it; the next push needs a new one."""
        if self._lease is not None and self._lease is not asyncio.current_task():
            self._lease.cancel()
        self._lease = None
        if self.current is not None:
            self.current, self._spec, self._counters, self._joined = None, None, None, False
            with contextlib.suppress(Exception):  # an engine gone leaves no group either
                await self._engine.leave_group()

    def _touch(self) -> None:
        self._last_used_s = time.monotonic()

    async def _expire(self, group: messages.WeightGroupResponse) -> None:
        """Release ``group`` once it has gone its lease without a call."""
        while self.current is group:
            remaining = self._last_used_s + group.lease_s - time.monotonic()
            if remaining <= 0:
                await self.close()
                return
            await asyncio.sleep(remaining)

    async def _until_done(self, states: Callable[[], Awaitable[list[str]]], what: str) -> None:
        """Poll every worker's state until all are ``done``.

        Raises:
            RuntimeError: a worker failed, or not all were done by the deadline.
        """
        assert self.current is not None
        timeout_s = self.current.timeout_s + WAIT_MARGIN_S

        async def all_done() -> bool:
            now = await states()
            if any(s not in ("running", "done") for s in now):
                raise RuntimeError(f"{what} failed: " + "; ".join(
                    f"worker {i}: {s}" for i, s in enumerate(now)))
            return all(s == "done" for s in now)

        if not await _poll(all_done, time.monotonic() + timeout_s):
            raise RuntimeError(f"{what} did not end within {timeout_s:g} s")


async def _at_least(counters: StoreCounters, key: str, count: int) -> bool:
    return await asyncio.to_thread(counters.finished, key) >= count


async def _poll(ready: Callable[[], Awaitable[bool]], deadline: float) -> bool:
    """Call ``ready`` until it says yes (True) or ``deadline`` (monotonic) passes (False),
    waiting from ``FIRST_POLL_S`` doubling up to ``MAX_POLL_S`` between calls."""
    poll_s = FIRST_POLL_S
    while True:
        if await ready():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
        poll_s = min(2 * poll_s, MAX_POLL_S)
