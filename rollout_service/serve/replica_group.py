"""One engine replica's part of the deployment's ``nccl`` pushes (Ray Serve).

Runs in each engine replica (``replica.py`` hands it the coordinator's group commands).
The replica's own :class:`~rollout_service.weights.group.WeightGroups` does the work, as
in the standalone service: ``group_join`` joins the trainer's group at the rank offset
the coordinator gave this replica, ``bucket`` receives one bucket in every worker (the
trainer broadcasts it to every replica at once), ``load`` loads main model and drafter
from the push's stored copy once it is written, ``fetch`` copies a peer's stored copy
(``peer_store.py``) and loads it, for a replica that was not in the group. The replica's
stored copy of the version it serves is served to peers by its :class:`StoreServer`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollout_service.protocol import messages
from rollout_service.protocol.store import StoreRef
from rollout_service.serve.commands import Command, CommandResult, StoredPush
from rollout_service.serve.peer_store import StoreServer, fetch_store
from rollout_service.weights.checks import PushError
from rollout_service.weights.group import WeightGroups
from rollout_service.weights.manager import WeightPushManager


class ReplicaGroup:
    """The group commands of one replica (module docstring).

    Args:
        weights: the replica's push manager (its ``groups`` set: ``weights_transport:
            nccl``).
        token: the weights token, required by the stored copy's server and sent to peers.
        host: where the stored copy's server binds (``metrics_host``).
        advertise: ``host:port`` other nodes reach, from the bound port.
    """

    def __init__(self, weights: WeightPushManager, *, token: str | None, host: str,
                 advertise: Callable[[str, int], str]) -> None:
        assert weights.groups is not None
        self._weights = weights
        self._groups: WeightGroups = weights.groups
        self._token = token
        self._server = StoreServer(self._groups.copies, token, host)
        self.store_address = advertise(host, self._server.port)

    def report(self) -> dict[str, object]:
        """The replica's fields of its ``/health`` report."""
        state = self._groups.state()
        return {"group_ranks": state.num_ranks, "group_backend": state.backend,
                "store_address": self.store_address}

    async def run(self, command: Command) -> CommandResult:
        """``group_join``, ``group_leave`` or ``bucket``; failures answered with their
        status (the coordinator names this replica)."""
        try:
            if command.kind == "group_join":
                assert command.group is not None
                await self._groups.create(command.group)
                await self._groups.check_joined(command.group.group_id)
            elif command.kind == "group_leave":
                await self._groups.close()
            else:
                assert command.push_id is not None and command.buckets
                try:
                    await self._groups.receive_buckets(command.push_id, command.buckets)
                except PushError:
                    self._groups.discard(command.push_id)
                    raise
        except PushError as exc:
            return CommandResult(ok=False, status=exc.status, message=str(exc))
        except Exception as exc:  # reported to the coordinator, which names us
            return CommandResult(ok=False, status=500, message=repr(exc))
        return CommandResult(ok=True)

    async def load(self, push: StoredPush) -> messages.PushFinishResponse:
        """Load a push this replica received in the group, from its stored copy.

        Raises:
            PushError: the receive did not end well (nothing loaded), or the load failed.
        """
        try:
            received = await self._groups.finish_receive(push.push_id, push.buckets)
            finished = await self._weights.load(push.begin, push.placements,
                                                push_id=push.push_id, store=received.store)
        except PushError:
            self._groups.discard(push.push_id)
            raise
        self._groups.copies.commit(received.store, received.copy_checksums)
        timings = finished.timings.model_copy(update={"receive_s": received.receive_s})
        return finished.model_copy(update={"timings": timings,
                                           "receive_peak_bytes": received.peak_bytes})

    @property
    def copy_checksums(self) -> dict[int, str]:
        """The served copy's checksums of its unchecksummed buckets (what this replica's
        writer computed as they arrived, or what its fetch checked them by)."""
        return self._groups.copies.committed_checksums

    async def fetch(self, push: StoredPush, peers: list[str]) -> messages.PushFinishResponse:
        """Copy ``push``'s stored copy from a peer (every bucket checked against the
        trainer's checksum, or the one its holders' writers computed) and load it.

        Raises:
            PushError(503): no peer had it whole; 500: the load failed.
        """
        path = self._groups.copies.path(push.push_id)
        try:
            await asyncio.to_thread(fetch_store, peers, self._token, push.push_id,
                                    push.buckets, path, copy_checksums=push.copy_checksums)
        except RuntimeError as exc:
            self._groups.discard(push.push_id)
            raise PushError(503, str(exc)) from exc
        store = StoreRef(path=path, buckets=tuple(push.buckets))
        try:
            finished = await self._weights.load(push.begin, push.placements,
                                                push_id=push.push_id, store=store)
        except PushError:
            self._groups.discard(push.push_id)
            raise
        self._groups.copies.commit(store, push.copy_checksums)
        return finished

    def close(self) -> None:
        self._server.close()
