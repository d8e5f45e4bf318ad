"""The service on a live SGLang 0.5.23 server: what is SGLang's own, checked against what
SGLang itself reports (GPU only: ``ROLLOUT_TEST_TARGET=sglang``, the sglang bundle).

The module starts its own SGLang server (the embedded tiny MiMo checkpoint, its MTP layer
as an EAGLE drafter, the target's arguments plus ``enable_metrics`` and no radix cache)
and a service driving it through ``engine_url``; the session's service, which launches its
own server, runs the shared tests (``sglang_target.py``). Greedy answers are compared only
between requests SGLang computes the same way: one at a time, each prefilled in full (no
radix cache), so a bf16 near-tie resolves alike in both. Sampled requests are never
compared: SGLang ignores ``sampling_seed`` unless it runs deterministic inference.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from bench.sglang_server import counter, own_checksums
from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import (
    API_KEY,
    NUM_SPECULATIVE_TOKENS,
    WEIGHTS_TOKEN,
    served_version,
    until,
    wait_for,
    weights_checksums,
    weights_status,
)
from tests.integration.rollout_service.sglang_live import (
    DRAFT_PARAM,
    LIVE_SGLANG,
    MAIN_ONLY_PARAM,
    PROMPTS,
    accept_rate,
    one_by_one,
    own_sglang,
    refuse_a_float32_push,
    service_on,
)
from trainer_client.push import WeightPusher

pytestmark = LIVE_SGLANG

K = NUM_SPECULATIVE_TOKENS
SHARED_PARAM = "lm_head.weight"


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's own SGLang server, exporting its metrics; yields its URL."""
    with own_sglang(tmp_path_factory.mktemp("sglang") / "sglang.log",
                    enable_metrics=True) as url:
        yield url


@pytest.fixture(scope="module")
def live(sglang: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A service driving the module's server (``engine_url``)."""
    with service_on(sglang, tmp_path_factory.mktemp("live-service")) as proc:
        yield proc


@pytest.fixture
async def client(live: ServiceProcess) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(live.url, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))


@pytest.fixture
def pusher(live: ServiceProcess, original: dict[str, torch.Tensor]) -> Iterator[WeightPusher]:
    """A pusher; afterwards the checkpoint is served again, bit for bit."""
    baseline = weights_checksums(live)
    with WeightPusher(live.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024, transport="shm") as p:
        yield p
        p.push(original.items(), version=served_version(live) + 1, target="both")
    assert weights_checksums(live) == baseline


def greedy(prompt: list[int], max_tokens: int = 24) -> messages.GenerateRequest:
    return messages.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True)


def direct(url: str, body: dict) -> dict:
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def scaled(original: dict[str, torch.Tensor], name: str, seed: int) -> dict[str, torch.Tensor]:
    """``original`` with ``name`` scaled element-wise by factors in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    factor = 0.5 + torch.rand(original[name].shape, generator=g)
    return {**original, name: (original[name].float() * factor).to(original[name].dtype)}


async def test_health_names_sglang_and_its_drafter(client: RolloutClient) -> None:
    health = await client.health()
    assert (health.status, health.engine, health.model) == ("ok", "sglang", "embedded:tiny")
    speculation = health.speculation
    assert (speculation.is_enabled, speculation.method, speculation.num_speculative_tokens,
            speculation.has_pushable_drafter) == (True, "EAGLE", K, True)


async def test_a_greedy_request_counts_as_sglang_reports(sglang: str,
                                                        client: RolloutClient) -> None:
    for prompt in PROMPTS[:3]:
        own = direct(sglang, {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}})
        out = (await client.generate(greedy(prompt, 32))).outputs[0]
        assert out.token_ids == own["output_ids"]  # computed alike: the counts must match
        spec, meta = out.spec_decode, own["meta_info"]
        assert (spec.num_verify_steps, spec.num_drafts, spec.num_accepted_tokens,
                spec.num_draft_tokens) == (meta["spec_verify_ct"], meta["spec_verify_ct"],
                                           meta["spec_num_correct_drafts"],
                                           meta["spec_num_proposed_drafts"]), meta
        assert spec.num_draft_tokens == K * spec.num_verify_steps  # a chain: k per step
        assert len(spec.accepted_per_position) == K
        assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
        # The prefill gives the first token, each verify step its accepted run plus one;
        # a last run cut at max_tokens is counted whole.
        assert 31 <= spec.num_accepted_tokens + spec.num_verify_steps <= 31 + K


async def test_verify_steps_and_tokens_match_sglangs_own_counters(
        sglang: str, client: RolloutClient) -> None:
    names = ("sglang:spec_verify_calls_total", "sglang:generation_tokens_total")
    before = [counter(sglang, name) for name in names]
    batch = await client.generate_batch(messages.BatchGenerateRequest(requests=[
        messages.GenerateRequest(prompt_token_ids=p, max_tokens=40, temperature=1.0, n=2)
        for p in PROMPTS]))
    seqs = [o for r in batch.responses for o in r.outputs]
    expected = [sum(o.spec_decode.num_verify_steps for o in seqs),
                sum(len(o.token_ids) for o in seqs)]
    after = wait_for(lambda: [counter(sglang, name) for name in names],
                     lambda now: all(n - b >= e for n, b, e in zip(now, before, expected)),
                     timeout_s=30)
    assert [a - b for a, b in zip(after, before)] == expected


async def test_sglang_dialect_answers_as_sglang_does(sglang: str, live: ServiceProcess) -> None:
    body = {"text": "12 + 7 =", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                                    "ignore_eos": True}}
    own = direct(sglang, body)
    async with httpx.AsyncClient(base_url=live.url, timeout=120,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as http:
        response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    ours = response.json()
    assert ours["output_ids"] == own["output_ids"] and ours["text"] == own["text"]
    # SGLang's own histogram stops at the most a step accepted; the dialect's has k + 1 bins.
    assert spec_stats_from_meta_info(ours["meta_info"], K + 1, num_positions=K) == \
        spec_stats_from_meta_info(own["meta_info"], K + 1, num_positions=K)


async def test_greedy_streams_and_chat_are_the_whole_answers(live: ServiceProcess,
                                                             client: RolloutClient) -> None:
    oai = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    params = {"model": "embedded:tiny", "prompt": "3 + 4 =", "max_tokens": 24,
              "temperature": 0.0}
    before = sample_sum(await client.metrics_text(), "rollout_requests_total")
    whole = await oai.completions.create(**params)
    streamed = [c.choices[0].text async for c in await oai.completions.create(
        **params, stream=True) if c.choices]
    assert "".join(streamed) == whole.choices[0].text and len(streamed) > 1
    chat = {"model": "embedded:tiny", "messages": [{"role": "user", "content": "3 + 4 ="}],
            "max_tokens": 16, "temperature": 0.0}
    whole_chat = await oai.chat.completions.create(**chat)
    chunks = [c.choices[0].delta.content or "" async for c in
              await oai.chat.completions.create(**chat, stream=True) if c.choices]
    assert "".join(chunks) == whole_chat.choices[0].message.content
    after = sample_sum(await client.metrics_text(), "rollout_requests_total")
    assert after - before == 4  # each sequence counted once, streamed or not


async def test_a_client_gone_mid_stream_aborts_in_sglang(sglang: str,
                                                        live: ServiceProcess) -> None:
    aborted = counter(sglang, "sglang:num_aborted_requests_total")
    body = {"model": "embedded:tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "n": 4,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live.url, timeout=60,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert (await anext(response.aiter_lines())).startswith("data: {")
    # The running gauge drops to 0 once the scheduler is idle (published on idle).
    wait_for(lambda: (counter(sglang, "sglang:num_aborted_requests_total") - aborted,
                      counter(sglang, "sglang:num_running_reqs")),
             lambda state: state[0] >= 4 and state[1] == 0, timeout_s=30)


async def test_main_push_changes_outputs_and_a_shared_head_moves_the_drafter(
        sglang: str, live: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    before_outputs, before = await one_by_one(client), own_checksums(sglang)
    version = served_version(live) + 1
    pusher.push(scaled(original, MAIN_ONLY_PARAM, seed=1).items(), version=version,
                target="main")
    after = own_checksums(sglang)
    assert after["target"][MAIN_ONLY_PARAM] != before["target"][MAIN_ONLY_PARAM]
    assert after["draft"] == before["draft"]
    outs = await one_by_one(client)
    assert [o.token_ids for o in outs] != [o.token_ids for o in before_outputs]
    assert all(o.weight_versions == [messages.WeightVersionSpan(version=str(version), start=0,
                                                                end=24)] for o in outs)
    state = weights_status(live)
    assert state.main_version == version and state.draft_version != version
    # SGLang's drafter reads the main model's lm_head (eagle_worker_v2.py's
    # set_embed_and_head): a main push of it moves the drafter's checksum too.
    pusher.push(scaled(original, SHARED_PARAM, seed=2).items(), version=version + 1,
                target="main")
    shared = own_checksums(sglang)
    [draft_head] = [name for name in shared["draft"] if name.endswith(SHARED_PARAM)]
    assert shared["draft"][draft_head] != before["draft"][draft_head]
    assert shared["draft"][draft_head] == shared["target"][SHARED_PARAM]


async def test_draft_push_moves_acceptance(sglang: str, live: ServiceProcess,
                                           client: RolloutClient, pusher: WeightPusher,
                                           original: dict[str, torch.Tensor]) -> None:
    before_outputs, before = await one_by_one(client), own_checksums(sglang)
    version = served_version(live) + 1
    noisy = dict(original)
    g = torch.Generator().manual_seed(3)
    noisy[DRAFT_PARAM] = (torch.randn(original[DRAFT_PARAM].shape, generator=g)
                          * original[DRAFT_PARAM].float().std() * 3).to(torch.bfloat16)
    pusher.push(noisy.items(), version=version, target="draft")
    after = own_checksums(sglang)
    assert after["target"] == before["target"] and after["draft"] != before["draft"]
    outs = await one_by_one(client)
    assert accept_rate(outs) < accept_rate(before_outputs) - 0.2
    assert weights_status(live).draft_version == version
    metrics = httpx.get(f"{live.url}/metrics", timeout=30).text
    assert sample_sum(metrics, "rollout_weight_version", engine="sglang",
                      role="draft") == version


def test_a_refused_push_changes_nothing_in_sglangs_own_checker(
        sglang: str, live: ServiceProcess, original: dict[str, torch.Tensor]) -> None:
    with WeightPusher(live.url, WEIGHTS_TOKEN, transport="shm") as p:
        refuse_a_float32_push(sglang, live, p, original, SHARED_PARAM)


async def test_a_push_during_generation_shows_in_the_spans(
        sglang: str, live: ServiceProcess, client: RolloutClient, pusher: WeightPusher,
        original: dict[str, torch.Tensor]) -> None:
    """A ``keep`` push (SGLang: ``/pause_generation`` in mode ``retract``) while sixteen
    long requests run: the requests it held finish on the new weights, their spans
    switching where it came; the others carry one version."""
    served = str(weights_status(live).main_version or "default")
    version = served_version(live) + 1
    pending = asyncio.gather(*(client.generate(messages.GenerateRequest(
        prompt_token_ids=[4 + i, 11], max_tokens=900, temperature=1.0, ignore_eos=True))
        for i in range(16)))
    # SGLang's gauge counts the requests decoding (each has its first token), published
    # every 40 decode steps: all 16, about a tenth of the way in.
    await until(lambda: asyncio.to_thread(counter, sglang, "sglang:num_running_reqs"),
                lambda n: n == 16 or pending.done(), timeout_s=60, interval_s=0.05)
    report = await asyncio.to_thread(pusher.push, scaled(original, MAIN_ONLY_PARAM, 4).items(),
                                     version=version, pause_mode="keep")
    responses = await pending
    spans = [list(r.outputs[0].weight_versions) for r in responses]
    assert all(len(r.outputs[0].token_ids) == 900 for r in responses)
    crossed = [s for s in spans if s[-1].version == str(version)]
    assert 0 < len(crossed) <= report.server.num_requests_held, (report.server, spans)
    for s in spans:
        assert s[0].start == 0 and s[-1].end == 900 and all(
            a.end == b.start for a, b in zip(s, s[1:])), s
        assert [span.version for span in s] in ([served], [served, str(version)]), s
