"""Every error answers in OpenAI's shape: ``{"error": {"message", "type", "code"}}``.

Runs in the service process. A bad request is a 400 naming the field, a missing
or wrong token a 401, a disabled endpoint a 403, a push conflict its own code,
a dead engine a 503; anything else fails that request alone with a 500 and never
takes the server down. Routes document the errors they can answer
(:func:`documented`), and bearer tokens are declared as OpenAPI security schemes
(:func:`bearer_guard`), so the OpenAPI document says what the service does.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from rollout_service.choices import UnknownModelError
from rollout_service.engines.base import EngineUnavailableError, InvalidRequestError
from rollout_service.protocol import messages
from rollout_service.service import SpeculationControlOff
from rollout_service.weights.intake import PushError

logger = logging.getLogger(__name__)

ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message names the field or value at fault.",
    401: "Missing or wrong bearer token.",
    403: "Disabled by configuration.",
    404: "Not found: a model other than the served one (as vLLM answers), or a push that "
         "is not the active one.",
    408: "The trainer's broadcast (transport 'nccl') did not arrive in time; nothing was "
         "loaded and the group is closed.",
    409: "Conflicts with the push in progress, the served versions or the weight group.",
    500: "The engine failed while loading weights.",
    503: "The engine is dead, or a weight load failed midway.",
}


class Unauthorized(Exception):
    """Missing or wrong bearer token."""


class Forbidden(Exception):
    """The endpoint is disabled by configuration."""


def check_bearer(request: Request, token: str) -> None:
    """Raises :class:`Unauthorized` unless the request carries ``Bearer <token>``."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise Unauthorized()


def bearer_guard(token: str | None, *, scheme_name: str,
                 description: str) -> Callable[..., Awaitable[None]] | None:
    """A dependency requiring ``Bearer <token>``, declared in OpenAPI as the security
    scheme ``scheme_name``; None (nothing required, nothing declared) without a token."""
    if token is None:
        return None
    scheme = HTTPBearer(auto_error=False, scheme_name=scheme_name, description=description)

    async def guard(request: Request,
                    _: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        check_bearer(request, token)

    return guard


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that can answer these error statuses."""
    return {status: {"model": messages.ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
            for status in statuses}


def error_body(status: int, message: str, kind: str) -> messages.ErrorResponse:
    return messages.ErrorResponse(error=messages.ErrorBody(message=message, type=kind,
                                                           code=status))


def error_response(status: int, message: str, kind: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind).model_dump(), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def classify(exc: Exception) -> tuple[int, str, str]:
    """``(status, message, error type)`` of an exception a handler or a stream raised."""
    if isinstance(exc, RequestValidationError):
        return 400, _validation_message(exc), "invalid_request_error"
    if isinstance(exc, InvalidRequestError):
        return 400, str(exc), "invalid_request_error"
    if isinstance(exc, Unauthorized):
        return 401, str(exc) or "missing or invalid bearer token", "authentication_error"
    if isinstance(exc, Forbidden | SpeculationControlOff):
        return 403, str(exc), "permission_error"
    if isinstance(exc, UnknownModelError):
        return 404, str(exc), "NotFoundError"
    if isinstance(exc, PushError):
        return exc.status, str(exc), "weight_push_error"
    if isinstance(exc, EngineUnavailableError):
        return 503, str(exc), "engine_unavailable"
    logger.error("request failed", exc_info=exc)
    return 500, f"{type(exc).__name__}: {exc}", "internal_error"


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the handlers can raise to its status and error type."""

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(*classify(exc))

    for kind in (RequestValidationError, InvalidRequestError, Unauthorized, Forbidden, PushError,
                 SpeculationControlOff, EngineUnavailableError, UnknownModelError, Exception):
        app.add_exception_handler(kind, on_error)

    @app.exception_handler(HTTPException)
    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        # Routing's own answers (404 no such route, 405 with its Allow header), in our shape.
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error",
                              headers=exc.headers)
