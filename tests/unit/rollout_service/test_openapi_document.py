"""The OpenAPI document states every bound in JSON Schema's own words.

pydantic writes a constraint it cannot place on a type (``ge`` of an integer inside a
union with null, given on the union's ``Field``) under its own name, which JSON Schema and
every client that reads the document ignore: the bound then holds at the service but not
in the document (schemathesis found ``PushFinishRequest.version: -304095412`` refused as
a schema-valid request). A bound goes inside the union's member instead
(``Annotated[int, Field(ge=0), ...] | None``). The whole document, no engine.
"""

from __future__ import annotations

from typing import Any

from rollout_service.api.app import create_app
from rollout_service.config import ServiceConfig

PYDANTIC_ONLY = {"ge", "gt", "le", "lt", "multiple_of", "min_length", "max_length"}
"""pydantic's names of constraints whose JSON Schema names differ."""


def _misnamed(node: Any, path: str, found: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in PYDANTIC_ONLY and not path.endswith("/properties"):
                found.append(f"{path}/{key}")
            _misnamed(value, f"{path}/{key}", found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _misnamed(value, f"{path}[{i}]", found)


def test_no_schema_keeps_a_bound_under_pydantics_own_name() -> None:
    document = create_app(ServiceConfig(api_key="a", weights_token="w")).openapi()
    found: list[str] = []
    _misnamed(document, "", found)
    assert not found, found
