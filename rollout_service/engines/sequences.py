"""What one sequence asks of an engine and what it gives back: engine-neutral values.

Every dialect (the native API, vLLM's OpenAI and token-in/token-out routes, SGLang's
``/generate``) translates its request into :class:`SamplingOptions` and its response out of
:class:`GenerationResult` / :class:`GenerationDelta`; every engine translates these into
its own types. Nothing here imports an engine or a web framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from rollout_service.protocol.messages import WeightVersionSpan


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingOptions:
    """Sampling for one sequence; engines translate it to their own type.

    The fields are those of vLLM's ``SamplingParams`` that every dialect can express
    (vLLM's OpenAI and token-in/token-out routes, SGLang's ``sampling_params``): each
    dialect translates its own names onto these, so one request means the same whichever
    way it came in.
    """

    max_tokens: int
    """Tokens to generate at most."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept."""
    top_k: int = 0
    """Tokens kept by rank; 0 keeps all."""
    min_p: float = 0.0
    """Tokens below this fraction of the most likely one's probability are dropped (vLLM
    0.32 refuses it with speculative decoding, and says so)."""
    seed: int | None = None
    """Per-sequence seed for reproducible sampling."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence (left out of the text unless
    :attr:`include_stop_str_in_output`)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (the token stays in ``token_ids``)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence (benchmarks)."""
    min_tokens: int = 0
    """Tokens to generate before end-of-sequence or a stop token may end the sequence."""
    repetition_penalty: float = 1.0
    """Above 1, tokens already in the prompt or the output become less likely (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens already generated (0: off)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logits of tokens already generated (0: off)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (``token_ids`` keep them)."""
    spaces_between_special_tokens: bool = True
    """Join special tokens with spaces in the text."""
    logprobs: int | None = None
    """None: no log-probabilities; 0: each sampled token's; N: and the N most likely
    tokens at each position."""
    prompt_logprobs: int | None = None
    """None: none; N: each prompt token's log-probability and the N most likely tokens at
    each prompt position (the first position has none)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability at one position."""

    token_id: int
    logprob: float
    rank: int | None = None
    """1 for the most likely token; None when the engine did not rank it."""


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """The log-probabilities at one position: the token there and the most likely ones."""

    token: TokenLogprob
    """The sampled token (output) or the prompt's token (prompt)."""
    top: tuple[TokenLogprob, ...] = ()
    """The N most likely tokens, most likely first (empty when N is 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationResult:
    """One finished sequence (``abort``: ended early, with the tokens it had by then)."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    """``stop`` (end-of-sequence, a stop string or a stop token), ``length``, or ``abort``
    (by a client, a pause in mode ``abort``, or the engine)."""
    logprobs: tuple[PositionLogprobs, ...] | None
    """One entry per output token, when asked for (:attr:`SamplingOptions.logprobs`)."""
    weight_versions: tuple[WeightVersionSpan, ...]
    """Which weight version produced which output tokens."""
    spec_decode: SpecDecodeStats | InvalidSpecDecodeStats | None
    """This sequence's acceptance counts; invalid when the engine's contradict themselves
    (counted, never raised); None when the engine gave none (vLLM gives none for an
    aborted sequence)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence; None for end-of-sequence,
    the length limit and aborts."""
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None
    """One entry per prompt token (the first is None: nothing predicts it), when asked
    for (:attr:`SamplingOptions.prompt_logprobs`)."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache; None when the engine does not say."""

    @property
    def is_aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationDelta:
    """What a streamed sequence produced since its previous delta."""

    text: str
    """The new text; may be empty (detokenization holds back an incomplete character or
    a possible stop string). The deltas' texts joined are the result's text."""
    token_ids: tuple[int, ...]
    """The new tokens."""
    logprobs: tuple[PositionLogprobs, ...] = ()
    """The new tokens' log-probabilities, when asked for."""
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt as the engine tokenized it: on the sequence's first delta only."""
    result: GenerationResult | None = None
    """The finished sequence with its stats: on the last delta, and only there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTurn:
    """One message of a conversation, as the chat template reads it."""

    role: str
    """``system``, ``developer``, ``user`` or ``assistant``."""
    content: str
    """The message's text."""
