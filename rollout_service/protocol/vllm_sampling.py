"""vLLM's sampling fields, as its OpenAI server and its token-in/token-out route take them.

Shared by the OpenAI messages (``protocol/openai.py``: vLLM's extensions of
``/v1/completions`` and ``/v1/chat/completions``) and vLLM's dialect
(``api/dialects/vllm``: ``sampling_params`` of ``POST /inference/v1/generate``); this
module holds only messages and the rule for fields outside them. The fields and their
defaults are vLLM 0.32's (vllm-project/vllm ``vllm/sampling_params.py``,
``vllm/entrypoints/openai/completion/protocol.py``).

Fields outside the model follow vLLM's convention: ignored, with a warning in the log
(:func:`ignore_extra_fields`), not a 400. The exception is a field that would change what
is sampled and that this service cannot honour (:data:`REFUSED_UNLESS`: beam search,
logit bias, grammars, ...): refused with a 400 naming it, unless it holds its neutral
value, so that no client gets different sampling than it asked for without knowing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rollout_service.protocol.messages import MAX_TOP_K, Int, TokenId, integral

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
"""Log-probabilities per position at most (vLLM's default ``max_logprobs``)."""

NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(integral)]
"""How many of the most likely tokens to return per position."""
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K), BeforeValidator(integral)]
"""Tokens kept by rank; -1 and 0 keep all."""

REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "logprob_token_ids": (None, []),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None, []),
    "guided_grammar": (None,),
    "response_format": (None, {"type": "text"}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "suffix": (None, ""),
    "echo": (None, False),
    "length_penalty": (1.0, 1),
    "logits_processors": (None, []),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "add_special_tokens": (None, True, False),
    "n_completions": (None,),
}
"""Fields vLLM honours that would change the sampled tokens, and the values that leave
sampling as this service does it (``add_special_tokens``: text prompts are tokenized
with the checkpoint's defaults either way, so both values are accepted)."""

_warned: set[str] = set()


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` values, with its JSON type (``0`` is not
    ``false``, as JSON Schema's ``enum`` reads it)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool)
               and (v is None) == (value is None) for v in neutral)


def neutral_values_schema(refused: dict[str, tuple[Any, ...]]
                          ) -> Callable[[dict[str, Any]], None]:
    """Adds the refused fields to a model's JSON Schema, each taking only its neutral
    values, so the OpenAPI document says which requests are refused."""
    def add(schema: dict[str, Any]) -> None:
        properties = schema.setdefault("properties", {})
        for name, values in refused.items():
            properties.setdefault(name, {"enum": list(values), "description": (
                "Not supported (it would change sampling): only these values are accepted.")})

    return add


LENIENT = ConfigDict(extra="allow", strict=True)
"""The config of a model that follows vLLM's rule for fields outside it: kept aside
(``model_extra``) for :func:`ignore_extra_fields` to refuse or warn about, never a 400 by
themselves; strict types for the fields it has."""


class IgnoringExtras(BaseModel):
    """A request model whose fields outside it follow :func:`ignore_extra_fields` (the
    dialects' weight routes: their frameworks send fields of later releases)."""

    model_config = LENIENT

    @model_validator(mode="after")
    def _extra(self) -> IgnoringExtras:
        ignore_extra_fields(self.model_extra, type(self).__name__)
        return self


def ignore_extra_fields(extra: dict[str, Any] | None, where: str) -> None:
    """vLLM's rule for the fields of a request outside its model (module docstring).

    Raises:
        ValueError: a field of :data:`REFUSED_UNLESS` with a value that would change
            sampling, naming the field.
    """
    if not extra:
        return
    for name, value in extra.items():
        neutral = REFUSED_UNLESS.get(name)
        if neutral is not None and not is_neutral(value, neutral):
            raise ValueError(f"{name}: {value!r} is not supported by this service (it would "
                             f"change sampling); leave it out")
    ignored = sorted(n for n in extra if n not in REFUSED_UNLESS)
    new = [n for n in ignored if f"{where}.{n}" not in _warned]
    if new:
        # vLLM warns once per request; a rollout sends thousands alike: once per field.
        _warned.update(f"{where}.{n}" for n in new)
        logger.warning("%s: ignored fields %s (not used by this service; warned once per "
                       "field)", where, new)


class VLLMSamplingFields(BaseModel):
    """vLLM's sampling extensions, beside OpenAI's fields (``extra_body`` of the openai
    client): each is honoured, with vLLM's meaning and default."""

    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=neutral_values_schema(REFUSED_UNLESS))

    top_k: TopK | None = Field(None, description=(
        "Tokens kept by rank; 0 or -1 keep all (vLLM's extension)."))
    min_p: float | None = Field(None, ge=0.0, le=1.0, description=(
        "Drop tokens below this fraction of the most likely one's probability (vLLM 0.32 "
        "refuses it with speculative decoding, and says so)."))
    min_tokens: Int = Field(0, ge=0, description=(
        "Tokens to generate before end-of-sequence or a stop token may end a choice."))
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description=(
        "Above 1, tokens already in the prompt or the output become less likely."))
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256, description=(
        "Token ids that end a choice (the token stays in its token ids)."))
    include_stop_str_in_output: bool = Field(False, description=(
        "Keep the matched stop string at the end of the text."))
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of text.")
    spaces_between_special_tokens: bool = True
    prompt_logprobs: NumLogprobs | None = Field(None, description=(
        "Each prompt token's log-probability and the N most likely at each prompt position "
        "(vLLM's shape: per position a map token id -> {logprob, rank, decoded_token})."))
    return_token_ids: bool | None = Field(None, description=(
        "Return each choice's token ids and the prompt's (vLLM's extension)."))
    return_tokens_as_token_ids: bool | None = Field(None, description=(
        "Logprob tokens as 'token_id:N' strings instead of their text."))
    request_id: str | None = Field(None, min_length=1, max_length=256, description=(
        "The id POST /abort_requests aborts this call by (vLLM's extension); default: the "
        "response's id."))
