"""vLLM's rollout dialect on the wire: token-in/token-out generation and the RL control
routes' answers; this module holds only messages.

Mirrors vllm-project/vllm 0.32 ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``
(``TokensRequest``, ``GenerateTokensResponse``, ``GenerateTokensStreamResponse``) and the
answers of ``vllm/entrypoints/rl/online/api_router.py``. As in vLLM, fields outside a
message are ignored with a warning, except those that would change sampling
(``protocol/vllm_sampling.py``); multimodal inputs are refused (text models only).
Responses add this service's per-choice ``spec_decode`` counts, which vLLM's clients
ignore; vLLM's own ``metrics.speculative_decoding`` is there too.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_service.protocol.messages import (
    MAX_N,
    MAX_STOP,
    Category,
    Int,
    Seed,
    SpecDecodeInfo,
    StopString,
    TokenId,
    WeightVersionSpan,
)
from rollout_service.protocol.openai import (
    ChatLogprobs,
    ChatMessage,
    CompletionUsage,
    PromptLogprobs,
    RequestMetrics,
    StreamOptions,
)
from rollout_service.protocol.vllm_sampling import (
    NumLogprobs,
    VLLMSamplingFields,
    ignore_extra_fields,
    neutral_values_schema,
)


class VLLMSamplingParams(VLLMSamplingFields):
    """vLLM's ``VLLMSamplingParams`` as JSON (``sampling_params`` of a token-in/token-out
    request), with vLLM's names and defaults."""

    n: Int = Field(1, ge=1, le=MAX_N, description=(
        "Sequences for the prompt; each is its own engine request, with its own acceptance."))
    max_tokens: Int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Seed | None = Field(None, description="Sequence i uses seed + i.")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    logprobs: NumLogprobs | None = Field(None, description=(
        "Each sampled token's log-probability, and the N most likely at each position."))
    detokenize: bool = Field(True, description="Needed for output_mode 'text'.")

    @model_validator(mode="after")
    def _extra_fields(self) -> VLLMSamplingParams:
        ignore_extra_fields(self.model_extra, "sampling_params")
        return self


class TokensRequest(BaseModel):
    """``POST /inference/v1/generate``: token ids in, token ids out."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=(
        neutral_values_schema({"features": (None,), "content_parts": (None,)})))

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1,
                            max_length=256, description=(
        "The id POST /abort_requests aborts this request by; echoed in the response."))
    token_ids: Annotated[list[TokenId], Field(min_length=1)] = Field(description=(
        "The prompt's token ids (each below the vocabulary size)."))
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    model: str | None = Field(None, description=(
        "The served model name; optional, as with vLLM. Another name is a 404."))
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description=(
        "Return the prompt's token ids too (prompt_token_ids)."))
    output_mode: Literal["tokens", "text"] = Field("tokens", description=(
        "'text' adds each choice's detokenized text, and logprobs with token strings."))
    category: Category | None = Field(None, description=(
        "Not vLLM's: the acceptance series' 'category' label for this request."))

    @model_validator(mode="after")
    def _extra_fields(self) -> TokensRequest:
        extra = dict(self.model_extra or {})
        for name in ("features", "content_parts"):
            if extra.pop(name, None) is not None:
                raise ValueError(f"{name}: multimodal inputs are not supported by this "
                                 "service (text models only)")
        ignore_extra_fields(extra, "TokensRequest")
        return self


class TokenLogprob(BaseModel):
    """One candidate: vLLM's ``GenerateLogProb``."""

    token_id: int
    logprob: float
    rank: int | None = None


class TokenLogprobsContent(TokenLogprob):
    """The sampled token at one position, then its candidates (the sampled token first,
    then the most likely in rank order, as vLLM sends them)."""

    top_logprobs: list[TokenLogprob] = Field(default_factory=list)


class TokenLogprobs(BaseModel):
    content: list[TokenLogprobsContent] | None = None


class TokensChoice(BaseModel):
    """One sequence of a token-in/token-out response."""

    index: int
    finish_reason: Literal["stop", "length", "abort"] | None = Field(description=(
        "'abort': aborted (a client's abort, a pause in mode abort) with its tokens so far."))
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: TokenLogprobs | ChatLogprobs | None = None
    text: str | None = Field(None, description="output_mode 'text' only.")
    weight_versions: list[WeightVersionSpan] | None = Field(None, description=(
        "Which weight version produced which output tokens."))
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension: this sequence's acceptance counts."))


class TokensResponse(BaseModel):
    """The answer of ``POST /inference/v1/generate`` (vLLM's ``GenerateTokensResponse``)."""

    request_id: str
    model: str
    created: int
    choices: list[TokensChoice]
    usage: CompletionUsage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = Field(None, description=(
        "vLLM's per-request acceptance (n = 1 only, as vLLM gives it)."))


class TokensStreamChoice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = Field(description="The tokens since this choice's previous chunk.")
    logprobs: TokenLogprobs | ChatLogprobs | None = None
    text: str | None = Field(None, description="output_mode 'text': the text since the last.")
    weight_versions: list[WeightVersionSpan] | None = Field(None, description=(
        "On the final chunk only: covers the whole output."))
    spec_decode: SpecDecodeInfo | None = Field(None, description="On the final chunk.")


class TokensStreamResponse(BaseModel):
    """One event of a streamed ``/inference/v1/generate``."""

    request_id: str
    choices: list[TokensStreamChoice]
    prompt_token_ids: list[int] | None = Field(None, description=(
        "With return_token_ids: on the first chunk only."))
    usage: CompletionUsage | None = Field(None, description=(
        "On the last chunk (no choices) with stream_options.include_usage."))
    metrics: RequestMetrics | None = None


# --- tokenization (vllm/entrypoints/serve/tokenize/protocol.py) -----------------------

class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a text (``prompt``) or a conversation (``messages``, by the
    checkpoint's chat template, with the generation prompt)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = Field(True, description="Text prompts only.")
    return_token_strs: bool = Field(False, description="Each token's text too.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        ignore_extra_fields(self.model_extra, "TokenizeRequest")
        return self


class TokenizeAnswer(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeAnswer(BaseModel):
    prompt: str


# --- the RL control routes (vllm/entrypoints/rl/online/api_router.py) ----------------

class PauseAnswer(BaseModel):
    status: Literal["paused"] = "paused"


class ResumeAnswer(BaseModel):
    status: Literal["resumed"] = "resumed"


class IsPausedAnswer(BaseModel):
    is_paused: bool


class AbortRequests(BaseModel):
    """``POST /abort_requests``: these requests (their ``request_id``); empty or missing:
    every running request."""

    request_ids: list[str] | None = None


class AbortAnswer(BaseModel):
    status: Literal["aborted"] = "aborted"
    aborted: int = Field(description="Engine requests told to abort.")


class ResetPrefixCacheAnswer(BaseModel):
    success: bool = Field(description=(
        "False while running requests hold cached blocks (retry, or pause first)."))


class SuccessAnswer(BaseModel):
    """AReaL's patched vLLM server's answer (``areal/engine/vllm_ext/areal_vllm_server.py``,
    ``to_json_response``)."""

    success: bool
    message: str


class WorldSizeAnswer(BaseModel):
    world_size: int


class WeightInfoAnswer(BaseModel):
    weight_version: str = Field(description=(
        "The served main model's version, as vLLM's weight_version string ('default' "
        "before any push)."))
