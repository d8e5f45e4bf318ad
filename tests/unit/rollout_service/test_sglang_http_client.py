"""The SGLang engine's HTTP (``engines/sglang/http_client.py``, ``AiohttpServer``) on a real
socket: no cap on connections in flight, no reuse of a connection idle longer than its
keep-alive (a server closing one at that moment resets the request sent on it), streams
of any line length, a stream left early closing its connection (SGLang aborts the request
of a client gone), and a server that cannot be reached or answers too late."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import psutil
import pytest
from aiohttp import web

from rollout_service.engines.base import EngineUnavailableError
from rollout_service.engines.sglang import http_client
from rollout_service.engines.sglang.http_client import AiohttpServer
from rollout_service.tools.launch import free_port
from tests.support.waiting import until

NUM_IN_FLIGHT = 150  # above aiohttp's and httpx's default caps of 100 connections
LONG_LINE = 1_000_000  # characters: past aiohttp's readline limit (twice its read buffer:
# 512 KiB in aiohttp 3.14)


class PeerServer:
    """``/peer`` answers with the client's port (its connection) once ``release`` is set,
    counting the requests waiting for it; ``/stream`` sends a long event, then one more
    only after ``release``, and records when its client goes away."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_waiting = 0
        self.is_stream_client_gone = False
        self.url = ""

    async def count_waiting(self) -> int:
        return self.num_waiting

    async def has_stream_client_gone(self) -> bool:
        return self.is_stream_client_gone

    async def peer(self, request: web.Request) -> web.Response:
        self.num_waiting += 1
        await self.release.wait()
        return web.json_response({"port": request.transport.get_extra_info("peername")[1],
                                  "body": await request.json() if request.can_read_body
                                  else None})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            await response.write(f"data: {json.dumps({'text': 'x' * LONG_LINE})}\n\n".encode())
            await self.release.wait()
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.is_stream_client_gone = True
            raise
        return response


async def is_open(client_port: int) -> bool:
    """Whether this process still holds the client's connection from ``client_port`` open
    (the OS's view: the pool closes an idle one once its keep-alive has passed)."""
    return any(c.laddr and c.laddr.port == client_port and c.status == psutil.CONN_ESTABLISHED
               for c in psutil.Process().net_connections(kind="tcp"))


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    peer = PeerServer()
    app = web.Application()
    app.router.add_route("*", "/peer", peer.peer)
    app.router.add_post("/stream", peer.stream)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client gone cancels its handler
    await runner.setup()
    port = free_port()
    # A backlog for every connection at once (aiohttp's default of 128 resets the rest;
    # SGLang's uvicorn keeps 2048).
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4 * NUM_IN_FLIGHT).start()
    peer.url = f"http://127.0.0.1:{port}"
    yield peer
    await runner.cleanup()


async def test_every_request_in_flight_reaches_the_server_at_once(server: PeerServer) -> None:
    http = AiohttpServer(server.url)
    requests = [asyncio.create_task(http.send("POST", "/peer", {"i": i}))
                for i in range(NUM_IN_FLIGHT)]
    try:
        await until(server.count_waiting, lambda n: n == NUM_IN_FLIGHT, timeout_s=30.0)
    finally:
        server.release.set()
    replies = await asyncio.gather(*requests)
    await http.aclose()
    assert len({r.json()["port"] for r in replies}) == NUM_IN_FLIGHT
    assert [r.json()["body"] for r in replies] == [{"i": i} for i in range(NUM_IN_FLIGHT)]
    assert {(r.status, r.content_type) for r in replies} == {(200, "application/json")}


async def test_a_connection_idle_past_the_keep_alive_is_not_reused(
        server: PeerServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_client, "KEEP_ALIVE_S", 0.3)
    server.release.set()
    http = AiohttpServer(server.url)
    first = (await http.send("GET", "/peer")).json()["port"]
    assert (await http.send("GET", "/peer")).json()["port"] == first  # kept alive
    await until(lambda: is_open(first), lambda still: not still, timeout_s=30.0)
    assert (await http.send("GET", "/peer")).json()["port"] != first
    await http.aclose()


async def test_a_stream_gives_long_lines_whole_and_leaving_it_closes_the_connection(
        server: PeerServer) -> None:
    http = AiohttpServer(server.url)
    async with http.stream("/stream", {}) as streamed:
        assert streamed.status == 200
        first = await anext(streamed.lines)
    assert json.loads(first.removeprefix("data: ")) == {"text": "x" * LONG_LINE}
    await until(server.has_stream_client_gone, bool, timeout_s=30.0)
    server.release.set()
    async with http.stream("/stream", {}) as streamed:  # read to the end this time
        lines = [line async for line in streamed.lines]
    assert lines[2:] == ["data: [DONE]", ""]
    await http.aclose()


async def test_an_unreachable_or_late_server_is_unavailable(server: PeerServer) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = AiohttpServer(f"http://127.0.0.1:{sock.getsockname()[1]}")
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await gone.send("GET", "/health")
    await gone.aclose()
    late = AiohttpServer(server.url)  # /peer waits for release, which never comes
    with pytest.raises(EngineUnavailableError, match="unreachable.*Timeout"):
        await late.send("GET", "/peer", timeout=0.2)
    await late.aclose()
