"""The HTTP modes of the serving benchmarks: a server in a child process and its client.

Runs in the benchmark's process (``bench/serving.py``, ``bench/speculation.py``). A mode is
a server (the service, or vLLM's own OpenAI server with the same engine arguments) and
the path and body its requests take; the service's dialect modes (``service-openai``:
``/v1/completions``, ``service-sglang``: SGLang's ``/generate``) reach the same service
process as ``service`` does, so the dialects are compared on one engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages
from rollout_service.tools.launch import ChildProcess, free_port, wait_http_ok

STARTUP_TIMEOUT_S = 900.0
HTTP_TIMEOUT_S = 1800.0
SERVER_KEEP_ALIVE_S: int = ServiceConfig.model_fields["http_keep_alive_s"].default
"""Idle seconds both HTTP servers keep a connection (the service's default
``http_keep_alive_s``; vLLM's server is told through ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``)."""
SERVICE_PATHS = {"service": "/generate", "service-no-preload": "/generate",
                 "service-openai": "/v1/completions", "service-sglang": "/generate"}
"""The path each of the service's modes posts to."""


async def closed_loop(one: Callable[[int], Awaitable[int]], concurrency: int,
                      num_requests: int) -> int:
    """Requests ``0 .. num_requests - 1`` through ``one(i) -> tokens``, ``concurrency`` in
    flight until fewer are left: each of ``concurrency`` workers takes the next index as
    soon as its request finishes. Returns the tokens of all of them."""
    indices = iter(range(num_requests))  # shared: a worker's next() is never interleaved

    async def worker() -> int:
        return sum([await one(i) for i in indices])

    return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What every mode runs."""

    prompts: tuple[str, ...]
    """One prompt per request of a round; a round of n requests sends the first n."""
    max_tokens: int
    """The tokens every request generates (``ignore_eos``), or their mean with ``lengths``."""
    temperature: float
    lengths: tuple[int, ...] = ()
    """Request i's own token count (``--length-spread``), the same in every mode; empty:
    ``max_tokens`` each."""

    def tokens_of(self, i: int) -> int:
        """The tokens request ``i`` generates."""
        return self.lengths[i] if self.lengths else self.max_tokens


def spread_lengths(num_requests: int, mean: int, spread: float) -> tuple[int, ...]:
    """Token counts uniform in ``mean * (1 +- spread)``, drawn once per request index
    (seeded: every mode and round gets the same ones). With one length for all, a closed
    loop's requests finish in the same engine step, wave after wave, and their
    replacements reach the engine as one burst; spread lengths desynchronize them, as
    sampled rollouts do.

    Raises:
        ValueError: ``spread`` outside [0, 1).
    """
    if not 0 <= spread < 1:
        raise ValueError(f"length spread {spread}: must be in [0, 1)")
    if spread == 0:
        return ()
    rng = random.Random(0)
    return tuple(max(1, round(mean * (1 + spread * rng.uniform(-1, 1))))
                 for _ in range(num_requests))


def engine_args(cfg: ServiceConfig) -> Any:
    """The ``AsyncEngineArgs`` the service builds for this config."""
    from rollout_service.engines.vllm.engine_args import build_engine_args
    from rollout_service.local import engine_spec

    spec = engine_spec(cfg)
    return build_engine_args(spec.model_path, spec.engine_kwargs, spec.mtp,
                             spec.checkpoint_config, served_model_name=spec.served_model_name)


def non_default_engine_args(args: Any) -> dict[str, Any]:
    """The fields of ``args`` that differ from ``AsyncEngineArgs()`` (what the flags carry)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    default = AsyncEngineArgs(model=args.model)  # the default model would need the hub
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if getattr(args, f.name) != getattr(default, f.name)}


def cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine kwargs as vLLM server flags: bools as ``--x`` / ``--no-x``, configs as JSON."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if dataclasses.is_dataclass(value):  # e.g. WeightTransferConfig, built from a dict
            value = dataclasses.asdict(value)  # type: ignore[arg-type]
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


class HttpMode:
    """A server in a child process and the client that drives it.

    The client is aiohttp, as in vLLM's own serving benchmark
    (vllm-project/vllm, ``vllm/benchmarks/lib/endpoint_request_func.py``): with httpx
    an H200 run at 512 requests in flight spent its time in httpcore's connection-pool
    bookkeeping (``_assign_requests_to_connections``, once per request over every
    connection), the client and not a server bounding the rate.
    """

    def __init__(self, server: ChildProcess, url: str, path: str,
                 body: Callable[[int], dict[str, Any]], count: Callable[[dict[str, Any]], int],
                 max_concurrency: int, *, owns_server: bool = True) -> None:
        self.server, self.url, self._path, self._body, self._count = (server, url, path, body,
                                                                       count)
        self._owns_server = owns_server
        # One kept-alive connection per request in flight: no connection is opened
        # during a timed round once the warm-up has opened them. They idle while the
        # other modes run; both servers keep them for SERVER_KEEP_ALIVE_S and this
        # client for less, so it never reuses one a server has just closed (a read
        # error ended an H200 run when both sides used 5 s).
        connector = aiohttp.TCPConnector(limit=max_concurrency,
                                         keepalive_timeout=SERVER_KEEP_ALIVE_S - 30)
        self._http = aiohttp.ClientSession(
            base_url=url, connector=connector,
            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))

    async def _one(self, i: int) -> int:
        return await self.send(self._body(i))

    async def send(self, body: dict[str, Any]) -> int:
        """One request with this ``body``; the tokens it generated."""
        return self.count(await self.answer(body))

    def count(self, answer: dict[str, Any]) -> int:
        """The tokens one of this mode's answers generated (each dialect's own shape)."""
        return self._count(answer)

    async def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request with this ``body``; the server's whole answer."""
        async with self._http.post(self._path, json=body) as response:
            if response.status >= 400:
                raise RuntimeError(f"{self._path}: HTTP {response.status}: "
                                   f"{await response.text()}")
            return await response.json()

    async def run_round(self, concurrency: int, num_requests: int) -> int:
        return await closed_loop(self._one, concurrency, num_requests)

    async def close(self) -> None:
        await self._http.close()
        if self._owns_server:
            self.server.stop()


async def start_http(mode: str, cfg: ServiceConfig, workload: Workload, scratch: Path,
                     max_concurrency: int) -> HttpMode:
    """Start the service or vLLM's server on a free port; wait until it is healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    address = ["--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEP_ALIVE_S)}
    if mode == "service-no-preload":
        env["ROLLOUT_CPU_PRELOAD"] = "0"
        env.pop("LD_PRELOAD", None)  # this process's own preload, inherited otherwise
    if mode.startswith("service"):
        config_path = scratch / "service.json"
        config_path.write_text(cfg.model_dump_json(exclude={"api_key"}))
        cmd = [sys.executable, "-m", "rollout_service.cli", "serve", "--config",
               str(config_path), *address]

        body, count = service_request(mode, workload, cfg.model_name)
        path = SERVICE_PATHS[mode]
    else:
        args = engine_args(cfg)
        model = args.model
        kwargs = {"model": model, **non_default_engine_args(args)}
        kwargs.setdefault("tokenizer", model)  # offline machines: no hub look-up
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               *cli_flags(kwargs), *address]

        def body(i: int) -> dict[str, Any]:
            return {"model": kwargs.get("served_model_name", model),
                    "prompt": workload.prompts[i], "max_tokens": workload.tokens_of(i),
                    "temperature": workload.temperature, "seed": i, "ignore_eos": True}

        def count(response: dict[str, Any]) -> int:
            return response["usage"]["completion_tokens"]

        path = "/v1/completions"
    server = ChildProcess(cmd, scratch / f"{mode}.log", env=env)
    try:
        await asyncio.to_thread(wait_http_ok, f"{url}/health", server, STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return HttpMode(server, url, path, body, count, max_concurrency)




def service_request(mode: str, workload: Workload, model: str
                    ) -> tuple[Callable[[int], dict[str, Any]], Callable[[dict[str, Any]], int]]:
    """The body of request ``i`` and the tokens counted in its answer, in ``mode``'s dialect:
    the same sampling in each (``ignore_eos``, ``max_tokens``, seed ``i``)."""
    if mode == "service-openai":
        def openai_body(i: int) -> dict[str, Any]:
            return {"model": model, "prompt": workload.prompts[i],
                    "max_tokens": workload.tokens_of(i), "temperature": workload.temperature,
                    "seed": i, "ignore_eos": True}

        return openai_body, lambda answer: answer["usage"]["completion_tokens"]
    if mode == "service-sglang":
        def sglang_body(i: int) -> dict[str, Any]:
            return {"text": workload.prompts[i], "sampling_params": {
                "max_new_tokens": workload.tokens_of(i), "temperature": workload.temperature,
                "sampling_seed": i, "ignore_eos": True}}

        return sglang_body, lambda answer: len(answer["output_ids"])

    def native_body(i: int) -> dict[str, Any]:
        return messages.GenerateRequest(
            prompt=workload.prompts[i], max_tokens=workload.tokens_of(i),
            temperature=workload.temperature, seed=i, ignore_eos=True,
        ).model_dump(exclude_none=True)

    return native_body, lambda answer: len(answer["outputs"][0]["token_ids"])


def on_same_server(other: HttpMode, mode: str, cfg: ServiceConfig, workload: Workload,
                   max_concurrency: int) -> HttpMode:
    """``mode`` (one of the service's dialects) on ``other``'s service process."""
    body, count = service_request(mode, workload, cfg.model_name)
    return HttpMode(other.server, other.url, SERVICE_PATHS[mode], body, count,
                    max_concurrency, owns_server=False)
