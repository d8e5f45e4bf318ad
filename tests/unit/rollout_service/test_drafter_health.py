"""Drafter health per weight version: the exporter, and the training stats a push carries."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.telemetry.drafter import DrafterHealth

LABELS = {"model": "m", "engine": "vllm"}


def stats(histogram: list[int]) -> SpecDecodeStats:
    return SpecDecodeStats.from_histogram(histogram, num_draft_tokens=2 * sum(histogram))


def drafts(registry: CollectorRegistry, weights: str, version: str) -> float | None:
    return registry.get_sample_value("rollout_spec_decode_weights_drafts",
                                     {**LABELS, "weights": weights, "version": version})


def accepted(registry: CollectorRegistry, weights: str, version: str, position: int
             ) -> float | None:
    return registry.get_sample_value("rollout_spec_decode_weights_accepted_per_position",
                                     {**LABELS, "weights": weights, "version": version,
                                      "position": str(position)})


def training(version: int, *accuracy: float) -> messages.TrainingStats:
    return messages.TrainingStats(version=version, mtp_accuracy=list(accuracy), num_tokens=10)


def test_each_push_moves_current_to_previous_and_starts_anew() -> None:
    registry = CollectorRegistry()
    health = DrafterHealth(registry=registry, num_speculative_tokens=2, **LABELS)
    health.observe(stats([1, 1, 2]))  # 4 drafts; position 0 accepted 3 times, 1 twice
    assert (drafts(registry, "current", "0"), accepted(registry, "current", "0", 0),
            accepted(registry, "current", "0", 1)) == (4, 3, 2)
    health.loaded(1, None)
    assert drafts(registry, "previous", "0") == 4 and accepted(registry, "previous", "0", 1) == 2
    assert drafts(registry, "current", "1") == 0 and drafts(registry, "current", "0") is None
    health.observe(stats([2, 0, 0]))
    health.loaded(2, None)
    assert drafts(registry, "previous", "1") == 2 and accepted(registry, "previous", "1", 0) == 0
    assert drafts(registry, "previous", "0") is None, "two versions at a time"
    assert drafts(registry, "current", "2") == 0


def test_sequences_without_per_position_counts_are_left_out() -> None:
    registry = CollectorRegistry()
    health = DrafterHealth(registry=registry, num_speculative_tokens=2, **LABELS)
    health.observe(SpecDecodeStats(num_drafts=5, num_draft_tokens=10, num_accepted_tokens=4,
                                   num_verify_steps=5))
    assert drafts(registry, "current", "0") == 0


def test_training_accuracy_is_kept_for_the_last_versions() -> None:
    registry = CollectorRegistry()
    health = DrafterHealth(registry=registry, num_speculative_tokens=1, versions_kept=2, **LABELS)
    for version in range(1, 5):
        health.loaded(version, training(version - 1, 0.5 + version / 10, 0.3))

    def accuracy(version: int, position: int) -> float | None:
        return registry.get_sample_value("rollout_trainer_mtp_accuracy", {
            **LABELS, "version": str(version), "position": str(position)})

    assert [accuracy(v, 0) for v in range(4)] == [None, None, pytest.approx(0.8),
                                                  pytest.approx(0.9)]
    assert accuracy(3, 1) == pytest.approx(0.3)


def test_training_stats_are_validated_naming_the_field() -> None:
    begin = {"version": 5, "segment": "mtp-rollout-push-x", "segment_bytes": 64,
             "total_bytes": 4, "params": [{"name": "w", "shape": [1], "dtype": "float32"}]}
    ok = messages.PushBeginRequest.model_validate(
        {**begin, "training_stats": {"version": 4, "mtp_accuracy": [0.7], "num_tokens": 9}})
    assert ok.training_stats == training(4, 0.7).model_copy(update={"num_tokens": 9})
    # A version newer than the pushed one is schema-valid and refused by the service with a
    # 409 (test_drafter_health.py of the integration tests): the schema cannot say it.
    for stats, field in (({"version": 4, "mtp_accuracy": [1.5], "num_tokens": 1},
                          "mtp_accuracy"),
                         ({"version": 4, "mtp_accuracy": [], "num_tokens": 1}, "mtp_accuracy"),
                         ({"version": 4, "mtp_accuracy": [0.5]}, "num_tokens")):
        with pytest.raises(ValidationError, match=field):
            messages.PushBeginRequest.model_validate({**begin, "training_stats": stats})
