"""Prometheus exporter of the K schedule in force: K and its reason per batch-size bucket.

Runs in the service process beside the acceptance and weight exporters (same registry).
The service's speculation control sets it whenever the engine runs a new schedule; a
service without the controller shows vLLM's fixed K in every bucket, reason
``controller off``, so the dashboard reads the same series either way. The PromQL is in
``telemetry/queries.py``.

Gauges of state, not averages: the K in force, a 0/1 per (bucket, reason), collapse 0/1;
labels ``model``, ``engine``, ``bucket`` (a bucket's upper batch size: as many as the
configured buckets) and ``reason`` (the fixed set passed in): bounded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

CONTROLLER_OFF = "controller off"
"""Reason of every bucket when the service runs no controller (vLLM's fixed K)."""
PINNED = "pinned"
"""Reason of every bucket while an operator's schedule is pinned."""
APPLY_OUTCOMES = ("applied", "refused")


class SpeculationMetrics:
    """The schedule's series.

    Args:
        registry: where to register (the service's; tests pass a fresh one).
        model: value of the ``model`` label.
        engine: value of the ``engine`` label.
        buckets: upper edges of the batch-size buckets.
        reasons: every reason a bucket can show.
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 buckets: Sequence[int], reasons: Sequence[str]) -> None:
        names = ("model", "engine")
        labels = {"model": model, "engine": engine}
        k = Gauge("rollout_speculation_k", "Draft tokens per step the engine runs at the "
                  "bucket's batch size (its upper edge).", (*names, "bucket"),
                  registry=registry)
        reason = Gauge("rollout_speculation_reason", "1 for the reason the bucket runs its "
                       "K, 0 for the others.", (*names, "bucket", "reason"), registry=registry)
        self._k = {b: k.labels(**labels, bucket=str(b)) for b in buckets}
        self._reasons = {b: {r: reason.labels(**labels, bucket=str(b), reason=r)
                             for r in reasons} for b in buckets}
        self._shown_k: dict[int, int] = {}
        self._shown_reason: dict[int, str] = {}
        """What the gauges hold: the controller shows its state after every finished
        sequence, and mostly nothing changed (only changes are written)."""
        self._collapsed = Gauge("rollout_speculation_collapsed", "1 while the drafter's "
                                "acceptance has collapsed (K = 0 everywhere).", names,
                                registry=registry).labels(**labels)
        applies = Counter("rollout_speculation_schedule_applies", "K schedules sent to the "
                          "engine, by outcome.", (*names, "outcome"), registry=registry)
        self._applies = {o: applies.labels(**labels, outcome=o) for o in APPLY_OUTCOMES}

    def set_buckets(self, k: Mapping[int, int], reasons: Mapping[int, str]) -> None:
        """The K in force and its reason, per bucket upper edge.

        Raises:
            ValueError: an unknown bucket or reason (nothing is written).
        """
        unknown = [b for b in (*k, *reasons) if b not in self._k]
        if unknown:
            raise ValueError(f"bucket {unknown[0]} is not one of {sorted(self._k)}")
        for bucket, reason in reasons.items():
            if reason not in self._reasons[bucket]:
                raise ValueError(f"reason {reason!r} is not one of "
                                 f"{sorted(self._reasons[bucket])}")
        for bucket, value in k.items():
            if self._shown_k.get(bucket) != value:
                self._k[bucket].set(value)
                self._shown_k[bucket] = value
        for bucket, reason in reasons.items():
            if self._shown_reason.get(bucket) != reason:
                for name, child in self._reasons[bucket].items():
                    child.set(1 if name == reason else 0)
                self._shown_reason[bucket] = reason

    def set_collapsed(self, is_collapsed: bool) -> None:
        self._collapsed.set(1 if is_collapsed else 0)

    def count_apply(self, outcome: str) -> None:
        """Count one schedule sent to the engine (``applied`` or ``refused``)."""
        if outcome not in self._applies:
            raise ValueError(f"outcome must be one of {APPLY_OUTCOMES}, got {outcome!r}")
        self._applies[outcome].inc()
