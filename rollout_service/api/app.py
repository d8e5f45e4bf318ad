"""The FastAPI application: generation, health and metrics handlers, and the routers.

Runs in the rollout service process under uvicorn (standalone) or as a Ray Serve
ingress. What the handlers call (:class:`~rollout_service.api.ports.AppState`)
opens in ``lifespan``, inside the server's event loop, and is injected with
``Depends``; nothing lives in module globals. Errors answer in OpenAI's shape
(``api.errors``), and every route documents the ones it can answer
(``api.openapi``). Dependencies are ``async def``: FastAPI runs a plain ``def`` one
in a worker thread, a thread hop per request that the event loop pays under load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Discriminator, Tag

from rollout_service.api.dialects.sglang import protocol as sglang
from rollout_service.api.dialects.sglang.router import (
    generate_dialect,
    sglang_generate,
    sglang_router,
)
from rollout_service.api.dialects.sglang.weights_router import sglang_weights_router
from rollout_service.api.dialects.vllm import protocol as vllm
from rollout_service.api.dialects.vllm.router import vllm_router
from rollout_service.api.dialects.vllm.weights_router import vllm_weights_router
from rollout_service.api.dialects.weights_auth import dialect_weights_guard
from rollout_service.api.errors import bearer_guard, documented, install_error_handlers
from rollout_service.api.openai import event_stream_doc, openai_router
from rollout_service.api.openapi import install_openapi
from rollout_service.api.ports import AppState, Rollouts
from rollout_service.api.speculation import speculation_router
from rollout_service.api.weights import weights_router
from rollout_service.config import ServiceConfig
from rollout_service.protocol import messages, openai
from rollout_service.telemetry.exposition import combined_registry

StateOpener = Callable[[], AbstractAsyncContextManager[AppState]]
"""Opens what the app serves for the server's lifetime."""

GenerateBody = Annotated[
    Annotated[messages.GenerateRequest, Tag("native")]
    | Annotated[sglang.GenerateReqInput, Tag("sglang")],
    Discriminator(generate_dialect)]
"""``POST /generate``: the native API's request, or SGLang's (``api/dialects``): their
keys never overlap, so one path serves both dialects' unmodified clients."""


def json_response(model: BaseModel | list[BaseModel]) -> Response:
    """A response model as JSON, serialized once by pydantic (no second encoding pass)."""
    if isinstance(model, list):
        body = b"[" + b",".join(m.model_dump_json().encode() for m in model) + b"]"
    else:
        body = model.model_dump_json().encode()
    return Response(body, media_type="application/json")


class RegistryPage:
    """``/metrics`` of one process: the engine's series beside this service's."""

    def __init__(self, service_registry: CollectorRegistry) -> None:
        self._registry = combined_registry(service_registry)

    async def render(self) -> bytes:
        return generate_latest(self._registry)


@asynccontextmanager
async def local_state(config: ServiceConfig) -> AsyncIterator[AppState]:
    """One engine in this process (``rollout-service serve``)."""
    from rollout_service.completions import OpenAICompletions
    from rollout_service.local import build_local_service, start_engine

    engine = await start_engine(config)
    try:
        service, registry = build_local_service(engine, config)
        await service.start()
        yield AppState(rollouts=service, completions=OpenAICompletions(service),
                       sequences=service, control=service, weights=service.weights,
                       metrics=RegistryPage(registry), speculation=service)
    finally:
        await engine.shutdown()


def create_app(config: ServiceConfig, open_state: StateOpener | None = None) -> FastAPI:
    """Build the app; its state opens inside the server's event loop (``lifespan``).

    Args:
        config: the service configuration (tokens are resolved here, at startup).
        open_state: what serves the handlers; default: one engine in this process.

    Raises:
        ValueError: an unreadable weights token file.
    """
    api_key = config.resolved_api_key()
    opener = open_state or (lambda: local_state(config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with opener() as state:
            app.state.serving = state
            yield

    app = FastAPI(title="MTP rollout service", lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app, stream_chunks=(openai.CompletionChunk, openai.ChatCompletionChunk,
                                        vllm.TokensStreamResponse, sglang.GenerateOutput))
    guard = bearer_guard(api_key, scheme_name="apiKey",
                         description="The service's api_key (generation endpoints).")
    # Starlette tries an app's routes in the order they were added, a path regex each, and
    # every generation request pays for the routes before its own: the generation routes
    # go first (tests/unit/rollout_service/test_route_order.py).

    async def rollouts(request: Request) -> Rollouts:
        return request.app.state.serving.rollouts

    guarded = [Depends(guard)] if guard is not None else []
    errors = documented(400, *((401,) if guard is not None else ()), 503)

    @app.post("/generate", dependencies=guarded, response_model=None, responses={
        200: {"model": messages.GenerateResponse | sglang.GenerateOutput
              | list[sglang.GenerateOutput], "description": (
                  "The native answer, or SGLang's (one object for one sequence, else a "
                  "list; with stream: server-sent events of GenerateOutput)"),
              **event_stream_doc(sglang.GenerateOutput)},
        **errors})
    async def generate(req: GenerateBody, request: Request) -> Any:
        """The native API's one prompt and ``n`` sequences, or SGLang's ``/generate``
        (``text`` / ``input_ids``), told apart by the body's keys."""
        state: AppState = request.app.state.serving
        if isinstance(req, sglang.GenerateReqInput):
            answer = await sglang_generate(req, state)
            return answer if isinstance(answer, Response) else json_response(answer)
        return json_response(await state.rollouts.generate(req))

    @app.post("/generate_batch", dependencies=guarded, responses=errors)
    async def generate_batch(req: messages.BatchGenerateRequest,
                             svc: Rollouts = Depends(rollouts)
                             ) -> messages.BatchGenerateResponse:
        return await svc.generate_batch(req)

    app.include_router(openai_router(config.model_name, guard))
    app.include_router(vllm_router(guard))
    app.include_router(sglang_router(guard))
    weights_token = config.resolved_weights_token()
    app.include_router(weights_router(weights_token))
    app.include_router(speculation_router(weights_token))
    weights_guard = dialect_weights_guard(weights_token, config.dialect_weights_auth)
    app.include_router(vllm_weights_router(weights_guard))
    app.include_router(sglang_weights_router(weights_guard))

    @app.get("/health", response_model=messages.HealthResponse, responses={503: {
        "model": messages.HealthResponse, "description": "The engine is dead, or a weight "
        "load failed midway (Ray Serve: no replica serves)."}})
    async def health(svc: Rollouts = Depends(rollouts)) -> JSONResponse:
        body, status = await svc.health()
        return JSONResponse(body.model_dump(mode="json"), status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        return Response(await request.app.state.serving.metrics.render(),
                        media_type=CONTENT_TYPE_LATEST)

    return app
