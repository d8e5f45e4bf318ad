"""One sequence's spec-decode stats in the shape vLLM 0.32 reports them.

vLLM's scheduler keeps a ``RequestSpecDecodeMetrics`` per request
(``vllm/v1/metrics/stats.py``): a histogram of accepted tokens per verify step with
``num_speculative_tokens + 1`` buckets whatever K the step ran, the proposed tokens, and
at the ``detailed`` level each step's proposed and accepted counts. These helpers fill
vLLM's own object step by step and convert it as the engine adapter does
(``SpecDecodeStats.from_histogram``), so tests see exactly what the service sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from rollout_service.protocol.acceptance import SpecDecodeStats


def chain_steps(num_drafts: int, rates: Sequence[float]) -> list[int]:
    """Accepted tokens of ``num_drafts`` steps drafting ``len(rates)`` tokens each, position
    ``i`` accepted (at most) at ``rates[i]`` among the steps that accepted every earlier
    one: deterministic, so a test reads exact rates."""
    accepted = [num_drafts]
    for rate in rates:
        accepted.append(int(accepted[-1] * rate))
    accepted.append(0)
    return [j for j in range(len(rates) + 1) for _ in range(accepted[j] - accepted[j + 1])]


def vllm_stats(steps: Sequence[tuple[int, int]], *, k_max: int,
               detailed: bool = False) -> SpecDecodeStats:
    """The stats of a sequence whose verify steps proposed and accepted ``steps``
    (``(K, accepted)`` each), as vLLM at ``k_max`` speculative tokens reports them."""
    metrics = RequestSpecDecodeMetrics.new(k_max)
    for proposed, accepted in steps:
        metrics.observe(num_draft_tokens=proposed, num_accepted=accepted, detailed=detailed)
    per_step = list(zip(metrics.per_step_drafted, metrics.per_step_accepted, strict=True))
    return SpecDecodeStats.from_histogram(metrics.histogram, metrics.num_draft_tokens,
                                          steps=per_step)


def vllm_chain(num_drafts: int, rates: Sequence[float], *, k: int, k_max: int,
               detailed: bool = False) -> SpecDecodeStats:
    """:func:`vllm_stats` of ``num_drafts`` steps at ``k`` draft tokens, position ``i``
    accepted at ``rates[i]`` (:func:`chain_steps`); at K = 0 vLLM verifies nothing, so
    no step is counted."""
    steps = [(k, j) for j in chain_steps(num_drafts, rates[:k])] if k else []
    return vllm_stats(steps, k_max=k_max, detailed=detailed)
