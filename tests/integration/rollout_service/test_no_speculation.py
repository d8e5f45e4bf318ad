"""A service without speculative decoding (``mtp.enabled: false``) on the real engine.

It must start (vLLM refuses per-request spec-decode metrics without a speculative
config, so the service must not ask for them), serve without acceptance stats, say
in ``/health`` that speculation is off, refuse a push naming the drafter before any
byte loads, and load a main-model push. One more vLLM engine for this module,
beside the session's MTP service (tests/integration/conftest.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import (
    API_KEY,
    TARGET,
    WEIGHTS_TOKEN,
    run_service,
    served_version,
    weights_checksums,
    weights_status,
)
from tests.integration.rollout_service.weights_support import MAIN_PARAM, with_change
from trainer_client.push import WeightPusher

ACCEPTANCE_SERIES = ("rollout_spec_decode_missing_stats_requests_total",
                     "rollout_spec_decode_invalid_stats_requests_total",
                     "rollout_spec_decode_no_spec_requests_total",
                     "rollout_spec_decode_drafts_total",
                     "rollout_spec_decode_draft_tokens_total",
                     "rollout_spec_decode_request_accept_length_count")


@pytest.fixture(scope="module")
def plain_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The tiny model served with MTP off, up and healthy (the same config otherwise)."""
    with run_service(tmp_path_factory.mktemp("no-speculation"),
                     mtp={"enabled": False}) as proc:
        yield proc


@pytest.fixture
async def plain_client(plain_service: ServiceProcess) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(plain_service.url, api_key=API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    tensors = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    return {name: t.to(TARGET.tensor_device) for name, t in tensors.items()}


@pytest.fixture
def pusher(plain_service: ServiceProcess) -> Iterator[WeightPusher]:
    with WeightPusher(plain_service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024,
                      transport=TARGET.transport) as p:  # type: ignore[arg-type]
        yield p


async def test_serves_and_reports_speculation_off(plain_client: RolloutClient) -> None:
    health = await plain_client.health()
    assert health.status == "ok"
    assert health.speculation == messages.SpeculationInfo(
        is_enabled=False, method=None, num_speculative_tokens=0, has_pushable_drafter=False)
    before = await plain_client.metrics_text()
    batch = await plain_client.generate_batch(messages.BatchGenerateRequest(requests=[
        messages.GenerateRequest(prompt_token_ids=[5 + i, 9, 40], max_tokens=8, temperature=1.0,
                                 seed=i, n=2, ignore_eos=True) for i in range(2)]))
    seqs = [o for r in batch.responses for o in r.outputs]
    assert len(seqs) == 4 and all(len(o.token_ids) == 8 for o in seqs)
    assert all(o.spec_decode is None for o in seqs)
    summary = batch.acceptance
    assert (summary.num_sequences, summary.num_with_speculation) == (4, 0)
    assert summary.macro_accept_rate is None and summary.micro_accept_rate is None
    after = await plain_client.metrics_text()
    assert sample_sum(after, "rollout_requests_total") - \
        sample_sum(before, "rollout_requests_total") == 4
    for name in ACCEPTANCE_SERIES:  # nothing drafts, so nothing is missing either
        assert sample_sum(after, name) == 0, name


@pytest.mark.parametrize("target", ["both", "draft"])
def test_drafter_push_is_refused_and_changes_nothing(
        plain_service: ServiceProcess, pusher: WeightPusher, original: dict[str, torch.Tensor],
        target: messages.PushTarget) -> None:
    before, state = weights_checksums(plain_service), weights_status(plain_service)
    with pytest.raises(ServiceError) as refused:
        pusher.push(with_change(original, MAIN_PARAM, seed=7).items(),
                    version=served_version(plain_service) + 1, target=target)
    assert refused.value.status == 400
    assert refused.value.message.startswith(f"target: {target!r} loads the drafter")
    assert weights_checksums(plain_service) == before
    after = weights_status(plain_service)
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
    assert after.active_push_id is None and after.consistent
    assert after.last_push.outcome == "rejected"


async def test_main_push_loads(plain_service: ServiceProcess, plain_client: RolloutClient,
                               pusher: WeightPusher,
                               original: dict[str, torch.Tensor]) -> None:
    baseline = weights_checksums(plain_service)
    version = served_version(plain_service) + 1
    report = pusher.push(with_change(original, MAIN_PARAM, seed=8).items(), version=version,
                         target="main")
    assert report.version == version
    assert weights_checksums(plain_service)["main"] != baseline["main"]
    response = await plain_client.generate(messages.GenerateRequest(
        prompt_token_ids=[5, 17, 42], max_tokens=4, temperature=0.0, ignore_eos=True))
    assert response.outputs[0].weight_versions == [
        messages.WeightVersionSpan(version=str(version), start=0, end=4)]
    state = weights_status(plain_service)
    assert (state.main_version, state.draft_version) == (version, None)
    pusher.push(original.items(), version=version + 1, target="main")  # the checkpoint again
    assert weights_checksums(plain_service) == baseline
