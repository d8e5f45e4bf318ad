"""Prometheus series of weight pushes: versions per model, outcomes, durations.

Runs in the service process beside the acceptance metrics (same registry).
Separate version gauges for the main model and the drafter make a stale
drafter visible: ``rollout_weight_version{role="main"} - ignoring(role)
rollout_weight_version{role="draft"} > 0``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PUSH_OUTCOMES = ("loaded", "aborted", "rejected", "failed")
PUSH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WeightMetrics:
    """Weight-push series; labels ``model`` and ``engine`` as the acceptance series."""

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str) -> None:
        labels = ("model", "engine")
        self._labels = {"model": model, "engine": engine}
        self.version = Gauge("rollout_weight_version",
                             "Weight version served, per role (main model or MTP drafter); "
                             "-1 before the first push.", (*labels, "role"), registry=registry)
        self.pushes = Counter("rollout_weight_pushes", "Weight pushes by outcome.",
                              (*labels, "outcome"), registry=registry)
        self.push_bytes = Counter("rollout_weight_push_bytes",
                                  "Bytes of completed weight pushes.", labels, registry=registry)
        self.push_seconds = Histogram("rollout_weight_push_duration_seconds",
                                      "Pause-to-resume time of completed pushes.", labels,
                                      buckets=PUSH_SECONDS_BUCKETS, registry=registry)
        for role in ("main", "draft"):
            self.version.labels(**self._labels, role=role).set(-1)
        for outcome in PUSH_OUTCOMES:
            self.pushes.labels(**self._labels, outcome=outcome)
        self.push_bytes.labels(**self._labels)
        self.push_seconds.labels(**self._labels)

    def set_version(self, role: str, version: int) -> None:
        self.version.labels(**self._labels, role=role).set(version)

    def count_outcome(self, outcome: str) -> None:
        self.pushes.labels(**self._labels, outcome=outcome).inc()

    def observe_push(self, num_bytes: int, seconds: float) -> None:
        self.push_bytes.labels(**self._labels).inc(num_bytes)
        self.push_seconds.labels(**self._labels).observe(seconds)
