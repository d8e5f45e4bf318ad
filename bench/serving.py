"""Serving throughput: this service vs vLLM's ``AsyncLLM`` and vLLM's own OpenAI server.

Runs in the caller's terminal process. One engine config (the service's: its
``ServiceConfig`` resolved and turned into ``AsyncEngineArgs`` by the service's
own ``build_engine_args``) and one workload go through three modes, one after
another, each stopped before the next starts:

- ``asyncllm``: ``AsyncLLM`` in this process (it spawns its engine-core process);
  the requests are sent with ``asyncio.gather``.
- ``service``: ``rollout-service serve`` as a child process, with that config
  written to a JSON file, reached with httpx posts to ``/generate``.
- ``vllm-server``: ``python -m vllm.entrypoints.openai.api_server`` as a child
  process, with the same engine args as CLI flags (every ``AsyncEngineArgs``
  field that differs from its default), reached with httpx posts to
  ``/v1/completions``.

Workload: ``--num-requests`` prompts from ``arithmetic_prompts``, all in flight at
once, n=1 each, ``ignore_eos`` so every request yields exactly ``--max-tokens``
tokens, temperature 1.0 (``--temperature``) with seed i for request i (the same
seeds every round and mode, so every round samples the same sequences; RL
rollouts sample rather than decode greedily). Each mode runs one untimed warm-up round, then
``--rounds`` timed rounds; a round's rate is the generated tokens (counted from
the responses) over its wall time, and the table shows the median. The ratios
service/asyncllm (the HTTP + service overhead; target >= 0.95) and
service/vllm-server (target >= 1.0) are printed with their targets.

    python -m bench.serving --model embedded:tiny --num-requests 16 --max-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from rollout_service import wire
from rollout_service.config import ServiceConfig, load_config
from rollout_service.launch import free_port
from rollout_service.model.corpus import arithmetic_prompts

MODES = ("asyncllm", "service", "vllm-server")
TARGETS = {("service", "asyncllm"): 0.95, ("service", "vllm-server"): 1.0}
STARTUP_TIMEOUT_S = 900.0
HTTP_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What every mode runs: all prompts concurrently, ``num_rounds`` timed times."""

    prompts: tuple[str, ...]
    max_tokens: int
    temperature: float
    num_rounds: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModeResult:
    """One mode's start-up time and per-round throughput."""

    startup_s: float
    num_tokens_per_round: int
    tokens_per_s: tuple[float, ...]

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)


async def measure(run_round: Callable[[], Awaitable[int]], workload: Workload,
                  startup_s: float) -> ModeResult:
    """One warm-up round, then the timed rounds; ``run_round`` returns tokens generated."""
    await run_round()
    rates, num_tokens = [], 0
    for _ in range(workload.num_rounds):
        start = time.perf_counter()
        num_tokens = await run_round()
        rates.append(num_tokens / (time.perf_counter() - start))
    return ModeResult(startup_s=startup_s, num_tokens_per_round=num_tokens,
                      tokens_per_s=tuple(rates))


def engine_args(cfg: ServiceConfig) -> Any:
    """The ``AsyncEngineArgs`` the service builds for this config."""
    from rollout_service.engines.vllm import build_engine_args
    from rollout_service.speculative import load_checkpoint_config

    model_path, kwargs = cfg.resolve_model()
    return build_engine_args(model_path, kwargs, cfg.mtp, load_checkpoint_config(model_path))


def non_default_engine_args(args: Any) -> dict[str, Any]:
    """The fields of ``args`` that differ from ``AsyncEngineArgs()`` (what the flags carry)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    default = AsyncEngineArgs()
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


async def bench_asyncllm(cfg: ServiceConfig, workload: Workload) -> ModeResult:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    start = time.perf_counter()
    llm = AsyncLLM.from_engine_args(engine_args(cfg))
    startup_s = time.perf_counter() - start
    num_calls = 0

    async def one(i: int, prompt: str, request_id: str) -> int:
        params = SamplingParams(n=1, max_tokens=workload.max_tokens,
                                temperature=workload.temperature, seed=i, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in llm.generate(prompt, params, request_id):
            final = output
        assert final is not None and final.finished
        return len(final.outputs[0].token_ids)

    async def run_round() -> int:
        nonlocal num_calls
        num_calls += 1
        counts = await asyncio.gather(*(one(i, p, f"bench-{num_calls}-{i}")
                                        for i, p in enumerate(workload.prompts)))
        return sum(counts)

    try:
        return await measure(run_round, workload, startup_s)
    finally:
        llm.shutdown()
        # Something in vLLM keeps this frame alive; without the del, AsyncLLM.__del__
        # shuts down again at interpreter exit and raises there.
        del llm


async def wait_healthy(url: str, is_alive: Callable[[], bool], log_path: Path) -> None:
    """Poll ``url`` until it answers 200; fail fast if the process died."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            if not is_alive():
                raise RuntimeError(f"server exited before it became healthy; see {log_path}")
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy after {STARTUP_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.5)


class ChildServer:
    """A server command run in its own process group; ``stop`` ends the whole group."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> None:
        if not self.is_alive():
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


async def bench_server(cmd: list[str], log_path: Path, workload: Workload, path: str,
                       body: Callable[[int, str], dict[str, Any]],
                       count: Callable[[dict[str, Any]], int],
                       headers: dict[str, str]) -> ModeResult:
    """Start ``cmd`` on a free port; each round posts ``body(i, prompt)`` for every prompt
    to ``path`` concurrently and sums ``count(response)``, the tokens generated."""
    port = free_port()
    start = time.perf_counter()
    server = ChildServer([*cmd, "--host", "127.0.0.1", "--port", str(port)], log_path)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(f"{url}/health", server.is_alive, log_path)
        startup_s = time.perf_counter() - start
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                     timeout=HTTP_TIMEOUT_S) as http:

            async def one(i: int, prompt: str) -> int:
                response = await http.post(path, json=body(i, prompt))
                if response.is_error:
                    raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text}")
                return count(response.json())

            async def run_round() -> int:
                return sum(await asyncio.gather(*(one(i, p)
                                                  for i, p in enumerate(workload.prompts))))

            return await measure(run_round, workload, startup_s)
    finally:
        server.stop()


def run_mode(mode: str, cfg: ServiceConfig, workload: Workload, scratch: Path) -> ModeResult:
    """Run one mode to the end: its engine or server is shut down when this returns."""
    if mode == "asyncllm":
        return asyncio.run(bench_asyncllm(cfg, workload))
    if mode == "service":
        config_path = scratch / "service.json"
        config_path.write_text(cfg.model_dump_json(exclude={"api_key"}))
        api_key = cfg.resolved_api_key()
        return asyncio.run(bench_server(
            [sys.executable, "-m", "rollout_service.cli", "serve", "--config", str(config_path)],
            scratch / "service.log", workload, "/generate",
            body=lambda i, prompt: wire.GenerateRequest(
                prompt=prompt, max_tokens=workload.max_tokens, temperature=workload.temperature,
                seed=i, ignore_eos=True).model_dump(exclude_none=True),
            count=lambda response: len(response["outputs"][0]["token_ids"]),
            headers={"authorization": f"Bearer {api_key}"} if api_key else {}))
    kwargs = non_default_engine_args(engine_args(cfg))
    return asyncio.run(bench_server(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cli_flags(kwargs)],
        scratch / "vllm-server.log", workload, "/v1/completions",
        body=lambda i, prompt: {
            "model": kwargs["model"], "prompt": prompt, "max_tokens": workload.max_tokens,
            "temperature": workload.temperature, "seed": i, "ignore_eos": True},
        count=lambda response: response["usage"]["completion_tokens"], headers={}))


def print_report(console: Console, cfg: ServiceConfig, workload: Workload,
                 results: dict[str, ModeResult]) -> None:
    kwargs = non_default_engine_args(engine_args(cfg))
    console.print(f"model: {cfg.model} ({kwargs.pop('model')})")
    console.print(f"engine args (non-default): {kwargs}")
    console.print(f"workload: {len(workload.prompts)} concurrent requests x "
                  f"{workload.max_tokens} tokens, n=1, ignore_eos, temperature "
                  f"{workload.temperature}, seed i per request; 1 warm-up + "
                  f"{workload.num_rounds} timed rounds")
    table = Table("mode", "median tok/s", "rounds tok/s", "tokens/round", "startup s")
    for mode, result in results.items():
        table.add_row(mode, f"{result.median_tokens_per_s:.1f}",
                      " ".join(f"{r:.1f}" for r in result.tokens_per_s),
                      str(result.num_tokens_per_round), f"{result.startup_s:.1f}")
    console.print(table)
    ratios = Table("ratio", "value", "target", "met")
    for (num, den), target in TARGETS.items():
        if num in results and den in results:
            ratio = results[num].median_tokens_per_s / results[den].median_tokens_per_s
            ratios.add_row(f"{num} / {den}", f"{ratio:.3f}", f">= {target}",
                           "yes" if ratio >= target else "NO")
    if ratios.row_count:
        console.print(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:small",
                        help="embedded:small, embedded:tiny or a checkpoint directory")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 decodes greedily")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    opts = parser.parse_args()
    modes = opts.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or opts.rounds < 1 or opts.num_requests < 1:
        parser.error(f"bad --modes {unknown}" if unknown else "--rounds and --num-requests >= 1")
    cfg = load_config(model=opts.model, mtp={"num_speculative_tokens": opts.num_speculative_tokens})
    prompts = tuple(p for p, _ in arithmetic_prompts(opts.num_requests))
    workload = Workload(prompts=prompts, max_tokens=opts.max_tokens,
                        temperature=opts.temperature,
                        num_rounds=opts.rounds)
    console = Console()
    scratch = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    console.print(f"logs: {scratch}")
    results: dict[str, ModeResult] = {}
    for mode in modes:
        console.print(f"[bold]{mode}[/bold] ...")
        results[mode] = run_mode(mode, cfg, workload, scratch)
        console.print(f"  median {results[mode].median_tokens_per_s:.1f} tok/s")
    print_report(console, cfg, workload, results)


if __name__ == "__main__":
    main()
