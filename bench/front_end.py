"""What the service adds per request in front of an SGLang server, without a GPU.

The GPU serving bench (``bench.serving --engine sglang``) compares the service with
SGLang's own server, but a GPU run is rare and its rounds mix the engine's scheduling with
the service's own cost. This script isolates that cost on any machine: a FAKE SGLang server
(``tests/support/fake_sglang.py``, no inference: its answers are SGLang-shaped, its own
CPU time is its own process's) in a child process, the service (``rollout_service.cli
serve``, ``engine: sglang``, ``engine_url`` the fake) in another, and two modes, driven
from this process with aiohttp:

- ``direct``: SGLang's ``/generate`` body straight to the fake;
- ``service``: the same request through the service's native ``/generate``;
- ``service-sglang``: SGLang's own body through the same service process's ``/generate``
  (its SGLang dialect: the serving bench's ``service-sglang``);
- ``service-h11``: the same through a second service process whose uvicorn parses HTTP
  with h11, the pure-Python parser: the service as uvicorn's ``auto`` ran it on a GPU
  machine without httptools (``rollout_service/cli.py`` names httptools now);
- ``service-httpx``: the same through a third service process whose engine sends through
  httpx's ``AsyncClient`` over aiohttp's pool (``httpx_aiohttp``), the engine's client
  until aiohttp took its place (``engines/sglang/http_client.py``);
- ``service-baseline`` (with ``--baseline REV``): the same as ``service`` through a service
  process run from a git worktree of commit ``REV`` (``bench.baseline``): a change to the
  service's request path against the code before it, in the same rounds.

Per round and mode, in rotating order: the median latency of one request at a time
(``--serial`` of them), and a closed loop of ``--requests`` at ``--concurrency`` in
flight, over which the mode's service process's CPU time per request is read (psutil).
The table gives the medians over rounds (min - max), the latency the service adds (its
median minus ``direct``'s, per round) and the service's CPU per request.

    python -m bench.front_end --rounds 5
    python -m bench.front_end --rounds 9 --modes direct,service --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp
import psutil
from rich.console import Console
from rich.table import Table

from bench.baseline import worktree
from bench.serving_http import closed_loop
from bench.spread import median_spread
from rollout_service.embedded import ensure_model
from rollout_service.tools.launch import ChildProcess, free_port, wait_http_ok

MODES = ("direct", "service", "service-sglang", "service-h11", "service-httpx")
BASELINE = "service-baseline"
PROMPT_IDS = list(range(1, 65))
MAX_TOKENS = 256
BODIES = {
    "direct": {"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True}},
    "service": {"prompt_token_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS,
                "temperature": 1.0, "ignore_eos": True},
}
BODIES["service-h11"] = BODIES["service-httpx"] = BODIES[BASELINE] = BODIES["service"]
BODIES["service-sglang"] = BODIES["direct"]
"""The same request in each mode's dialect: 64 prompt tokens, 256 generated."""


def fake_app() -> Any:
    """The FAKE SGLang server of the tiny checkpoint (``uvicorn --factory``)."""
    from tests.support.fake_sglang import FakeSGLang
    from tests.support.sglang_on_fake import SPEC_ARGS

    return FakeSGLang("0.5.23", model_path=str(ensure_model("tiny")), speculative=SPEC_ARGS,
                      context_length=1024).app


def serve_h11() -> None:
    """``rollout-service serve`` (its arguments from ``sys.argv``) with uvicorn's h11
    parser in place of httptools: ``python -c 'from bench.front_end import serve_h11;
    serve_h11()' serve ...``."""
    from rollout_service import cli

    named = cli.server_config

    def with_h11(app: Any, keep_alive_s: float, **options: Any) -> Any:
        config = named(app, keep_alive_s, **options)
        config.http = "h11"
        return config

    cli.server_config = with_h11
    cli.app()


def serve_httpx() -> None:
    """``rollout-service serve`` (its arguments from ``sys.argv``) with the SGLang engine
    sending through httpx over aiohttp's pool (``bench.http_clients.httpx_over_aiohttp``):
    ``python -c 'from bench.front_end import serve_httpx; serve_httpx()' serve ...``."""
    from bench.http_clients import httpx_over_aiohttp
    from rollout_service import cli
    from rollout_service.engines.sglang import engine

    engine.AiohttpServer = httpx_over_aiohttp  # type: ignore[misc, assignment]
    cli.app()


Send = Callable[[int], Awaitable[int]]


def sender(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
           latencies: list[float]) -> Send:
    """One request to ``url``: its latency appended, 1 returned (``closed_loop``'s count)."""

    async def send(_: int) -> int:
        start = time.perf_counter()
        async with session.post(url, json=body) as response:
            answer = await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {answer[:300]!r}")
        latencies.append(time.perf_counter() - start)
        return 1
    return send


async def one_round(session: aiohttp.ClientSession, urls: dict[str, str],
                    services: dict[str, psutil.Process], order: tuple[str, ...],
                    opts: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per mode: median latency one at a time (s) and its service's CPU s per request
    (``direct``: the ``service`` process's, idle)."""
    out = {}
    for mode in order:
        service = services.get(mode, services["service"])
        serial: list[float] = []
        await closed_loop(sender(session, urls[mode], BODIES[mode], serial), 1, opts.serial)
        before = sum(service.cpu_times()[:2])
        await closed_loop(sender(session, urls[mode], BODIES[mode], []), opts.concurrency,
                          opts.requests)
        cpu = (sum(service.cpu_times()[:2]) - before) / opts.requests
        out[mode] = (statistics.median(serial), cpu)
    return out


def report(console: Console, rounds: list[dict[str, tuple[float, float]]],
           opts: argparse.Namespace) -> None:
    table = Table("mode", "latency, one at a time (ms)", "added by the service (ms)",
                  f"service CPU ms / request at {opts.concurrency} in flight",
                  "CPU / service's, per round")
    for mode in opts.modes:
        latency = [1e3 * r[mode][0] for r in rounds]
        added = [1e3 * (r[mode][0] - r["direct"][0]) for r in rounds]
        cpu = [1e3 * r[mode][1] for r in rounds]
        to_service = [r[mode][1] / r["service"][1] for r in rounds]
        is_service = mode not in ("direct", "service")
        table.add_row(mode, median_spread(latency, "{:.2f}"),
                      median_spread(added, "{:.2f}") if mode != "direct" else "-",
                      median_spread(cpu),
                      median_spread(to_service, "{:.2f}x") if is_service else "-")
    console.print(f"FAKE SGLang (tiny, 64 prompt + {MAX_TOKENS} tokens a request); "
                  f"{opts.rounds} rounds, modes in rotating order; {opts.serial} requests one "
                  f"at a time, then {opts.requests} at {opts.concurrency} in flight")
    console.print(table)
    console.print("(direct's CPU column: what the idle service spends meanwhile)")


SERVICE_COMMANDS = {
    "service": [sys.executable, "-m", "rollout_service.cli"],
    "service-h11": [sys.executable, "-c", "from bench.front_end import serve_h11; serve_h11()"],
    "service-httpx": [sys.executable, "-c",
                      "from bench.front_end import serve_httpx; serve_httpx()"],
    BASELINE: [sys.executable, "-m", "rollout_service.cli"]}
"""The service process behind each mode (``service-sglang`` shares ``service``'s);
``BASELINE``'s runs in the baseline's worktree, where ``-m`` imports that tree's code."""


async def run(opts: argparse.Namespace, console: Console
              ) -> list[dict[str, tuple[float, float]]]:
    """The rounds' measurements (``one_round``'s), after printing them and the table."""
    modes: tuple[str, ...] = opts.modes
    fake_port = free_port()
    fake_url = f"http://127.0.0.1:{fake_port}"
    with TemporaryDirectory() as scratch_dir, worktree(opts.baseline,
                                                       Path(scratch_dir)) as baseline:
        scratch = Path(scratch_dir)
        config = scratch / "service.json"
        config.write_text(json.dumps({"model": str(ensure_model("tiny")), "engine": "sglang",
                                      "engine_url": fake_url, "served_model_name": "tiny"}))
        fake = ChildProcess(
            [sys.executable, "-m", "uvicorn", "--factory", "bench.front_end:fake_app",
             "--port", str(fake_port), "--log-level", "warning", "--no-access-log",
             "--timeout-keep-alive", "90"], scratch / "fake.log", env=dict(os.environ))
        commands = {mode: command for mode, command in SERVICE_COMMANDS.items()
                    if mode in modes}
        ports = {mode: free_port() for mode in commands}
        procs: dict[str, ChildProcess] = {}
        try:
            await asyncio.to_thread(wait_http_ok, f"{fake_url}/health", fake, 120.0)
            for mode, command in commands.items():
                procs[mode] = ChildProcess(
                    [*command, "serve", "--config", str(config), "--host", "127.0.0.1",
                     "--port", str(ports[mode])], scratch / f"{mode}.log",
                    env=dict(os.environ), cwd=baseline if mode == BASELINE else None)
                await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{ports[mode]}/health",
                                        procs[mode], 120.0)
            services = {mode: psutil.Process(proc.pid) for mode, proc in procs.items()}
            urls = {"direct": f"{fake_url}/generate",
                    "service-sglang": f"http://127.0.0.1:{ports['service']}/generate",
                    **{mode: f"http://127.0.0.1:{port}/generate" for mode, port in ports.items()}}
            rounds = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for mode in modes:  # warm-up: connections opened, code paths run once
                    await closed_loop(sender(session, urls[mode], BODIES[mode], []),
                                      opts.concurrency, opts.concurrency)
                for r in range(opts.rounds):
                    order = modes[r % len(modes):] + modes[:r % len(modes)]
                    rounds.append(await one_round(session, urls, services, order, opts))
                    console.print(f"  round {r + 1}: " + ", ".join(
                        f"{m} {1e3 * rounds[-1][m][0]:.2f} ms, service CPU "
                        f"{1e3 * rounds[-1][m][1]:.3f} ms/request" for m in modes))
        finally:
            for proc in procs.values():
                proc.stop()
            fake.stop()
    report(console, rounds, opts)
    return rounds


def modes_arg(text: str) -> tuple[str, ...]:
    """``--modes``: names of ``MODES``, comma-separated; ``direct`` and ``service`` are the
    references every other mode is read against."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if not {"direct", "service"} <= set(modes):
        raise argparse.ArgumentTypeError("must include direct and service (the references)")
    return modes


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serial", type=int, default=100,
                        help="requests one at a time per round and mode")
    parser.add_argument("--requests", type=int, default=1024,
                        help="requests of the closed loop per round and mode")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--modes", type=modes_arg, default=MODES,
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help=f"add {BASELINE}: the service at git commit REV")
    return parser


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, ``--baseline`` adding its mode to ``--modes``."""
    opts = parser().parse_args(argv)
    if opts.baseline is not None:
        opts.modes = (*opts.modes, BASELINE)
    return opts


def main() -> None:
    asyncio.run(run(parse_options(), Console(width=160)))


if __name__ == "__main__":
    main()
