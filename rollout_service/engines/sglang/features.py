"""What the connected SGLang server accepts, told apart by feature, not by version string.

Runs in the rollout service process, once per connection: :func:`detect_features`
reads the server's ``/openapi.json`` over HTTP (which routes exist, which fields each
request model has; SGLang ignores unknown fields, so sending one blindly does nothing)
and probes routes when the schema is disabled (``DISABLE_OPENAPI_DOC``). The engine
asks the result which route and which field to use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_service.engines.sglang.http_client import ServerHTTP

logger = logging.getLogger(__name__)

INFO_TIMEOUT_S = 30.0
"""Limit of the server's quick answers (info, schema, health); loads and generation
have none."""

# POST-only routes: a GET probe answers 405 if the route exists and runs nothing.
_PROBED_ROUTES = ("/generate", "/pause_generation", "/continue_generation",
                  "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update")
# These also answer GET by doing their work, so they are never probed.
_UNPROBED_ROUTES = ("/flush_cache", "/weights_checker")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerFeatures:
    """What the connected SGLang server supports (see :func:`detect_features`)."""

    routes: frozenset[str]
    """POST routes among those the engine uses."""
    fields: Mapping[str, frozenset[str]]
    """Request-model field names per route; a route missing here has unknown fields."""

    @property
    def has_weight_update_session(self) -> bool:
        """``/begin_weight_update`` ... ``/end_weight_update`` must wrap loads (0.5.23)."""
        return {"/begin_weight_update", "/end_weight_update"} <= self.routes

    def accepts(self, route: str, field: str) -> bool:
        """Whether ``route``'s request model has ``field`` (unknown schema: inferred)."""
        if route in self.fields:
            return field in self.fields[route]
        # No schema: infer from the routes, as SGLang's history goes (0.5.10-0.5.23):
        # selector arrived with the update sessions and replaced disable_draft_model
        # (tensor route only); every 0.5.x pause takes a mode.
        session = self.has_weight_update_session
        inferred = {"selector": session, "mode": True,
                    "disable_draft_model": route == "/update_weights_from_tensor" and not session}
        return inferred.get(field, False)


async def detect_features(http: ServerHTTP) -> ServerFeatures:
    """Read routes and request fields from ``/openapi.json``, or probe routes without it.

    Probing sends GET to each POST-only route: 405 (method not allowed) means it
    exists, 404 that it does not. Without the schema, ``/flush_cache`` is assumed
    (every 0.5.x has it) and ``/weights_checker`` is not.
    """
    reply = await http.send("GET", "/openapi.json", timeout=INFO_TIMEOUT_S)
    if reply.status == 200:
        schema = reply.json()
        paths = schema.get("paths", {})
        routes = frozenset(route for route in (*_PROBED_ROUTES, *_UNPROBED_ROUTES)
                           if "post" in paths.get(route, {}))
        fields = {route: frozenset(request_fields(schema, paths[route]["post"]))
                  for route in routes}
        return ServerFeatures(routes=routes, fields={r: f for r, f in fields.items() if f})
    logger.info("SGLang's /openapi.json is unavailable (%d); probing routes",
                reply.status)
    probes = await asyncio.gather(*(http.send("GET", route, timeout=INFO_TIMEOUT_S)
                                    for route in _PROBED_ROUTES))
    routes = {route for route, probe in zip(_PROBED_ROUTES, probes) if probe.status == 405}
    return ServerFeatures(routes=frozenset({*routes, "/flush_cache"}), fields={})


def request_fields(schema: Mapping[str, Any], operation: Mapping[str, Any]) -> set[str]:
    """Property names of an OpenAPI operation's JSON body, following $ref / allOf / anyOf
    (FastAPI nests a pydantic model's fields behind them)."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    names: set[str] = set()
    pending = [body.get("schema", {})]
    while pending:
        node = pending.pop()
        if "$ref" in node:
            node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
        names |= set(node.get("properties", {}))
        pending += [*node.get("allOf", ()), *node.get("anyOf", ())]
    return names
