"""Per-request speculative-decoding acceptance: stats, batch summary, Prometheus.

Runs inside the rollout service process (one per replica). The engine hands each
finished sequence's counts to :class:`SpecDecodeStats`; the service observes them
once into :class:`SpecDecodeMetrics` (Prometheus) and summarizes a response's
sequences with :func:`summarize` (returned to the caller, e.g. a trainer that logs
it beside its losses). Both use the definitions below, so the numbers a trainer
logs and the numbers Grafana shows are the same numbers.

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
  accepted more than ``i`` tokens.

Micro-averages weigh every token equally (long answers dominate); macro-averages
weigh every request equally (what a trainer means by "the batch's accept rate").

Exported series (labels ``model``, ``engine``; Prometheus adds ``instance``) and
the PromQL of each derived figure (``[5m]`` is any window):

- micro accept rate::

    sum(rate(rollout_spec_decode_accepted_tokens_total[5m]))
      / sum(rate(rollout_spec_decode_draft_tokens_total[5m]))

- micro accept length::

    1 + sum(rate(rollout_spec_decode_accepted_tokens_total[5m]))
          / sum(rate(rollout_spec_decode_drafts_total[5m]))

- macro accept rate (mean over requests with drafts; sums correctly across
  replicas because ``_sum`` and ``_count`` are counters)::

    sum(rate(rollout_spec_decode_request_accept_rate_sum[5m]))
      / sum(rate(rollout_spec_decode_request_accept_rate_count[5m]))

- macro accept length (mean over all requests with stats)::

    sum(rate(rollout_spec_decode_request_accept_length_sum[5m]))
      / sum(rate(rollout_spec_decode_request_accept_length_count[5m]))

- per-position acceptance::

    sum by (position) (rate(rollout_spec_decode_accepted_per_position_total[5m]))
      / ignoring(position) group_left
        sum(rate(rollout_spec_decode_drafts_total[5m]))

- share of requests without a speculative step, and without stats::

    sum(rate(rollout_spec_decode_no_spec_requests_total[5m]))
      / sum(rate(rollout_requests_total[5m]))
    sum(rate(rollout_spec_decode_missing_stats_requests_total[5m]))
      / sum(rate(rollout_requests_total[5m]))
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import fmean

from prometheus_client import CollectorRegistry, Counter, Histogram

logger = logging.getLogger(__name__)

ACCEPT_RATE_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Accept-rate histogram bounds: 0.05 steps, fine enough for a heatmap."""


def accept_length_buckets(num_speculative_tokens: int) -> tuple[float, ...]:
    """Accept-length bounds from 1 to ``k + 1`` in quarter-token steps."""
    steps = 4 * num_speculative_tokens
    return tuple(1.0 + i / 4 for i in range(steps + 1))


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

    def __post_init__(self) -> None:
        counts = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                  self.num_verify_steps, *self.accepted_per_position)
        if any(c < 0 for c in counts):
            raise ValueError(f"spec-decode counts must be >= 0, got {self}")
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise ValueError(f"num_accepted_tokens > num_draft_tokens in {self}")

    @classmethod
    def from_histogram(cls, histogram: Sequence[int], num_draft_tokens: int) -> SpecDecodeStats:
        """Build from an acceptance histogram (``histogram[j]``: steps accepting ``j``).

        This is the shape vLLM reports per request; every step drafts, so drafts
        and verify steps are both the histogram's total.
        """
        num_steps = sum(histogram)
        num_accepted = sum(j * count for j, count in enumerate(histogram))
        per_position = tuple(sum(histogram[i + 1:]) for i in range(len(histogram) - 1))
        return cls(num_drafts=num_steps, num_draft_tokens=num_draft_tokens,
                   num_accepted_tokens=num_accepted, num_verify_steps=num_steps,
                   accepted_per_position=per_position)

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
    """Sequences whose engine returned no stats (excluded from everything else)."""
    macro_accept_rate: float | None
    """Mean of per-sequence accept rates; None when no sequence drafted."""
    macro_accept_length: float | None
    """Mean of per-sequence accept lengths; None when no sequence has stats."""
    micro_accept_rate: float | None
    """All accepted / all drafted tokens; None when nothing was drafted."""
    micro_accept_length: float | None
    """1 + all accepted tokens / all drafts; None when no sequence has stats."""
    micro_accept_rate_per_position: tuple[float, ...] = field(default=())
    """Per draft position: drafts accepting that position / all drafts."""


def summarize(stats: Iterable[SpecDecodeStats | None]) -> BatchSummary:
    """Summarize a batch with the module's definitions (None = engine gave no stats)."""
    items = list(stats)
    known = [s for s in items if s is not None]
    rates = [s.accept_rate for s in known if s.accept_rate is not None]
    num_drafts = sum(s.num_drafts for s in known)
    num_draft_tokens = sum(s.num_draft_tokens for s in known)
    num_accepted = sum(s.num_accepted_tokens for s in known)
    width = max((len(s.accepted_per_position) for s in known), default=0)
    per_position = tuple(
        sum(s.accepted_per_position[i] for s in known if i < len(s.accepted_per_position))
        / num_drafts
        for i in range(width)
    ) if num_drafts else ()
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
    )


class SpecDecodeMetrics:
    """Prometheus exporter of per-request acceptance (counters and histograms only).

    Args:
        registry: where to register; the service passes the process-wide default
            registry so ``/metrics`` shows these beside the engine's own series,
            tests pass a fresh ``CollectorRegistry()``.
        model: value of the ``model`` label.
        engine: value of the ``engine`` label (``vllm``, ``sglang``).
        num_speculative_tokens: ``k``; sizes the accept-length buckets and the
            per-position series.
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 num_speculative_tokens: int) -> None:
        labels = ("model", "engine")
        self._labels = {"model": model, "engine": engine}
        self._warned_missing = False

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + extra, registry=registry)

        self.requests = counter("rollout_requests", "Finished sequences (n=1 engine requests).")
        self.no_spec_requests = counter(
            "rollout_spec_decode_no_spec_requests",
            "Finished sequences with stats but no drafted token (excluded from the rate).")
        self.missing_stats_requests = counter(
            "rollout_spec_decode_missing_stats_requests",
            "Finished sequences whose engine returned no spec-decode stats.")
        self.drafts = counter("rollout_spec_decode_drafts", "Verify steps with a draft.")
        self.draft_tokens = counter("rollout_spec_decode_draft_tokens", "Drafted tokens.")
        self.accepted_tokens = counter("rollout_spec_decode_accepted_tokens",
                                       "Drafted tokens accepted by the target.")
        self.verify_steps = counter("rollout_spec_decode_verify_steps",
                                    "Target forward passes that verified a draft.")
        self.accepted_per_position = counter(
            "rollout_spec_decode_accepted_per_position",
            "Drafts whose token at this 0-based position was accepted.", ("position",))
        self.request_accept_rate = Histogram(
            "rollout_spec_decode_request_accept_rate",
            "Per-request accept rate; _sum/_count is the macro-average.",
            labels, buckets=ACCEPT_RATE_BUCKETS, registry=registry)
        self.request_accept_length = Histogram(
            "rollout_spec_decode_request_accept_length",
            "Per-request accept length (bonus token included); _sum/_count is the macro-average.",
            labels, buckets=accept_length_buckets(num_speculative_tokens), registry=registry)
        # Create every series at zero so rate() and ratios exist before traffic.
        for metric in (self.requests, self.no_spec_requests, self.missing_stats_requests,
                       self.drafts, self.draft_tokens, self.accepted_tokens, self.verify_steps,
                       self.request_accept_rate, self.request_accept_length):
            metric.labels(**self._labels)
        for position in range(num_speculative_tokens):
            self.accepted_per_position.labels(**self._labels, position=str(position))

    def observe(self, stats: SpecDecodeStats | None) -> None:
        """Record one finished sequence; never raises on missing stats."""
        labels = self._labels
        self.requests.labels(**labels).inc()
        if stats is None:
            self.missing_stats_requests.labels(**labels).inc()
            if not self._warned_missing:
                self._warned_missing = True
                logger.warning("engine returned no spec-decode stats for a request; such "
                               "requests are counted in rollout_spec_decode_missing_stats_"
                               "requests_total and left out of acceptance (warned once)")
            return
        self.drafts.labels(**labels).inc(stats.num_drafts)
        self.draft_tokens.labels(**labels).inc(stats.num_draft_tokens)
        self.accepted_tokens.labels(**labels).inc(stats.num_accepted_tokens)
        self.verify_steps.labels(**labels).inc(stats.num_verify_steps)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(**labels, position=str(position)).inc(count)
        self.request_accept_length.labels(**labels).observe(stats.accept_length)
        rate = stats.accept_rate
        if rate is None:
            self.no_spec_requests.labels(**labels).inc()
        else:
            self.request_accept_rate.labels(**labels).observe(rate)


def sample_sum(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``, in a /metrics
    page (what ``sum(name{labels})`` gives in PromQL, for one scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())
