"""vLLM's sampling fields, as the OpenAI routes and vLLM's token-in/token-out route take
them, in the engine-neutral :class:`SamplingOptions`; and vLLM's per-request acceptance.

Runs in the service process (standalone, or the Ray Serve ingress), once per choice of a
call: one translation whichever vLLM-shaped route the request came through, so the same
fields sample the same way there and in SGLang's dialect (``api/dialects/sglang``).
"""

from __future__ import annotations

from rollout_service.engines.sequences import SamplingOptions
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.protocol.openai import SpeculativeDecodingMetrics
from rollout_service.protocol.vllm_sampling import VLLMSamplingFields


def vllm_sampling_options(fields: VLLMSamplingFields, *, max_tokens: int, temperature: float,
                          top_p: float, seed: int | None, stop: str | list[str] | None,
                          logprobs: int | None) -> SamplingOptions:
    """One choice's sampling: OpenAI's fields (given apart: their names and defaults differ
    per route) and vLLM's extensions; vLLM's ``None`` means its default."""
    return SamplingOptions(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=max(0, fields.top_k or 0),  # vLLM: -1 and 0 both keep all
        min_p=fields.min_p or 0.0, seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        include_stop_str_in_output=fields.include_stop_str_in_output,
        ignore_eos=fields.ignore_eos, min_tokens=fields.min_tokens,
        repetition_penalty=1.0 if fields.repetition_penalty is None
        else fields.repetition_penalty,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        skip_special_tokens=fields.skip_special_tokens,
        spaces_between_special_tokens=fields.spaces_between_special_tokens,
        logprobs=logprobs, prompt_logprobs=fields.prompt_logprobs)


def speculative_decoding_metrics(stats: SpecDecodeStats | None, num_speculative_tokens: int
                                 ) -> SpeculativeDecodingMetrics | None:
    """One sequence's counts as vLLM's OpenAI server reports them
    (``RequestSpecDecodeMetrics.to_dict``); None without stats."""
    if stats is None:
        return None
    per_position = stats.accepted_per_position
    histogram: list[int] = []
    if per_position:
        # accepted_per_position[i]: drafts accepting at least i + 1 tokens.
        at_least = [stats.num_drafts, *per_position, 0]
        histogram = [at_least[j] - at_least[j + 1] for j in range(len(per_position) + 1)]
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=stats.accept_length,
        draft_acceptance_rate=stats.accept_rate or 0.0, acceptance_histogram=histogram,
        num_spec_steps=stats.num_drafts, num_accepted_draft_tokens=stats.num_accepted_tokens,
        num_draft_tokens=stats.num_draft_tokens,
        num_spec_tokens=len(per_position) or num_speculative_tokens)
