"""What the service adds per request in front of an SGLang server, without a GPU.

The GPU serving bench (``bench.serving --engine sglang``) compares the service with
SGLang's own server, but a GPU run is rare and its rounds mix the engine's scheduling with
the service's own cost. This script isolates that cost on any machine: a FAKE SGLang server
(``tests/support/fake_sglang.py``, no inference: its answers are SGLang-shaped, its own
CPU time is its own process's) in a child process, the service (``rollout_service.cli
serve``, ``engine: sglang``, ``engine_url`` the fake) in another, and two modes, driven
from this process with aiohttp:

- ``direct``: SGLang's ``/generate`` body straight to the fake;
- ``service``: the same request through the service's native ``/generate``.

Per round and mode, in rotating order: the median latency of one request at a time
(``--serial`` of them), and a closed loop of ``--requests`` at ``--concurrency`` in
flight, over which the service process's CPU time per request is read (psutil). The
table gives the medians over rounds (min - max), the latency the service adds (its
median minus ``direct``'s, per round) and the service's CPU per request.

    python -m bench.front_end --rounds 5
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

from bench.serving_http import closed_loop
from bench.spread import median_spread
from rollout_service.embedded import ensure_model
from rollout_service.tools.launch import ChildProcess, free_port, wait_http_ok

MODES = ("direct", "service")
PROMPT_IDS = list(range(1, 65))
MAX_TOKENS = 256
BODIES = {
    "direct": {"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True}},
    "service": {"prompt_token_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS,
                "temperature": 1.0, "ignore_eos": True},
}
"""The same request in each mode's dialect: 64 prompt tokens, 256 generated."""


def fake_app() -> Any:
    """The FAKE SGLang server of the tiny checkpoint (``uvicorn --factory``)."""
    from tests.support.fake_sglang import FakeSGLang
    from tests.support.sglang_on_fake import SPEC_ARGS

    return FakeSGLang("0.5.23", model_path=str(ensure_model("tiny")), speculative=SPEC_ARGS,
                      context_length=1024).app


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


async def one_round(session: aiohttp.ClientSession, urls: dict[str, str], service: psutil.Process,
                    order: tuple[str, ...], opts: argparse.Namespace
                    ) -> dict[str, tuple[float, float]]:
    """Per mode: median latency one at a time (s) and the service's CPU s per request."""
    out = {}
    for mode in order:
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
                  f"service CPU ms / request at {opts.concurrency} in flight")
    for mode in MODES:
        latency = [1e3 * r[mode][0] for r in rounds]
        added = [1e3 * (r[mode][0] - r["direct"][0]) for r in rounds]
        cpu = [1e3 * r[mode][1] for r in rounds]
        table.add_row(mode, median_spread(latency, "{:.2f}"),
                      median_spread(added, "{:.2f}") if mode != "direct" else "-",
                      median_spread(cpu))
    console.print(f"FAKE SGLang (tiny, 64 prompt + {MAX_TOKENS} tokens a request); "
                  f"{opts.rounds} rounds, modes in rotating order; {opts.serial} requests one "
                  f"at a time, then {opts.requests} at {opts.concurrency} in flight")
    console.print(table)
    console.print("(direct's CPU column: what the idle service spends meanwhile)")


async def run(opts: argparse.Namespace, console: Console
              ) -> list[dict[str, tuple[float, float]]]:
    """The rounds' measurements (``one_round``'s), after printing them and the table."""
    fake_port, service_port = free_port(), free_port()
    fake_url, service_url = f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{service_port}"
    with TemporaryDirectory() as scratch:
        config = Path(scratch) / "service.json"
        config.write_text(json.dumps({"model": str(ensure_model("tiny")), "engine": "sglang",
                                      "engine_url": fake_url, "served_model_name": "tiny"}))
        fake = ChildProcess(
            [sys.executable, "-m", "uvicorn", "--factory", "bench.front_end:fake_app",
             "--port", str(fake_port), "--log-level", "warning", "--no-access-log",
             "--timeout-keep-alive", "90"], Path(scratch) / "fake.log", env=dict(os.environ))
        service_proc = None
        try:
            await asyncio.to_thread(wait_http_ok, f"{fake_url}/health", fake, 120.0)
            service_proc = ChildProcess(
                [sys.executable, "-m", "rollout_service.cli", "serve", "--config", str(config),
                 "--host", "127.0.0.1", "--port", str(service_port)],
                Path(scratch) / "service.log", env=dict(os.environ))
            await asyncio.to_thread(wait_http_ok, f"{service_url}/health", service_proc, 120.0)
            service = psutil.Process(service_proc.pid)
            urls = {"direct": f"{fake_url}/generate", "service": f"{service_url}/generate"}
            rounds = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for mode in MODES:  # warm-up: connections opened, code paths run once
                    await closed_loop(sender(session, urls[mode], BODIES[mode], []),
                                      opts.concurrency, opts.concurrency)
                for r in range(opts.rounds):
                    order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                    rounds.append(await one_round(session, urls, service, order, opts))
                    console.print(f"  round {r + 1}: " + ", ".join(
                        f"{m} {1e3 * rounds[-1][m][0]:.2f} ms, service CPU "
                        f"{1e3 * rounds[-1][m][1]:.3f} ms/request" for m in MODES))
        finally:
            if service_proc is not None:
                service_proc.stop()
            fake.stop()
    report(console, rounds, opts)
    return rounds


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serial", type=int, default=100,
                        help="requests one at a time per round and mode")
    parser.add_argument("--requests", type=int, default=1024,
                        help="requests of the closed loop per round and mode")
    parser.add_argument("--concurrency", type=int, default=128)
    return parser


def main() -> None:
    asyncio.run(run(parser().parse_args(), Console(width=160)))


if __name__ == "__main__":
    main()
