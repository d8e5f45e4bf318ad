"""Acceptance by request category: bounded labels, the exporter, the batch summary."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rollout_service.config import load_config
from rollout_service.protocol import messages, openai
from rollout_service.protocol.acceptance import SpecDecodeStats, summarize, summarize_by_category
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.telemetry.config import CategoryLabels, TelemetryConfig

LABELS = {"model": "m", "engine": "vllm"}


def stats(histogram: list[int]) -> SpecDecodeStats:
    return SpecDecodeStats.from_histogram(histogram, num_draft_tokens=sum(histogram))


def test_first_categories_seen_get_labels_and_the_rest_is_other() -> None:
    labels = CategoryLabels(TelemetryConfig(max_categories=2))
    assert [labels.label(c) for c in ("code", "math", "chat", "code", None)] == \
        ["code", "math", "other", "code", "none"]


def test_an_allow_list_labels_only_its_categories() -> None:
    labels = CategoryLabels(TelemetryConfig(categories=["math", "code"]))
    assert labels.initial == ("none", "other", "code", "math")
    assert [labels.label(c) for c in ("chat", "math", None)] == ["other", "math", "none"]


@pytest.mark.parametrize("categories", [["other"], ["none"], ["a", "a"], ["bad label!"]])
def test_bad_allow_lists_are_refused_naming_the_field(categories: list[str]) -> None:
    with pytest.raises(ValueError, match="telemetry.categories"):
        load_config(telemetry={"categories": categories})


def test_exporter_labels_each_category_and_bounds_them() -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=1,
                                 categories=CategoryLabels(TelemetryConfig(max_categories=1)),
                                 **LABELS)
    exporter.observe(stats([0, 4]), "math")      # accept rate 1
    exporter.observe(stats([4, 0]), "code")      # 0, past the bound: "other"
    exporter.observe(stats([2, 2]), "prose")     # 0.5, "other"
    exporter.observe(stats([1, 3]))              # 0.75, "none"

    def value(name: str, category: str) -> float | None:
        return registry.get_sample_value(name, {**LABELS, "category": category})

    rate = "rollout_spec_decode_request_accept_rate"
    assert value(f"{rate}_sum", "math") == 1.0
    assert value(f"{rate}_sum", "other") == 0.5 and value(f"{rate}_count", "other") == 2
    assert value(f"{rate}_sum", "none") == 0.75
    assert value("rollout_requests_total", "code") is None
    assert value("rollout_spec_decode_accepted_per_position_total", "math") is None
    assert registry.get_sample_value("rollout_spec_decode_accepted_per_position_total",
                                     {**LABELS, "category": "math", "position": "0"}) == 4


def test_series_of_the_allow_list_exist_before_traffic() -> None:
    registry = CollectorRegistry()
    SpecDecodeMetrics(registry=registry, num_speculative_tokens=1,
                      categories=CategoryLabels(TelemetryConfig(categories=["math"])), **LABELS)
    for category in ("math", "other", "none"):
        assert registry.get_sample_value("rollout_requests_total",
                                         {**LABELS, "category": category}) == 0


def test_batch_summary_per_category_is_the_summary_of_its_sequences() -> None:
    math, code = [stats([0, 3]), stats([1, 1])], [stats([3, 0]), None]
    by_category = summarize_by_category([("math", math[0]), ("code", code[0]),
                                         (None, stats([2, 2])), ("math", math[1]),
                                         ("code", code[1])])
    assert by_category == {"code": summarize(code), "math": summarize(math)}


def test_requests_name_a_category_or_are_refused() -> None:
    req = messages.GenerateRequest(prompt="1 + 1 =", category="math/easy")
    assert req.category == "math/easy"
    for bad in ("", "x" * 65, "a b", 3):
        with pytest.raises(ValidationError, match="category"):
            messages.GenerateRequest(prompt="1 + 1 =", category=bad)
    chat = openai.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "category": "chat"})
    assert chat.category == "chat"
    with pytest.raises(ValidationError, match="category"):
        openai.CompletionRequest.model_validate({"model": "m", "prompt": "x", "category": "?"})


@pytest.mark.parametrize("reserved", ["none", "other"])
def test_the_labels_the_service_gives_are_refused_as_request_categories(reserved: str) -> None:
    """A request named 'none' would be counted with the uncategorized ones, 'other' with
    those past the allow-list: refused with the field's name, and the schema says so."""
    with pytest.raises(ValidationError, match=f"category\n.*'{reserved}' is reserved"):
        messages.GenerateRequest(prompt="1 + 1 =", category=reserved)
    with pytest.raises(ValidationError, match="category"):
        openai.CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "category": reserved})
    schema = messages.GenerateRequest.model_json_schema()["properties"]["category"]
    assert {"not": {"enum": ["none", "other"]}}.items() <= schema["anyOf"][0].items()
    assert CategoryLabels(TelemetryConfig()).label(None) == "none"  # the label it would hit
