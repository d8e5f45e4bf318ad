"""vLLM's types at the engine's edge: :class:`SamplingOptions` in, results out.

Runs in the rollout service process, on every request and every finished output of the
vLLM engine (``engine.py``). ``sampling_params`` builds one sequence's ``SamplingParams``;
``to_result`` turns a finished ``CompletionOutput`` into the engine-neutral
:class:`~rollout_service.engines.sequences.GenerationResult`, with its acceptance counts
(``to_stats``) and, when asked for, its log-probabilities (``position_logprobs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from rollout_service.engines.sequences import (
    GenerationResult,
    PositionLogprobs,
    SamplingOptions,
    TokenLogprob,
)
from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from rollout_service.protocol.messages import WeightVersionSpan


def sampling_params(sampling: SamplingOptions, *, is_streamed: bool = False) -> SamplingParams:
    """One sequence: the final output only (no per-token streaming overhead), or deltas
    when ``is_streamed``.

    vLLM detokenizes incrementally, one step per generated token in the front-end
    process; the final output needs that only to find stop strings, and without any
    the text is decoded once when the sequence ends (``VLLMEngine.generate``). A stream
    needs the text of every delta, so it is always detokenized.
    """
    return SamplingParams(
        n=1,
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        ignore_eos=sampling.ignore_eos,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        detokenize=is_streamed or bool(sampling.stop),
        output_kind=RequestOutputKind.DELTA if is_streamed else RequestOutputKind.FINAL_ONLY,
    )


def position_logprobs(token_id: int, candidates: Mapping[int, Any], num_top: int
                      ) -> PositionLogprobs:
    """One position of vLLM's logprobs (a ``{token_id: Logprob}`` holding the token there
    and the ``num_top`` most likely, ranked by vLLM)."""
    chosen = candidates[token_id]
    top = sorted((TokenLogprob(t, lp.logprob, lp.rank) for t, lp in candidates.items()
                  if lp.rank is not None and lp.rank <= num_top), key=lambda c: c.rank or 0)
    return PositionLogprobs(TokenLogprob(token_id, chosen.logprob, chosen.rank), tuple(top))


def output_logprobs(completion: Any, token_ids: Sequence[int], num_top: int | None
                    ) -> tuple[PositionLogprobs, ...] | None:
    """The log-probabilities of ``token_ids`` (a whole output, or a stream's delta)."""
    if num_top is None or completion.logprobs is None:
        return None
    return tuple(position_logprobs(token, step, num_top)
                 for step, token in zip(completion.logprobs, token_ids))


def prompt_logprobs(output: Any, prompt_ids: Sequence[int], num_top: int | None
                    ) -> tuple[PositionLogprobs | None, ...] | None:
    """A ``RequestOutput``'s prompt log-probabilities (its first position has none)."""
    if num_top is None or output.prompt_logprobs is None:
        return None
    return tuple(None if step is None else position_logprobs(token, step, num_top)
                 for step, token in zip(output.prompt_logprobs, prompt_ids))


def to_result(prompt_ids: list[int], output: Any, text: str, sampling: SamplingOptions, *,
              token_ids: Sequence[int] | None = None,
              logprobs: Sequence[PositionLogprobs] | None = None,
              prompt: tuple[PositionLogprobs | None, ...] | None = None,
              verify_cost_ratio: float | None = None) -> GenerationResult:
    """A finished ``RequestOutput`` (and its text) as the engine-neutral result; a stream
    gives the sequence's ``token_ids``, ``logprobs`` and ``prompt`` log-probabilities
    apart (its last output holds only the last delta)."""
    completion = output.outputs[0]
    spans = tuple(WeightVersionSpan(version=s.version, start=s.start, end=s.end)
                  for s in completion.weight_versions or ())
    is_delta = token_ids is not None
    ids = tuple(token_ids if is_delta else completion.token_ids)
    return GenerationResult(
        prompt_token_ids=tuple(prompt_ids),
        token_ids=ids,
        text=text,
        finish_reason=completion.finish_reason or "abort",
        logprobs=(None if logprobs is None else tuple(logprobs)) if is_delta
        else output_logprobs(completion, ids, sampling.logprobs),
        weight_versions=spans,
        spec_decode=to_stats(completion.spec_decode_metrics,
                             verify_cost_ratio=verify_cost_ratio),
        stop_reason=completion.stop_reason,
        prompt_logprobs=prompt if is_delta
        else prompt_logprobs(output, prompt_ids, sampling.prompt_logprobs),
        num_cached_tokens=output.num_cached_tokens,
    )


def to_stats(metrics: Any, *, verify_cost_ratio: float | None = None
             ) -> SpecDecodeStats | InvalidSpecDecodeStats | None:
    """vLLM's ``RequestSpecDecodeMetrics`` -> :class:`SpecDecodeStats` (None passes), with
    the engine's measured verify cost ratio and, at the ``detailed`` level, each step's
    proposed and accepted counts; counts that contradict themselves are
    :class:`InvalidSpecDecodeStats`, never raised."""
    if metrics is None:
        return None
    steps = list(zip(getattr(metrics, "per_step_drafted", ()),
                     getattr(metrics, "per_step_accepted", ()), strict=True))
    try:
        return SpecDecodeStats.from_histogram(metrics.histogram, metrics.num_draft_tokens,
                                              verify_cost_ratio=verify_cost_ratio,
                                              steps=steps)
    except ValueError as exc:
        return InvalidSpecDecodeStats(
            detail=f"vLLM histogram {list(metrics.histogram)} with "
                   f"{metrics.num_draft_tokens} draft tokens: {exc}")
