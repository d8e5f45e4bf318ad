"""What the SGLang engine's HTTP client costs per request, by connection pool.

The service reaches an SGLang server over HTTP with one connection per request in flight.
This script puts a local server in a child process (``uvicorn``; each ``POST /generate``
reads its body and answers a fixed SGLang-sized JSON after ``--delay-s``, so the server is
never the bound) and drives it in a closed loop from this process with three clients:

- ``httpx``: httpx's own pool with no connection cap (the engine's first client);
- ``httpx-aiohttp``: httpx's API over aiohttp's pool (``httpx_aiohttp``), the engine's
  second;
- ``service``: the engine's client now (``engines/sglang/http_client.AiohttpServer``),
  aiohttp's pool alone.

Rounds rotate the clients' order; per client the median requests/s and CPU ms per request
of this process (min - max), and each ratio against ``httpx``.

    python -m bench.http_clients --concurrency 128,512 --requests 1024 --rounds 5
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

import aiohttp
import httpx
from rich.console import Console
from rich.table import Table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.serving_http import closed_loop
from rollout_service.engines.sglang.http_client import (
    CONNECT_TIMEOUT_S,
    KEEP_ALIVE_S,
    AiohttpServer,
    HttpxServer,
)
from rollout_service.tools.launch import ChildProcess, free_port, wait_http_ok

CLIENTS = ("httpx", "httpx-aiohttp", "service")
ANSWER = json.dumps({"text": "a" * 1024, "output_ids": list(range(256)),
                     "meta_info": {"id": "bench", "prompt_tokens": 64,
                                   "completion_tokens": 256}}).encode()
BODY = {"text": "hello " * 64, "sampling_params": {"max_new_tokens": 256}}
DELAY_S = float(os.environ.get("BENCH_HTTP_DELAY_S", "0.2"))


async def _generate(request: Request) -> Response:
    await request.body()
    await asyncio.sleep(DELAY_S)  # the stand-in engine's generation time
    return Response(ANSWER, media_type="application/json")


async def _health(request: Request) -> Response:
    return Response(b"ok")


app = Starlette(routes=[Route("/generate", _generate, methods=["POST"]),
                        Route("/health", _health)])
"""The stand-in server (``uvicorn bench.http_clients:app``)."""

Send = Callable[[int], Awaitable[int]]
"""One request (its index unused); 1 when it was answered, for ``closed_loop``'s count."""


def httpx_over_aiohttp(base_url: str) -> HttpxServer:
    """The SGLang engine's HTTP as it was before aiohttp alone: httpx's ``AsyncClient``
    over aiohttp's pool (github karpetrosyan/httpx-aiohttp), no cap on connections."""
    from httpx_aiohttp import AiohttpTransport  # a dev dependency: only the benches use it

    def pool() -> aiohttp.ClientSession:  # made on first use, inside the running loop
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=KEEP_ALIVE_S))

    return HttpxServer(httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        transport=AiohttpTransport(client=pool)))


def open_client(name: str, url: str) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """One request's coroutine and the close of the client ``name``."""
    http = {"httpx": lambda u: HttpxServer(httpx.AsyncClient(
                base_url=u, timeout=None,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))),
            "httpx-aiohttp": httpx_over_aiohttp,
            "service": AiohttpServer}[name](url)

    async def send(_: int) -> int:
        (await http.send("POST", "/generate", BODY)).json()
        return 1
    return send, http.aclose


async def measure(url: str, concurrency: int, num_requests: int, num_rounds: int,
                  console: Console) -> dict[str, tuple[list[float], list[float]]]:
    """Per client: requests/s and CPU ms per request, a value per round."""
    clients = {name: open_client(name, url) for name in CLIENTS}
    results: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in CLIENTS}
    try:
        for send, _ in clients.values():  # warm-up: every connection opened once
            await closed_loop(send, concurrency, concurrency)
        for r in range(num_rounds):
            order = CLIENTS[r % len(CLIENTS):] + CLIENTS[:r % len(CLIENTS)]
            for name in order:
                wall, cpu = time.monotonic(), time.process_time()
                await closed_loop(clients[name][0], concurrency, num_requests)
                wall, cpu = time.monotonic() - wall, time.process_time() - cpu
                results[name][0].append(num_requests / wall)
                results[name][1].append(1e3 * cpu / num_requests)
            console.print(f"  c={concurrency} round {r + 1}: " + ", ".join(
                f"{n} {results[n][0][-1]:.0f} req/s {results[n][1][-1]:.2f} ms"
                for n in CLIENTS))
    finally:
        for _, close in clients.values():
            await close()
    return results


def report(console: Console, by_concurrency: dict[int, dict[str, tuple[list[float],
                                                                       list[float]]]]) -> None:
    table = Table("concurrency", "client", "requests/s", "CPU ms / request",
                  "requests/s vs httpx", "CPU vs httpx")
    for concurrency, results in by_concurrency.items():
        base_rate, base_cpu = (statistics.median(v) for v in results["httpx"])
        for name, (rates, cpus) in results.items():
            rate, cpu = statistics.median(rates), statistics.median(cpus)
            table.add_row(str(concurrency), name,
                          f"{rate:.0f} ({min(rates):.0f} - {max(rates):.0f})",
                          f"{cpu:.2f} ({min(cpus):.2f} - {max(cpus):.2f})",
                          f"{rate / base_rate:.2f}x", f"{cpu / base_cpu:.3f}x")
    console.print(table)


async def run(opts: argparse.Namespace, console: Console
              ) -> dict[int, dict[str, tuple[list[float], list[float]]]]:
    """Per concurrency and client: requests/s and CPU ms per request, a value per round
    (``measure``'s), after printing them and the table."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with TemporaryDirectory() as scratch:
        server = ChildProcess(
            [sys.executable, "-m", "uvicorn", "bench.http_clients:app", "--port", str(port),
             "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "90"],
            Path(scratch) / "server.log", env={**os.environ,
                                               "BENCH_HTTP_DELAY_S": str(opts.delay_s)})
        try:
            await asyncio.to_thread(wait_http_ok, f"{url}/health", server, 60.0)
            results = {c: await measure(url, c, opts.requests, opts.rounds, console)
                       for c in opts.concurrency}
        finally:
            server.stop()
    console.print(f"closed loop of {opts.requests} requests a round, the server answering "
                  f"after {opts.delay_s} s; {opts.rounds} rounds, order rotated")
    report(console, results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="128,512",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--requests", type=int, default=1024, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay-s", type=float, default=0.2,
                        help="the server's time per request (a stand-in engine)")
    asyncio.run(run(parser.parse_args(), Console(width=160)))


if __name__ == "__main__":
    main()
