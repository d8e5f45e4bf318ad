"""One engine in this process, assembled from the service config.

Runs in the service process: ``rollout-service serve`` (through ``api.app``)
and each Ray Serve engine replica (``serve.replica``) start their engine and
wrap it in a :class:`~rollout_service.service.RolloutService` here, so both run
exactly the same service around it.
"""

from __future__ import annotations

import importlib
from typing import cast

from prometheus_client import CollectorRegistry

from rollout_service.config import ServiceConfig
from rollout_service.engines.base import (
    Engine,
    EngineSpec,
    EngineStarter,
    SpecScheduleEngine,
)
from rollout_service.engines.broadcast_engine import BroadcastEngine
from rollout_service.engines.speculative import load_checkpoint_config
from rollout_service.engines.start_deadline import StartDeadline
from rollout_service.pausing import PauseGate
from rollout_service.protocol.tensors import checkpoint_tensors
from rollout_service.service import RolloutService
from rollout_service.spec_control import (
    REASONS,
    SpeculationControl,
    served_versions,
    show_fixed_k,
)
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.telemetry.config import CategoryLabels
from rollout_service.telemetry.drafter import DrafterHealth
from rollout_service.telemetry.speculation import SpeculationMetrics
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.group import WeightGroups
from rollout_service.weights.manager import WeightPushManager
from rollout_service.weights.stored_copies import StoredCopies

ENGINE_MODULES = {"vllm": "rollout_service.engines.vllm.engine",
                  "sglang": "rollout_service.engines.sglang.engine"}
"""Engine name -> the module whose ``start`` runs it (imported on demand)."""


def engine_spec(config: ServiceConfig) -> EngineSpec:
    """What the configured engine needs to start (the embedded model is built here)."""
    model_path, engine_kwargs = config.resolve_model()
    return EngineSpec(model_path=model_path, served_model_name=config.model_name,
                      engine_kwargs=engine_kwargs, mtp=config.mtp,
                      checkpoint_config=load_checkpoint_config(model_path),
                      weights_transport=config.weights_transport,
                      weights_load=config.weights_load, engine_url=config.engine_url,
                      verify_cost_batch_size=config.telemetry.verify_cost_batch_size,
                      runtime_spec_schedule=config.speculation_control.enabled,
                      drafter_at_k0=config.speculation_control.drafter_at_k0,
                      full_cuda_graphs=config.speculation_control.full_cuda_graphs)


async def start_engine(config: ServiceConfig) -> Engine:
    """Start the configured engine inside the serving event loop.

    Raises:
        ValueError: a config the engine rejects (the message names the field).
        EngineStartTimeout: not started within ``engine_start_timeout_s``.
    """
    if config.engine == "vllm":
        from rollout_service.engines.vllm.cpu_preload import preload_for_cpu_engine

        preload_for_cpu_engine()
    start = cast(EngineStarter, importlib.import_module(ENGINE_MODULES[config.engine]).start)
    with StartDeadline(config.engine_start_timeout_s):
        return await start(engine_spec(config))


def weight_groups(engine: Engine, config: ServiceConfig) -> WeightGroups | None:
    """The ``nccl`` transport's groups, or None for the other transports."""
    if config.weights_transport != "nccl":
        return None
    if not isinstance(engine, BroadcastEngine):
        raise ValueError(f"weights_transport: 'nccl' needs an engine whose workers join a "
                         f"group, and {type(engine).__name__} has none")
    return WeightGroups(engine, StoredCopies(config.weights_store_dir),
                        timeout_s=config.weights_group_timeout_s,
                        lease_s=config.weights_group_lease_s,
                        bucket_bytes=config.weights_bucket_bytes,
                        num_buckets=config.weights_num_buckets)


def build_local_service(engine: Engine, config: ServiceConfig
                        ) -> tuple[RolloutService, CollectorRegistry]:
    """The service around one engine, with its own metrics registry; the speculation
    control too when configured (``await service.start()`` before serving)."""
    info = engine.info
    registry = CollectorRegistry()
    drafter = DrafterHealth(registry=registry, model=info.model, engine=info.engine,
                            num_speculative_tokens=info.num_speculative_tokens,
                            versions_kept=config.telemetry.versions_kept)
    metrics = SpecDecodeMetrics(registry=registry, model=info.model, engine=info.engine,
                                num_speculative_tokens=info.num_speculative_tokens,
                                verify_cost_ratio=info.verify_cost_ratio,
                                categories=CategoryLabels(config.telemetry),
                                drafter=drafter)
    pauses = PauseGate(engine)
    weights = WeightPushManager(
        engine, checkpoint_tensors(info.model_path),
        WeightMetrics(registry=registry, model=info.model, engine=info.engine,
                      drafter=drafter, has_pushable_drafter=info.has_pushable_drafter),
        timeout_s=config.push_timeout_s, has_draft=info.has_pushable_drafter,
        transport=config.weights_transport, groups=weight_groups(engine, config),
        pauses=pauses)
    settings = config.speculation_control
    speculation_metrics = SpeculationMetrics(
        registry=registry, model=info.model, engine=info.engine,
        buckets=settings.batch_size_buckets, reasons=REASONS)
    control = None
    if settings.enabled:
        control = SpeculationControl(cast(SpecScheduleEngine, engine), settings,
                                     lambda: served_versions(weights), speculation_metrics)
    else:
        show_fixed_k(speculation_metrics, settings.batch_size_buckets,
                     info.num_speculative_tokens)
    return RolloutService(engine, metrics, weights, speculation=control,
                          pauses=pauses), registry
