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
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rollout_service import wire
from rollout_service.config import ServiceConfig
from rollout_service.engines.base import Engine, EngineUnavailableError, InvalidRequestError
from rollout_service.service import RolloutService
from rollout_service.telemetry import SpecDecodeMetrics
from rollout_service.weights.checkpoint import checkpoint_tensors
from rollout_service.weights.metrics import WeightMetrics
from rollout_service.weights.session import PushError, WeightPushManager

logger = logging.getLogger(__name__)


class Unauthorized(Exception):
    """Missing or wrong bearer token."""


class Forbidden(Exception):
    """The endpoint is disabled by configuration."""


def _error(status: int, message: str, kind: str) -> JSONResponse:
    body = wire.ErrorResponse(error=wire.ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def _check_bearer(request: Request, token: str) -> None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise Unauthorized()


@dataclass(frozen=True, kw_only=True, slots=True)
class AppState:
    """What the handlers call: a service (generate, health, checksums), the weight-push
    protocol, and the registry ``/metrics`` adds to the process-wide one.

    Standalone these are a :class:`RolloutService` and its :class:`WeightPushManager`;
    behind Ray Serve (``serve.py``) they route to the engine replicas and the weights
    coordinator, with the same methods.
    """

    service: Any
    weights: Any
    registry: CollectorRegistry


def build_local_service(engine: Engine, config: ServiceConfig
                        ) -> tuple[RolloutService, CollectorRegistry]:
    """The service object around one engine, with its own metrics registry."""
    info = engine.info
    registry = CollectorRegistry()
    metrics = SpecDecodeMetrics(registry=registry, model=info.model, engine=info.engine,
                                num_speculative_tokens=info.num_speculative_tokens)
    weights = WeightPushManager(
        engine, checkpoint_tensors(info.model_path),
        WeightMetrics(registry=registry, model=info.model, engine=info.engine),
        timeout_s=config.push_timeout_s, has_draft=info.num_speculative_tokens > 0,
        transport=config.weights_transport)
    return RolloutService(engine, metrics, weights), registry


@asynccontextmanager
async def local_state(config: ServiceConfig) -> AsyncIterator[AppState]:
    """One engine in this process (``rollout-service serve``)."""
    from rollout_service.engines import create_engine

    engine = await create_engine(config)
    try:
        service, registry = build_local_service(engine, config)
        yield AppState(service=service, weights=service.weights, registry=registry)
    finally:
        await engine.shutdown()


def create_app(config: ServiceConfig,
               open_state: Callable[[], AbstractAsyncContextManager[AppState]] | None = None
               ) -> FastAPI:
    """Build the app; its state opens inside the server's event loop (``lifespan``).

    Args:
        config: the service configuration (tokens are resolved here, at startup).
        open_state: what serves the handlers; default: one engine in this process.
    """
    api_key = config.resolved_api_key()
    weights_token = config.resolved_weights_token()
    opener = open_state or (lambda: local_state(config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with opener() as state:
            app.state.service = state.service
            app.state.weights = state.weights
            app.state.registry = state.registry
            yield

    app = FastAPI(title="MTP rollout service", lifespan=lifespan)

    def service(request: Request) -> RolloutService:
        return request.app.state.service

    def authorized(request: Request) -> None:
        if api_key is not None:
            _check_bearer(request, api_key)

    def may_push(request: Request) -> None:
        if weights_token is None:
            raise Forbidden("weight pushes are disabled: no weights token is configured "
                            "(weights_token, weights_token_file or $ROLLOUT_WEIGHTS_TOKEN)")
        _check_bearer(request, weights_token)

    def weights(request: Request) -> WeightPushManager:
        return request.app.state.weights

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return _error(401, "missing or invalid bearer token", "authentication_error")

    @app.exception_handler(Forbidden)
    async def on_forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return _error(403, str(exc), "permission_error")

    @app.exception_handler(PushError)
    async def on_push_error(_: Request, exc: PushError) -> JSONResponse:
        return _error(exc.status, str(exc), "weight_push_error")

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

    pushers = [Depends(may_push)]

    @app.post("/weights/begin", dependencies=pushers)
    async def weights_begin(req: wire.PushBeginRequest,
                            mgr: WeightPushManager = Depends(weights)) -> wire.PushBeginResponse:
        return await mgr.begin(req)

    @app.post("/weights/update", dependencies=pushers)
    async def weights_update(req: wire.PushUpdateRequest,
                             mgr: WeightPushManager = Depends(weights)
                             ) -> wire.PushUpdateResponse:
        return await mgr.update(req)

    @app.post("/weights/finish", dependencies=pushers)
    async def weights_finish(req: wire.PushFinishRequest,
                             mgr: WeightPushManager = Depends(weights)
                             ) -> wire.PushFinishResponse:
        return await mgr.finish(req)

    @app.post("/weights/abort", dependencies=pushers)
    async def weights_abort(req: wire.PushAbortRequest,
                            mgr: WeightPushManager = Depends(weights)) -> wire.WeightStatus:
        return await mgr.abort(req)

    @app.get("/weights/status", dependencies=pushers)
    async def weights_status(mgr: WeightPushManager = Depends(weights)) -> wire.WeightStatus:
        return await mgr.get_status()

    @app.get("/weights/checksums", dependencies=pushers)
    async def weights_checksums(svc: RolloutService = Depends(service)) -> dict[str, Any]:
        return await svc.weight_checksums()

    @app.get("/health")
    async def health(svc: RolloutService = Depends(service)) -> JSONResponse:
        body, status = await svc.health()
        return JSONResponse(body.model_dump(), status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # The engine's own series (vLLM registers in the process-wide registry)
        # beside this service's per-request series.
        payload = generate_latest(REGISTRY) + generate_latest(request.app.state.registry)
        return Response(payload, media_type=CONTENT_TYPE_LATEST)

    return app
