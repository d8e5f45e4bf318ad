"""Generation's messages: ``/generate`` and ``/generate_batch``, their sequences and
acceptance.

Part of :mod:`rollout_service.protocol.messages`. OpenAI-shaped messages are in
``protocol/openai.py``, the dialects' in ``api/dialects/*/protocol.py``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_service.protocol.acceptance import BatchSummary, SpecDecodeStats
from rollout_service.protocol.messages.common import (
    MAX_BATCH,
    MAX_N,
    MAX_STOP,
    MAX_TOP_K,
    STRICT,
    Category,
    Int,
    Seed,
    StopString,
    TokenId,
)


class SamplingFields(BaseModel):
    """Sampling parameters shared by ``/generate`` requests."""

    model_config = STRICT

    max_tokens: Int = Field(16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0,
                               description="Sampling temperature; 0 is greedy (OpenAI's range).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus probability mass kept.")
    top_k: Int = Field(0, ge=0, le=MAX_TOP_K, description=(
        "Tokens kept by rank; 0 keeps all (and so does any k past the vocabulary)."))
    seed: Seed | None = Field(None, description=(
        "Seed for reproducible sampling; sequence i of a request with n > 1 uses seed + i."))
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP,
                                   description="Strings that end a sequence (non-empty).")
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence (benchmarks).")
    logprobs: bool = Field(False, description="Return each sampled token's log-probability.")


_ONE_PROMPT = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    {"required": ["prompt_token_ids"], "properties": {"prompt_token_ids": {"type": "array"}}},
]}
"""Exactly one of the two prompt fields is given and not null, in JSON Schema."""


class GenerateRequest(SamplingFields):
    """One prompt, ``n`` sequences; give exactly one of ``prompt`` and ``prompt_token_ids``."""

    model_config = ConfigDict(json_schema_extra=_ONE_PROMPT)

    prompt: Annotated[str, Field(min_length=1)] | None = Field(None, description=(
        "Prompt text (tokenized by the server)."))
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None \
        = Field(None, description="Prompt as token ids (each below the vocabulary size).")
    n: Int = Field(1, ge=1, le=MAX_N, description=(
        "Sequences to sample; each runs as its own engine request so each has exact stats."))
    category: Category | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' and 'prompt_token_ids'")
        return self


class WeightVersionSpan(BaseModel):
    """Output tokens ``[start, end)`` were produced by weights labelled ``version``."""

    model_config = ConfigDict(frozen=True)

    version: str
    start: int
    end: int


class SpecDecodeInfo(BaseModel):
    """One sequence's speculative-decoding counts and ratios (see ``protocol.acceptance``)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    accepted_per_position: list[int]
    accept_rate: float | None = Field(description="None when nothing was drafted.")
    accept_length: float = Field(description="1 + accepted / drafts; 1.0 without drafts.")
    num_rejected_tokens: int = Field(0, description=(
        "Drafted tokens the target rejected: work computed and thrown away."))
    verify_cost_ratio: float | None = Field(None, description=(
        "Time of this sequence's verify steps over plain decode steps: with the speculation "
        "control, the measured cost at the K each step ran (c(K, B) / c(0, B)), else the "
        "engine's start-up figure at the largest K (docs/telemetry.md); None when not "
        "measured."))
    net_speedup: float | None = Field(None, description=(
        "accept_length / verify_cost_ratio: below 1, speculation slowed this sequence down; "
        "None without drafts or without a measured cost ratio."))

    def to_stats(self) -> SpecDecodeStats:
        """The counts, for ``protocol.acceptance.summarize`` on the client side."""
        return SpecDecodeStats(
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, num_verify_steps=self.num_verify_steps,
            accepted_per_position=tuple(self.accepted_per_position),
            verify_cost_ratio=self.verify_cost_ratio)


AcceptanceSummary = BatchSummary
"""Acceptance over a response's sequences: ``protocol.acceptance.BatchSummary`` itself, so
the wire carries exactly the figures (and definitions) Prometheus exports."""


class SequenceOutput(BaseModel):
    """One generated sequence."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    weight_versions: list[WeightVersionSpan]
    spec_decode: SpecDecodeInfo | None


class GenerateResponse(BaseModel):
    """The ``n`` sequences of one prompt and their acceptance summary."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput]
    acceptance: AcceptanceSummary
    replica: str | None = Field(None, description=(
        "Ray Serve: the replica that generated this response; None when standalone."))


class BatchGenerateRequest(BaseModel):
    """Many prompts in one call; the answer summarizes acceptance over all of them."""

    model_config = STRICT

    requests: list[GenerateRequest] = Field(min_length=1, max_length=MAX_BATCH)


class BatchGenerateResponse(BaseModel):
    """One response per request, in order, and the batch's acceptance summary."""

    responses: list[GenerateResponse]
    acceptance: AcceptanceSummary
    acceptance_by_category: dict[str, AcceptanceSummary] = Field(default_factory=dict, description=(
        "The same summary over the sequences of each category the requests named (as named: "
        "not bounded like the metric labels); requests without one are left out here."))

