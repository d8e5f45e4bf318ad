"""Serving throughput: this service vs vLLM's ``AsyncLLM`` and vLLM's own OpenAI server, or
(``--engine sglang``) vs SGLang's own server.

Runs in the caller's terminal process. One engine config (the service's own
``build_engine_args``) and one workload go through up to three modes, all
running at once and measured round by round in rotating order, so drift in the
machine (clocks, other load) hits every mode alike:

- ``asyncllm``: ``AsyncLLM`` in this process (it spawns its engine-core process);
  requests sent with ``asyncio.gather``: the engine's own ceiling.
- ``service``: ``rollout-service serve`` as a child process, reached with aiohttp
  posts to ``/generate``.
- ``vllm-server``: ``python -m vllm.entrypoints.openai.api_server`` as a child
  process with the same engine args as CLI flags, reached with ``/v1/completions``.
- ``service-no-preload`` (CPU, on request): the service without the tcmalloc and
  Intel OpenMP preload it gives vLLM's CPU engine (``engines/vllm/cpu_preload.py``;
  the other modes get the same preload), against ``service``.
- ``--engine sglang`` (GPU): ``service`` and ``service-sglang`` on a service that launches
  SGLang, against ``sglang-server``, SGLang's own server on the same arguments
  (``bench/serving_sglang.py``).
- ``ray-serve``: ``rollout-service serve-ray``, the Ray Serve app with ``--ray-replicas``
  engine replicas (default 2) on the ``service`` mode's share: on a GPU each with
  ``num_gpus`` 1/N and ``--gpu-memory-utilization`` / N, on the CPU ``num_cpus`` cores / N;
  the ``service`` mode's requests to its ingress (``bench/serving_ray.py``).

Workload: ``--concurrency`` requests in flight at once (each level measured on
its own), prompts from the embedded corpus, n=1, ``ignore_eos`` so every request
yields exactly ``--max-tokens`` tokens (``--length-spread S``: request i its own count,
uniform in ``max-tokens * (1 +- S)``, the same in every mode), temperature 1.0 with
seed i for request i.
A round sends ``--waves`` x concurrency requests in a closed loop: each request
that finishes is replaced at once by the next, so the engine runs at the level's
batch size from the first request to the last few (vLLM's own benchmark does the
same with ``--max-concurrency``). With one wave a round is one batch's ramp and
tail: 128 x 256 tokens took 1.3-2.4 s on an H200 and the rounds of one mode spread
2x. Each mode runs one untimed warm-up round per level, then ``--rounds`` timed
rounds. A round's rate is the tokens generated (counted from the responses) over
its wall time. The table shows each mode's median and range, and each ratio's
median over the rounds with its range (a round's ratio pairs the two modes'
rates of that round).

On a GPU (``--device cuda``, the default when CUDA is present) every engine gets
``--gpu-memory-utilization`` and bf16; on the CPU the embedded defaults.
``--profile-service DIR`` samples the service process with py-spy during the
timed rounds (collapsed stacks, read with ``bench/profile_summary.py``).

    python -m bench.serving --model embedded:tiny --concurrency 16 --max-tokens 32 --rounds 2
    python -m bench.serving --model embedded:small --concurrency 128,512 --max-tokens 256
    python -m bench.serving --engine sglang --model embedded:small --concurrency 128,512 \
        --max-tokens 256
    python -m bench.serving --model embedded:small --modes service,ray-serve \
        --concurrency 128,512 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.engine_options import add_device_arguments, json_object, resolve_device
from bench.profiling import start_profiler, stop_profiler
from bench.serving_http import (  # noqa: F401 - re-exported for bench.speculation, tests
    HttpMode,
    Workload,
    closed_loop,
    engine_args,
    non_default_engine_args,
    on_same_server,
    spread_lengths,
    start_http,
)
from bench.serving_measure import FrontEnd, Rates, RoundFn, measure
from bench.serving_ray import RAY_MODE, start_ray_serve
from bench.serving_sglang import (
    SGLANG_MODES,
    launched_server_pid,
    sglang_config,
    start_sglang_server,
)
from bench.spread import min_max
from rollout_service.config import ServiceConfig, load_config
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.engines.vllm.cpu_preload import preload_for_cpu_engine

MODES = ("asyncllm", "service", "service-openai", "service-sglang", "service-no-preload",
         "vllm-server", "sglang-server", RAY_MODE)
DEFAULT_MODES = ("asyncllm", "service", "vllm-server")
RATIOS = (("service", "asyncllm", 0.90), ("service", "vllm-server", 1.0),
          ("service", "sglang-server", 1.0), ("service-sglang", "sglang-server", 1.0),
          ("service-openai", "vllm-server", 1.0), ("service-sglang", "vllm-server", 1.0),
          ("service-openai", "service", 0.97), ("service-sglang", "service", 0.97),
          ("service", "service-no-preload", None), (RAY_MODE, "service", 0.95))
"""(numerator, denominator, target) of each printed ratio."""
DIALECT_MODES = ("service", "service-openai", "service-sglang")
"""The service's modes that share one service process (the same engine, three dialects)."""


async def start_asyncllm(cfg: ServiceConfig, workload: Workload) -> tuple[RoundFn, Callable]:
    """``AsyncLLM`` in this process; returns its round function and its shutdown."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    preload_for_cpu_engine()  # as the service does (vllm-server inherits it too)
    from rollout_service.engines.vllm.usage_context import serving_usage_context

    # The service's batch-size defaults, so the three modes run one engine config.
    engine = AsyncLLM.from_engine_args(engine_args(cfg), usage_context=serving_usage_context())
    calls = 0

    async def one(i: int, request_id: str) -> int:
        params = SamplingParams(n=1, max_tokens=workload.tokens_of(i),
                                temperature=workload.temperature, seed=i, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in engine.generate(workload.prompts[i], params, request_id):
            final = output
        assert final is not None and final.finished
        return len(final.outputs[0].token_ids)

    async def run_round(concurrency: int, num_requests: int) -> int:
        nonlocal calls
        calls += 1
        return await closed_loop(lambda i: one(i, f"bench-{calls}-{i}"), concurrency,
                                 num_requests)

    return run_round, engine.shutdown


def print_report(console: Console, results: dict[int, Rates], workload: Workload,
                 num_rounds: int, waves: int, length_spread: float) -> None:
    tokens = (f"{workload.max_tokens} +- {length_spread:.0%}" if length_spread
              else str(workload.max_tokens))
    console.print(f"workload: {tokens} tokens per request, n=1, ignore_eos, "
                  f"temperature {workload.temperature}; rounds of {waves} x concurrency "
                  f"requests in a closed loop; 1 warm-up + {num_rounds} timed rounds per "
                  "mode, modes interleaved")
    table = Table("concurrency", "mode", "median tok/s", "range tok/s",
                  "front-end CPU (cores)", "front end ms/req",
                  "engine's front end ms/req", "client CPU (cores)")
    ratios = Table("concurrency", "ratio", "median", "range", "target", "met")
    for concurrency, rates in results.items():
        for mode, values in rates.by_mode.items():
            table.add_row(str(concurrency), mode, f"{statistics.median(values):.0f}",
                          min_max(values),
                          f"{statistics.median(rates.front_end_cores(mode)):.2f}",
                          f"{statistics.median(rates.front_end_ms(mode)):.3f}",
                          "-" if (engine := rates.engine_front_end_ms(mode)) is None
                          else f"{statistics.median(engine):.3f}",
                          f"{statistics.median(rates.client_cores(mode)):.2f}")
        for num, den, target in RATIOS:
            if num in rates.by_mode and den in rates.by_mode:
                per_round = [a / b for a, b in zip(rates.by_mode[num], rates.by_mode[den])]
                median = statistics.median(per_round)
                met = "-" if target is None else ("yes" if median >= target else "NO")
                ratios.add_row(str(concurrency), f"{num} / {den}", f"{median:.3f}",
                               min_max(per_round), "-" if target is None else f">= {target}",
                               met)
    console.print(table)
    console.print(ratios)


def build_config(opts: argparse.Namespace, max_concurrency: int) -> ServiceConfig:
    if opts.engine == "sglang":
        return sglang_config(opts, max_concurrency)
    overrides: dict[str, Any] = {"mtp": {"num_speculative_tokens": opts.num_speculative_tokens}}
    if opts.device == "cuda":
        # vLLM's own GPU defaults (torch.compile, CUDA graphs, KV cache from the memory
        # fraction), not the embedded model's CPU ones (eager, a fixed 512 MiB cache).
        overrides["engine_kwargs"] = {"dtype": "bfloat16", "enforce_eager": opts.eager,
                                      "kv_cache_memory_bytes": None,
                                      "gpu_memory_utilization": opts.gpu_memory_utilization}
    return load_config(model=opts.model, **overrides)


async def run(opts: argparse.Namespace, console: Console) -> dict[int, Rates]:
    modes = opts.modes.split(",")
    levels = [int(c) for c in opts.concurrency.split(",")]
    cfg = build_config(opts, max(levels))
    prompts = tuple(p for p, _ in arithmetic_prompts(max(levels) * opts.waves))
    workload = Workload(prompts=prompts, max_tokens=opts.max_tokens,
                        temperature=opts.temperature,
                        lengths=spread_lengths(len(prompts), opts.max_tokens, opts.length_spread))
    scratch = Path(opts.logs or tempfile.mkdtemp(prefix="bench-serving-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if opts.engine == "sglang":
        console.print(f"logs: {scratch}\nSGLang server arguments: {cfg.engine_kwargs}, "
                      f"mtp {cfg.mtp}")
    else:
        preload_for_cpu_engine()  # the vllm-server child inherits it, like the service's
        console.print(f"logs: {scratch}\nengine args (non-default): "
                      f"{non_default_engine_args(engine_args(cfg))}")
    rounds: dict[str, RoundFn] = {}
    servers: dict[str, HttpMode] = {}
    front_ends: dict[str, FrontEnd] = {}
    closers: list[Callable[[], Awaitable[None]]] = []
    profiler: Popen[bytes] | None = None
    try:
        for mode in modes:  # all up at once; the servers start first (own processes)
            console.print(f"starting {mode} ...")
            if mode == "asyncllm":
                run_round, shutdown = await start_asyncllm(cfg, workload)
                front_ends[mode] = FrontEnd((os.getpid(),))

                async def close(shutdown: Callable = shutdown) -> None:
                    shutdown()
            elif mode == RAY_MODE:
                http, pids, app = await start_ray_serve(
                    cfg, workload, scratch, max(levels), num_replicas=opts.ray_replicas,
                    device=opts.device)
                front_ends[mode] = FrontEnd(pids)
                console.print(f"  {app.num_replicas} replicas, {app.ray_actor_options}, "
                              f"engine_kwargs {app.engine_kwargs}; front-end processes {pids}")
                run_round, close = http.run_round, http.close
            else:
                shared = next((h for m, h in servers.items() if m in DIALECT_MODES), None)
                if mode in DIALECT_MODES and shared is not None:
                    http = on_same_server(shared, mode, cfg, workload, max(levels))
                elif mode == "sglang-server":
                    http = await start_sglang_server(cfg, workload, scratch, max(levels))
                else:
                    http = await start_http(mode, cfg, workload, scratch, max(levels))
                servers[mode] = http
                run_round, close = http.run_round, http.close
                front_ends[mode] = FrontEnd(
                    (http.server.pid,),
                    launched_server_pid(http.server.pid) if mode in DIALECT_MODES else None)
                if mode == "service" and opts.profile_service:
                    profiler = start_profiler(http.server.pid, Path(opts.profile_service))
            rounds[mode] = run_round
            closers.append(close)
        return {c: await measure(rounds, front_ends, c, c * opts.waves, opts.rounds, console)
                for c in levels}
    finally:
        if profiler is not None:
            stop_profiler(profiler)
        for close in reversed(closers):  # the modes sharing a server before its owner
            await close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:small",
                        help="embedded:<size> (tiny, small, 1b, 7b) or a checkpoint directory")
    parser.add_argument("--concurrency", default="64",
                        help="comma-separated levels of requests in flight")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--length-spread", type=float, default=0.0, help=(
        "request i's tokens uniform in max-tokens * (1 +- this), alike in every mode"))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    parser.add_argument("--waves", type=int, default=2,
                        help="requests per round, in multiples of the concurrency (closed loop)")
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 decodes greedily")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                        help="sglang: GPU only, the sglang bundle on the path")
    parser.add_argument("--sglang-kwargs", type=json_object, default={}, help=(
        "--engine sglang: a JSON object of launch_server arguments (engine_kwargs spelling) "
        "merged over both servers' defaults"))
    parser.add_argument("--modes", default=None, help=(
        f"comma-separated subset of {','.join(MODES)}; default {','.join(DEFAULT_MODES)} "
        f"(vllm), {','.join(SGLANG_MODES)} (sglang)"))
    add_device_arguments(parser, gpu_memory_utilization=0.25, engines="all modes run at once")
    parser.add_argument("--ray-replicas", type=int, default=2,
                        help=f"{RAY_MODE}: engine replicas sharing the one engine's share")
    parser.add_argument("--profile-service", default=None,
                        help="directory for a py-spy profile of the service process")
    opts = parser.parse_args()
    is_sglang = opts.engine == "sglang"
    opts.modes = opts.modes or ",".join(SGLANG_MODES if is_sglang else DEFAULT_MODES)
    accepted = set(SGLANG_MODES) if is_sglang else set(MODES) - {"sglang-server"}
    unknown = sorted(set(opts.modes.split(",")) - accepted)
    if unknown or opts.rounds < 1 or opts.waves < 1 or opts.ray_replicas < 1:
        parser.error(f"bad --modes {unknown} for --engine {opts.engine}" if unknown
                     else "--rounds, --waves and --ray-replicas must be >= 1")
    if opts.sglang_kwargs and not is_sglang:
        parser.error("--sglang-kwargs: for --engine sglang only")
    try:
        spread_lengths(0, opts.max_tokens, opts.length_spread)  # its own bounds, checked once
    except ValueError as exc:
        parser.error(f"--length-spread: {exc}")
    if is_sglang:
        opts.device = "cuda"  # SGLang serves on GPUs only; nothing here imports vLLM
    else:
        resolve_device(opts)
    console = Console()
    results = asyncio.run(run(opts, console))
    print_report(console, results, Workload(prompts=(), max_tokens=opts.max_tokens,
                                            temperature=opts.temperature), opts.rounds,
                 opts.waves, opts.length_spread)


if __name__ == "__main__":
    main()
