"""Starlette matches a request against an app's routes in order, a path regex each, so the
order is paid on every request: the generation routes of every dialect come first, and no
route is shadowed by one before it (each path and method reaches its own route)."""

from __future__ import annotations

from starlette.routing import Match, Route

from rollout_service.api.app import create_app
from rollout_service.config import ServiceConfig

GENERATION = ("/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions",
              "/inference/v1/generate")
"""The routes a rollout sends its requests to: the native API, OpenAI's, vLLM's, SGLang's."""

MAX_TRIED = 10
"""Routes tried before a generation request's own, at most: FastAPI's 4 (/openapi.json,
/docs, its OAuth2 redirect, /redoc), the other generation routes and a few of the dialect
routers they share; /generate was behind 51 of the 55 when it was added last."""


def first_match(routes: list, path: str, method: str) -> int:
    scope = {"type": "http", "path": path, "method": method, "root_path": ""}
    return next(i for i, route in enumerate(routes)
                if route.matches(scope)[0] == Match.FULL)


def test_generation_is_matched_among_the_first_routes() -> None:
    routes = create_app(ServiceConfig(api_key="a", weights_token="w")).routes
    tried = {path: first_match(routes, path, "POST") for path in GENERATION}
    assert max(tried.values()) < MAX_TRIED < len(routes), tried


def test_every_route_is_reached_by_its_own_path_and_method() -> None:
    routes = create_app(ServiceConfig(api_key="a", weights_token="w")).routes
    for i, route in enumerate(routes):
        if isinstance(route, Route):
            for method in route.methods or ():
                assert first_match(routes, route.path, method) == i, (route.path, method)
