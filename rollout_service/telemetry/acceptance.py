"""Prometheus exporter of per-request speculative-decoding acceptance.

Runs inside the rollout service process (one per engine replica). The service
observes each finished sequence's :class:`SpecDecodeStats` (definitions in
``protocol/acceptance.py``, which also summarizes a batch for the caller) once
into :class:`SpecDecodeMetrics`; Prometheus scrapes them from ``GET /metrics``.
The batch summary a trainer logs and the figures Grafana shows use the same
definitions, so they are the same numbers.

Counters and histograms only, labels ``model`` and ``engine`` (Prometheus adds
``instance``). The PromQL of every derived figure (macro and micro accept rate
and length, per-position acceptance, shares without drafts, without stats or with
invalid stats, verl's accept rate) is in ``telemetry/queries.py``;
``docs/telemetry.md`` tabulates it.

Nothing here fails a request: a sequence without stats, or with counts that
contradict themselves, is counted in its own counter and logged once.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram

from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats

logger = logging.getLogger(__name__)

ACCEPT_RATE_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Accept-rate histogram bounds: 0.05 steps, fine enough for a heatmap."""


def accept_length_buckets(num_speculative_tokens: int) -> tuple[float, ...]:
    """Accept-length bounds from 1 to ``k + 1`` in quarter-token steps."""
    steps = 4 * num_speculative_tokens
    return tuple(1.0 + i / 4 for i in range(steps + 1))


class SpecDecodeMetrics:
    """Prometheus exporter of per-request acceptance (counters and histograms only).

    Args:
        registry: where to register; the service passes the process-wide default
            registry so ``/metrics`` shows these beside the engine's own series,
            tests pass a fresh ``CollectorRegistry()``.
        model: value of the ``model`` label.
        engine: value of the ``engine`` label (``vllm``, ``sglang``).
        num_speculative_tokens: ``k``; sizes the accept-length buckets and the
            per-position series. 0: speculative decoding is off, and a sequence
            without stats is expected (not counted as missing).
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 num_speculative_tokens: int) -> None:
        names = ("model", "engine")
        labels = {"model": model, "engine": engine}
        self._is_speculative = num_speculative_tokens > 0
        self._warned_missing = False
        self._warned_invalid = False

        # Label children are bound once here, so an observation is only increments;
        # binding also creates every series at zero, so rate() and ratios exist
        # before traffic.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets,
                             registry=registry).labels(**labels)

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
        self._drafts = counter("rollout_spec_decode_drafts", "Verify steps with a draft.")
        self._drafts_with_positions = counter(
            "rollout_spec_decode_drafts_with_positions",
            "Verify steps with a draft, of sequences that reported per-position acceptance "
            "(the per-position denominator).")
        self._draft_tokens = counter("rollout_spec_decode_draft_tokens", "Drafted tokens.")
        self._accepted_tokens = counter("rollout_spec_decode_accepted_tokens",
                                        "Drafted tokens accepted by the target.")
        self._verify_steps = counter("rollout_spec_decode_verify_steps",
                                     "Target forward passes that verified a draft.")
        per_position = Counter("rollout_spec_decode_accepted_per_position",
                               "Drafts whose token at this 0-based position was accepted.",
                               (*names, "position"), registry=registry)
        self._accepted_per_position = tuple(
            per_position.labels(**labels, position=str(position))
            for position in range(num_speculative_tokens))
        self._request_accept_rate = histogram(
            "rollout_spec_decode_request_accept_rate",
            "Per-request accept rate; _sum/_count is the macro-average.", ACCEPT_RATE_BUCKETS)
        self._request_accept_length = histogram(
            "rollout_spec_decode_request_accept_length",
            "Per-request accept length (bonus token included); _sum/_count is the macro-average.",
            accept_length_buckets(num_speculative_tokens))

    def observe(self, stats: SpecDecodeStats | InvalidSpecDecodeStats | None) -> None:
        """Record one finished sequence; missing or invalid stats are counted and logged
        once, never raised.

        Raises:
            ValueError: ``stats`` has more draft positions than ``num_speculative_tokens``
                (the engine and the exporter disagree on ``k``); nothing is recorded.
        """
        if isinstance(stats, SpecDecodeStats) and \
                len(stats.accepted_per_position) > len(self._accepted_per_position):
            raise ValueError(f"stats with {len(stats.accepted_per_position)} draft positions, "
                             f"but the exporter was built for "
                             f"{len(self._accepted_per_position)}: {stats}")
        self._requests.inc()
        if stats is None:
            self._observe_missing()
            return
        if isinstance(stats, InvalidSpecDecodeStats):
            self._observe_invalid(stats)
            return
        self._drafts.inc(stats.num_drafts)
        if stats.has_per_position:
            self._drafts_with_positions.inc(stats.num_drafts)
        self._draft_tokens.inc(stats.num_draft_tokens)
        self._accepted_tokens.inc(stats.num_accepted_tokens)
        self._verify_steps.inc(stats.num_verify_steps)
        for child, count in zip(self._accepted_per_position, stats.accepted_per_position):
            child.inc(count)
        self._request_accept_length.observe(stats.accept_length)
        rate = stats.accept_rate
        if rate is None:
            self._no_spec_requests.inc()
        else:
            self._request_accept_rate.observe(rate)

    def _observe_missing(self) -> None:
        if not self._is_speculative:
            return  # nothing drafts, so nothing is missing
        self._missing_stats_requests.inc()
        if not self._warned_missing:
            self._warned_missing = True
            logger.warning("engine returned no spec-decode stats for a request; such "
                           "requests are counted in rollout_spec_decode_missing_stats_"
                           "requests_total and left out of acceptance (warned once)")

    def _observe_invalid(self, stats: InvalidSpecDecodeStats) -> None:
        self._invalid_stats_requests.inc()
        if not self._warned_invalid:
            self._warned_invalid = True
            logger.warning("engine returned spec-decode counts that contradict themselves "
                           "(%s); such requests are counted in rollout_spec_decode_invalid_"
                           "stats_requests_total, left out of acceptance and served without "
                           "stats (warned once)", stats.detail)
