"""Prometheus exporter of drafter health per weight version: rollout acceptance of the
weights served now and of those served before the last push, and the trainer's own
top-1 accuracy of the MTP head for each version it reports.

Runs in the service process (one per engine replica). The acceptance exporter hands it
every finished sequence's stats (:meth:`DrafterHealth.observe`); the weight-push manager
tells it when a push loaded (:meth:`DrafterHealth.loaded`), with the trainer's
``training_stats`` when the push carried them. The PromQL that compares them (the
acceptance drop after a push, rollout acceptance against training accuracy) is in
``telemetry/queries.py``.

Why gauges: these are the totals of one weight version's sequences, a population that
ends at the next push, not rates; their ratio is that version's acceptance. Bounded
labels: ``weights`` is ``current`` or ``previous``, each with its version's number, so
two versions are exported at a time (one series moves per push); the trainer's accuracy
keeps the last ``versions_kept`` versions.

Per position: the share of drafts whose token at draft position ``i`` was accepted is
what the trainer's top-1 agreement at depth ``i + 1`` estimates on the same samples (vLLM
drafts greedily, so a draft is accepted with the target's probability of the head's top
token), which is why the trainer's accuracy carries a ``position`` label, not a depth.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Gauge

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.protocol.messages import TrainingStats

WEIGHTS = ("current", "previous")


class DrafterHealth:
    """Per-version acceptance and the trainer's accuracy (see the module docstring).

    Args:
        registry: where to register (the service's registry; tests pass a fresh one).
        model: value of the ``model`` label.
        engine: value of the ``engine`` label.
        num_speculative_tokens: ``k``: the per-position series exported.
        versions_kept: weight versions whose trainer accuracy stays exported.
        initial_version: the main model's version before the first push.
    """

    def __init__(self, *, registry: CollectorRegistry, model: str, engine: str,
                 num_speculative_tokens: int, versions_kept: int = 4,
                 initial_version: int = 0) -> None:
        self._labels = {"model": model, "engine": engine}
        names = ("model", "engine", "weights", "version")
        self._drafts = Gauge(
            "rollout_spec_decode_weights_drafts",
            "Drafts (with per-position counts) of the sequences finished on these weights: "
            "'current' since the last push, 'previous' before it.", names, registry=registry)
        self._accepted = Gauge(
            "rollout_spec_decode_weights_accepted_per_position",
            "Drafts whose token at this 0-based position was accepted, of the sequences "
            "finished on these weights.", (*names, "position"), registry=registry)
        self._accuracy = Gauge(
            "rollout_trainer_mtp_accuracy",
            "The trainer's top-1 agreement of the MTP head at depth position + 1 with the "
            "tokens position + 2 ahead, on its training batch, measured with the weights of "
            "this version (sent with a weight push).",
            ("model", "engine", "version", "position"), registry=registry)
        self._num_positions = num_speculative_tokens
        self._versions_kept = versions_kept
        self._accuracy_versions: deque[tuple[str, int]] = deque()
        self._counts: dict[str, tuple[str, float, list[float]]] = {}
        self._set("current", str(initial_version), 0.0, [0.0] * num_speculative_tokens)

    def _set(self, weights: str, version: str, drafts: float, accepted: list[float]) -> None:
        self._counts[weights] = (version, drafts, accepted)
        self._drafts.labels(**self._labels, weights=weights, version=version).set(drafts)
        for position, count in enumerate(accepted):
            self._accepted.labels(**self._labels, weights=weights, version=version,
                                  position=str(position)).set(count)

    def _remove(self, weights: str) -> None:
        version, _, accepted = self._counts.pop(weights)
        self._drafts.remove(*self._labels.values(), weights, version)
        for position in range(len(accepted)):
            self._accepted.remove(*self._labels.values(), weights, version, str(position))

    def observe(self, stats: SpecDecodeStats) -> None:
        """Count one finished sequence on the current weights (only sequences that reported
        per-position acceptance count: the ratio's numerator needs them)."""
        if not stats.has_per_position or not self._num_positions:
            return
        version, drafts, accepted = self._counts["current"]
        # A shorter list means nothing accepted past it (acceptance is a prefix).
        new = list(stats.accepted_per_position[:self._num_positions])
        new += [0] * (self._num_positions - len(new))
        self._set("current", version, drafts + stats.num_drafts,
                  [a + b for a, b in zip(accepted, new)])

    def loaded(self, main_version: int, training: TrainingStats | None) -> None:
        """A push loaded: the current weights' counts become the previous ones, the new
        weights (labelled with the main model's version) start at zero, and the trainer's
        accuracy, when the push carried it, is exported under its own version."""
        if "previous" in self._counts:
            self._remove("previous")
        version, drafts, accepted = self._counts["current"]
        self._remove("current")
        self._set("previous", version, drafts, accepted)
        self._set("current", str(main_version), 0.0, [0.0] * self._num_positions)
        if training is not None:
            self._observe_training(training)

    def _observe_training(self, training: TrainingStats) -> None:
        version = str(training.version)
        for position, accuracy in enumerate(training.mtp_accuracy):
            self._accuracy.labels(**self._labels, version=version,
                                  position=str(position)).set(accuracy)
        self._accuracy_versions = deque(
            [(v, n) for v, n in self._accuracy_versions if v != version])
        self._accuracy_versions.append((version, len(training.mtp_accuracy)))
        while len(self._accuracy_versions) > self._versions_kept:
            old, num_positions = self._accuracy_versions.popleft()
            for position in range(num_positions):
                self._accuracy.remove(*self._labels.values(), old, str(position))
