"""Field types every message shares, and the error body every route answers with.

Part of :mod:`rollout_service.protocol.messages` (the package says how its modules
divide the messages). Requests reject unknown fields and take JSON types as they are
(strict: ``"1"`` is not ``1``; an integer may be written ``3.0``, as JSON Schema reads it),
so every request model starts from :data:`STRICT`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True)
"""A request's model config: unknown fields refused, JSON types taken as they are."""

MAX_N = 64
"""Sequences per prompt."""
MAX_BATCH = 4096
"""Requests per batch, prompts per completion call."""
MAX_STOP = 16
"""Stop strings per request."""
MAX_TOP_K = 2**31 - 1
"""Far past any vocabulary (top-k past it keeps all); integers past 64 bits fail inside
vLLM, whose processes exchange requests as msgpack."""
CATEGORY_PATTERN = r"^[A-Za-z0-9_.:/-]{1,64}$"
"""A request's ``category``: a short name, safe as a Prometheus label value."""
MAX_SEED = 2**53 - 1
"""The largest integer a JSON number holds exactly (an IEEE double: the OpenAPI document's
bounds are doubles, and so are many clients' numbers)."""


def integral(value: Any) -> Any:
    """``3.0`` as 3; anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]
"""An integer of a request: JSON has one number type, and ``3.0`` is the integer 3 (as
JSON Schema reads it); strings, booleans and fractions are refused. Constrained integers
carry their bounds before the validator (after it, in a union, pydantic would document
them under names JSON Schema does not know)."""
Count = Annotated[int, Field(ge=1), BeforeValidator(integral)]
"""An integer of at least 1."""
TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral)]
"""A token id (the vocabulary's size is the engine's to check)."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(integral)]
"""A sampling seed."""
StopString = Annotated[str, Field(min_length=1)]
"""A string that ends a sequence; the engines refuse an empty one."""
RESERVED_CATEGORIES = ("none", "other")
"""The labels the service itself gives: requests without a category, and past its list."""


def unreserved(category: str) -> str:
    """Refuse a category named like one of :data:`RESERVED_CATEGORIES`: its sequences would
    be counted with the uncategorized ones, or with those past the allow-list."""
    if category in RESERVED_CATEGORIES:
        raise ValueError(f"{category!r} is reserved: the service labels requests without a "
                         "category 'none' and those past its categories 'other'")
    return category


Category = Annotated[str, Field(pattern=CATEGORY_PATTERN, json_schema_extra={
    "not": {"enum": list(RESERVED_CATEGORIES)}}, description=(
    "Where the prompt comes from (task, data source: 'code', 'math', ...): the acceptance "
    "series get it as their 'category' label (the service's allow-list or its first "
    "categories; the rest as 'other'), and a batch's acceptance is summarized per "
    "category. 1-64 characters of letters, digits and _.:/-; not 'none' or 'other', the "
    "labels the service gives requests without one and past its list.")),
    AfterValidator(unreserved)]
"""A request's category (``telemetry.categories`` bounds the labels it becomes)."""


class ErrorBody(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: OpenAI's error shape, so OpenAI clients show the message."""

    error: ErrorBody
