"""Prometheus exporter of per-request speculative-decoding acceptance.

Runs inside the rollout service process (one per engine replica). The service
observes each finished sequence's :class:`SpecDecodeStats` (definitions in
``protocol/acceptance.py``, which also summarizes a batch for the caller) once
into :class:`SpecDecodeMetrics`; Prometheus scrapes them from ``GET /metrics``.
The batch summary a trainer logs and the figures Grafana shows use the same
definitions, so they are the same numbers.

Counters and histograms only (and the engine's verify cost ratio measured at start-up,
set once), labels ``model``, ``engine`` and the request's ``category`` (bounded: an
allow-list or the first categories seen, the rest ``other``; Prometheus adds ``instance``).
The PromQL of every derived figure (macro and micro accept rate
and length, per-position acceptance, shares without drafts, without stats or with
invalid stats, verl's accept rate, the verify cost ratio and the net speed-up) is in
``telemetry/queries.py``; ``docs/telemetry.md`` tabulates it.

The net speed-up reads three counters over the sequences with a verify cost ratio, not
the start-up gauge: each sequence's ratio is that of the K its steps ran when the
speculation control measured it (``protocol/acceptance.py``), so only a sum of verify
steps each weighed by its own ratio divides correctly across sequences, K values and
replicas.

Nothing here fails a request: a sequence without stats, or with counts that
contradict themselves, is counted in its own counter and logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from rollout_service.telemetry.config import CategoryLabels, TelemetryConfig
from rollout_service.telemetry.drafter import DrafterHealth

logger = logging.getLogger(__name__)

ACCEPT_RATE_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Accept-rate histogram bounds: 0.05 steps, fine enough for a heatmap."""


def accept_length_buckets(num_speculative_tokens: int) -> tuple[float, ...]:
    """Accept-length bounds from 1 to ``k + 1`` in quarter-token steps."""
    steps = 4 * num_speculative_tokens
    return tuple(1.0 + i / 4 for i in range(steps + 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class _CategorySeries:
    """The label children of one category, bound once."""

    requests: Any
    no_spec_requests: Any
    missing_stats_requests: Any
    invalid_stats_requests: Any
    aborted_requests: Any
    drafts: Any
    drafts_with_positions: Any
    draft_tokens: Any
    accepted_tokens: Any
    rejected_tokens: Any
    verify_steps: Any
    costed_drafts: Any
    costed_tokens: Any
    verify_cost: Any
    accepted_per_position: tuple[Any, ...]
    request_accept_rate: Any
    request_accept_length: Any


class SpecDecodeMetrics:
    """Prometheus exporter of per-request acceptance (counters and histograms only).

    Every series has the labels ``model``, ``engine`` and ``category`` (the request's,
    bounded by ``categories``: see ``telemetry/config.CategoryLabels``).

    Args:
        registry: where to register; the service passes the process-wide default
            registry so ``/metrics`` shows these beside the engine's own series,
            tests pass a fresh ``CollectorRegistry()``.
        model: value of the ``model`` label.
        engine: value of the ``engine`` label (``vllm``, ``sglang``).
        num_speculative_tokens: ``k``; sizes the accept-length buckets and the
            per-position series. 0: speculative decoding is off, and a sequence
            without stats is expected (not counted as missing).
        verify_cost_ratio: the engine's measured cost of a verify step over a plain
            decode step (``EngineInfo.verify_cost_ratio``), exported as a gauge; None
            leaves the gauge out (the net speed-up then has no series).
        categories: how request categories become label values; default: the default
            ``TelemetryConfig`` (the first 8 seen).
        drafter: per-version acceptance (``telemetry/drafter.py``), fed every sequence's
            stats too; None leaves it out.
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 num_speculative_tokens: int, verify_cost_ratio: float | None = None,
                 categories: CategoryLabels | None = None,
                 drafter: DrafterHealth | None = None) -> None:
        names = ("model", "engine", "category")
        self._labels = {"model": model, "engine": engine}
        self._categories = categories or CategoryLabels(TelemetryConfig())
        self._num_positions = num_speculative_tokens
        self._drafter = drafter
        self._is_speculative = num_speculative_tokens > 0
        self._warned_missing = False
        self._warned_invalid = False

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry)

        self._requests = counter("rollout_requests", "Finished sequences (n=1 engine requests).")
        self._no_spec_requests = counter(
            "rollout_spec_decode_no_spec_requests",
            "Finished sequences with stats but no drafted token (excluded from the rate).")
        self._missing_stats_requests = counter(
            "rollout_spec_decode_missing_stats_requests",
            "Finished sequences whose engine returned no spec-decode stats.")
        self._invalid_stats_requests = counter(
            "rollout_spec_decode_invalid_stats_requests",
            "Finished sequences whose engine returned spec-decode counts that contradict "
            "themselves (e.g. accepted > drafted); left out of every figure.")
        self._aborted_requests = counter(
            "rollout_aborted_requests",
            "Finished sequences that were aborted (by a client, or a pause in mode abort), "
            "with the tokens they had; one without stats is not counted as missing.")
        self._drafts = counter("rollout_spec_decode_drafts", "Verify steps with a draft.")
        self._drafts_with_positions = counter(
            "rollout_spec_decode_drafts_with_positions",
            "Verify steps with a draft, of sequences that reported per-position acceptance "
            "(the per-position denominator).")
        self._draft_tokens = counter("rollout_spec_decode_draft_tokens", "Drafted tokens.")
        self._accepted_tokens = counter("rollout_spec_decode_accepted_tokens",
                                        "Drafted tokens accepted by the target.")
        self._rejected_tokens = counter(
            "rollout_spec_decode_rejected_tokens",
            "Drafted tokens rejected by the target (computed, then thrown away).")
        self._verify_steps = counter("rollout_spec_decode_verify_steps",
                                     "Target forward passes that verified a draft.")
        self._costed_drafts = counter(
            "rollout_spec_decode_costed_drafts",
            "Verify steps with a draft, of sequences with a verify cost ratio.")
        self._costed_tokens = counter(
            "rollout_spec_decode_costed_tokens",
            "Tokens those verify steps emitted: accepted drafts plus one token per step.")
        self._verify_cost = counter(
            "rollout_spec_decode_verify_cost",
            "Those verify steps, each counted at its cost in plain decode steps (its "
            "sequence's verify cost ratio, at the K the steps ran where measured).")
        self._accepted_per_position = Counter(
            "rollout_spec_decode_accepted_per_position",
            "Drafts whose token at this 0-based position was accepted.",
            (*names, "position"), registry=registry)
        self._request_accept_rate = Histogram(
            "rollout_spec_decode_request_accept_rate",
            "Per-request accept rate; _sum/_count is the macro-average.", names,
            buckets=ACCEPT_RATE_BUCKETS, registry=registry)
        self._request_accept_length = Histogram(
            "rollout_spec_decode_request_accept_length",
            "Per-request accept length (bonus token included); _sum/_count is the macro-average.",
            names, buckets=accept_length_buckets(num_speculative_tokens), registry=registry)
        if verify_cost_ratio is not None:
            # Measured once when the engine starts: a fact about the engine, not an average.
            Gauge("rollout_spec_decode_verify_cost_ratio",
                  "Time of a verify step with k_max drafts over a plain decode step, as the "
                  "engine measured it at start-up (the net speed-up reads "
                  "rollout_spec_decode_verify_cost_total).", names[:2],
                  registry=registry).labels(**self._labels).set(verify_cost_ratio)
        # Binding creates every series at zero, so rate() and ratios exist before traffic;
        # a category seen later gets its children on its first request.
        self._series = {label: self._bind(label) for label in self._categories.initial}

    def _bind(self, category: str) -> _CategorySeries:
        labels = {**self._labels, "category": category}
        return _CategorySeries(
            requests=self._requests.labels(**labels),
            no_spec_requests=self._no_spec_requests.labels(**labels),
            missing_stats_requests=self._missing_stats_requests.labels(**labels),
            invalid_stats_requests=self._invalid_stats_requests.labels(**labels),
            aborted_requests=self._aborted_requests.labels(**labels),
            drafts=self._drafts.labels(**labels),
            drafts_with_positions=self._drafts_with_positions.labels(**labels),
            draft_tokens=self._draft_tokens.labels(**labels),
            accepted_tokens=self._accepted_tokens.labels(**labels),
            rejected_tokens=self._rejected_tokens.labels(**labels),
            verify_steps=self._verify_steps.labels(**labels),
            costed_drafts=self._costed_drafts.labels(**labels),
            costed_tokens=self._costed_tokens.labels(**labels),
            verify_cost=self._verify_cost.labels(**labels),
            accepted_per_position=tuple(
                self._accepted_per_position.labels(**labels, position=str(position))
                for position in range(self._num_positions)),
            request_accept_rate=self._request_accept_rate.labels(**labels),
            request_accept_length=self._request_accept_length.labels(**labels))

    def _category(self, category: str | None) -> _CategorySeries:
        label = self._categories.label(category)
        series = self._series.get(label)
        if series is None:
            series = self._series[label] = self._bind(label)
        return series

    def observe(self, stats: SpecDecodeStats | InvalidSpecDecodeStats | None,
                category: str | None = None, *, is_aborted: bool = False) -> None:
        """Record one finished sequence of ``category``; missing or invalid stats are
        counted and logged once, never raised. An aborted sequence (``is_aborted``) is
        counted as one; its stats count as any other's, and it may have none (vLLM gives
        an aborted request none): that is not a missing-stats sequence.

        Raises:
            ValueError: ``stats`` has more draft positions than ``num_speculative_tokens``
                (the engine and the exporter disagree on ``k``); nothing is recorded.
        """
        if isinstance(stats, SpecDecodeStats) and \
                len(stats.accepted_per_position) > self._num_positions:
            raise ValueError(f"stats with {len(stats.accepted_per_position)} draft positions, "
                             f"but the exporter was built for {self._num_positions}: {stats}")
        series = self._category(category)
        series.requests.inc()
        if is_aborted:
            series.aborted_requests.inc()
        if stats is None:
            if not is_aborted:
                self._observe_missing(series)
            return
        if isinstance(stats, InvalidSpecDecodeStats):
            self._observe_invalid(series, stats)
            return
        if self._drafter is not None:
            self._drafter.observe(stats)
        series.drafts.inc(stats.num_drafts)
        if stats.has_per_position:
            series.drafts_with_positions.inc(stats.num_drafts)
        series.draft_tokens.inc(stats.num_draft_tokens)
        series.accepted_tokens.inc(stats.num_accepted_tokens)
        series.rejected_tokens.inc(stats.num_rejected_tokens)
        series.verify_steps.inc(stats.num_verify_steps)
        ratio = stats.verify_cost_ratio
        if stats.num_drafts and ratio is not None:  # the sequences with a net speed-up
            series.costed_drafts.inc(stats.num_drafts)
            series.costed_tokens.inc(stats.num_drafts + stats.num_accepted_tokens)
            series.verify_cost.inc(stats.num_drafts * ratio)
        for child, count in zip(series.accepted_per_position, stats.accepted_per_position):
            child.inc(count)
        series.request_accept_length.observe(stats.accept_length)
        rate = stats.accept_rate
        if rate is None:
            series.no_spec_requests.inc()
        else:
            series.request_accept_rate.observe(rate)

    def _observe_missing(self, series: _CategorySeries) -> None:
        if not self._is_speculative:
            return  # nothing drafts, so nothing is missing
        series.missing_stats_requests.inc()
        if not self._warned_missing:
            self._warned_missing = True
            logger.warning("engine returned no spec-decode stats for a request; such "
                           "requests are counted in rollout_spec_decode_missing_stats_"
                           "requests_total and left out of acceptance (warned once)")

    def _observe_invalid(self, series: _CategorySeries, stats: InvalidSpecDecodeStats) -> None:
        series.invalid_stats_requests.inc()
        if not self._warned_invalid:
            self._warned_invalid = True
            logger.warning("engine returned spec-decode counts that contradict themselves "
                           "(%s); such requests are counted in rollout_spec_decode_invalid_"
                           "stats_requests_total, left out of acceptance and served without "
                           "stats (warned once)", stats.detail)
