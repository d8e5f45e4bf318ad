"""HTTP to one SGLang server: what the engine sends and reads, over aiohttp's pool.

Every generation the service serves on SGLang is one request from this client, so its CPU
cost per request is the service's, and a service slower per request hands a closed loop's
burst of requests to SGLang more spread out (fewer to a prefill batch). With httpx's
``AsyncClient`` over aiohttp's pool (``httpx_aiohttp``; its layers: auth, redirects,
cookies, request building, the adapter) the service spent 1.54x the CPU per request it
spends on aiohttp alone (``python -m bench.front_end``: ``service-httpx`` against
``service``, docs/sglang.md). httpx's own pool is worse still: it costs O(connections) per
request (httpcore's ``_assign_requests_to_connections``), which held the service at
0.46-0.64x SGLang's own server on the H100 (``python -m bench.http_clients``).

:class:`ServerHTTP` is the contract the engine uses; :class:`AiohttpServer` serves it on a
socket and :class:`HttpxServer` over an httpx client: the tests' in-process ASGI app of the
fake server, and the bench's baseline of the client as it was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx
import pydantic_core

from rollout_service.engines.base import EngineUnavailableError

CONNECT_TIMEOUT_S = 10.0
"""Generation and weight loads take as long as they take; connecting does not."""

KEEP_ALIVE_S = 4.0
"""How long an idle connection is kept for reuse: under SGLang's own 5 s
(``SGLANG_TIMEOUT_KEEP_ALIVE``, uvicorn's ``timeout_keep_alive``), so that no request goes
out on a connection the server is closing at that moment (a reset mid-round ended an H100
serving bench where the client kept connections as long as the server)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer, read whole."""

    status: int
    content_type: str
    """The media type without parameters (``application/json``)."""
    body: bytes

    def json(self) -> Any:
        """The body as JSON (ValueError if it is not), parsed by pydantic's Rust parser
        (faster than the standard library's on every answer the service relays)."""
        return pydantic_core.from_json(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Streamed:
    """A streamed answer: its status, then its body line by line, or whole (an error's)."""

    status: int
    lines: AsyncIterator[str]
    read: Callable[[], Awaitable[Reply]]


class ServerHTTP(Protocol):
    """HTTP to the server at ``base_url``. A request that cannot reach it, or whose
    connection breaks, raises EngineUnavailableError; any status is a reply."""

    base_url: str

    async def send(self, method: str, path: str, body: Any = None, *,
                   timeout: float | None = None) -> Reply:
        """``body`` as JSON (None: no body) to ``base_url + path``; ``timeout`` in seconds
        for the whole exchange (None: none)."""
        ...

    def stream(self, path: str, body: Any) -> AbstractAsyncContextManager[Streamed]:
        """POST ``body``; leaving the block closes the connection unless the body was read
        to its end (SGLang aborts a request whose client went away)."""
        ...

    async def aclose(self) -> None: ...


@contextmanager
def unreachable_as_unavailable(base_url: str, errors: tuple[type[BaseException], ...]
                               ) -> Iterator[None]:
    try:
        yield
    except errors as exc:
        raise EngineUnavailableError(f"SGLang server at {base_url} unreachable: {exc!r}") from exc


class AiohttpServer:
    """:class:`ServerHTTP` on a socket, with no cap on connections.

    Each request in flight holds one connection and SGLang queues what it cannot run
    (``--max-running-requests``); a cap of 100 connections (aiohttp's and httpx's default)
    would hold the service at 100 running requests.
    """

    _ERRORS = (aiohttp.ClientError, TimeoutError)

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _pool(self) -> aiohttp.ClientSession:
        """Made on first use, inside the event loop that serves the engine."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        return self._session

    async def send(self, method: str, path: str, body: Any = None, *,
                   timeout: float | None = None) -> Reply:
        limit = (aiohttp.ClientTimeout(total=timeout, sock_connect=CONNECT_TIMEOUT_S)
                 if timeout is not None else None)  # None: the pool's, built once
        with unreachable_as_unavailable(self.base_url, self._ERRORS):
            async with self._pool().request(method, self.base_url + path,
                                            **aiohttp_json(body), timeout=limit) as response:
                return await read_reply(response)

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[Streamed]:
        with unreachable_as_unavailable(self.base_url, self._ERRORS):
            async with self._pool().post(self.base_url + path, **aiohttp_json(body)) as response:
                try:
                    yield Streamed(response.status, split_lines(response.content.iter_any()),
                                   lambda: read_reply(response))
                finally:
                    if not response.content.at_eof():
                        response.close()  # the connection, not back to the pool

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


JSON_HEADERS = {"Content-Type": "application/json"}


def aiohttp_json(body: Any) -> dict[str, Any]:
    """aiohttp's request arguments for ``body`` as JSON (None: no body), encoded into bytes
    by pydantic's Rust encoder, as replies are parsed by its parser (:meth:`Reply.json`).
    aiohttp's own ``json=`` runs the standard library's encoder, which a py-spy profile of
    the service in front of the fake server (``bench.front_end``'s workload, 128 in
    flight) showed among its larger costs per request."""
    if body is None:
        return {}
    return {"data": pydantic_core.to_json(body), "headers": JSON_HEADERS}


async def read_reply(response: aiohttp.ClientResponse) -> Reply:
    return Reply(response.status, response.content_type, await response.read())


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream, each without its ``\\n``, of any length: aiohttp's own
    ``readline`` raises ``LineTooLong`` past twice its read buffer (512 KiB in aiohttp
    3.14), which a cumulative SGLang event with logprobs of a long answer can pass."""
    rest = b""
    async for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line.decode()
    if rest:
        yield rest.decode()


class HttpxServer:
    """:class:`ServerHTTP` over an httpx client: the fake server's ASGI app in process (the
    tests), or any transport httpx has."""

    _ERRORS = (httpx.TransportError,)

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.base_url = str(client.base_url).rstrip("/")
        self._client = client

    async def send(self, method: str, path: str, body: Any = None, *,
                   timeout: float | None = None) -> Reply:
        with unreachable_as_unavailable(self.base_url, self._ERRORS):
            response = await self._client.request(
                method, self.base_url + path, json=body,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        return reply_of(response)

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[Streamed]:
        with unreachable_as_unavailable(self.base_url, self._ERRORS):
            async with self._client.stream("POST", self.base_url + path, json=body) as response:

                async def read() -> Reply:
                    await response.aread()
                    return reply_of(response)

                yield Streamed(response.status_code, response.aiter_lines(), read)

    async def aclose(self) -> None:
        await self._client.aclose()


def reply_of(response: httpx.Response) -> Reply:
    media_type = response.headers.get("content-type", "").partition(";")[0].strip()
    return Reply(response.status_code, media_type, response.content)

