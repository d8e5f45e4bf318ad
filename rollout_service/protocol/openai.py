"""OpenAI-shaped HTTP messages as vLLM's OpenAI server takes and gives them
(``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``); this module holds
nothing else.

Shared by the service (``api/openai.py``, ``completions.py``) and its clients. OpenAI's
fields plus vLLM's sampling extensions (``protocol/vllm_sampling.py``: ``min_tokens``,
``stop_token_ids``, ``repetition_penalty``, ``prompt_logprobs``, ``return_token_ids``...),
as vllm-project/vllm ``vllm/entrypoints/openai/completion/protocol.py`` and
``chat_completion/protocol.py`` define them. ``model`` may be left out, as with vLLM; a
model other than the served one is a 404. Fields outside these follow vLLM's rule
(ignored with a warning, or refused when they would change sampling). Like every
request of this service, they take JSON types as they are (strict: ``"1"`` is not ``1``).

Responses carry OpenAI's fields, vLLM's extensions (``token_ids``, ``prompt_token_ids``,
``prompt_logprobs``, ``stop_reason``, ``metrics.speculative_decoding``) and this
service's, which OpenAI clients ignore: ``spec_decode`` on a choice (that sequence's
acceptance counts; streamed, on the final chunk of each sequence) and ``acceptance`` (the
call's summary; streamed, on the usage chunk). A stream (``stream: true``) is server-sent
events (``protocol/sse.py``), one ``*Chunk`` message each, then ``[DONE]``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

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
)
from rollout_service.protocol.vllm_sampling import (
    LENIENT,
    NumLogprobs,
    VLLMSamplingFields,
    ignore_extra_fields,
)

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
    model_config = LENIENT

    include_usage: bool = Field(False, description=(
        "Send one more chunk before [DONE], with no choices, the call's usage and its "
        "acceptance summary."))


class _OpenAISampling(VLLMSamplingFields):
    """Fields shared by completion and chat requests."""

    model: str | None = Field(None, description=(
        "The served model name (see /v1/models); optional, as with vLLM. Another name is "
        "a 404."))
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

    @model_validator(mode="after")
    def _extra_fields(self) -> _OpenAISampling:
        ignore_extra_fields(self.model_extra, type(self).__name__)
        return self


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_BATCH)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
             ) = Field(description="Text, texts, token ids, or lists of token ids.")
    max_tokens: Int = Field(16, ge=1)
    logprobs: NumLogprobs | None = Field(None, description=(
        "Each sampled token's log-probability, and the N most likely at each position."))
    echo: bool = Field(False, description=(
        "The prompt before each choice's text, and with logprobs, the prompt's logprobs "
        "before the choice's (prompt_logprobs defaults to logprobs then), as vLLM does."))


ChatRole = Literal["system", "developer", "user", "assistant"]


class ChatTextPart(BaseModel):
    model_config = LENIENT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = LENIENT

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
    logprobs: bool = Field(False, description="Each sampled token's log-probability.")
    top_logprobs: NumLogprobs | None = Field(None, description=(
        "With logprobs: the N most likely tokens at each position too."))


# --- responses ---------------------------------------------------------------------

class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion choice (or of a chunk's new tokens)."""

    tokens: list[str] = Field(description=(
        "Each token's text, or 'token_id:N' with return_tokens_as_token_ids."))
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(description=(
        "Per position, by token: the sampled token's logprob, then the N most likely."))
    text_offset: list[int]


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobsContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """OpenAI's logprobs of a chat choice: one entry per token."""

    content: list[ChatLogprobsContent] | None = None


class PromptLogprob(BaseModel):
    """One candidate at a prompt position, as vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt position (the first is null), the prompt's
token and the N most likely, by token id."""


class SpeculativeDecodingMetrics(BaseModel):
    """vLLM's per-request acceptance (``metrics.speculative_decoding`` of its responses,
    vllm-project/vllm ``vllm/entrypoints/generate/base/protocol.py``)."""

    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int] = Field(description=(
        "Index j: verify steps that accepted exactly j draft tokens (k + 1 entries)."))
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int


class RequestMetrics(BaseModel):
    """vLLM's ``metrics`` of a response: given, as vLLM gives them, only for a call of one
    prompt and one choice (with several, each choice's ``spec_decode`` has its own)."""

    speculative_decoding: SpeculativeDecodingMetrics | None = None


class _VLLMChoiceFields(BaseModel):
    stop_reason: int | str | None = Field(None, description=(
        "vLLM's: the stop string or token id that ended the choice."))
    token_ids: list[int] | None = Field(None, description=(
        "vLLM's, with return_token_ids: the choice's token ids."))
    spec_decode: SpecDecodeInfo | None = Field(None, description=(
        "Extension: this choice's acceptance counts (None without speculative decoding)."))


class CompletionChoice(_VLLMChoiceFields):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description=(
        "vLLM's, with return_token_ids: the prompt's token ids."))
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    metrics: RequestMetrics | None = None
    acceptance: AcceptanceSummary = Field(description="Extension: this call's acceptance.")


class CompletionStreamChoice(_VLLMChoiceFields):
    index: int
    text: str = Field(description="The text since this choice's previous chunk.")
    finish_reason: FinishReason | None = Field(description="Set on the choice's final chunk.")
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description=(
        "vLLM's, with return_token_ids: on the choice's first chunk."))


class CompletionChunk(BaseModel):
    """One event of a streamed ``/v1/completions`` (OpenAI's completion chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: CompletionUsage | None = Field(None, description=(
        "On the last chunk (no choices) when stream_options.include_usage is set."))
    metrics: RequestMetrics | None = Field(None, description="On the usage chunk.")
    acceptance: AcceptanceSummary | None = Field(None, description=(
        "Extension, on the usage chunk: the call's acceptance."))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_VLLMChoiceFields):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_token_ids: list[int] | None = Field(None, description=(
        "vLLM's, with return_token_ids: the templated prompt's token ids."))
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    acceptance: AcceptanceSummary = Field(description="Extension: this call's acceptance.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="On each choice's first chunk.")
    content: str | None = None


class ChatStreamChoice(_VLLMChoiceFields):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = Field(description="Set on the choice's final chunk.")
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed ``/v1/chat/completions`` (OpenAI's chat completion chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    prompt_token_ids: list[int] | None = Field(None, description=(
        "vLLM's, with return_token_ids: on the first chunk."))
    usage: CompletionUsage | None = Field(None, description=(
        "On the last chunk (no choices) when stream_options.include_usage is set."))
    metrics: RequestMetrics | None = Field(None, description="On the usage chunk.")
    acceptance: AcceptanceSummary | None = Field(None, description=(
        "Extension, on the usage chunk: the call's acceptance."))
