"""The Ray Serve application: HTTP ingress -> N engine replicas, plus the weights coordinator.

Runs in Ray: :func:`build_app` (or :func:`app_builder`, the import path of
``deploy/serve.yaml``) runs where the app is deployed and only binds
deployments; the classes below run in Serve replica actors:

- ``RolloutIngress`` (stateless, ``num_ingress_replicas``): the same FastAPI app
  as the standalone service (``api.app.create_app``), every dialect included, whose
  handlers call the engine replicas through a deployment handle (a call's sequences
  on one replica, retried on another while the one reached has a dead engine or lags
  behind the weights; a stream until its first chunk, through a streaming handle;
  ``serve/sequences.py``), broadcast the control routes to every replica, and call
  the coordinator for weight pushes, ``/health`` and ``GET /metrics/targets``.
- ``RolloutEngine`` (``num_replicas`` or autoscaling): one engine each
  (``serve/replica.py``).
- ``WeightsCoordinator`` (one replica): fans every push out to all engine
  replicas (``serve/coordinator.py``).

Metrics: each engine replica serves its own ``/metrics`` (vLLM's ``vllm:*``
and this service's ``rollout_*`` series, unchanged names) on a free port, and
Prometheus discovers them through ``GET /metrics/targets`` on the ingress
(``http_sd_configs``), so the dashboards' ``sum(...)`` aggregate replicas. The
ingress's own ``/metrics`` answers with all of them merged (``serve/metrics.py``)
for a Prometheus pointed at the Serve endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from rollout_service.api.app import create_app
from rollout_service.api.ports import AppState
from rollout_service.completions import OpenAICompletions
from rollout_service.engines.base import EngineUnavailableError
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import summarize, summarize_by_category
from rollout_service.serve.config import RayServeConfig, parse_serve_config
from rollout_service.serve.coordinator import WeightsCoordinator
from rollout_service.serve.group_fanout import GroupSettings
from rollout_service.serve.metrics import fetch_pages, merge_pages
from rollout_service.serve.replica import EngineReplica
from rollout_service.serve.sequences import BroadcastControl, ReplicatedSequences
from rollout_service.service import gather_or_cancel

logger = logging.getLogger(__name__)

_MANY = 10_000
"""max_ongoing_requests of the ingress and the coordinator: they only wait on others."""


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


async def _call(response: Any) -> Any:
    try:
        return await response
    except Exception as exc:
        raise _cause(exc) from None


class Replicas:
    """Calls to the engine replicas, retried on another while the one reached cannot serve
    (a dead engine, lagging weights, a lost actor) until ``retry_timeout_s``."""

    def __init__(self, config: RayServeConfig, engine: DeploymentHandle) -> None:
        self._retry_timeout_s = config.retry_timeout_s
        self._engine = engine

    async def call(self, method: str, request: Any) -> Any:
        """The answer of ``method`` on a replica."""
        deadline = time.monotonic() + self._retry_timeout_s
        delay = 0.05
        while True:
            try:
                return await getattr(self._engine, method).remote(request)
            except Exception as exc:
                self._check_retry(method, _cause(exc), deadline, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def stream(self, method: str, request: Any) -> AsyncGenerator[Any, None]:
        """The items of the async generator ``method`` on a replica; retried until its
        first item only (what follows went to the client already)."""
        deadline = time.monotonic() + self._retry_timeout_s
        delay = 0.05
        while True:
            items = getattr(self._engine.options(stream=True), method).remote(request)
            try:
                first = await anext(items)
                break
            except StopAsyncIteration:
                return
            except Exception as exc:
                self._check_retry(method, _cause(exc), deadline, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
        try:
            yield first
            async for item in items:
                yield item
        except Exception as exc:
            raise _cause(exc) from None
        finally:
            items.cancel()  # the client went away: the replica closes its stream, aborting

    @staticmethod
    def _check_retry(method: str, cause: BaseException, deadline: float, delay: float) -> None:
        if (not isinstance(cause, (EngineUnavailableError, RayActorError))
                or time.monotonic() + delay > deadline):
            raise cause from None
        logger.info("retrying %s on another replica: %s", method, cause)


class ReplicatedService:
    """The ingress's side of :class:`~rollout_service.service.RolloutService`."""

    def __init__(self, config: RayServeConfig, engine: DeploymentHandle,
                 coordinator: DeploymentHandle) -> None:
        self._config = config
        self._replicas = Replicas(config, engine)
        self._coordinator = coordinator
        autoscaling = config.autoscaling_config or {}
        self._num_wanted = (config.num_replicas if config.autoscaling_config is None
                            else max(1, int(autoscaling.get("min_replicas", 1))))

    async def _on_a_replica(self, method: str, request: Any) -> Any:
        return await self._replicas.call(method, request)

    async def generate(self, req: messages.GenerateRequest) -> messages.GenerateResponse:
        return await self._on_a_replica("generate", req)

    async def generate_batch(self, batch: messages.BatchGenerateRequest
                             ) -> messages.BatchGenerateResponse:
        """Each request goes to a replica of its own; one failure fails the batch."""
        responses = await gather_or_cancel([self.generate(r) for r in batch.requests])
        stats = [[o.spec_decode.to_stats() if o.spec_decode else None for o in response.outputs]
                 for response in responses]
        return messages.BatchGenerateResponse(
            responses=responses, acceptance=summarize(s for seqs in stats for s in seqs),
            acceptance_by_category=summarize_by_category(
                (req.category, s) for req, seqs in zip(batch.requests, stats) for s in seqs))

    async def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Per replica: SHA-256 of its main model's and drafter's parameters."""
        return await _call(self._coordinator.checksums.remote())

    async def health(self) -> tuple[messages.HealthResponse, int]:
        """Every replica's state; 200 while at least one serves, "ok" when all wanted do."""
        replicas = await _call(self._coordinator.replicas.remote())
        weights = await _call(self._coordinator.status.remote())
        return deployment_health(self._config, replicas, weights, num_wanted=self._num_wanted)


def deployment_health(config: RayServeConfig, replicas: list[messages.ReplicaHealth],
                      weights: messages.WeightStatus, *, num_wanted: int
                      ) -> tuple[messages.HealthResponse, int]:
    """The deployment's ``/health`` from its replicas' own reports.

    200 while at least one replica serves, status "ok" when every current one does and at
    least ``num_wanted`` serve. The top-level ``speculation`` and ``speculation_control``
    are the first serving replica's (each replica runs its own controller on its own
    batches); every replica's own is in ``replicas``.
    """
    current = [r for r in replicas if r.status != "gone"]
    serving = [r for r in current if r.status == "ok"]
    if serving and len(serving) == len(current) and len(serving) >= num_wanted:
        status = "ok"
    else:
        status = "degraded" if serving else "unavailable"
    problems = [f"replica {r.replica}: {r.status}" + (f" ({r.detail})" if r.detail else "")
                for r in current if r.status != "ok"]
    if len(serving) < num_wanted:
        problems.append(f"{len(serving)} of {num_wanted} replicas serve")
    speculation = next((r.speculation for r in serving if r.speculation), None)
    control = next((r.speculation_control for r in serving if r.speculation_control), None)
    body = messages.HealthResponse(
        status=status, model=config.model_name, engine=config.engine, weights=weights,
        speculation=speculation, speculation_control=control,
        detail="; ".join(problems) or None, replicas=replicas)
    return body, 200 if serving else 503


class CoordinatorPushes:
    """The ingress's side of the push protocol: every call goes to the coordinator."""

    def __init__(self, coordinator: DeploymentHandle) -> None:
        self._coordinator = coordinator

    async def begin(self, req: messages.PushBeginRequest) -> messages.PushBeginResponse:
        return await _call(self._coordinator.begin.remote(req))

    async def update(self, req: messages.PushUpdateRequest) -> messages.PushUpdateResponse:
        return await _call(self._coordinator.update.remote(req))

    async def finish(self, req: messages.PushFinishRequest) -> messages.PushFinishResponse:
        return await _call(self._coordinator.finish.remote(req))

    async def abort(self, req: messages.PushAbortRequest) -> messages.WeightStatus:
        return await _call(self._coordinator.abort.remote(req))

    async def get_status(self) -> messages.WeightStatus:
        return await _call(self._coordinator.status.remote())

    async def create_group(self, req: messages.WeightGroupRequest
                           ) -> messages.WeightGroupResponse:
        return await _call(self._coordinator.create_group.remote(req))

    async def release_group(self, req: messages.WeightGroupRelease
                            ) -> messages.WeightGroupState:
        return await _call(self._coordinator.release_group.remote(req))

    async def group_state(self) -> messages.WeightGroupState:
        return await _call(self._coordinator.group_state.remote())


class ReplicaMetrics:
    """The ingress's ``/metrics``: every live replica's page, labelled by replica."""

    def __init__(self, coordinator: DeploymentHandle) -> None:
        self._coordinator = coordinator

    async def render(self) -> bytes:
        targets = await _call(self._coordinator.metrics_targets.remote())
        return merge_pages(await fetch_pages(targets))


class RolloutIngress:
    """The HTTP entry point; builds the FastAPI app once the handles are known."""

    def __init__(self, config: RayServeConfig, engine: DeploymentHandle,
                 coordinator: DeploymentHandle) -> None:
        self._config = config
        self._engine = engine
        self._coordinator = coordinator

    @asynccontextmanager
    async def _state(self) -> AsyncIterator[AppState]:
        sequences = ReplicatedSequences(Replicas(self._config, self._engine))
        yield AppState(rollouts=ReplicatedService(self._config, self._engine, self._coordinator),
                       completions=OpenAICompletions(sequences), sequences=sequences,
                       control=BroadcastControl(self._engine),
                       weights=CoordinatorPushes(self._coordinator),
                       metrics=ReplicaMetrics(self._coordinator))

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self._config, open_state=self._state)
        coordinator = self._coordinator

        @app.get("/metrics/targets")
        async def metrics_targets() -> list[dict[str, Any]]:
            """Prometheus HTTP service discovery: every engine replica's /metrics."""
            return await _call(coordinator.metrics_targets.remote())

        return app


class CoordinatorReplica(WeightsCoordinator):
    """The coordinator as a Serve deployment: reads the checkpoint's headers itself."""

    def __init__(self, config: RayServeConfig) -> None:
        from rollout_service.protocol.tensors import checkpoint_tensors

        model_path, _ = config.resolve_model()
        super().__init__(checkpoint_tensors(model_path), has_draft=config.mtp.enabled,
                         push_timeout_s=config.push_timeout_s,
                         ack_timeout_s=config.push_ack_timeout_s,
                         transport=config.weights_transport,
                         group=GroupSettings(timeout_s=config.weights_group_timeout_s,
                                             lease_s=config.weights_group_lease_s,
                                             bucket_bytes=config.weights_bucket_bytes,
                                             num_buckets=config.weights_num_buckets))


@dataclass(frozen=True, kw_only=True, slots=True)
class Deployments:
    """The app's three deployments, configured and not yet bound."""

    coordinator: serve.Deployment
    engine: serve.Deployment
    ingress: serve.Deployment


def deployments(config: RayServeConfig) -> Deployments:
    """Each deployment with its options from ``config``."""
    access_log = {"enable_access_log": config.http_access_log}
    scaling: dict[str, Any] = ({"num_replicas": config.num_replicas}
                               if config.autoscaling_config is None
                               else {"autoscaling_config": config.autoscaling_config})
    return Deployments(
        coordinator=serve.deployment(
            CoordinatorReplica, name="WeightsCoordinator", num_replicas=1,
            max_ongoing_requests=_MANY, ray_actor_options={"num_cpus": 0},
            logging_config={"enable_access_log": False}),  # replicas poll it every second
        engine=serve.deployment(
            EngineReplica, name="RolloutEngine", ray_actor_options=config.ray_actor_options,
            max_ongoing_requests=config.max_ongoing_requests,
            health_check_period_s=config.health_check_period_s,
            health_check_timeout_s=config.health_check_timeout_s, logging_config=access_log,
            **scaling),
        ingress=serve.deployment(
            serve.ingress()(RolloutIngress), name="RolloutIngress",
            num_replicas=config.num_ingress_replicas, max_ongoing_requests=_MANY,
            ray_actor_options={"num_cpus": 0}, logging_config=access_log))


def build_app(config: RayServeConfig) -> serve.Application:
    """Bind the three deployments; the ingress is the app's entry point.

    Resolves the model here first, so an embedded checkpoint is built once on
    this node rather than by every replica at the same time.
    """
    config.resolve_model()
    built = deployments(config)
    coordinator = built.coordinator.bind(config)
    engine = built.engine.bind(config, coordinator)
    return built.ingress.bind(config, engine, coordinator)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder (``import_path`` in ``deploy/serve.yaml``).

    Raises:
        ValueError: an invalid config, naming the field.
    """
    return build_app(parse_serve_config(args))


def run(config: RayServeConfig, *, address: str | None = None,
        num_cpus: int | None = None) -> None:
    """Deploy the app (starting a local Ray unless ``address`` is given); block until
    SIGINT/SIGTERM, then shut Serve and Ray down. Runs in the ``serve-ray`` CLI process."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=address, num_cpus=num_cpus)
    try:
        serve.start(http_options={"host": config.host, "port": config.port,
                                  "keep_alive_timeout_s": config.http_keep_alive_s})
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        logger.info("rollout service on http://%s:%d (%s)", config.host, config.port,
                    f"{config.num_replicas} replicas" if config.autoscaling_config is None
                    else "autoscaling")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
