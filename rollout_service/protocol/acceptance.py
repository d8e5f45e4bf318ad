"""Acceptance of speculative decoding: one sequence's counts and a batch's summary.

Pure data and arithmetic, no Prometheus: the service computes these from the
engine's per-request counts, sends them to clients (``messages``), and the
exporter (``telemetry.acceptance``) turns the same counts into Prometheus series,
so the numbers a trainer logs and the numbers Grafana shows are the same numbers.

Definitions, per finished sequence (one engine request, ``n == 1``):

- ``drafts``: verify steps in which the drafter proposed tokens (vLLM: the sum of
  the acceptance histogram).
- ``draft_tokens``: tokens the drafter proposed.
- ``accepted_tokens``: proposed tokens the target accepted.
- ``verify_steps``: target forward passes that verified a draft. vLLM drafts in
  every verify step, so it equals ``drafts`` there; SGLang reports it separately
  (``spec_verify_ct``).
- ``accept_rate = accepted_tokens / draft_tokens``; undefined (and excluded from
  the macro-average) for a sequence with no draft tokens.
- ``accept_length = 1 + accepted_tokens / drafts``: tokens emitted per verify
  step, the bonus token included. A sequence with no speculative step emitted one
  token per step, so its accept length is 1.0 (verl reports 0, which drags its
  mean below 1 for short answers).
- ``accepted_per_position[i]``: drafts in which the draft token at position ``i``
  (0-based) was accepted; acceptance is a prefix, so it counts drafts that
  accepted more than ``i`` tokens. An engine may leave it empty (SGLang does for an
  inconsistent histogram): the per-position shares then divide by the drafts of the
  sequences that have it, never by all drafts.
- ``reached_per_position[i]``: drafts that reached position ``i``, that is proposed more
  than ``i`` tokens and had the first ``i`` accepted; ``accepted_per_position[i]`` of
  them accepted it. Only an engine that reports each step's proposed and accepted counts
  gives it (vLLM's ``per_request_spec_decode_metrics: detailed``): vLLM's histogram has
  ``num_speculative_tokens + 1`` buckets whatever K a step ran, so from it alone a step
  at K = 1 cannot be told from a step at K = 3 that accepted one token.
- ``drafts_per_k[K]``: drafts that proposed ``K`` tokens (length ``num_speculative_tokens +
  1``; index 0 counts drafts whose every token a grammar invalidated), from the same
  per-step counts: which K each verify step ran, and so what it cost.

Populations of the macro averages: the accept length averages over every sequence
with stats (one without drafts counts 1.0), the accept rate over the sequences with
drafts only; verl counts a sequence without drafts as 0 in both.

Counts that contradict themselves (more accepted than drafted tokens, a negative
count) are refused by :class:`SpecDecodeStats`; an engine's conversion turns them into
:class:`InvalidSpecDecodeStats`, which the exporter counts apart and no figure uses.

Micro-averages weigh every token equally (long answers dominate); macro-averages
weigh every request equally (what a trainer means by "the batch's accept rate").

Wasted work and net speed-up:

- ``rejected_tokens = draft_tokens - accepted_tokens``: drafted tokens the target
  computed and threw away.
- ``verify_cost_ratio``: the mean cost of the sequence's verify steps (drafting included)
  in plain decode steps at the same batch size. With the speculation control, from its
  measured step costs at the K each step ran, ``c(K, B) / c(0, B)``
  (``speculation/cost.py``, ``StepCostTable.verify_cost_ratio``); otherwise the engine
  adapter's figure for ``k = num_speculative_tokens`` (vLLM: measured once at start-up,
  ``engines/vllm/verify_cost.py``); None when neither is known.
- ``net_speedup = accept_length / verify_cost_ratio``: tokens per verify step, each step
  weighed by what it costs in plain decode steps. Below 1, speculation slows the
  sequence down. A batch's figure is a micro-average: all tokens emitted by verify steps
  over all verify steps, each counted at its sequence's ratio.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import fmean


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecDecodeStats:
    """One finished sequence's speculative-decoding counts (see module docstring)."""

    num_drafts: int
    """Verify steps in which the drafter proposed tokens."""
    num_draft_tokens: int
    """Tokens the drafter proposed."""
    num_accepted_tokens: int
    """Proposed tokens the target accepted."""
    num_verify_steps: int
    """Target forward passes that verified a draft."""
    accepted_per_position: tuple[int, ...] = ()
    """Drafts whose token at position ``i`` was accepted; length ``k`` when known."""
    reached_per_position: tuple[int, ...] = ()
    """Drafts that reached position ``i`` (see the module docstring); empty when the engine
    did not report each step's counts."""
    drafts_per_k: tuple[int, ...] = ()
    """Drafts that proposed ``K`` tokens, by ``K`` (see the module docstring); empty when the
    engine did not report each step's counts."""
    verify_cost_ratio: float | None = None
    """Cost of a verify step over a plain decode step, as the engine measured it (see the
    module docstring); None when not measured."""

    def __post_init__(self) -> None:
        # The engines' conversions catch this and report InvalidSpecDecodeStats.
        counts = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                  self.num_verify_steps, *self.accepted_per_position)
        if any(c < 0 for c in counts):
            raise ValueError(f"spec-decode counts must be >= 0, got {self}")
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise ValueError(f"num_accepted_tokens > num_draft_tokens in {self}")
        if self.verify_cost_ratio is not None and not self.verify_cost_ratio > 0:
            raise ValueError(f"verify_cost_ratio must be > 0, got {self.verify_cost_ratio}")
        reached, accepted = self.reached_per_position, self.accepted_per_position
        # Position 0 is reached by every draft that kept a token: not by one whose every
        # token a grammar invalidated (vLLM counts it as a step proposing 0, drafts_per_k[0]).
        proposing = self.num_drafts - (self.drafts_per_k[0] if self.drafts_per_k else 0)
        if reached and (len(reached) != len(accepted) or reached[0] != proposing or any(
                r < a for r, a in zip(reached, accepted)) or any(
                r > a for r, a in zip(reached[1:], accepted))):
            raise ValueError("reached_per_position must start at the drafts that proposed a "
                             "token, and reach at least what is accepted and at most what the "
                             f"position before accepted: {self}")
        if self.drafts_per_k and (sum(self.drafts_per_k) != self.num_drafts or sum(
                k * n for k, n in enumerate(self.drafts_per_k)) != self.num_draft_tokens):
            raise ValueError(f"drafts_per_k must add up to num_drafts and num_draft_tokens: "
                             f"{self}")

    @classmethod
    def from_histogram(cls, histogram: Sequence[int], num_draft_tokens: int, *,
                       verify_cost_ratio: float | None = None,
                       steps: Sequence[tuple[int, int]] = ()) -> SpecDecodeStats:
        """Build from an acceptance histogram (``histogram[j]``: steps accepting ``j``).

        This is the shape vLLM reports per request; every step drafts, so drafts
        and verify steps are both the histogram's total. ``steps``: each step's
        ``(proposed, accepted)`` when the engine reported them (vLLM's ``detailed``
        level: ``per_step_drafted``, ``per_step_accepted``), which give
        ``reached_per_position`` and ``drafts_per_k``.

        Raises:
            ValueError: ``steps`` that disagree with the histogram, or counts that
                contradict themselves.
        """
        num_steps = sum(histogram)
        num_accepted = sum(j * count for j, count in enumerate(histogram))
        per_position = tuple(sum(histogram[i + 1:]) for i in range(len(histogram) - 1))
        reached: tuple[int, ...] = ()
        per_k: tuple[int, ...] = ()
        if steps:
            if len(steps) != num_steps or sum(d for d, _ in steps) != num_draft_tokens or (
                    sum(a for _, a in steps) != num_accepted):
                raise ValueError(f"{len(steps)} per-step counts disagree with the histogram "
                                 f"{list(histogram)} and {num_draft_tokens} draft tokens")
            reached = tuple(sum(1 for proposed, accepted in steps
                                if proposed > i and accepted >= i)
                            for i in range(len(per_position)))
            per_k = tuple(sum(1 for proposed, _ in steps if proposed == k)
                          for k in range(len(histogram)))
        return cls(num_drafts=num_steps, num_draft_tokens=num_draft_tokens,
                   num_accepted_tokens=num_accepted, num_verify_steps=num_steps,
                   accepted_per_position=per_position, reached_per_position=reached,
                   drafts_per_k=per_k, verify_cost_ratio=verify_cost_ratio)

    @property
    def has_per_position(self) -> bool:
        """Whether the engine reported per-position acceptance for this sequence."""
        return bool(self.accepted_per_position)

    @property
    def has_speculation(self) -> bool:
        """Whether any token was drafted (a rate is defined)."""
        return self.num_draft_tokens > 0

    @property
    def accept_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        if not self.has_speculation:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, bonus token included; 1.0 without drafts."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def num_rejected_tokens(self) -> int:
        """Drafted tokens the target rejected (computed, then thrown away)."""
        return self.num_draft_tokens - self.num_accepted_tokens

    @property
    def net_speedup(self) -> float | None:
        """Accept length over the verify cost ratio; None without drafts or without a
        measured ratio."""
        if self.num_drafts == 0 or self.verify_cost_ratio is None:
            return None
        return self.accept_length / self.verify_cost_ratio


@dataclass(frozen=True, kw_only=True, slots=True)
class InvalidSpecDecodeStats:
    """Counts an engine reported for one sequence that contradict themselves (e.g. more
    accepted than drafted tokens): no figure uses them, the exporter counts the sequence
    in ``rollout_spec_decode_invalid_stats_requests_total``, and the response carries no
    stats for it."""

    detail: str
    """What contradicts what, with the engine's numbers (logged once)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSummary:
    """Acceptance over a batch of sequences, macro- and micro-averaged."""

    num_sequences: int
    """Sequences in the batch."""
    num_with_speculation: int
    """Sequences with at least one drafted token (they define the macro rate)."""
    num_without_speculation: int
    """Sequences with stats but no drafted token (accept length 1.0)."""
    num_missing_stats: int
    """Sequences without stats (excluded from everything else): the engine returned none,
    or contradictory ones (which Prometheus counts apart as invalid). The summary is
    computed from what the response carries, so a client gets the same numbers from the
    sequences."""
    macro_accept_rate: float | None
    """Mean of per-sequence accept rates; None when no sequence drafted."""
    macro_accept_length: float | None
    """Mean of per-sequence accept lengths; None when no sequence has stats."""
    micro_accept_rate: float | None
    """All accepted / all drafted tokens; None when nothing was drafted."""
    micro_accept_length: float | None
    """1 + all accepted tokens / all drafts; None when no sequence has stats."""
    micro_accept_rate_per_position: tuple[float, ...] = field(default=())
    """Per draft position: drafts accepting that position / drafts of the sequences that
    reported per-position acceptance."""
    num_rejected_tokens: int = 0
    """Drafted tokens the target rejected, over every sequence with stats."""
    net_speedup: float | None = None
    """Tokens emitted by verify steps over the verify steps' cost in plain decode steps,
    over the sequences with drafts and a measured cost ratio; None without any."""


def summarize(stats: Iterable[SpecDecodeStats | None]) -> BatchSummary:
    """Summarize a batch with the module's definitions (None = engine gave no stats)."""
    items = list(stats)
    known = [s for s in items if s is not None]
    rates = [s.accept_rate for s in known if s.accept_rate is not None]
    num_drafts = sum(s.num_drafts for s in known)
    num_draft_tokens = sum(s.num_draft_tokens for s in known)
    num_accepted = sum(s.num_accepted_tokens for s in known)
    with_positions = [s for s in known if s.has_per_position]
    num_position_drafts = sum(s.num_drafts for s in with_positions)
    width = max((len(s.accepted_per_position) for s in with_positions), default=0)
    # A shorter list means no acceptance beyond it (a prefix): its drafts still count.
    per_position = tuple(
        sum(s.accepted_per_position[i] for s in with_positions
            if i < len(s.accepted_per_position)) / num_position_drafts
        for i in range(width)
    ) if num_position_drafts else ()
    return BatchSummary(
        num_sequences=len(items),
        num_with_speculation=len(rates),
        num_without_speculation=len(known) - len(rates),
        num_missing_stats=len(items) - len(known),
        macro_accept_rate=fmean(rates) if rates else None,
        macro_accept_length=fmean(s.accept_length for s in known) if known else None,
        micro_accept_rate=num_accepted / num_draft_tokens if num_draft_tokens else None,
        micro_accept_length=(1.0 + num_accepted / num_drafts if num_drafts else 1.0)
        if known else None,
        micro_accept_rate_per_position=per_position,
        num_rejected_tokens=sum(s.num_rejected_tokens for s in known),
        net_speedup=_net_speedup(known),
    )


def summarize_by_category(items: Iterable[tuple[str | None, SpecDecodeStats | None]]
                          ) -> dict[str, BatchSummary]:
    """:func:`summarize` per category of ``(category, stats)`` pairs; sequences without a
    category are left out."""
    grouped: dict[str, list[SpecDecodeStats | None]] = {}
    for category, stats in items:
        if category is not None:
            grouped.setdefault(category, []).append(stats)
    return {category: summarize(stats) for category, stats in sorted(grouped.items())}


def _net_speedup(stats: Sequence[SpecDecodeStats]) -> float | None:
    costed = [s for s in stats if s.net_speedup is not None]
    cost = sum(s.num_drafts * s.verify_cost_ratio for s in costed)  # type: ignore[operator]
    if not cost:
        return None
    return sum(s.num_drafts + s.num_accepted_tokens for s in costed) / cost
