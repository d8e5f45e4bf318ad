"""The Ray Serve application's configuration: one pydantic model, no Ray import.

Read by ``rollout-service serve-ray`` and by the Serve app builder
(``rollout_service.serve.app:app_builder``, the import path in ``deploy/serve.yaml``)
before anything is deployed, so a bad field fails at startup with its name. It
is the standalone :class:`~rollout_service.config.ServiceConfig` (model, engine
kwargs, MTP, auth, push timeout, the weight transport and its group settings) plus what
Ray Serve needs: replicas, autoscaling, resources, health checks and the weight
fan-out's timeouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rollout_service.config import ServiceConfig, read_config_file


class RayServeConfig(ServiceConfig):
    """Everything the Ray Serve app needs; each engine replica runs one engine."""

    app_name: str = Field("rollout", min_length=1, description=(
        "Ray Serve application name (deployments are named inside it)."))
    mode: Literal["rl", "serving"] = Field("rl", description=(
        "'rl' pins the replica count to num_replicas: every weight push must reach a known "
        "set of replicas, so autoscaling is refused. 'serving' allows autoscaling_config."))
    num_replicas: int = Field(1, ge=1, description=(
        "Engine replicas (one engine each) when autoscaling is off."))
    autoscaling_config: dict[str, Any] | None = Field(None, description=(
        "Ray Serve autoscaling_config for the engine deployment (min_replicas, max_replicas, "
        "target_ongoing_requests, ...), passed as is; only in mode 'serving'."))
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 1}, description=(
            "Ray actor options of each engine replica, passed as is: num_cpus, num_gpus, "
            "resources, runtime_env (e.g. env_vars VLLM_CPU_OMP_THREADS_BIND=nobind and "
            "OMP_NUM_THREADS so CPU engines sharing a host do not bind the same cores)."))
    engine_start_lock: Path | None = Field(None, description=(
        "A file on the replicas' host: replicas naming the same one start their engines one "
        "at a time. Set it when replicas share a GPU (fractional num_gpus): vLLM sizes its "
        "KV cache from the device's free memory during its start and counts what another "
        "engine starting beside it allocates as its own (serve/start_lock.py)."))
    max_ongoing_requests: int = Field(256, ge=1, description=(
        "Requests Ray Serve sends one engine replica at once (the engine batches them)."))
    health_check_period_s: float = Field(10.0, gt=0, description=(
        "Ray Serve calls each replica's check_health this often; a replica whose engine "
        "died fails it and is replaced after 3 failures in a row."))
    health_check_timeout_s: float = Field(30.0, gt=0, description=(
        "A health check slower than this counts as failed."))
    num_ingress_replicas: int = Field(1, ge=1, description=(
        "Replicas of the HTTP ingress (stateless: pushes are held by the coordinator)."))
    retry_timeout_s: float = Field(60.0, gt=0, description=(
        "The ingress retries a request on another replica while the one it reached has a "
        "dead engine or lags behind the deployment's weights, for at most this long."))
    push_ack_timeout_s: float = Field(300.0, gt=0, description=(
        "How long the coordinator waits for every replica to load a push; a replica that "
        "has not answered by then fails the push, named in the error."))
    metrics_host: str = Field("0.0.0.0", description=(
        "Each engine replica serves its own /metrics on this address (a free port); "
        "Prometheus finds them at the ingress's GET /metrics/targets (http_sd_configs)."))

    @model_validator(mode="after")
    def _replicated_transports(self) -> RayServeConfig:
        # cuda_ipc needs the trainer on each engine's GPU; replicas spread over GPUs and hosts.
        if self.weights_transport not in ("shm", "nccl"):
            raise ValueError(f"weights_transport: {self.weights_transport!r} is not supported "
                             "under Ray Serve (accepted: 'shm' with the trainer on the "
                             "replicas' host, 'nccl' for replicas on any hosts); the "
                             "replicas' engines sit on GPUs of their own")
        return self

    @model_validator(mode="after")
    def _rl_pins_replicas(self) -> RayServeConfig:
        if self.mode == "rl" and self.autoscaling_config is not None:
            raise ValueError("autoscaling_config: mode 'rl' pins the replica count to "
                             "num_replicas (a weight push must reach a known set of replicas); "
                             "set mode: serving to autoscale")
        return self


def load_serve_config(path: str | Path | None = None, **overrides: Any) -> RayServeConfig:
    """Load a Ray Serve config file (YAML or JSON) and apply non-None overrides.

    Raises:
        ValueError: unreadable file or invalid fields (pydantic names each field).
    """
    data = read_config_file(path) if path is not None else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_serve_config(data)


def parse_serve_config(data: dict[str, Any]) -> RayServeConfig:
    """Validate a mapping (e.g. Serve's application ``args``).

    Raises:
        ValueError: naming each invalid field.
    """
    try:
        return RayServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid Ray Serve config: {exc}") from exc
