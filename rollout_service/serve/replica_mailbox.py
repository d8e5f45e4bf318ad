"""The weights coordinator's replicas and their mailboxes: who is alive, what each last
reported, and the commands queued to each, answered by acks with a deadline.

Runs in the coordinator's Ray Serve replica, as the base of
:class:`~rollout_service.serve.coordinator.WeightsCoordinator` (no Ray import). Replicas
come to it: each long-polls :meth:`ReplicaMailbox.poll`, which carries its state and
returns the commands queued for it, and answers each command with :meth:`ack` (a
``commit``'s answer carries its state too, so its report is fresh when the push returns).
A replica that stops polling is gone (:data:`GONE_AFTER_S`; a starting one, whose event
loop is busy loading the engine, :data:`STARTING_GONE_AFTER_S`), and its unanswered
commands fail by name (503), as do those unanswered by the ack deadline (504).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rollout_service.protocol import messages
from rollout_service.serve.commands import Command, CommandResult

POLL_TIMEOUT_S = 1.0
"""A poll returns after this long without commands: replicas poll at least this often."""
GONE_AFTER_S = 6.0
"""A replica that has not polled for this long is gone (dead, or stopped by Serve)."""
STARTING_GONE_AFTER_S = 900.0
"""A starting replica's event loop is busy loading the engine: it may not poll for minutes."""
KEEP_GONE_S = 600.0
"""Gone replicas stay listed in /health this long, for the story."""


@dataclass(kw_only=True, slots=True)
class _Replica:
    report: messages.ReplicaHealth
    last_poll_s: float = field(default_factory=time.monotonic)
    is_registered: bool = False
    is_replaying: bool = False
    queue: asyncio.Queue[Command] = field(default_factory=asyncio.Queue)

    def is_alive(self) -> bool:
        limit = STARTING_GONE_AFTER_S if self.report.status == "starting" else GONE_AFTER_S
        return time.monotonic() - self.last_poll_s < limit


class ReplicaMailbox:
    """The replicas seen, their last reports, and the command queues and acks.

    Args:
        ack_timeout_s: a replica that has not acknowledged a command by then fails it.
    """

    def __init__(self, *, ack_timeout_s: float) -> None:
        self._ack_timeout_s = ack_timeout_s
        self._replicas: dict[str, _Replica] = {}
        self._acks: dict[tuple[str, str], asyncio.Future[CommandResult]] = {}

    # ---- replica side ------------------------------------------------------------

    async def announce(self, report: messages.ReplicaHealth) -> None:
        """A replica exists (its engine is starting); /health lists it from now on."""
        self._touch(report)

    async def poll(self, report: messages.ReplicaHealth) -> list[Command]:
        """Report state; wait up to :data:`POLL_TIMEOUT_S` for commands."""
        replica = self._touch(report)
        try:
            first = await asyncio.wait_for(replica.queue.get(), POLL_TIMEOUT_S)
        except TimeoutError:
            return []
        commands = [first]
        while not replica.queue.empty():
            commands.append(replica.queue.get_nowait())
        return commands

    async def ack(self, replica_id: str, command_id: str, result: CommandResult) -> None:
        """A replica's answer to a command; one that carries the replica's state (a
        ``commit``'s) replaces its last report, even past the ack's deadline: it is newer
        than any poll's."""
        if result.report is not None and replica_id in self._replicas:
            self._touch(result.report)
        future = self._acks.pop((command_id, replica_id), None)
        if future is not None and not future.done():
            future.set_result(result)

    def _touch(self, report: messages.ReplicaHealth) -> _Replica:
        replica = self._replicas.get(report.replica)
        if replica is None:
            replica = self._replicas[report.replica] = _Replica(report=report)
        replica.report = report
        replica.last_poll_s = time.monotonic()
        return replica

    # ---- commands ------------------------------------------------------------------

    async def _send(self, targets: list[str], command: Command) -> dict[str, CommandResult]:
        """Queue ``command`` for each target; wait for every ack or its failure."""
        return await self.collect(self.dispatch(targets, command), command.id)

    def dispatch(self, targets: list[str], command: Command
                 ) -> dict[str, asyncio.Future[CommandResult]]:
        """Queue ``command`` (or, by target, its own copy of it) for each target; the
        futures of their acks."""
        loop = asyncio.get_running_loop()
        futures = {}
        for replica_id in targets:
            futures[replica_id] = self._acks[(command.id, replica_id)] = loop.create_future()
            self._replicas[replica_id].queue.put_nowait(command)
        return futures

    def send_each(self, commands: dict[str, Command]) -> dict[str, asyncio.Future[CommandResult]]:
        """:meth:`dispatch` of one command per replica (each with its own id)."""
        futures: dict[str, asyncio.Future[CommandResult]] = {}
        for replica_id, command in commands.items():
            futures.update(self.dispatch([replica_id], command))
        return futures

    async def collect(self, futures: dict[str, asyncio.Future[CommandResult]],
                      command_id: str | None = None, timeout_s: float | None = None
                      ) -> dict[str, CommandResult]:
        """Wait for every ack, a replica that went away, or the ack timeout."""
        deadline = time.monotonic() + (timeout_s or self._ack_timeout_s)
        while not all(f.done() for f in futures.values()):
            for replica_id, future in futures.items():
                if future.done():
                    continue
                if not self._replicas[replica_id].is_alive():
                    future.set_result(CommandResult(ok=False, status=503, message=(
                        "the replica went away (stopped polling) before answering")))
                elif time.monotonic() > deadline:
                    future.set_result(CommandResult(ok=False, status=504, message=(
                        f"no answer within push_ack_timeout_s={self._ack_timeout_s:g}"
                        if timeout_s is None else f"no answer within {timeout_s:g} s")))
            await asyncio.wait(list(futures.values()), timeout=0.5)
        for key in [k for k, f in self._acks.items() if f in futures.values()]:
            self._acks.pop(key, None)
        return {r: f.result() for r, f in futures.items()}

    def live_registered(self) -> list[tuple[str, messages.ReplicaHealth]]:
        """The replicas a push can reach, with their last reports."""
        return [(r, s.report) for r, s in self._live() if s.is_registered
                and s.report.status != "unavailable"]

    def is_alive(self, replica_id: str) -> bool:
        replica = self._replicas.get(replica_id)
        return replica is not None and replica.is_alive()

    # ---- views -------------------------------------------------------------------

    def _live(self) -> list[tuple[str, _Replica]]:
        return [(r, s) for r, s in self._replicas.items() if s.is_alive()]

    def replicas(self) -> list[messages.ReplicaHealth]:
        """Every replica seen lately, in registration order; gone ones marked."""
        now = time.monotonic()
        for replica_id in [r for r, s in self._replicas.items()
                           if now - s.last_poll_s > KEEP_GONE_S]:
            del self._replicas[replica_id]
        return [s.report if s.is_alive() else s.report.model_copy(update={"status": "gone"})
                for s in self._replicas.values()]

    def metrics_targets(self) -> list[dict[str, object]]:
        """Prometheus HTTP service discovery: one target per live replica."""
        return [{"targets": [s.report.metrics_address], "labels": {"replica": replica_id}}
                for replica_id, s in self._live() if s.report.metrics_address]
