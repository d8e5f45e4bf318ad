"""Weight pushes into the real engine: main model and MTP drafter, during generation,
in keep mode, and an engine that fails mid-load (the refusals are in
``test_weights_refused.py``).

Every test leaves the session's service serving the original checkpoint again
(the ``restore`` fixture pushes it back), so other test modules see the model
they expect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from rollout_service.client import RolloutClient, ServiceError
from rollout_service.protocol import messages
from rollout_service.protocol.shm import Segment
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import shm_only, until
from tests.integration.conftest import weights_checksums as checksums
from tests.integration.conftest import weights_status as status
from tests.integration.rollout_service.weights_support import (
    DRAFT_PARAM,
    MAIN_PARAM,
    HeldBack,
    accept_rate,
    begin_body,
    generated_tokens,
    generating_or_done,
    http,
    load_original,
    next_version,
    placed,
    probe,
    requests_in_engine,
    tokens_generated_reach,
    trainer_pusher,
    with_change,
)
from tests.support.waiting import first_caught
from trainer_client.push import WeightPusher, copy_into, layout, param_spec, spec_nbytes


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_original()


@pytest.fixture
def pusher(service: ServiceProcess) -> Iterator[WeightPusher]:
    with trainer_pusher(service) as p:
        yield p


@pytest.fixture(scope="module")
def baseline(service: ServiceProcess) -> dict[str, str]:
    """Checksums of the checkpoint as served before this module pushes anything."""
    return checksums(service)


@pytest.fixture
def restore(service: ServiceProcess, pusher: WeightPusher, original: dict[str, torch.Tensor],
            baseline: dict[str, str]) -> Iterator[None]:
    yield
    pusher.push(original.items(), version=next_version(service), target="both")
    # The same segment (and the engine's cached mapping of it) carried different
    # bytes in the test's push: the original must be back, bit for bit.
    assert checksums(service) == baseline


async def test_main_push_changes_outputs_and_versions_not_drafter(
        service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor], restore: None) -> None:
    before_outputs = await probe(client)
    before = checksums(service)
    version = next_version(service)
    report = pusher.push(with_change(original, MAIN_PARAM, seed=1).items(), version=version,
                         target="main")
    assert report.num_buckets > 1 and report.num_bytes == sum(
        t.numel() * t.element_size() for t in original.values())
    assert 0 < report.begin_s < report.control_s < report.total_s  # begin, then the updates
    after = checksums(service)
    assert after["main"] != before["main"]
    assert after["draft"] == before["draft"]
    outs = await probe(client)
    assert [o.token_ids for o in outs] != [o.token_ids for o in before_outputs]
    assert all(o.weight_versions == [messages.WeightVersionSpan(version=str(version), start=0,
                                                                end=24)] for o in outs)
    state = status(service)
    assert state.main_version == version and state.draft_version != version


async def test_draft_push_moves_acceptance_not_outputs(
        service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor], restore: None) -> None:
    before_outputs = await probe(client)
    before = checksums(service)
    version = next_version(service)
    pusher.push(with_change(original, DRAFT_PARAM, seed=2).items(), version=version,
                target="draft")
    after = checksums(service)
    assert after["draft"] != before["draft"] and after["main"] == before["main"]
    outs = await probe(client)
    # greedy speculative decoding is lossless: same tokens, worse drafts
    assert [o.token_ids for o in outs] == [o.token_ids for o in before_outputs]
    assert accept_rate(outs) < accept_rate(before_outputs) - 0.2
    assert status(service).draft_version == version
    with httpx.Client() as c:
        metrics = c.get(f"{service.url}/metrics").text
    assert f'rollout_weight_version{{engine="vllm",model="embedded:tiny",role="draft"}} ' \
           f'{float(version)}' in metrics


async def test_generation_during_push_sees_only_complete_versions(
        service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor], restore: None) -> None:
    old = str(status(service).main_version) if status(service).main_version else None
    version = next_version(service)
    before = await generated_tokens(client)
    requests = [client.generate(messages.GenerateRequest(
        prompt_token_ids=[3 + i, 8, 13], max_tokens=48, temperature=1.0, seed=i))
        for i in range(12)]
    pending = asyncio.gather(*requests)
    # The push must meet generation: wait until vLLM generates some of them (or, on a fast
    # machine, they are already done: the spans must then hold the old version alone).
    await until(lambda: generating_or_done(client, before, pending), bool, timeout_s=120,
                interval_s=0.05)
    report = await asyncio.to_thread(
        pusher.push, with_change(original, MAIN_PARAM, seed=5).items(), version=version)
    responses = await pending
    seen = {span.version for r in responses for span in r.outputs[0].weight_versions}
    allowed = {str(version), old or "default"}
    assert seen <= allowed, seen
    for r in responses:  # spans tile the output without gaps
        spans = r.outputs[0].weight_versions
        assert spans[0].start == 0 and spans[-1].end == len(r.outputs[0].token_ids)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert report.server.timings.total_s > 0


async def test_keep_mode_freezes_requests_and_spans_show_the_switch(
        service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor], restore: None) -> None:
    """Requests frozen by a ``keep`` push finish on the new weights, and their version spans
    switch where the push came.

    That needs requests that have tokens and are still running when the push pauses the
    engine. The push sends all but its last bucket before the requests start
    (:class:`HeldBack`), so its pause follows the requests' first 32 tokens by one update
    call. The test process can still be starved for the requests' whole generation on a
    busy machine, and the push says so: ``num_requests_held`` counts the requests it froze.
    An attempt in which no request with tokens was frozen is repeated (``first_caught``:
    three attempts, more within 90 s); everything an attempt shows is checked in each.
    """
    async def attempt() -> int | None:
        held, spans, version, served = await _keep_mode_push(service, client, pusher, original)
        crossed = [s for s in spans if s[-1].version == str(version)]
        switched = [s for s in crossed if len(s) == 2]
        assert len(crossed) <= held, (held, spans)  # only frozen requests see the new version
        assert all(len(s) == 1 for s in spans if s not in crossed), spans
        for old, new in switched:
            assert (old.version, new.version) == (served, str(version)), (old, new)
            assert old.start == 0 and old.end == new.start, (old, new)
        return len(switched) or None

    await first_caught(attempt, what="the push froze no request with tokens")


async def _keep_mode_push(service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
                          original: dict[str, torch.Tensor]
                          ) -> tuple[int, list[list[messages.WeightVersionSpan]], int, str]:
    """A ``keep`` push staged first, then sixteen long requests, then the push's last bucket
    and ``finish`` once vLLM has counted 32 of their tokens: the requests the push held,
    each request's version spans, the pushed version and the version served before."""
    version = next_version(service)
    num_tokens = 1000
    # New tokens carry the served main version's label, or no switch could show.
    probe = await client.generate(messages.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=2))
    served = str(status(service).main_version or "default")
    assert [span.version for span in probe.outputs[0].weight_versions] == [served]
    # Requests of earlier tests still in the engine would generate the tokens counted
    # below while these wait: start from an idle engine (before the push, which the
    # service aborts after push_timeout_s without a call).
    await until(lambda: requests_in_engine(client), lambda n: n == 0, timeout_s=120)
    held_back = HeldBack(original)
    push = asyncio.ensure_future(asyncio.to_thread(
        pusher.push, iter(held_back), specs=held_back.specs, version=version,
        pause_mode="keep"))

    async def staged_or_ended() -> bool:
        return held_back.staged.is_set() or push.done()

    try:
        await until(staged_or_ended, bool, timeout_s=60, interval_s=0.05)
        if push.done():
            push.result()  # it cannot finish before the release: this raises its error
        before = await generated_tokens(client)
        pending = asyncio.gather(*(client.generate(messages.GenerateRequest(
            prompt_token_ids=[4 + i, 11], max_tokens=num_tokens, temperature=1.0, seed=i,
            ignore_eos=True)) for i in range(16)))
        await tokens_generated_reach(client, before + 32, pending)  # mid-generation, normally
    finally:
        held_back.release()
        await asyncio.wait([push])
    report = push.result()
    responses = await pending
    assert all(len(r.outputs[0].token_ids) == num_tokens for r in responses)  # none aborted
    return (report.server.num_requests_held,
            [list(r.outputs[0].weight_versions) for r in responses], version, served)


@shm_only
async def test_engine_failure_mid_load_refuses_generation_until_a_full_push(
        service: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor], restore: None) -> None:
    """The failure no validation can catch: the engine fails after it began loading.

    The announcement and the bucket are valid; the segment then vanishes before
    ``finish`` (a trainer killed between its last update and finish, its segment
    removed by the OS), so the main model's load fails inside vLLM after the reload
    session has started. The service must not serve that model: 500 for the push,
    503 for generation and health, versions unchanged, until a complete push."""
    state = status(service)
    specs = [param_spec(name, t) for name, t in original.items()]
    sizes = [spec_nbytes(spec) for spec in specs]
    offsets, nbytes = layout(sizes)
    segment = Segment.create("mtp-rollout-test-vanishing", nbytes)
    for (name, tensor), offset, size in zip(original.items(), offsets, sizes, strict=True):
        copy_into(segment, offset, tensor, size)
    with http(service) as c:
        begin = c.post("/weights/begin",
                       json=begin_body(original, segment.name, next_version(service)))
        assert begin.status_code == 200, begin.text
        push_id = begin.json()["push_id"]
        placements = [placed(name, tensor, segment.name, offset)
                      for (name, tensor), offset in zip(original.items(), offsets, strict=True)]
        update = c.post("/weights/update", json={"push_id": push_id, "tensors": placements})
        assert update.status_code == 200, update.text
        segment.close()  # unlinks it: everything was validated, the load cannot succeed
        finish = c.post("/weights/finish", json={"push_id": push_id})
        health = httpx.get(f"{service.url}/health", timeout=30)
    assert finish.status_code == 500, finish.text
    assert "generation is refused" in finish.json()["error"]["message"]
    assert health.status_code == 503 and not health.json()["weights"]["consistent"]
    after = status(service)
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
    assert after.last_push.outcome == "failed"
    with pytest.raises(ServiceError) as refused:
        await client.generate(messages.GenerateRequest(prompt_token_ids=[5, 17], max_tokens=4))
    assert refused.value.status == 503

    version = next_version(service)
    pusher.push(original.items(), version=version)  # a complete push heals it
    response = await client.generate(messages.GenerateRequest(prompt_token_ids=[5, 17],
                                                           max_tokens=4))
    assert response.outputs[0].weight_versions[-1].version == str(version)
    health = httpx.get(f"{service.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["weights"]["consistent"]
