"""The OpenAI router: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Runs in the service process (standalone, or the Ray Serve ingress). Each handler
parses a typed request (``protocol/openai.py``) and calls the app's
:class:`~rollout_service.api.ports.Completions`. ``stream: true`` answers with
server-sent events (``protocol/sse.py``): the handler pulls the first chunk before
answering, so a refused request is an ordinary error status; an error after that is
one error event before ``[DONE]`` (OpenAI's clients raise it). When the client goes
away the stream is closed, which aborts its engine requests.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rollout_service.api.errors import classify, documented, error_body
from rollout_service.api.ports import Completions
from rollout_service.protocol import openai
from rollout_service.protocol.sse import DONE, DONE_EVENT, encode_message

OWNED_BY = "mtp-rollout"


class EventStreamResponse(StreamingResponse):
    """Chunks as server-sent events, then ``[DONE]``; closes the chunks however it ends.

    Args:
        first: the chunk already pulled (None: the stream was empty).
        chunks: the rest.
    """

    def __init__(self, first: BaseModel | None, chunks: AsyncGenerator[BaseModel, None]) -> None:
        self._chunks = chunks
        super().__init__(self._events(first), media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})

    async def _events(self, first: BaseModel | None) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield encode_message(first)
            async for chunk in self._chunks:
                yield encode_message(chunk)
        except Exception as exc:
            yield encode_message(error_body(*classify(exc)))
        yield DONE_EVENT

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A client that went away cancelled the sending: abort the engine requests.
            await self._chunks.aclose()


async def event_stream(chunks: AsyncGenerator[BaseModel, None]) -> EventStreamResponse:
    """The response of a stream, once its first chunk is here (a refusal raises here)."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    return EventStreamResponse(first, chunks)


def event_stream_doc(chunk: type[BaseModel]) -> dict[str, Any]:
    """The ``text/event-stream`` answer of a route in OpenAPI: one event's schema (``x-chunk``
    becomes the data's ``contentSchema``, ``api/openapi.py``)."""
    return {"content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "x-chunk": chunk.__name__,
        "description": (f"With stream: true, one server-sent event per chunk: data is a "
                        f"{chunk.__name__} as JSON, an ErrorResponse as JSON after a failure, "
                        f"then {DONE}."),
        "properties": {"data": {"anyOf": [
            {"const": DONE},
            {"type": "string", "contentMediaType": "application/json"}]}},
    }}}}


def openai_router(model_name: str, guard: Callable[..., Awaitable[None]] | None) -> APIRouter:
    """The router; ``guard`` checks the API key (None: open)."""
    created = int(time.time())
    auth = (401,) if guard is not None else ()
    router = APIRouter(prefix="/v1", dependencies=[Depends(guard)] if guard else [],
                       responses=documented(*auth))

    async def completions(request: Request) -> Completions:
        return request.app.state.serving.completions

    @router.post("/completions", response_model=openai.CompletionResponse,
                 responses={200: event_stream_doc(openai.CompletionChunk),
                            **documented(400, 404, 503)})
    async def complete(req: openai.CompletionRequest,
                       svc: Completions = Depends(completions)) -> Any:
        if req.stream:
            return await event_stream(svc.complete_stream(req))
        return await svc.complete(req)

    @router.post("/chat/completions", response_model=openai.ChatCompletionResponse,
                 responses={200: event_stream_doc(openai.ChatCompletionChunk),
                            **documented(400, 404, 503)})
    async def chat(req: openai.ChatCompletionRequest,
                   svc: Completions = Depends(completions)) -> Any:
        if req.stream:
            return await event_stream(svc.chat_stream(req))
        return await svc.chat(req)

    @router.get("/models")  # after the generation routes, which Starlette tries first
    async def models() -> openai.ModelList:
        return openai.ModelList(data=[openai.ModelCard(id=model_name, created=created,
                                                       owned_by=OWNED_BY)])

    return router
