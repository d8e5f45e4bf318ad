"""Drafter health on the real service: wasted work, the measured cost of a verify step,
the net speed-up, per request and in Prometheus's text."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.embedded.corpus import arithmetic_prompts
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import API_KEY, NUM_SPECULATIVE_TOKENS, WEIGHTS_TOKEN
from tests.integration.rollout_service.weights_support import next_version
from trainer_client.push import WeightPusher

PROMPTS = [p for p, _ in arithmetic_prompts(6, seed=11)]


def _health(service: ServiceProcess) -> messages.HealthResponse:
    return messages.HealthResponse.model_validate(httpx.get(f"{service.url}/health",
                                                            timeout=60).json())


def test_engine_measured_a_verify_step_dearer_than_a_decode_step(
        service: ServiceProcess) -> None:
    speculation = _health(service).speculation
    assert speculation is not None and speculation.num_speculative_tokens == \
        NUM_SPECULATIVE_TOKENS
    ratio = speculation.verify_cost_ratio
    # A verify step runs the target over 1 + k tokens per sequence and the drafter k
    # times: it cannot be cheaper than the target over one token.
    assert ratio is not None and 1.0 < ratio < 20.0


async def test_each_sequence_reports_its_waste_and_net_speedup(
        client: RolloutClient, service: ServiceProcess) -> None:
    ratio = _health(service).speculation.verify_cost_ratio
    before = await client.metrics_text()
    batch = await client.generate_batch(messages.BatchGenerateRequest(requests=[
        messages.GenerateRequest(prompt=p, max_tokens=24, temperature=1.0, seed=i,
                                 ignore_eos=True) for i, p in enumerate(PROMPTS)]))
    after = await client.metrics_text()
    seqs = [o.spec_decode for r in batch.responses for o in r.outputs]
    assert all(s is not None and s.num_drafts > 0 for s in seqs)
    for spec in seqs:
        assert spec.num_rejected_tokens == spec.num_draft_tokens - spec.num_accepted_tokens
        assert spec.verify_cost_ratio == ratio
        assert spec.net_speedup == pytest.approx(spec.accept_length / ratio)
    rejected = sum(s.num_rejected_tokens for s in seqs)
    assert rejected > 0, "at temperature 1 the embedded drafter is rejected sometimes"
    assert batch.acceptance.num_rejected_tokens == rejected
    tokens = sum(s.num_drafts + s.num_accepted_tokens for s in seqs)
    assert batch.acceptance.net_speedup == pytest.approx(
        tokens / sum(s.num_drafts for s in seqs) / ratio)
    name = "rollout_spec_decode_rejected_tokens_total"
    assert sample_sum(after, name) - sample_sum(before, name) == rejected
    assert sample_sum(after, "rollout_spec_decode_verify_cost_ratio") == ratio
    # Without the speculation control every verify step is priced at that one ratio.
    drafts = sum(s.num_drafts for s in seqs)
    for name, value in (("costed_drafts", drafts), ("costed_tokens", tokens),
                        ("verify_cost", drafts * ratio)):
        name = f"rollout_spec_decode_{name}_total"
        assert sample_sum(after, name) - sample_sum(before, name) == pytest.approx(value)


def _by_category(text: str, name: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and "category" in sample.labels:
                category = sample.labels["category"]
                found[category] = found.get(category, 0.0) + sample.value
    return found


async def test_acceptance_is_labelled_by_category_with_the_rest_as_other(
        client: RolloutClient, service: ServiceProcess) -> None:
    name = "rollout_spec_decode_request_accept_rate_count"
    before = _by_category(await client.metrics_text(), name)
    assert {"math", "code", "other", "none"} <= set(before), "allow-list series exist at start"
    requests = [messages.GenerateRequest(prompt=p, max_tokens=16, temperature=1.0, seed=i,
                                         ignore_eos=True, category=category)
                for i, (p, category) in enumerate(zip(PROMPTS, ["math", "math", "code",
                                                                "poetry", None, "math"]))]
    batch = await client.generate_batch(messages.BatchGenerateRequest(requests=requests))
    # the OpenAI route takes the category as an extra field
    async with openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=API_KEY) as oai:
        await oai.completions.create(model="embedded:tiny", prompt=PROMPTS[0], max_tokens=16, n=2,
                                     extra_body={"category": "code"})
    after = _by_category(await client.metrics_text(), name)
    delta = {c: after.get(c, 0.0) - before.get(c, 0.0) for c in after}
    assert delta == {"math": 3, "code": 1 + 2, "other": 1, "none": 1}
    assert set(batch.acceptance_by_category) == {"math", "code", "poetry"}
    seqs = {category: [o.spec_decode.accept_rate for r, q in zip(batch.responses, requests)
                       if q.category == category for o in r.outputs]
            for category in ("math", "code")}
    for category, rates in seqs.items():
        summary = batch.acceptance_by_category[category]
        assert summary.num_sequences == len(rates)
        assert summary.macro_accept_rate == pytest.approx(sum(rates) / len(rates))


def test_a_bad_category_is_a_400_naming_it(service: ServiceProcess) -> None:
    response = httpx.post(f"{service.url}/generate", timeout=60,
                          headers={"authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "1 + 1 =", "category": "no spaces allowed"})
    assert response.status_code == 400
    assert "category" in response.json()["error"]["message"]


async def test_acceptance_per_weight_version_and_training_accuracy(
        client: RolloutClient, service: ServiceProcess) -> None:
    """A push carrying the trainer's accuracy: exported under the version it measured, and
    the sequences after the push counted under the new version's 'current' series."""
    original = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    version = next_version(service)
    stats = messages.TrainingStats(version=version - 1, mtp_accuracy=[0.625], num_tokens=80)
    with WeightPusher(service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024) as pusher:
        with pytest.raises(ServiceError, match="training_stats.version") as refused:
            pusher.push(original.items(), version=version,
                        training_stats=stats.model_copy(update={"version": version + 1}))
        assert refused.value.status == 409
        pusher.push(original.items(), version=version, target="both", training_stats=stats)
    batch = await client.generate_batch(messages.BatchGenerateRequest(requests=[
        messages.GenerateRequest(prompt=p, max_tokens=16, temperature=1.0, seed=i)
        for i, p in enumerate(PROMPTS)]))
    text = await client.metrics_text()
    seqs = [o.spec_decode for r in batch.responses for o in r.outputs]
    current = {"weights": "current", "version": str(version)}
    assert sample_sum(text, "rollout_spec_decode_weights_drafts", **current) == \
        sum(s.num_drafts for s in seqs)
    for position in range(NUM_SPECULATIVE_TOKENS):
        assert sample_sum(text, "rollout_spec_decode_weights_accepted_per_position",
                          **current, position=str(position)) == \
            sum(s.accepted_per_position[position] for s in seqs)
    assert 'weights="previous"' in text, "the weights before the push stay exported"
    assert sample_sum(text, "rollout_trainer_mtp_accuracy", version=str(version - 1),
                      position="0") == 0.625
