"""The HTTP client of one SGLang server: httpx's API over aiohttp's connection pool.

The engine speaks httpx (its tests run it on the fake server's ASGI app with httpx's own
transport), but on a socket it sends through ``httpx_aiohttp.AiohttpTransport``
(github karpetrosyan/httpx-aiohttp, the transport the ``openai`` SDK offers for the same
reason). httpx's own pool costs O(connections) per request (httpcore's
``_assign_requests_to_connections`` walks every connection for every request), so with
one connection per request in flight the client, not SGLang, bounds the rate:
``python -m bench.http_clients`` (a local server answering after 0.2 s, the 2-core CPU
machine) measured httpx's own pool at 20 ms of CPU per request with 128 in flight (48
requests/s) against 0.4 ms over aiohttp (550/s, the server's bound); on the H100 the
service held 128 requests at 0.46-0.64x SGLang's own server, SGLang's scheduler
receiving them one prefill at a time.
"""

from __future__ import annotations

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

TIMEOUT = httpx.Timeout(None, connect=10.0)
"""Generation and weight loads take as long as they take; connecting does not."""

KEEP_ALIVE_S = 4.0
"""How long an idle connection is kept for reuse: under SGLang's own 5 s
(``SGLANG_TIMEOUT_KEEP_ALIVE``, uvicorn's ``timeout_keep_alive``), so that no request goes
out on a connection the server is closing at that moment (a reset mid-round ended an H100
serving bench where the client kept connections as long as the server)."""


def server_client(base_url: str) -> httpx.AsyncClient:
    """A client of the server at ``base_url`` with no cap on connections.

    Each request in flight holds one connection and SGLang queues what it cannot run
    (``--max-running-requests``); a cap of 100 connections (httpx's and aiohttp's default)
    would hold the service at 100 running requests.
    """

    def session() -> aiohttp.ClientSession:  # made on first use, inside the serving loop
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_S))

    return httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT,
                             transport=AiohttpTransport(client=session))
