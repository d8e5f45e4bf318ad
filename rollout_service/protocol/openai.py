"""OpenAI-shaped HTTP messages (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``); this module holds nothing else.

Shared by the service (``api/openai.py``, ``completions.py``) and its clients. The
subset of OpenAI's fields the official ``openai`` client and evaluation harnesses
send; requests reject unknown fields and, like every request of this service, take
JSON types as they are (strict: ``"1"`` is not ``1``). The constraints live in the
fields, so the OpenAPI document states them.

Responses carry OpenAI's fields plus this service's extensions, which OpenAI
clients ignore: ``spec_decode`` on a choice (that sequence's acceptance counts;
streamed, on the final chunk of each sequence) and ``acceptance`` (the call's
summary; streamed, on the usage chunk). A stream (``stream: true``) is server-sent
events (``protocol/sse.py``), one ``*Chunk`` message each, then ``[DONE]``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from rollout_service.protocol.messages import (
    MAX_BATCH,
    MAX_N,
    MAX_STOP,
    AcceptanceSummary,
    Category,
    Count,
    Int,
    Seed,
    SpecDecodeInfo,
    StopString,
    TokenId,
    integral,
)

_STRICT = ConfigDict(extra="forbid", strict=True)

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None
FinishReason = Literal["stop", "length", "abort"]
"""``abort``: the engine aborted the sequence (OpenAI has no such reason)."""


# --- /v1/models ------------------------------------------------------------------

class ModelCard(BaseModel):
    """The served model."""

    id: str = Field(description="The served model name (``served_model_name``).")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the service started.")
    owned_by: str


class ModelList(BaseModel):
    """``GET /v1/models``: the one served model."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- requests ----------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = Field(False, description=(
        "Send one more chunk before [DONE], with no choices, the call's usage and its "
        "acceptance summary."))


class _OpenAISampling(BaseModel):
    """Fields shared by completion and chat requests."""

    model_config = _STRICT

    model: str = Field(description="Any name; the served model answers (see /v1/models).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Int = Field(1, ge=1, le=MAX_N, description=(
        "Choices per prompt; each is its own engine request, with its own acceptance."))
    stop: Stop = Field(None, description="Strings that end a choice (non-empty).")
    seed: Seed | None = Field(None, description="Choice i uses seed + i.")
    stream: bool = Field(False, description="Answer as server-sent events of chunks.")
    stream_options: StreamOptions | None = None
    user: str | None = None
    category: Category | None = Field(None, description=(
        "Not OpenAI's: an extra field (the openai client's extra_body) naming where the "
        "prompt comes from; the acceptance series get it as their 'category' label."))


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``; fields outside this subset are rejected."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_BATCH)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
             ) = Field(description="Text, texts, token ids, or lists of token ids.")
    max_tokens: Int = Field(16, ge=1)
    logprobs: Annotated[int, Field(ge=0, le=0), BeforeValidator(integral)] | None = Field(
        None, description=(
        "Only 0 (the sampled token); accepted for compatibility, not returned."))
    echo: bool = Field(False, json_schema_extra={"const": False}, description=(
        "Only false: the prompt is not repeated."))

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("only false is supported")
        return echo


ChatRole = Literal["system", "developer", "user", "assistant"]


class ChatTextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = _STRICT

    role: ChatRole
    content: str | Annotated[list[ChatTextPart], Field(min_length=1)] = Field(description=(
        "Text, or text parts (joined)."))

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    """``POST /v1/chat/completions``: the checkpoint's chat template turns ``messages``
    into the prompt; a checkpoint without one answers 400."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_BATCH)
    max_tokens: Count | None = Field(None, description=(
        "Tokens to generate at most; None: up to the model's context."))
    max_completion_tokens: Count | None = Field(None, description=(
        "OpenAI's newer name for max_tokens; wins when both are given."))


# --- responses ---------------------------------------------------------------------

class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension: this choice's acceptance counts (None without speculative decoding)."))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    acceptance: AcceptanceSummary = Field(description="Extension: this call's acceptance.")


class CompletionStreamChoice(BaseModel):
    index: int
    text: str = Field(description="The text since this choice's previous chunk.")
    finish_reason: FinishReason | None = Field(description="Set on the choice's final chunk.")
    logprobs: None = None
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension, on the choice's final chunk: its acceptance counts."))


class CompletionChunk(BaseModel):
    """One event of a streamed ``/v1/completions`` (OpenAI's completion chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: CompletionUsage | None = Field(None, description=(
        "On the last chunk (no choices) when stream_options.include_usage is set."))
    acceptance: AcceptanceSummary | None = Field(None, description=(
        "Extension, on the usage chunk: the call's acceptance."))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension: this choice's acceptance counts (None without speculative decoding)."))


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    acceptance: AcceptanceSummary = Field(description="Extension: this call's acceptance.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="On each choice's first chunk.")
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = Field(description="Set on the choice's final chunk.")
    logprobs: None = None
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension, on the choice's final chunk: its acceptance counts."))


class ChatCompletionChunk(BaseModel):
    """One event of a streamed ``/v1/chat/completions`` (OpenAI's chat completion chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: CompletionUsage | None = Field(None, description=(
        "On the last chunk (no choices) when stream_options.include_usage is set."))
    acceptance: AcceptanceSummary | None = Field(None, description=(
        "Extension, on the usage chunk: the call's acceptance."))
