"""The speculation control on the real engine (vLLM CPU, model runner V1, 2 speculative
tokens): K changes at run time in vLLM's engine core, greedy outputs do not, a bad
schedule is refused while the engine serves on, the start-up calibration fills the cost
table, and a zeroed drafter push drops K to 0 within the collapse bound until a good push.

One more vLLM engine for this module, beside the session's (tests/integration/conftest.py):
a service with ``speculation_control.enabled``. Schedules are pinned over HTTP
(``POST /speculation/schedule``) and observed in each sequence's own spec-decode counts.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from vllm.platforms import current_platform

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.speculation.cost import CostConfig, StepCostSample, StepCostTable
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    TARGET,
    WEIGHTS_TOKEN,
    run_service,
    served_version,
    until,
)
from trainer_client.push import WeightPusher

BUCKETS = [1, 2, 4, 8]
CALIBRATED_BATCH_SIZES = (1, 2, 4)
WINDOW_DRAFTS = 64  # about three of this file's sequences (24 tokens) at K = 1
CONTROL = {  # on the GPU target with vLLM's default graphs (spec-tests), FULL ones included
    "enabled": True, "batch_size_buckets": BUCKETS, "collapse_window_drafts": WINDOW_DRAFTS,
    "full_cuda_graphs": "as_is",
    "calibration": {"max_batch_size": CALIBRATED_BATCH_SIZES[-1], "num_steps": 12,
                    "prompt_tokens": 32},
}
PROMPTS = [[5 + i, 17, 42, 9] for i in range(3)]
DRAFTER_PREFIX = "model.mtp_layers."


@pytest.fixture(scope="module")
def controlled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The tiny model served with the speculation control, calibrated, up and healthy."""
    with run_service(tmp_path_factory.mktemp("speculation-control"),
                     speculation_control=CONTROL) as proc:
        yield proc


@pytest.fixture
async def client(controlled: ServiceProcess) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(controlled.url, api_key=API_KEY,
                             weights_token=WEIGHTS_TOKEN) as c:
        yield c


@pytest.fixture
async def unpinned(client: RolloutClient) -> AsyncIterator[None]:
    """Whatever a test pins, the controller has K back afterwards."""
    yield
    await client.pin_schedule(None)


async def control(client: RolloutClient) -> SpeculationControlStatus:
    status = (await client.health()).speculation_control
    assert status is not None, "the service runs no speculation control"
    return status


async def sequence(client: RolloutClient, prompt: list[int], max_tokens: int = 24
                   ) -> messages.SequenceOutput:
    response = await client.generate(messages.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return response.outputs[0]


async def k_series(client: RolloutClient) -> dict[int, float]:
    text = await client.metrics_text()
    return {b: sample_sum(text, "rollout_speculation_k", bucket=str(b)) for b in BUCKETS}


async def test_the_calibration_filled_the_cost_table(client: RolloutClient) -> None:
    status = await control(client)
    measured = {(p.k, p.batch_size) for p in status.cost_table}
    assert {(k, b) for k in range(NUM_SPECULATIVE_TOKENS + 1)
            for b in CALIBRATED_BATCH_SIZES} <= measured
    assert all(p.step_s > 0 and p.num_samples >= 1 and p.last_step_s is not None
               and p.last_step_s > 0 for p in status.cost_table)
    assert status.calibration_s is not None and status.calibration_s > 0
    covered = [b for b in status.buckets if b.batch_size <= CALIBRATED_BATCH_SIZES[-1]]
    assert covered and all(None not in b.tokens_per_s for b in covered)
    assert status.k_max == NUM_SPECULATIVE_TOKENS and status.num_refused == 0
    # drafter_at_k0: auto, the default: skip on CUDA (model runner V2), run on the CPU (V1)
    assert status.drafter_at_k0 == ("skip" if current_platform.is_cuda() else "run")


async def test_the_pinned_k_is_the_drafted_k_and_greedy_outputs_do_not_change(
        client: RolloutClient, unpinned: None) -> None:
    token_ids = {}
    for k in (0, NUM_SPECULATIVE_TOKENS, 1):
        status = await client.pin_schedule({1: k})
        assert [(b.k, b.reason) for b in status.buckets] == [(k, "pinned")] * len(BUCKETS)
        assert await k_series(client) == dict.fromkeys(BUCKETS, float(k))
        outs = await asyncio.gather(*(sequence(client, p) for p in PROMPTS))
        stats = [o.spec_decode for o in outs]
        assert all(s is not None for s in stats)
        if k == 0:  # K = 0 drafts nothing (vLLM still runs one drafter pass per step)
            assert all(s.num_drafts == 0 and s.num_draft_tokens == 0 for s in stats)
        else:
            assert all(s.num_drafts > 0 and s.num_draft_tokens == k * s.num_drafts
                       for s in stats), stats
        token_ids[k] = [o.token_ids for o in outs]
    assert token_ids[0] == token_ids[1] == token_ids[NUM_SPECULATIVE_TOKENS]


async def test_every_k_serves_at_every_batch_size(client: RolloutClient,
                                                  unpinned: None) -> None:
    """A K pinned at run time serves batches on both sides of the start-up schedule's
    tiers, where the engine captured its graphs for other K. On the H200 (CUDA graphs,
    model runner V2) an engine died of an illegal memory access with K = 0 pinned, in the
    step after a 17th request joined 16 decoding ones (docs/speculation-control.md): fresh
    batches of each size, then that step."""
    for k in range(NUM_SPECULATIVE_TOKENS + 1):
        await client.pin_schedule({1: k})
        for batch_size in (1, 5, 17, 40):
            prompts = [[3 + (i % 50), 7 + k, 11 + batch_size % 13, 5] for i in range(batch_size)]
            outs = await asyncio.gather(*(sequence(client, p, max_tokens=12) for p in prompts))
            assert [len(o.token_ids) for o in outs] == [12] * batch_size, (k, batch_size)
            assert all(o.spec_decode is not None
                       and o.spec_decode.num_draft_tokens == k * o.spec_decode.num_drafts
                       for o in outs), (k, batch_size)
        # The H200's failing step: 16 requests decoding, then a 17th admitted among them.
        before = sample_sum(await client.metrics_text(), "vllm:generation_tokens_total")
        running = [asyncio.create_task(sequence(client, [9, i % 50 + 3, 4], max_tokens=64))
                   for i in range(16)]

        async def generated() -> float:
            return sample_sum(await client.metrics_text(), "vllm:generation_tokens_total")

        await until(generated, lambda n: n >= before + 32, timeout_s=120, interval_s=0.05)
        joining = await sequence(client, [9, 8, 7], max_tokens=12)
        outs = await asyncio.gather(*running)
        assert [len(o.token_ids) for o in [*outs, joining]] == [64] * 16 + [12], k
    assert (await client.health()).status == "ok"


async def test_a_sequence_is_priced_at_the_k_it_ran(client: RolloutClient,
                                                   unpinned: None) -> None:
    """The engine measured its start-up verify cost at K = k_max; a lone sequence pinned at
    K = 1 is priced at c(1, 1) / c(0, 1) of the controller's own table, in the response and
    in the counters the slow-down alert reads (vLLM's output handler records a step's
    costs before the sequence it finished resumes, and nothing steps afterwards, so the
    table read after it is the one it was priced with; the points as measured, K = 1
    against K = 0 read as the controller reads it, ``StepCostTable.cost_ratio``)."""
    await client.pin_schedule({1: 1})
    before = await client.metrics_text()
    spec = (await sequence(client, PROMPTS[0])).spec_decode
    after = await client.metrics_text()
    health = await client.health()
    assert health.speculation is not None and health.speculation_control is not None
    costs = StepCostTable(CostConfig(), (  # /health's points, priced as the controller does
        StepCostSample(k=p.k, batch_size=p.batch_size, step_s=p.step_s)
        for p in health.speculation_control.cost_table))
    ratio = costs.cost_ratio(1, 1)
    assert spec is not None and spec.num_drafts > 0 and spec.num_draft_tokens == spec.num_drafts
    assert spec.verify_cost_ratio == pytest.approx(ratio, rel=1e-9)
    assert spec.verify_cost_ratio != health.speculation.verify_cost_ratio  # not k_max's
    assert spec.net_speedup == pytest.approx(spec.accept_length / ratio, rel=1e-9)

    def added(name: str) -> float:
        return sample_sum(after, name) - sample_sum(before, name)

    assert added("rollout_spec_decode_verify_cost_total") == pytest.approx(
        spec.num_drafts * ratio, rel=1e-9)
    assert added("rollout_spec_decode_costed_tokens_total") == \
        spec.num_drafts + spec.num_accepted_tokens


@pytest.mark.parametrize("body, message", [
    ({"schedule": [{"batch_size": 4, "k": NUM_SPECULATIVE_TOKENS + 1}]},
     f"K={NUM_SPECULATIVE_TOKENS + 1} in range \\[1, 4\\] exceeds the engine's "
     f"num_speculative_tokens={NUM_SPECULATIVE_TOKENS}"),
    ({"schedule": [{"batch_size": 0, "k": 1}]}, "schedule.0.batch_size"),
    ({"schedule": [{"batch_size": 2, "k": -1}]}, "schedule.0.k"),
    ({"schedule": [{"batch_size": 2, "k": 1}, {"batch_size": 2, "k": 0}]}, "distinct"),
    ({"schedule": {"2": 1}}, "schedule"),
    ({"schedule": []}, "schedule"),
    ({}, "schedule"),
])
async def test_a_bad_schedule_is_refused_and_the_engine_keeps_serving(
        controlled: ServiceProcess, client: RolloutClient, unpinned: None, body: dict,
        message: str) -> None:
    await client.pin_schedule({1: 1})
    with httpx.Client(base_url=controlled.url, timeout=60,
                      headers={"authorization": f"Bearer {WEIGHTS_TOKEN}"}) as http:
        response = http.post("/speculation/schedule", json=body)
    assert response.status_code == 400
    assert re.search(message, response.json()["error"]["message"]), response.json()
    status = await control(client)
    assert [b.k for b in status.buckets] == [1] * len(BUCKETS)  # the schedule in force stays
    out = await sequence(client, PROMPTS[0])
    assert out.spec_decode is not None and out.spec_decode.num_drafts > 0
    assert out.spec_decode.num_draft_tokens == out.spec_decode.num_drafts
    assert (await client.health()).status == "ok"


async def test_pins_need_the_weights_token(controlled: ServiceProcess) -> None:
    for headers in ({}, {"authorization": f"Bearer {API_KEY}"}):
        response = httpx.post(f"{controlled.url}/speculation/schedule", headers=headers,
                              json={"schedule": None}, timeout=60)
        assert response.status_code == 401


async def test_the_session_service_without_the_controller_refuses_pins(
        service: ServiceProcess) -> None:
    async with RolloutClient(service.url, weights_token=WEIGHTS_TOKEN) as c:
        with pytest.raises(ServiceError) as refused:
            await c.pin_schedule({1: 0})
    assert refused.value.status == 403 and "speculation_control.enabled" in refused.value.message


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    tensors = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    return {name: t.to(TARGET.tensor_device) for name, t in tensors.items()}


@pytest.fixture
def pusher(controlled: ServiceProcess) -> Iterator[WeightPusher]:
    with WeightPusher(controlled.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024,
                      transport=TARGET.transport) as p:  # type: ignore[arg-type]
        yield p


async def test_a_zeroed_drafter_drops_k_to_zero_and_a_good_push_brings_it_back(
        controlled: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """The issue's bound: K = 0 within 60 s of a broken drafter. The controller's: once
    the broken drafter has drafted ``collapse_window_drafts`` times (the new drafter is
    probed at K >= 1 in the small buckets, so a lone sequence drafts)."""
    zeroed = {name: torch.zeros_like(t) if name.startswith(DRAFTER_PREFIX) else t
              for name, t in original.items()}
    version = served_version(controlled) + 1
    pusher.push(zeroed.items(), version=version, target="draft")
    pushed_at = time.monotonic()
    num_drafts = 0
    for i in range(WINDOW_DRAFTS):  # every sequence drafts at least once
        out = await sequence(client, [3 + i, 11, 29, 7])
        num_drafts += 0 if out.spec_decode is None else out.spec_decode.num_drafts
        if num_drafts >= WINDOW_DRAFTS:
            break
    status = await until(lambda: control(client), lambda s: s.is_collapsed, timeout_s=30)
    assert time.monotonic() - pushed_at < 60
    assert status.draft_version == version and status.collapse_rate is not None
    assert status.collapse_rate < 0.1
    assert all((b.controller_k, b.reason) == (0, "acceptance collapsed") for b in status.buckets)
    status = await until(lambda: control(client),
                         lambda s: all(b.k == 0 for b in s.buckets), timeout_s=30)
    assert await k_series(client) == dict.fromkeys(BUCKETS, 0.0)
    assert sample_sum(await client.metrics_text(), "rollout_speculation_collapsed") == 1
    out = await sequence(client, PROMPTS[0])
    assert out.spec_decode is not None and out.spec_decode.num_draft_tokens == 0

    pusher.push(original.items(), version=version + 1, target="draft")
    # The controller learns of the new drafter from the first sequence it served.
    await sequence(client, PROMPTS[1])
    status = await until(lambda: control(client),
                         lambda s: s.buckets[0].k >= 1 and not s.is_collapsed, timeout_s=30)
    assert status.draft_version == version + 1 and status.is_probing
    assert status.buckets[0].reason == "probing the drafter"
    drafted = (await sequence(client, PROMPTS[2])).spec_decode
    assert drafted is not None and drafted.num_drafts > 0
    assert drafted.num_accepted_tokens / drafted.num_draft_tokens > 0.3
    assert sample_sum(await client.metrics_text(), "rollout_speculation_collapsed") == 0
