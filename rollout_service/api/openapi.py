"""The app's OpenAPI document, as the service behaves.

Runs in the service process, once, on the first ``GET /openapi.json``. FastAPI
documents a 422 on every route that parses a request; this service answers an
invalid request with 400 in OpenAI's error shape (``api/errors.py``), so the 422s and
their schemas go. The chunk messages of streams join the components, so that the
events of a ``text/event-stream`` answer name the chunk their data holds
(``contentSchema``). Everything else (constraints, error answers, security schemes)
comes from the messages and routes themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, stream_chunks: Sequence[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` build the corrected document.

    Args:
        stream_chunks: the chunk messages of the app's streams.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = corrected(
                get_openapi(title=app.title, version=app.version, routes=app.routes),
                stream_chunks)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def corrected(schema: dict[str, Any], stream_chunks: Sequence[type[BaseModel]]
              ) -> dict[str, Any]:
    """``schema`` without FastAPI's 422s, with the chunk schemas (see the module docstring)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
            _name_stream_chunks(operation)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, definitions = models_json_schema([(chunk, "serialization") for chunk in stream_chunks],
                                        ref_template=_REF)
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)
    return schema


def _name_stream_chunks(operation: dict[str, Any]) -> None:
    """Point each event's data of a ``text/event-stream`` answer at its chunk's schema."""
    content = operation.get("responses", {}).get("200", {}).get("content", {})
    event = content.get("text/event-stream", {}).get("schema")
    chunk = event and event.pop("x-chunk", None)
    if chunk:
        json_data = event["properties"]["data"]["anyOf"][-1]
        json_data["contentSchema"] = {"anyOf": [{"$ref": _REF.format(model=chunk)},
                                                {"$ref": _REF.format(model="ErrorResponse")}]}
