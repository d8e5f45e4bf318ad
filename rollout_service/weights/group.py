"""The ``nccl`` transport's group on the service side: the rendezvous, the current
group, and its workers' join and receives.

Runs in the service process. ``POST /weights/group`` makes a new group (the previous
one, if any, is let go): the service's rendezvous store gets a new key prefix, every
engine worker starts joining on a thread of its own, and the answer tells the trainer
where to join as rank 0. A push names its group in ``begin``, which waits for the
workers' join to end. ``finish`` receives the trainer's broadcast into the workers'
buffers before generation pauses. A broadcast that fails closes the group: nothing of
that push was loaded, and the trainer makes a new group for the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rollout_service.engines.base import BroadcastEngine
from rollout_service.protocol import messages
from rollout_service.protocol.broadcast import (
    TRAINER_RANK,
    GroupSpec,
    Rendezvous,
    new_group_id,
)
from rollout_service.weights.intake import PushError

FIRST_POLL_S = 0.002
"""The first wait between two asks how a join or a receive goes: of the workers (an RPC
to every worker, run between two engine steps) for a join, of the rendezvous store (this
process's own) for a receive."""
MAX_POLL_S = 0.05
"""The wait doubles up to this: a push of a small model is seen done within
milliseconds, and a long join costs the engine, which keeps generating meanwhile, 20 RPCs
a second, not 500."""


class WeightGroups:
    """The service's one current group (module docstring).

    Args:
        engine: the engine whose workers join (its ``num_workers`` and ``group_backend``
            size and pick the group).
        address: where trainers reach the rendezvous (``ServiceConfig.group_address``).
        timeout_s: the join's and every broadcast's timeout (``weights_group_timeout_s``).
    """

    def __init__(self, engine: BroadcastEngine, *, address: str, timeout_s: float) -> None:
        self._engine = engine
        self._address = address
        self._timeout_s = timeout_s
        self._rendezvous: Rendezvous | None = None
        self.current: GroupSpec | None = None
        self._joined = False

    async def create(self) -> messages.WeightGroupResponse:
        """A new group; the workers start joining it now."""
        if self._rendezvous is None:
            self._rendezvous = await asyncio.to_thread(Rendezvous, self._address,
                                                       self._timeout_s)
        spec = GroupSpec(group_id=new_group_id(), master_address=self._address,
                         master_port=self._rendezvous.port,
                         world_size=1 + self._engine.num_workers,
                         backend=self._engine.group_backend, timeout_s=self._timeout_s)
        self.current, self._joined = None, False
        await self._engine.join_group(spec)
        self.current = spec
        return messages.WeightGroupResponse(
            group_id=spec.group_id, master_address=spec.master_address,
            master_port=spec.master_port, world_size=spec.world_size,
            trainer_rank=TRAINER_RANK, backend=spec.backend, timeout_s=spec.timeout_s)

    async def check_joined(self, group_id: str) -> None:
        """Wait (up to the group's timeout) until every worker has joined ``group_id``.

        Raises:
            PushError(409): not the current group, or its join failed (the group is
                closed: make a new one).
        """
        spec = self.current
        if spec is None or spec.group_id != group_id:
            raise PushError(409, f"group_id: {group_id!r} is not this service's current "
                                 f"weight group ({spec.group_id if spec else None}); "
                                 "POST /weights/group makes one")
        if self._joined:
            return
        try:
            await self._until_done(lambda: self._engine.group_state(group_id),
                                   f"the workers' join of {group_id!r}", self._deadline())
        except RuntimeError as exc:
            self.close()
            raise PushError(409, f"group_id: {exc} (did the trainer join?); make a new "
                                 "group") from exc
        self._joined = True

    async def receive(self, push_id: str, group_id: str, nbytes: int) -> float:
        """Receive a push's broadcast in every worker; returns the seconds it took.

        Raises:
            PushError(408): it failed or timed out; the group is closed.
        """
        start = time.perf_counter()
        try:
            await self._engine.start_receive(push_id, group_id, nbytes)
            deadline = self._deadline()  # one for both waits: a silent worker costs it once
            await self._until_finished(push_id, group_id, deadline)
            await self._until_done(lambda: self._engine.receive_state(push_id),
                                   f"the broadcast of push {push_id}", deadline)
        except RuntimeError as exc:
            self.close()
            raise PushError(408, f"broadcast: {exc}; nothing was loaded, the old weights "
                                 "are still served; the group is closed (the next push "
                                 "makes a new one)") from exc
        return time.perf_counter() - start

    def _deadline(self) -> float:
        """When a wait on the workers gives up: the workers' own timeout (the group's)
        ends a wait for a silent trainer; 30 s more only bounds a worker that never
        reports."""
        return time.monotonic() + self._timeout_s + 30

    async def _until_finished(self, push_id: str, group_id: str, deadline: float) -> None:
        """Wait until every worker counts its receive of ``push_id`` as finished in the
        rendezvous store, without asking the workers (``Rendezvous.finished`` says why);
        :meth:`_until_done` then asks them once how it ended. A worker that never counts
        itself (its process gone) is asked at the deadline."""
        assert self._rendezvous is not None  # a receive follows a group's create
        rendezvous = self._rendezvous

        async def all_finished() -> bool:
            finished = await asyncio.to_thread(rendezvous.finished, group_id, push_id)
            return finished >= self._engine.num_workers

        await _poll(all_finished, deadline)

    async def _until_done(self, states: Callable[[], Awaitable[list[str]]], what: str,
                          deadline: float) -> None:
        """Poll every worker's state until all are ``done``.

        Raises:
            RuntimeError: a worker failed, or not all were done by the deadline.
        """

        async def all_done() -> bool:
            now = await states()
            if any(s not in ("running", "done") for s in now):  # every worker's, to tell
                # a trainer that sent nothing from one that reached only some ranks
                raise RuntimeError(f"{what} failed: " + "; ".join(
                    f"worker {i}: {s}" for i, s in enumerate(now)))
            return all(s == "done" for s in now)

        if not await _poll(all_done, deadline):
            raise RuntimeError(f"{what} did not end within {self._timeout_s + 30:g} s")

    def close(self) -> None:
        """No current group: the next push needs a new one."""
        self.current, self._joined = None, False


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
