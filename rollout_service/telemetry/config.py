"""The telemetry part of the service config: request categories and cost measurement.

Read once in the service process at startup (``ServiceConfig.telemetry``); the
exporters get its values, never the config object. Pure pydantic, no Prometheus.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_service.protocol.messages import CATEGORY_PATTERN

OTHER = "other"
"""Label of the categories past the allow-list or the first ``max_categories``."""
UNCATEGORIZED = "none"
"""Label of the requests that name no category."""


class TelemetryConfig(BaseModel):
    """What the exporters label and measure (``telemetry`` in the service config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    categories: list[str] | None = Field(None, description=(
        "Allow-list of request categories that get their own 'category' label on the "
        "acceptance series; any other category counts under 'other', a request without "
        "one under 'none'. None: the first max_categories categories seen get a label."))
    max_categories: int = Field(8, ge=0, le=64, description=(
        "Without an allow-list, how many categories get their own label, first seen first "
        "served (for the process's lifetime); later ones count under 'other'. Bounds the "
        "series a client can create."))
    verify_cost_batch_size: int = Field(8, ge=0, le=1024, description=(
        "Sequences per batch when the engine measures, at start-up, a verify step's cost "
        "over a plain decode step (the net speed-up's denominator); 0 skips the "
        "measurement and leaves the net speed-up unknown."))
    versions_kept: int = Field(4, ge=2, le=32, description=(
        "Weight versions whose trainer-side MTP accuracy stays exported (each version is a "
        "series; older ones are removed)."))

    @field_validator("categories")
    @classmethod
    def _valid_categories(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for name in value:
            if not re.fullmatch(CATEGORY_PATTERN, name):
                raise ValueError(f"{name!r} is not a category name ({CATEGORY_PATTERN})")
            if name in (OTHER, UNCATEGORIZED):
                raise ValueError(f"{name!r} is reserved (requests past the list, without one)")
        if len(set(value)) != len(value):
            raise ValueError("names a category twice")
        if len(value) > 64:
            raise ValueError(f"{len(value)} categories, at most 64")
        return value


class CategoryLabels:
    """A request's category -> its label value, with bounded cardinality.

    With an allow-list, a listed category is its own label and any other ``other``;
    without, the first ``max_categories`` categories seen are, and later ones ``other``.
    A request without a category is ``none``. Runs on the service's event loop (no lock).
    """

    def __init__(self, config: TelemetryConfig) -> None:
        self._is_allow_list = config.categories is not None
        self._known: set[str] = set(config.categories or ())
        self._max = config.max_categories

    @property
    def initial(self) -> tuple[str, ...]:
        """Labels that exist before any request: ``none``, ``other`` and the allow-list."""
        return (UNCATEGORIZED, OTHER, *sorted(self._known)) if self._is_allow_list \
            else (UNCATEGORIZED, OTHER)

    def label(self, category: str | None) -> str:
        """The label value of ``category`` (first seen, first labelled)."""
        if category is None:
            return UNCATEGORIZED
        if category in self._known:
            return category
        if not self._is_allow_list and len(self._known) < self._max:
            self._known.add(category)
            return category
        return OTHER
