"""Every error answers in OpenAI's shape: ``{"error": {"message", "type", "code"}}``.

Runs in the service process. A bad request is a 400 naming the field, a missing
or wrong token a 401, a disabled endpoint a 403, a push conflict its own code,
a dead engine a 503; anything else fails that request alone with a 500 and never
takes the server down.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollout_service.engines.base import EngineUnavailableError, InvalidRequestError
from rollout_service.protocol import messages
from rollout_service.weights.intake import PushError

logger = logging.getLogger(__name__)


class Unauthorized(Exception):
    """Missing or wrong bearer token."""


class Forbidden(Exception):
    """The endpoint is disabled by configuration."""


def check_bearer(request: Request, token: str) -> None:
    """Raises :class:`Unauthorized` unless the request carries ``Bearer <token>``."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise Unauthorized()


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    body = messages.ErrorResponse(error=messages.ErrorBody(message=message, type=kind,
                                                           code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the handlers can raise to its status and error type."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return error_response(401, "missing or invalid bearer token", "authentication_error")

    @app.exception_handler(Forbidden)
    async def on_forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return error_response(403, str(exc), "permission_error")

    @app.exception_handler(PushError)
    async def on_push_error(_: Request, exc: PushError) -> JSONResponse:
        return error_response(exc.status, str(exc), "weight_push_error")

    @app.exception_handler(EngineUnavailableError)
    async def on_unavailable(_: Request, exc: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(exc), "engine_unavailable")

    @app.exception_handler(Exception)
    async def on_internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal_error")
