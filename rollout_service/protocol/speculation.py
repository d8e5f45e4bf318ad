"""HTTP messages of the speculation control: its state in ``/health`` and the pin request.

Shared by the server and its clients like ``protocol/messages.py`` (whose ``HealthResponse``
embeds :class:`SpeculationControlStatus`); messages only. A schedule travels as a list of
``{batch_size, k}`` entries, not a JSON object: object keys are strings, and requests take
JSON types as they are.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

MAX_SCHEDULE_ENTRIES = 64
"""Buckets in a pinned schedule: far past any useful table."""


def _integral(value: object) -> object:
    """``3.0`` as 3 (JSON Schema's reading); anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class ScheduleEntry(BaseModel):
    """One bucket of a K schedule: batch sizes above the previous entry's up to
    ``batch_size`` run ``k`` draft tokens (past the last entry, its ``k``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    batch_size: Annotated[int, Field(ge=1), BeforeValidator(_integral)] = Field(
        description="The bucket's upper edge.")
    k: Annotated[int, Field(ge=0), BeforeValidator(_integral)] = Field(
        description="Draft tokens per step; at most the engine's num_speculative_tokens.")


class PinScheduleRequest(BaseModel):
    """``POST /speculation/schedule``: run this schedule whatever the controller decides
    (null: back to the controller's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    schedule: Annotated[list[ScheduleEntry],
                        Field(min_length=1, max_length=MAX_SCHEDULE_ENTRIES)] | None = Field(
        description=("Entries with distinct batch sizes; null unpins. A K above the engine's "
                     "num_speculative_tokens is refused (400) and the schedule in force "
                     "stays."))

    @field_validator("schedule")
    @classmethod
    def _distinct(cls, entries: list[ScheduleEntry] | None) -> list[ScheduleEntry] | None:
        sizes = [e.batch_size for e in entries or ()]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"batch sizes must be distinct, got {sizes}")
        return entries

    def table(self) -> dict[int, int] | None:
        """The schedule as a batch size -> K table; None unpins."""
        return None if self.schedule is None else {e.batch_size: e.k for e in self.schedule}


class BucketStatus(BaseModel):
    """One batch-size bucket of the controller."""

    batch_size: int = Field(description="The bucket's upper edge.")
    k: int = Field(description="Draft tokens the engine runs at this batch size.")
    reason: str = Field(description=(
        "Why: the controller's reason ('best expected throughput', 'hysteresis hold', "
        "'acceptance collapsed', 'no cost data', 'step cost extrapolated', 'probing the "
        "drafter') or 'pinned'."))
    controller_k: int = Field(description=(
        "The controller's K; differs from k while pinned or while a change is on its way "
        "to the engine."))
    tokens_per_s: list[float | None] = Field(description=(
        "Expected throughput by K = 0..k_max at this batch size; null without cost data."))


class StepCostPoint(BaseModel):
    """One point of the step-cost table c(K, B)."""

    k: int
    batch_size: int
    step_s: float = Field(description="Seconds per engine step (blended measurements).")
    num_samples: int = Field(1, description=(
        "Measurements blended into step_s (the calibration's and the engine's live steps)."))
    last_step_s: float | None = Field(None, description=(
        "The latest of them, as measured: far from step_s, the point is still moving."))


class SpeculationControlStatus(BaseModel):
    """The speculation controller's state (``/health``)."""

    k_max: int = Field(description="The engine's num_speculative_tokens: the largest K.")
    drafter_at_k0: Literal["run", "skip"] = Field("run", description=(
        "Whether steps at K = 0 still run the drafter: speculation_control.drafter_at_k0 as "
        "the engine resolved it at its start (auto: skip where the engine can, else run)."))
    buckets: list[BucketStatus]
    is_collapsed: bool = Field(description="Acceptance collapsed: K = 0 everywhere.")
    is_probing: bool = Field(description="Small buckets run K >= 1 to measure a drafter.")
    collapse_rate: float | None = Field(description=(
        "Pooled first-position acceptance of the collapse window; null while it is empty."))
    acceptance: list[float] = Field(description=(
        "Conditional acceptance per 0-based draft position, as the decisions use it."))
    draft_version: int | None = Field(description="Drafter version of the estimate.")
    num_observations: int = Field(description="Finished sequences counted.")
    last_batch_size: int | None = Field(description="Engine batch size at the last one.")
    pinned: list[ScheduleEntry] | None = Field(description="The pinned schedule, if any.")
    engine_schedule: list[ScheduleEntry] | None = Field(description=(
        "The schedule the engine runs, as it read it back; null before the first apply."))
    cost_table: list[StepCostPoint] = Field(description="c(K, B) as measured.")
    calibration_s: float | None = Field(description=(
        "Seconds the start-up calibration took; null if it did not run."))
    num_applied: int = Field(description="Schedules the engine took.")
    num_refused: int = Field(description="Schedules the engine refused.")
    last_error: str | None = Field(description="Why the last refused schedule was refused.")
