"""The Ray Serve app (``rollout_service/serve/``) with N engine replicas sharing the standalone
service's share of the machine: its config and its start, for ``bench/serving.py``'s
``ray-serve`` mode and ``bench/push_under_load.py --ray-replicas N``.

Runs in the benchmark's process; ``rollout-service serve-ray`` runs as a child process, as a
user starts it, on a local Ray of its own (``--address local``: never a cluster that happens
to run on the host). Each replica gets 1/N of what the standalone service gets: on a GPU
``num_gpus`` 1/N (Ray places all N on the one GPU) and ``gpu_memory_utilization`` / N; on the
CPU ``num_cpus`` and OpenMP threads of cores / N, unbound (as ``deploy/serve.yaml`` does). The
replicas start their engines one at a time (``engine_start_lock``, ``serve/start_lock.py``:
vLLM engines starting together on one GPU mis-size each other's KV cache). The ingress takes
the requests the standalone service takes, at the same paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import psutil

from bench.serving_http import HttpMode, Workload, service_request
from rollout_service.config import ServiceConfig
from rollout_service.serve.config import RayServeConfig, parse_serve_config
from rollout_service.tools.launch import ServiceProcess

RAY_MODE = "ray-serve"
STARTUP_TIMEOUT_S = 900.0
FRONT_END_TITLES = re.compile(
    r"ray::(ProxyActor|ServeReplica:[^:]+:(RolloutIngress|RolloutEngine))")
"""Process titles (Ray sets them) of what does the standalone service process's work under
Ray Serve: Serve's HTTP proxy, the ingress and the engine replicas (vLLM's output handler);
not the weights coordinator."""


def replica_actor_options(device: str, num_replicas: int) -> dict[str, Any]:
    """Each engine replica's share: 1/N of the GPU, or of this host's cores."""
    if device == "cuda":
        return {"num_gpus": 1.0 / num_replicas}
    cores = max(1, (os.cpu_count() or 1) // num_replicas)
    return {"num_cpus": cores, "runtime_env": {"env_vars": {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cores)}}}


def ray_serve_config(service: dict[str, Any], *, num_replicas: int, device: str,
                     max_ongoing_requests: int, scratch: Path) -> dict[str, Any]:
    """The app's config (validated, as a mapping for its file) from a standalone service's:
    the same model, engine and weights settings, each replica on 1/N of the share.

    Raises:
        ValueError: a field the app refuses (e.g. ``weights_transport: cuda_ipc``).
    """
    engine_kwargs = dict(service.get("engine_kwargs") or {})
    if device == "cuda":
        share = engine_kwargs.get("gpu_memory_utilization")
        if share is None:
            raise ValueError("engine_kwargs.gpu_memory_utilization: the standalone share to "
                             "split between the replicas is not set")
        engine_kwargs["gpu_memory_utilization"] = share / num_replicas
    data = {**service, "engine_kwargs": engine_kwargs, "num_replicas": num_replicas,
            "ray_actor_options": replica_actor_options(device, num_replicas),
            "engine_start_lock": str(scratch / "engine-start.lock"),
            "max_ongoing_requests": max_ongoing_requests, "metrics_host": "127.0.0.1"}
    parse_serve_config(data)
    return data


def start_serve_ray(config: dict[str, Any], scratch: Path, *, device: str) -> ServiceProcess:
    """``rollout-service serve-ray`` with ``config`` (from :func:`ray_serve_config`), every
    replica serving; the caller stops it (``ServiceProcess.stop``).

    Raises:
        RuntimeError, TimeoutError: it exited, or did not serve within STARTUP_TIMEOUT_S.
    """
    path = scratch / "ray-serve.json"
    path.write_text(json.dumps(config))
    cpus = () if device == "cuda" else ("--num-cpus", str(os.cpu_count() or 1))
    with contextlib.ExitStack() as on_failure:
        service = on_failure.enter_context(ServiceProcess(
            scratch / "ray-serve.log", config=path, command="serve-ray",
            extra_args=("--address", "local", *cpus)))
        service.wait_healthy(timeout_s=STARTUP_TIMEOUT_S)
        on_failure.pop_all()  # serving: stopped by the caller from now on
    return service


def front_end_pids(leader_pid: int) -> tuple[int, ...]:
    """The proxy, ingress and engine replica actors under ``serve-ray`` (its descendants)."""
    pids = []
    for child in psutil.Process(leader_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(child.cmdline())
            if FRONT_END_TITLES.match(title):
                pids.append(child.pid)
    return tuple(pids)


async def start_ray_serve(cfg: ServiceConfig, workload: Workload, scratch: Path,
                          max_concurrency: int, *, num_replicas: int, device: str
                          ) -> tuple[HttpMode, tuple[int, ...], RayServeConfig]:
    """The app on ``cfg``'s engine, healthy; its client (the ``service`` mode's requests to
    the ingress), its front-end processes and its config."""
    service = cfg.model_dump(mode="json", exclude={"api_key", "weights_token"})
    config = ray_serve_config(service, num_replicas=num_replicas, device=device,
                              max_ongoing_requests=max_concurrency, scratch=scratch)
    process = await asyncio.to_thread(start_serve_ray, config, scratch, device=device)
    pids = front_end_pids(process.child.pid)
    body, count = service_request("service", workload, cfg.model_name)
    http = HttpMode(process.child, process.url, "/generate", body, count, max_concurrency)
    return http, pids, parse_serve_config(config)
