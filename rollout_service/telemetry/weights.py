"""Prometheus exporter of weight pushes: versions per role, outcomes, durations.

Runs in the service process beside the acceptance exporter (same registry); the
push intake counts outcomes and the push manager sets versions and durations.
Separate version gauges for the main model and the drafter make a stale drafter
visible; an engine whose drafter no push can load (MTP off, n-gram, a separate EAGLE
checkpoint) has no drafter version series, so the drafter-behind-main alert, which
subtracts the two, has nothing to fire on there. The PromQL of every derived figure
(version lag, push durations and outcomes) and of the weight alerts is in
``telemetry/queries.py``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollout_service.protocol.messages import TrainingStats
from rollout_service.telemetry.drafter import DrafterHealth

ROLES = ("main", "draft")
PUSH_OUTCOMES = ("loaded", "aborted", "rejected", "failed")
PUSH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WeightMetrics:
    """Weight-push series; labels ``model`` and ``engine`` as the acceptance series.

    Args:
        registry: where to register (the service's registry; tests pass a fresh one).
        model: value of the ``model`` label.
        engine: value of the ``engine`` label.
        drafter: per-version acceptance and the trainer's accuracy
            (``telemetry/drafter.py``), told of every loaded push; None leaves it out.
        has_pushable_drafter: whether pushes can load a drafter
            (``EngineInfo.has_pushable_drafter``); without, only the main model has a
            version series.
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 drafter: DrafterHealth | None = None,
                 has_pushable_drafter: bool = True) -> None:
        self._drafter = drafter
        names = ("model", "engine")
        labels = {"model": model, "engine": engine}
        # Children bound once: observations only set and increment, and every
        # series exists (versions at -1, counters at 0) before the first push.
        version = Gauge("rollout_weight_version",
                        "Weight version served, per role (main model or MTP drafter); "
                        "-1 before the first push.", (*names, "role"), registry=registry)
        roles = ROLES if has_pushable_drafter else ("main",)
        self._versions = {role: version.labels(**labels, role=role) for role in roles}
        for child in self._versions.values():
            child.set(-1)
        pushes = Counter("rollout_weight_pushes", "Weight pushes by outcome.",
                         (*names, "outcome"), registry=registry)
        self._pushes = {outcome: pushes.labels(**labels, outcome=outcome)
                        for outcome in PUSH_OUTCOMES}
        self._push_bytes = Counter("rollout_weight_push_bytes",
                                   "Bytes of completed weight pushes.", names,
                                   registry=registry).labels(**labels)
        self._push_seconds = Histogram("rollout_weight_push_duration_seconds",
                                       "Pause-to-resume time of completed pushes.", names,
                                       buckets=PUSH_SECONDS_BUCKETS,
                                       registry=registry).labels(**labels)

    def set_version(self, role: str, version: int) -> None:
        """Serve ``version`` for ``role``.

        Raises:
            ValueError: ``role`` is not one of :data:`ROLES`, or is the drafter of an
                engine without a pushable one.
        """
        if role not in self._versions:
            raise ValueError(f"role must be one of {tuple(self._versions)}, got {role!r}")
        self._versions[role].set(version)

    def count_outcome(self, outcome: str) -> None:
        """Count one push that ended with ``outcome``.

        Raises:
            ValueError: ``outcome`` is not one of :data:`PUSH_OUTCOMES`.
        """
        if outcome not in self._pushes:
            raise ValueError(f"outcome must be one of {PUSH_OUTCOMES}, got {outcome!r}")
        self._pushes[outcome].inc()

    def loaded(self, main_version: int, training: TrainingStats | None) -> None:
        """A push loaded (the main model now serves ``main_version``), with the trainer's
        stats when it carried them: the per-version acceptance starts a new version."""
        if self._drafter is not None:
            self._drafter.loaded(main_version, training)

    def observe_push(self, num_bytes: int, seconds: float) -> None:
        """Record one completed push: its size and its pause-to-resume time."""
        self._push_bytes.inc(num_bytes)
        self._push_seconds.observe(seconds)
