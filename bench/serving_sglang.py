"""The SGLang side of the serving benchmark (``python -m bench.serving --engine sglang``):
the service on an SGLang server it launches, against SGLang's own server started with the
same arguments.

Runs in the benchmark's process on the GPU machine (the sglang bundle on the path). The
modes: ``service`` (the native ``/generate``) and ``service-sglang`` (SGLang's ``/generate``
dialect) reach one service, whose SGLang server is its child; ``sglang-server`` is
``sglang.launch_server`` started here with the command the service builds for the same
config (``engines/sglang/launch.py``), sent the very body ``service-sglang`` sends. Both
SGLang servers run at once, each on a share of the GPU memory that is free when it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import psutil

from bench.serving_http import SERVER_KEEP_ALIVE_S, HttpMode, Workload
from rollout_service.config import ServiceConfig, load_config
from rollout_service.engines.sglang.launch import (
    LAUNCH_MODULE,
    build_launch_command,
    free_port_below_ephemeral,
)
from rollout_service.local import engine_spec
from rollout_service.tools.launch import ChildProcess, wait_http_ok

SGLANG_MODES = ("service", "service-sglang", "sglang-server")
STARTUP_TIMEOUT_S = 900.0


def server_args(opts: argparse.Namespace, max_concurrency: int) -> dict[str, Any]:
    """The SGLang server arguments of both servers.

    SGLang's own defaults, except: the memory share (two servers on one GPU), room for the
    largest concurrency (SGLang caps running requests at 48 under speculative decoding
    unless told otherwise), sampling in PyTorch (FlashInfer's sampling kernels would
    JIT-compile with the image's nvcc on the first request), FA3 attention, CUDA graphs
    unless ``--eager``; then ``--sglang-kwargs``, which win (``{"tokenizer_worker_num": 2}``:
    SGLang's HTTP front end in two processes, in both servers).
    """
    return {"mem_fraction_static": opts.gpu_memory_utilization,
            "max_running_requests": max_concurrency, "sampling_backend": "pytorch",
            "attention_backend": "fa3", "disable_cuda_graph": opts.eager,
            **opts.sglang_kwargs}


def sglang_config(opts: argparse.Namespace, max_concurrency: int) -> ServiceConfig:
    return load_config(model=opts.model, engine="sglang",
                       mtp={"num_speculative_tokens": opts.num_speculative_tokens},
                       engine_kwargs=server_args(opts, max_concurrency))


def launch_command(cfg: ServiceConfig, port: int) -> list[str]:
    """``sglang.launch_server`` on ``cfg``'s engine arguments, as a user runs SGLang's own
    server: without what the service adds to the server it launches
    (``SERVICE_SERVER_ARGS``: no access log, as the service writes its own)."""
    spec = engine_spec(cfg)
    return build_launch_command(spec.model_path, spec.engine_kwargs, spec.mtp,
                                host="127.0.0.1", port=port)


async def start_sglang_server(cfg: ServiceConfig, workload: Workload, scratch: Path,
                              max_concurrency: int) -> HttpMode:
    """SGLang's own server on a free port, healthy; its requests are ``service-sglang``'s."""
    port = free_port_below_ephemeral()
    url = f"http://127.0.0.1:{port}"
    # idle connections kept as long as by the service (SGLang's default is 5 s, less than
    # the other modes' rounds: a request on a connection it was closing reset an H100 run)
    env = {**os.environ, "SGLANG_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEP_ALIVE_S)}
    server = ChildProcess(launch_command(cfg, port), scratch / "sglang-server.log", env=env)
    try:
        await asyncio.to_thread(wait_http_ok, f"{url}/health", server, STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise

    def body(i: int) -> dict[str, Any]:
        return {"text": workload.prompts[i], "sampling_params": {
            "max_new_tokens": workload.tokens_of(i), "temperature": workload.temperature,
            "sampling_seed": i, "ignore_eos": True}}

    return HttpMode(server, url, "/generate", body, lambda answer: len(answer["output_ids"]),
                    max_concurrency)


def launched_server_pid(service_pid: int) -> int | None:
    """The SGLang server a service process launched (its child running
    ``sglang.launch_server``: the HTTP server and tokenizer manager every request of the
    service crosses), or None (a vLLM service, or one given an ``engine_url``)."""
    for child in psutil.Process(service_pid).children():
        try:
            if LAUNCH_MODULE in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None
