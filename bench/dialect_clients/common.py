"""What every client shares: the service under test, one row of results, and the checks
more than one client makes.

Runs in the caller's terminal process. :class:`Target` sends a call as a client sends it
and waits until a long request runs (SGLang's ``GET /v1/loads``, which the service serves
in every dialect); :class:`Row` collects one client's calls and failures, a failed step
recorded while the next steps still run; :func:`traced` and :func:`traced_thread` run one
call of a framework's own code and turn its HTTP error (aiohttp, requests, httpx) into the
call that failed; :func:`check_partial` is what every framework reads from a sequence
aborted mid-generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlencode

import httpx

PROMPT_IDS = [17, 294, 258, 270]
"""The prompt every client sends, as token ids below any vocabulary's size."""
SHORT_TOKENS = 16
HTTP_TIMEOUT_S = 300.0

T = TypeVar("T")


class CallFailed(Exception):
    """One call answered what its client cannot use."""

    def __init__(self, call: str, why: str) -> None:
        super().__init__(f"{call}: {why}")
        self.call = call
        self.why = why


def expect(condition: bool, call: str, why: str) -> None:
    if not condition:
        raise CallFailed(call, why)


def short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


@dataclasses.dataclass
class Row:
    """One client's calls and what failed."""

    client: str
    dialect: str
    code: str = "data"
    calls: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    skipped: str | None = None

    def call(self, label: str) -> None:
        if label not in self.calls:
            self.calls.append(label)

    async def step(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        """Run one step; a failure is recorded and the next steps still run."""
        try:
            await fn()
        except CallFailed as exc:
            self.failures.append(f"{exc.call}: {exc.why}")
        except Exception as exc:  # the real clients raise their own types
            self.failures.append(f"{name}: {type(exc).__name__}: {short(str(exc))}")

    @property
    def label(self) -> str:
        how = {"real": "its own client code", "data": "payloads from its source"}.get(
            self.code, "skipped")
        return f"{self.client} ({how})"


def unavailable(row: Row, mode: str, why: str) -> None:
    """A client's own code cannot run here: a failure under ``--mode real``, else skipped."""
    if mode == "real":
        row.failures.append(f"real client unavailable: {why}")
    else:
        row.code, row.skipped = "skipped", why


def load_real(mode: str, rows: list[Row], load: Callable[[], T]) -> T | None:
    """The framework's modules (``load`` imports them), or None for its payloads: under
    ``--mode data``, or ``auto`` where they do not import. Under ``--mode real`` an import
    error is each row's failure (then the caller returns the rows as they are)."""
    if mode == "data":
        return None
    try:
        return load()
    except ImportError as exc:
        if mode == "real":
            for row in rows:
                unavailable(row, mode, str(exc))
        return None


def error_message(resp: httpx.Response) -> str:
    """The message of an error answer: OpenAI's ``error.message``, FastAPI's ``detail``,
    or the text."""
    try:
        body = resp.json()
    except ValueError:
        return short(resp.text or resp.reason_phrase)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return short(str(error["message"]))
        if isinstance(error, str):
            return short(error)
        if body.get("detail"):
            return short(str(body["detail"]))
    return short(resp.text)


def failed_call(exc: Exception, call: str) -> CallFailed:
    """A real client's HTTP error as the call that failed (aiohttp, requests, httpx)."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    if status is None and response is not None:
        status = getattr(response, "status_code", None)
    message = getattr(exc, "message", None) or str(exc)
    if isinstance(response, httpx.Response):
        message = error_message(response)
    elif response is not None and hasattr(response, "json"):  # requests
        with contextlib.suppress(Exception):
            message = response.json()["error"]["message"]
    return CallFailed(call, short(f"{status or type(exc).__name__} {message}"))


async def traced(row: Row, label: str, call: Awaitable[T]) -> T:
    """One call made by a framework's own async code, listed as ``label``."""
    row.call(label)
    try:
        return await call
    except CallFailed:
        raise
    except Exception as exc:
        raise failed_call(exc, label) from exc


async def traced_thread(row: Row, label: str, fn: Callable[[], T]) -> T:
    """One call made by a framework's own blocking code (requests), in a thread."""
    return await traced(row, label, asyncio.to_thread(fn))


@dataclasses.dataclass
class Target:
    """The service under test and the client every data call goes through."""

    url: str
    model: str
    tokenizer: str | None
    api_key: str | None
    long_tokens: int
    http: httpx.AsyncClient

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.url.split("://", 1)[-1].rstrip("/").rpartition(":")
        return host, int(port)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def send(self, row: Row, method: str, path: str, *, params: dict[str, Any] | None = None,
                   json_body: Any = None, headers: dict[str, str] | None = None,
                   label: str | None = None) -> httpx.Response:
        """One call as its client sends it; a status >= 400 fails it."""
        label = label or f"{method} {path}" + (f"?{urlencode(params)}" if params else "")
        row.call(label)
        resp = await self.http.request(method, self.url + path, params=params, json=json_body,
                                       headers={**self.auth, **(headers or {})})
        if resp.status_code >= 400:
            raise CallFailed(label, f"{resp.status_code} {error_message(resp)}")
        return resp

    async def running(self) -> int | None:
        """Requests the service runs now (SGLang's ``/v1/loads``), None without the route."""
        try:
            resp = await self.http.get(self.url + "/v1/loads", params={"include": "core"},
                                       headers=self.auth)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return sum(int(load.get("num_running_reqs", 0)) for load in resp.json().get("loads", []))

    async def in_flight(self, task: asyncio.Future[Any]) -> None:
        """Until ``task``'s request runs and has made some tokens (or 0.5 s without
        ``/v1/loads``)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not task.done():
            running = await self.running()
            if running is None:
                await asyncio.sleep(0.5)
                return
            if running > 0:
                await asyncio.sleep(0.1)
                return
            await asyncio.sleep(0.05)


def check_partial(call: str, tokens: list[int], logprobs: list[float] | None,
                  finish: str | None, wanted: int) -> None:
    """An aborted sequence: finish reason abort, its tokens so far, one logprob each."""
    expect(not (finish in ("length", "stop") and len(tokens) >= wanted), call,
           f"the request ended ({finish}, {len(tokens)} tokens) before the abort: raise "
           "--long-tokens")
    expect(finish == "abort", call, f"finish reason {finish!r}, wanted 'abort'")
    expect(0 < len(tokens) < wanted, call, f"{len(tokens)} tokens, wanted 1..{wanted - 1}")
    expect(logprobs is None or len(logprobs) == len(tokens), call,
           f"{len(logprobs or [])} logprobs for {len(tokens)} tokens")


def local_tokenizer(path: str | None) -> Any:
    """The checkpoint's Hugging Face tokenizer, or None (no path, no ``transformers``)."""
    if path is None:
        return None
    with contextlib.suppress(Exception):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    return None
