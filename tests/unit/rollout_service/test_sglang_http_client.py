"""The SGLang engine's HTTP client (``engines/sglang/http_client.py``) on a real socket: no
cap on connections in flight, and no reuse of a connection idle longer than its keep-alive
(a server closing one at that moment resets the request sent on it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rollout_service.engines.sglang import http_client
from rollout_service.engines.sglang.http_client import server_client
from rollout_service.tools.launch import free_port

NUM_IN_FLIGHT = 150  # above aiohttp's and httpx's default caps of 100 connections


class PeerServer:
    """Answers each request with the client's port (its connection) once ``release`` is
    set, and counts the requests waiting for it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_waiting = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.num_waiting += 1
        await self.release.wait()
        return web.json_response({"port": request.transport.get_extra_info("peername")[1]})


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    peer = PeerServer()
    app = web.Application()
    app.router.add_get("/peer", peer.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    peer.url = f"http://127.0.0.1:{port}"
    yield peer
    await runner.cleanup()


async def test_every_request_in_flight_reaches_the_server_at_once(server: PeerServer) -> None:
    async with server_client(server.url) as client:
        requests = [asyncio.create_task(client.get("/peer")) for _ in range(NUM_IN_FLIGHT)]
        try:
            async with asyncio.timeout(30):
                while server.num_waiting < NUM_IN_FLIGHT:
                    await asyncio.sleep(0.01)
        finally:
            server.release.set()
        answers = await asyncio.gather(*requests)
    assert len({a.json()["port"] for a in answers}) == NUM_IN_FLIGHT


async def test_a_connection_idle_past_the_keep_alive_is_not_reused(
        server: PeerServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_client, "KEEP_ALIVE_S", 0.3)
    server.release.set()
    async with server_client(server.url) as client:
        first = (await client.get("/peer")).json()["port"]
        assert (await client.get("/peer")).json()["port"] == first  # kept alive
        await asyncio.sleep(1.0)  # idle past the keep-alive: the span under test
        assert (await client.get("/peer")).json()["port"] != first
