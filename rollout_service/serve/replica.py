"""One engine replica of the Ray Serve app: an engine, its weights, its own /metrics.

Runs inside a Ray Serve replica actor (``serve/app.py`` makes this class a deployment;
Ray Serve starts N of them). The ingress calls :meth:`EngineReplica.generate`
and friends through a deployment handle. Weight pushes do not come that way:
the replica registers with the weights coordinator and long-polls it for
commands (``coordinator.py``), so one push reaches every replica.

Life of a replica:

1. ``__init__`` announces itself, starts the engine (after the other replicas naming the
   same ``engine_start_lock`` have started theirs), serves its metrics on a free port,
   registers, and replays the deployment's last push from the
   trainer's segment if it is behind, all before the constructor returns, so
   Ray Serve never routes a request to it while it holds older weights. If
   the segment is gone, it still starts but reports ``lagging`` and refuses
   generation (the ingress retries elsewhere) until the next push.
2. A ``load`` command closes the admission gate (new requests wait), loads
   the coordinator's validated push through the same
   :class:`~rollout_service.weights.manager.WeightPushManager` as the standalone
   service (``load``: no second validation), acknowledges, and keeps the gate closed until
   the coordinator's ``commit``: every replica has loaded by then. The commit is
   acknowledged too, with the replica's state after it (the push waits for that).
3. ``check_health`` raises once the engine is dead or a load tore the weights;
   Ray Serve then replaces the replica, and the new one replays (step 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from rollout_service.choices import Choice
from rollout_service.engines.base import (
    ChatTurn,
    Engine,
    EngineInfo,
    EngineUnavailableError,
    GenerationDelta,
    GenerationResult,
)
from rollout_service.protocol import messages
from rollout_service.serve.config import RayServeConfig
from rollout_service.serve.coordinator import Command, CommandResult, StoredPush
from rollout_service.serve.replica_group import ReplicaGroup
from rollout_service.serve.start_lock import one_start_at_a_time
from rollout_service.service import RolloutService, speculation_info
from rollout_service.telemetry.exposition import serve_metrics
from rollout_service.weights.intake import PushError

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)


def advertised_address(host: str, port: int) -> str:
    """``host:port`` other nodes reach: this node's IP when bound to every interface."""
    import ray

    advertised = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host
    return f"{advertised}:{port}"


class EngineReplica:
    """Owns one engine; generation calls come from the ingress, pushes from the coordinator.

    Args:
        config: the app's configuration.
        coordinator: a deployment handle to the weights coordinator.
    """

    async def __init__(self, config: RayServeConfig, coordinator: DeploymentHandle) -> None:
        from ray import serve

        from rollout_service.local import build_local_service, start_engine

        self._id = serve.get_replica_context().replica_id.unique_id
        self._coordinator = coordinator
        self._hold_s = config.push_ack_timeout_s
        self._open = asyncio.Event()
        self._open.set()
        self._commands = asyncio.Lock()
        self._expected: tuple[int | None, int | None] = (None, None)
        self._stale: str | None = None
        self._reopen: asyncio.Task[None] | None = None
        self._is_ready = False
        self._metrics_address: str | None = None
        self._engine: Engine | None = None
        self._service: RolloutService | None = None
        await coordinator.announce.remote(await self._report())
        async with one_start_at_a_time(config.engine_start_lock):
            self._engine = await start_engine(config)
        if config.weights_store_dir is not None:  # each replica its own stored copies
            config = config.model_copy(update={
                "weights_store_dir": config.weights_store_dir / self._id})
        self._service, registry = build_local_service(self._engine, config)
        await self._service.start()
        self._weights = self._service.weights
        self._metrics_address = advertised_address(
            config.metrics_host, serve_metrics(registry, config.metrics_host))
        self._group = None if self._weights.groups is None else ReplicaGroup(
            self._weights, token=config.resolved_weights_token(), host=config.metrics_host,
            advertise=advertised_address)
        snapshot = await coordinator.register.remote(await self._report())
        self._expected = (snapshot.main_version, snapshot.draft_version)
        self._poller = asyncio.create_task(self._poll_forever())
        async with self._commands:
            try:
                if snapshot.last_push is not None and self._lag() is not None:
                    await self._replay(snapshot.last_push, snapshot.peers)
            finally:
                await coordinator.replayed.remote(self._id)
        self._is_ready = True
        logger.info("replica %s ready (weights %s)", self._id, self._versions())

    # ---- generation (called by the ingress through the handle) --------------------

    async def generate(self, req: messages.GenerateRequest) -> messages.GenerateResponse:
        await self._admit()
        response = await self._service.generate(req)
        return response.model_copy(update={"replica": self._id})

    async def run_choices(self, choices: list[Choice]) -> list[GenerationResult]:
        """One call's sequences (``serve/sequences.py``), all on this replica."""
        await self._admit()
        return await self._service.run(choices)

    async def stream_choices(self, choices: list[Choice]
                             ) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """Streamed to the ingress (``handle.options(stream=True)``); cancelled with it."""
        await self._admit()
        async with aclosing(self._service.stream(choices)) as deltas:
            async for item in deltas:
                yield item

    async def chat_prompt(self, turns: list[ChatTurn]) -> list[int]:
        return await self._service.chat_prompt(turns)

    async def decode_tokens(self, token_ids: list[int]) -> list[str]:
        return await self._service.decode_tokens(token_ids)

    async def encode(self, text_and_special: tuple[str, bool]) -> list[int]:
        text, add_special_tokens = text_and_special
        return await self._service.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._service.decode(token_ids)

    async def engine_info(self, _: None = None) -> EngineInfo:
        return self._service.info

    # ---- generation control (broadcast by the ingress to every replica) ----------------

    async def pause(self, mode: messages.PauseMode) -> int:
        return await self._service.pause(mode)

    async def resume(self) -> bool:
        return await self._service.resume()

    async def is_paused(self) -> bool:
        return await self._service.is_paused()

    async def abort(self, client_ids: list[str] | None) -> int:
        return await self._service.abort(client_ids)

    async def reset_prefix_cache(self) -> bool:
        return await self._service.reset_prefix_cache()

    async def num_running(self) -> list[int]:
        return await self._service.num_running()

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine or torn weights fail the replica."""
        assert self._engine is not None  # Serve checks health only after __init__
        await self._engine.health()
        if not self._weights.is_consistent:
            raise EngineUnavailableError(f"replica {self._id}: a weight load failed midway")

    async def _admit(self) -> None:
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), self._hold_s)
            except TimeoutError:
                pass
        reason = self._lag()
        if reason is not None:
            raise EngineUnavailableError(f"replica {self._id}: {reason}")

    def _versions(self) -> tuple[int | None, int | None]:
        return (self._weights.main_version, self._weights.draft_version)

    def _lag(self) -> str | None:
        """Why this replica must not generate now, or None."""
        if self._stale is not None:
            return self._stale
        if self._versions() != self._expected:
            return (f"serves weight versions (main, draft) {self._versions()}, the deployment "
                    f"serves {self._expected}; it refuses generation until the next push")
        return None

    # ---- the coordinator's commands ---------------------------------------------

    async def _report(self) -> messages.ReplicaHealth:
        status: messages.ReplicaStatus = "starting"
        detail = None
        if self._engine is not None:
            try:
                await self.check_health()
                detail = self._lag()
                status = ("lagging" if detail else "ok") if self._is_ready else "starting"
            except EngineUnavailableError as exc:
                status, detail = "unavailable", str(exc)
        main, draft = self._versions() if self._engine is not None else (None, None)
        speculation = None if self._engine is None else speculation_info(self._engine.info)
        controller = None if self._service is None else self._service.speculation
        group = {} if getattr(self, "_group", None) is None else self._group.report()
        return messages.ReplicaHealth(
            replica=self._id, status=status, main_version=main, draft_version=draft,
            detail=detail, pid=os.getpid(), metrics_address=self._metrics_address,
            speculation=speculation,
            speculation_control=None if controller is None else controller.status(), **group)

    async def _poll_forever(self) -> None:
        while True:
            try:
                commands = await self._coordinator.poll.remote(await self._report())
            except Exception:  # the coordinator restarting: keep trying
                logger.exception("replica %s: polling the weights coordinator failed", self._id)
                await asyncio.sleep(1.0)
                continue
            for command in commands:
                if command.kind == "commit":  # applied and answered before later ones start
                    await self._commit(command)
                elif command.kind == "group_leave":  # at once: it ends a receive in progress
                    asyncio.create_task(self._run_group(command))
                else:
                    asyncio.create_task(self._run(command))

    async def _run_group(self, command: Command) -> None:
        assert self._group is not None  # the coordinator sends group commands for nccl only
        await self._coordinator.ack.remote(self._id, command.id, await self._group.run(command))

    async def _run(self, command: Command) -> None:
        if command.kind in ("group_join", "bucket"):
            async with self._commands:
                await self._run_group(command)
            return
        async with self._commands:
            if command.kind == "fetch":
                assert command.push is not None and self._group is not None
                result = await self._load(command.push, command.peers)
            elif command.kind == "load":
                assert command.push is not None
                self._open.clear()
                result = await self._load(command.push)
                if self._reopen is not None:
                    self._reopen.cancel()
                self._reopen = asyncio.create_task(self._reopen_later())
            else:
                try:
                    checksums = await self._service.weight_checksums()
                    result = CommandResult(ok=True, checksums=checksums)
                except Exception as exc:  # reported to the coordinator, which names us
                    result = CommandResult(ok=False, status=500, message=repr(exc))
        await self._coordinator.ack.remote(self._id, command.id, result)

    async def _load(self, push: StoredPush, peers: list[str] | None = None) -> CommandResult:
        try:
            finish = await self._apply(push, peers)
        except PushError as exc:
            return CommandResult(ok=False, status=exc.status, message=str(exc))
        except Exception as exc:
            logger.exception("replica %s: load failed", self._id)
            return CommandResult(ok=False, status=500, message=repr(exc))
        self._stale = None
        return CommandResult(ok=True, finish=finish, copy_checksums=None if self._group is None
                             else self._group.copy_checksums)

    async def _apply(self, push: StoredPush, peers: list[str] | None = None
                     ) -> messages.PushFinishResponse:
        """Load ``push``: from the trainer's segment (``shm``), or (``nccl``) from this
        replica's stored copy, or, given ``peers``, from a peer's copy fetched first."""
        if push.begin.transport != "nccl":
            return await self._weights.load(push.begin, push.placements, push_id=push.push_id)
        assert self._group is not None
        if peers is None:
            return await self._group.load(push)
        return await self._group.fetch(push, peers)

    async def _replay(self, push: StoredPush, peers: list[str]) -> None:
        try:
            await self._apply(push, peers if push.begin.transport == "nccl" else None)
        except Exception as exc:
            where = ("a peer's stored copy" if push.begin.transport == "nccl"
                     else "the trainer's segment")
            self._stale = (f"could not replay weight version {push.begin.version} from "
                           f"{where} ({exc}); it refuses generation until the next push")
            logger.warning("replica %s: %s", self._id, self._stale)

    async def _commit(self, command: Command) -> None:
        """Serve the deployment's versions and open the gate, then answer with the state
        that leaves (computed after it): the trainer's push returns once every replica
        has, and ``/health`` shows this one as it is now, not as its last poll."""
        self._expected = (command.main_version, command.draft_version)
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        self._open.set()
        try:
            await self._coordinator.ack.remote(self._id, command.id, CommandResult(
                ok=True, report=await self._report()))
        except Exception:  # the coordinator restarting: the next poll reports the state
            logger.exception("replica %s: acknowledging a commit failed", self._id)

    async def _reopen_later(self) -> None:
        """Never hold requests forever: without a commit (coordinator lost), reopen."""
        await asyncio.sleep(self._hold_s)
        logger.warning("replica %s: no commit from the coordinator within %g s; admitting "
                       "requests again", self._id, self._hold_s)
        self._open.set()

    async def __del__(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()
