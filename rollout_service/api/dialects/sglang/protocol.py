"""SGLang's rollout dialect on the wire: ``/generate`` and the control routes' answers;
this module holds only messages.

Mirrors sgl-project/sglang 0.5.23 ``python/sglang/srt/managers/io_struct.py``
(``GenerateReqInput``, ``AbortReq``, ``PauseGenerationReqInput``) and
``python/sglang/srt/sampling/sampling_params.py``, as slime, AReaL's SGLang backend and
NeMo-RL's SGLang path send them. As in SGLang, a single prompt answers with one object
and a batch (a list of prompts, or ``n`` > 1) with a list. Fields outside these are
ignored with a warning; those that would change sampling and that this service cannot
honour (grammars, logit bias, beam search, multimodal inputs...) are refused, naming the
field, unless they hold their neutral value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from rollout_service.protocol.messages import (
    MAX_BATCH,
    MAX_N,
    MAX_STOP,
    Category,
    Count,
    Int,
    Seed,
    StopString,
    TokenId,
    integral,
)
from rollout_service.protocol.vllm_sampling import (
    LENIENT,
    NumLogprobs,
    TopK,
    ignore_extra_fields,
    is_neutral,
    neutral_values_schema,
)

_SAMPLING_REFUSED: dict[str, tuple[Any, ...]] = {
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "beam_width": (None, 1),
    "stop_regex": (None, [], ""),
}
"""SGLang sampling fields that would change what is sampled, and their neutral values
(``custom_params`` is not one: SGLang hands it only to a custom logit processor, and
``custom_logit_processor`` is refused; slime sends it with ``--rollout-top-p`` < 1)."""
_REQUEST_REFUSED: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []),
    "audio_data": (None, []), "lora_path": (None,), "custom_logit_processor": (None,),
    "session_params": (None,), "token_ids_logprob": (None, []),
}
"""Request fields this service cannot honour (multimodal inputs, LoRA, sessions...)."""


def _is_none(value: Any) -> bool:
    return value is None


def omitted_if_none(description: str | None = None) -> Any:
    """An optional answer field left out when unset, as SGLang's dicts leave it out."""
    return Field(None, exclude_if=_is_none, description=description)


def _refuse_or_ignore(extra: dict[str, Any] | None, refused: dict[str, tuple[Any, ...]],
                      where: str) -> None:
    extra = dict(extra or {})
    for name, neutral in refused.items():
        value = extra.pop(name, None)
        if not is_neutral(value, neutral):
            raise ValueError(f"{name}: {value!r} is not supported by this service; leave it "
                             "out")
    ignore_extra_fields(extra, where)


class SGLangSamplingParams(BaseModel):
    """SGLang's ``sampling_params``, with its names and defaults."""

    model_config = ConfigDict(**LENIENT, json_schema_extra=neutral_values_schema(
        _SAMPLING_REFUSED))

    max_new_tokens: Count | None = Field(128, description="None: SGLang's 128.")
    min_new_tokens: Int = Field(0, ge=0)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: TopK | None = Field(-1, description="-1 (or 0) keeps all.")
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in the text.")
    n: Int = Field(1, ge=1, le=MAX_N, description=(
        "Sequences per prompt; each is its own engine request, with its own acceptance."))
    sampling_seed: Seed | None = Field(None, description="Sequence i uses seed + i.")

    @model_validator(mode="after")
    def _extra_fields(self) -> SGLangSamplingParams:
        custom = (self.model_extra or {}).get("custom_params")
        if isinstance(custom, dict) and custom.get("return_top_p_token_ids"):
            # slime's top-p replay: only slime's patched SGLang answers it (THUDM/slime
            # docker/patch/latest/sglang-top_p.patch), and slime asserts the answer on every
            # sample, so a stock server fails it a whole rollout later; fail it now.
            raise ValueError("custom_params.return_top_p_token_ids: the top-p replay of "
                             "slime's patched SGLang is not supported; run slime with "
                             "--rollout-top-p 1")
        _refuse_or_ignore(self.model_extra, _SAMPLING_REFUSED, "sampling_params")
        return self


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _one_or_list(value: Any) -> str:
    """A batch field's shape by its JSON type, so that a refusal names only its own."""
    return "per-prompt" if isinstance(value, list) else "one"



StartLen = Annotated[int, Field(ge=-1), BeforeValidator(integral)]
"""A prompt position; -1: none."""
_ONE_PROMPT = {"oneOf": [{"required": ["text"], "properties": {"text": {"not": {"type": "null"}}}},
                         {"required": ["input_ids"],
                          "properties": {"input_ids": {"not": {"type": "null"}}}}]}
"""Exactly one of ``text`` and ``input_ids`` is given and not null, in JSON Schema."""


def _request_schema(schema: dict[str, Any]) -> None:
    neutral_values_schema(_REQUEST_REFUSED)(schema)
    schema.update(_ONE_PROMPT)


class GenerateReqInput(BaseModel):
    """``POST /generate`` in SGLang's shape: ``text`` or ``input_ids`` (one prompt or a
    batch), told apart from the native ``/generate`` by these keys (``api/dialects``)."""

    model_config = ConfigDict(**LENIENT, json_schema_extra=_request_schema)

    text: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]],
                       Field(min_length=1, max_length=MAX_BATCH)] | None) = None
    input_ids: (TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
                | None) = None
    sampling_params: Annotated[
        Annotated[SGLangSamplingParams, Tag("one")]
        | Annotated[list[SGLangSamplingParams], Tag("per-prompt")],
        Discriminator(_one_or_list)] | None = Field(
        None, description="One for every prompt, or one per prompt of a batch.")
    rid: str | list[str] | None = Field(None, description=(
        "The id /abort_request aborts a prompt's sequences by (a batch: one per prompt)."))
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: StartLen | list[StartLen] | None = Field(None, description=(
        "With return_logprob: the prompt position from which prompt logprobs are returned "
        "(-1 or None: none)."))
    top_logprobs_num: NumLogprobs | list[NumLogprobs] | None = None
    return_text_in_logprobs: bool = Field(False, description=(
        "Each logprob entry's third element: the token's text (else null)."))
    stream: bool = False
    category: Category | None = Field(None, description=(
        "Not SGLang's: the acceptance series' 'category' label for this request."))

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        _refuse_or_ignore(self.model_extra, _REQUEST_REFUSED, "GenerateReqInput")
        return self

    @property
    def is_batch(self) -> bool:
        """A list of prompts (SGLang then answers with a list)."""
        if self.text is not None:
            return isinstance(self.text, list)
        assert self.input_ids is not None
        return isinstance(self.input_ids[0], list)


class FinishReason(BaseModel):
    """SGLang's ``finish_reason``: ``{"type": "stop", "matched": token id or string}``,
    ``{"type": "length", "length": N}`` or ``{"type": "abort", "message": ...}``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = omitted_if_none()
    length: int | None = omitted_if_none()
    message: str | None = omitted_if_none()


LogprobEntry = tuple[float | None, int, str | None]
"""``[logprob, token id, text or null]`` (the first prompt position's logprob is null)."""


class MetaInfo(BaseModel):
    """A ``/generate`` answer's ``meta_info``, with the acceptance counts under SGLang's
    0.5.23 names and the older ones slime reads (``spec_accept_token_num``,
    ``spec_draft_token_num``)."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None = Field(description="null until the last event.")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = Field(description=(
        "The main model's weight version when the sequence ended."))
    weight_versions: list[dict[str, Any]] | None = omitted_if_none(
        "Which version produced which output tokens: [{version, start, end}].")
    output_token_logprobs: list[LogprobEntry] | None = omitted_if_none()
    output_top_logprobs: list[list[LogprobEntry] | None] | None = omitted_if_none()
    input_token_logprobs: list[LogprobEntry] | None = omitted_if_none()
    input_top_logprobs: list[list[LogprobEntry] | None] | None = omitted_if_none()


class GenerateOutput(BaseModel):
    """One sequence of a ``/generate`` answer (a stream's event has the same shape, with
    the text and ``output_ids`` so far, as SGLang sends by default)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = omitted_if_none("Streamed batches: the sequence's index.")


class AbortReq(BaseModel):
    """``POST /abort_request``: one request by ``rid``, or every one (``abort_all``)."""

    model_config = LENIENT

    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(BaseModel):
    """``POST /pause_generation``: ``abort`` the running requests, or hold them (``retract``,
    ``in_place``: both resume on ``/continue_generation`` here)."""

    model_config = LENIENT

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    model_config = LENIENT

    torch_empty_cache: bool = True


class StatusAnswer(BaseModel):
    message: str
    status: Literal["ok"] = "ok"


class WeightVersionAnswer(BaseModel):
    weight_version: str = Field(description="The main model's; 'default' before any push.")


class ServerInfo(BaseModel):
    """``GET /server_info`` (``/get_server_info``): the server arguments an SGLang client
    reads to size and check an engine (slime ``slime/backends/sglang_utils/external.py``:
    ``tp_size``, ``pp_size``, ``dp_size``, ``ep_size``); one engine of this service, with
    no data or expert parallelism."""

    model_path: str
    served_model_name: str
    tp_size: int
    pp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    moe_dp_size: int = 1
    num_gpus: int
    context_length: int
    speculative_algorithm: str | None = Field(description=(
        "The engine's speculative method (vLLM's name, e.g. 'mtp'); None when off."))
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    disaggregation_mode: Literal["null"] = "null"
    enable_memory_saver: bool = False
    weight_version: str
    version: str = Field(description="This service, not SGLang.")
    internal_states: list[dict[str, Any]] = Field(default_factory=list)


class ModelInfo(BaseModel):
    """``GET /model_info`` (``/get_model_info``)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool = True
    weight_version: str


class Load(BaseModel):
    """One engine's load, as one DP rank of SGLang's ``/v1/loads`` (its ``core`` section)."""

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int = 0


class LoadsAnswer(BaseModel):
    """``GET /v1/loads``: slime polls it after ``/abort_request`` until nothing runs."""

    timestamp: str
    version: str
    accelerator: str | None = None
    num_accelerators: int
    loads: list[Load]
