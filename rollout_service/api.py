"""FastAPI application: thin handlers over :class:`~rollout_service.service.RolloutService`.

Runs in the rollout service process under uvicorn (standalone) or as a Ray Serve
ingress. The engine is created in ``lifespan`` and injected with ``Depends``;
nothing lives in module globals. Errors always answer in OpenAI's error shape
(``{"error": {"message", "type", "code"}}``) and never take the server down:
a bad request is a 400, a dead engine a 503, anything else fails that request
alone with a 500.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rollout_service import wire
from rollout_service.engines.base import Engine, EngineUnavailableError, InvalidRequestError
from rollout_service.service import RolloutService
from rollout_service.telemetry import SpecDecodeMetrics

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[Engine]]


class Unauthorized(Exception):
    """Missing or wrong API key."""


def _error(status: int, message: str, kind: str) -> JSONResponse:
    body = wire.ErrorResponse(error=wire.ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def create_app(engine_factory: EngineFactory, *, api_key: str | None = None) -> FastAPI:
    """Build the app; ``engine_factory`` runs inside the server's event loop at startup.

    Args:
        engine_factory: coroutine returning a started engine.
        api_key: bearer token required on generation endpoints (None: open).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await engine_factory()
        registry = CollectorRegistry()
        metrics = SpecDecodeMetrics(registry=registry, model=engine.info.model,
                                    engine=engine.info.engine,
                                    num_speculative_tokens=engine.info.num_speculative_tokens)
        app.state.service = RolloutService(engine, metrics)
        app.state.registry = registry
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="MTP rollout service", lifespan=lifespan)

    def service(request: Request) -> RolloutService:
        return request.app.state.service

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
            raise Unauthorized()

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return _error(401, "missing or invalid bearer token", "authentication_error")

    @app.exception_handler(EngineUnavailableError)
    async def on_unavailable(_: Request, exc: EngineUnavailableError) -> JSONResponse:
        return _error(503, str(exc), "engine_unavailable")

    @app.exception_handler(Exception)
    async def on_internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return _error(500, f"{type(exc).__name__}: {exc}", "internal_error")

    guarded = [Depends(authorized)]

    @app.post("/generate", dependencies=guarded)
    async def generate(req: wire.GenerateRequest,
                       svc: RolloutService = Depends(service)) -> wire.GenerateResponse:
        return await svc.generate(req)

    @app.post("/generate_batch", dependencies=guarded)
    async def generate_batch(req: wire.BatchGenerateRequest,
                             svc: RolloutService = Depends(service)
                             ) -> wire.BatchGenerateResponse:
        return await svc.generate_batch(req)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: wire.CompletionRequest,
                          svc: RolloutService = Depends(service)) -> wire.CompletionResponse:
        return await svc.complete(req)

    @app.get("/health")
    async def health(svc: RolloutService = Depends(service)) -> JSONResponse:
        info = svc.engine.info
        try:
            await svc.engine.health()
            version = await svc.engine.weight_version()
        except EngineUnavailableError as exc:
            body = wire.HealthResponse(status="unavailable", model=info.model,
                                       engine=info.engine, weight_version=None, detail=str(exc))
            return JSONResponse(body.model_dump(), status_code=503)
        body = wire.HealthResponse(status="ok", model=info.model, engine=info.engine,
                                   weight_version=version)
        return JSONResponse(body.model_dump())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # The engine's own series (vLLM registers in the process-wide registry)
        # beside this service's per-request series.
        payload = generate_latest(REGISTRY) + generate_latest(request.app.state.registry)
        return Response(payload, media_type=CONTENT_TYPE_LATEST)

    return app
