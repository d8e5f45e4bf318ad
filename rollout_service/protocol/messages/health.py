"""``/health``'s messages: the service's, its engine's speculation and, under Ray Serve,
each replica's report to the weights coordinator.

Part of :mod:`rollout_service.protocol.messages`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from rollout_service.protocol.messages.pushes import WeightStatus
from rollout_service.protocol.speculation import SpeculationControlStatus

ReplicaStatus = Literal["starting", "ok", "lagging", "unavailable", "gone"]


class SpeculationInfo(BaseModel):
    """The engine's speculative decoding, as ``/health`` reports it."""

    is_enabled: bool = Field(description=(
        "False: no drafter; sequences carry no acceptance stats and only target 'main' "
        "pushes are accepted."))
    method: str | None = Field(description=(
        "vLLM's speculative method ('mtp', 'ngram', 'suffix', 'eagle', ...) or SGLang's "
        "algorithm; None when off."))
    num_speculative_tokens: int = Field(description="Draft tokens per step; 0 when off.")
    has_pushable_drafter: bool = Field(description=(
        "Whether pushes with target 'draft' or 'both' are accepted: only an MTP drafter read "
        "from the served checkpoint can load a push (docs/weight-pushes.md)."))
    verify_cost_ratio: float | None = Field(None, description=(
        "A verify step's time over a plain decode step's, measured when the engine started "
        "(docs/telemetry.md); None when off or not measured."))


class ReplicaHealth(BaseModel):
    """One Ray Serve replica as it reports itself to the weights coordinator on every
    poll, and as ``/health`` lists it."""

    replica: str
    status: ReplicaStatus = Field(description=(
        "'starting' (engine loading), 'ok', 'lagging' (serves an older weight version than "
        "the deployment: refuses generation until the next push), 'unavailable' (engine dead; "
        "Ray Serve replaces it), 'gone' (stopped polling the coordinator)."))
    main_version: int | None = None
    draft_version: int | None = None
    detail: str | None = None
    pid: int | None = None
    metrics_address: str | None = Field(None, description="host:port of its /metrics.")
    group_ranks: int | None = Field(None, description=(
        "nccl: the ranks its engine's workers take in a weight group; None otherwise."))
    group_backend: Literal["nccl", "gloo"] | None = Field(None, description=(
        "nccl: its workers' collective backend."))
    store_address: str | None = Field(None, description=(
        "nccl: host:port where it serves its stored copy of the last push to replicas that "
        "(re)start (weights token required)."))
    speculation: SpeculationInfo | None = Field(None, description=(
        "Its engine's speculative decoding; None while the engine starts."))
    speculation_control: SpeculationControlStatus | None = Field(None, description=(
        "Its own speculation controller (each replica decides K from its own batches and "
        "acceptance); None when the control is off or the engine starts."))


class HealthResponse(BaseModel):
    """Service and engine state."""

    status: Literal["ok", "degraded", "unavailable"] = Field(description=(
        "'degraded' (Ray Serve only): some replicas serve, others do not (see replicas)."))
    model: str
    engine: str
    weights: WeightStatus
    speculation: SpeculationInfo | None = Field(None, description=(
        "The engine's speculative decoding (Ray Serve: the first serving replica's; "
        "every replica's is in replicas)."))
    speculation_control: SpeculationControlStatus | None = Field(None, description=(
        "The speculation controller's K per batch-size bucket and why; null when it is off "
        "(speculation_control.enabled). Ray Serve: the first serving replica's; every "
        "replica's is in replicas."))
    detail: str | None = None
    replicas: list[ReplicaHealth] | None = Field(None, description="Ray Serve only.")
