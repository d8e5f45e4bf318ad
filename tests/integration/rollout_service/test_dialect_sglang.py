"""SGLang's rollout dialect on the real service (vLLM CPU engine, MTP on), as slime,
AReaL's SGLang backend and NeMo-RL send it: ``/generate`` (beside the native API on the
same path), logprobs, streaming, pause / continue, abort one or all.

Request shapes are the clients' own (cited per test); answers are read the way they read
them, and their acceptance counts with the SGLang engine adapter's own reader
(``engines/sglang/stats.py``, written against SGLang's ``meta_info``), so the counts a
slime trainer logs are the counts this service exported.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.protocol.sse import read_events
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import API_KEY, NUM_SPECULATIVE_TOKENS, until
from tests.support.waiting import first_caught

PROMPT_IDS = [21, 22, 23, 24]
LONG = 1000
"""Tokens of a request still running while a test pauses or aborts it (the context is
1024; the tiny model writes a few hundred tokens a second on two cores)."""


@pytest.fixture
async def http(service: ServiceProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=service.url, timeout=120,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as client:
        yield client


class Streamed:
    """One SGLang ``/generate`` streamed in the background (SGLang's default stream: the
    sequence so far in every event); ``first`` once its first event arrived."""

    def __init__(self, http: httpx.AsyncClient, rid: str, max_new_tokens: int) -> None:
        self.first = asyncio.Event()
        self.events: list[dict] = []
        self._task = asyncio.ensure_future(self._run(http, {
            "input_ids": PROMPT_IDS, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}))

    async def _run(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for event in read_events(response.aiter_lines()):
                self.events.append(json.loads(event))
                self.first.set()

    async def started(self) -> Streamed:
        await asyncio.wait_for(self.first.wait(), 60)
        return self

    async def last(self) -> dict:
        await asyncio.wait_for(self._task, 120)
        return self.events[-1]

    @property
    def is_done(self) -> bool:
        return self._task.done()


async def held(http: httpx.AsyncClient, rids: list[str]) -> list[Streamed]:
    """Requests caught running by ``/pause_generation`` in mode ``in_place`` (the service
    is left paused); a test process starved until one had finished tries again."""
    async def attempt() -> list[Streamed] | None:
        streams = [Streamed(http, rid, LONG) for rid in rids]
        for stream in streams:
            await stream.started()
        await http.post("/pause_generation", json={"mode": "in_place"})
        loads = (await http.get("/v1/loads")).json()["loads"]
        in_engine = sum(load["num_running_reqs"] for load in loads)
        # A request that ended in the engine before the pause may not have sent its last
        # event yet: the engine's count says so at once.
        if in_engine < len(streams) or any(s.is_done for s in streams):
            await http.post("/continue_generation", json={})
            for s in streams:
                await s.last()
            return None
        return streams

    return await first_caught(attempt, attempts=5, what="a request finished before the pause")


async def test_generate_as_slime_sends_it_and_reads_it(http: httpx.AsyncClient) -> None:
    """slime ``slime/rollout/sglang_rollout.py::generate`` sends ``input_ids``,
    ``sampling_params`` (with ``no_stop_trim``, ``stop_token_ids``) and
    ``return_logprob``; ``slime/utils/types.py`` reads ``meta_info.output_token_logprobs``,
    ``weight_version``, ``spec_accept_token_num``, ``spec_draft_token_num``,
    ``spec_verify_ct``, ``cached_tokens`` and ``finish_reason``."""
    response = await http.post("/generate", json={
        "input_ids": PROMPT_IDS, "return_logprob": True, "return_routed_experts": False,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                            "max_new_tokens": 12, "stop": None, "stop_token_ids": None,
                            "skip_special_tokens": False, "no_stop_trim": True,
                            "spaces_between_special_tokens": False, "sampling_seed": 4}})
    assert response.status_code == 200, response.text
    out = response.json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(entry[0] <= 0 for entry in meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == len(PROMPT_IDS)
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    assert meta["spec_draft_token_num"] == meta["spec_verify_ct"] * NUM_SPECULATIVE_TOKENS
    assert "cached_tokens" in meta and "weight_version" in meta
    stats = spec_stats_from_meta_info(meta, NUM_SPECULATIVE_TOKENS + 1)
    assert stats is not None and stats.num_draft_tokens == meta["spec_draft_token_num"]
    assert len(meta["spec_correct_drafts_histogram"]) == NUM_SPECULATIVE_TOKENS + 1


async def test_the_native_api_keeps_its_own_generate(http: httpx.AsyncClient) -> None:
    """One path, two dialects: the body's keys pick the answer's shape."""
    native = await http.post("/generate", json={"prompt_token_ids": PROMPT_IDS, "max_tokens": 3})
    assert native.status_code == 200 and "outputs" in native.json()
    sglang = await http.post("/generate", json={"input_ids": PROMPT_IDS,
                                                "sampling_params": {"max_new_tokens": 3}})
    assert sglang.status_code == 200 and "meta_info" in sglang.json()
    typo = await http.post("/generate", json={"prompt": "a", "max_token": 3})
    assert typo.status_code == 400 and "max_token" in typo.text   # native stays strict
    both = await http.post("/generate", json={"text": "a", "input_ids": [1]})
    assert both.status_code == 400 and "exactly one of 'text' and 'input_ids'" in both.text


async def test_batches_and_n_answer_with_a_list_in_order(http: httpx.AsyncClient) -> None:
    """SGLang's batch: ``text`` as a list, per-prompt ``rid`` and ``sampling_params``."""
    response = await http.post("/generate", json={
        "text": ["1 + 1 =", "2 + 2 ="], "rid": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 3, "n": 2, "sampling_seed": 1},
                            {"max_new_tokens": 5}]})
    assert response.status_code == 200, response.text
    outs = response.json()
    assert [o["meta_info"]["id"] for o in outs] == ["a", "a", "b"]
    assert [len(o["output_ids"]) for o in outs] == [3, 3, 5]
    mismatched = await http.post("/generate", json={"text": ["x", "y"], "rid": ["only-one"]})
    assert mismatched.status_code == 400 and "rid" in mismatched.text


async def test_top_and_prompt_logprobs_as_areal_asks_for_them(
        http: httpx.AsyncClient) -> None:
    """AReaL's ``compute_logp`` path and SGLang's ``logprob_start_len``:
    ``input_token_logprobs`` from the prompt's first token (its logprob null)."""
    response = await http.post("/generate", json={
        "input_ids": PROMPT_IDS, "return_logprob": True, "top_logprobs_num": 3,
        "logprob_start_len": 0, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    meta = response.json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT_IDS
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 3 for top in meta["input_top_logprobs"][1:])
    assert all(len(top) == 3 and isinstance(top[0][2], str)
               for top in meta["output_top_logprobs"])
    # greedy: the sampled token is the most likely one
    assert [e[1] for e in meta["output_token_logprobs"]] == [
        top[0][1] for top in meta["output_top_logprobs"]]


async def test_a_stream_is_the_sequence_so_far_then_done(http: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPT_IDS, "stream": True,
            "sampling_params": {"max_new_tokens": 10, "sampling_seed": 9}}
    whole = (await http.post("/generate", json={**body, "stream": False})).json()
    events = []
    async with http.stream("POST", "/generate", json=body) as response:
        async for event in read_events(response.aiter_lines()):
            events.append(json.loads(event))
    for before, after in zip(events, events[1:]):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    assert events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["text"] == whole["text"]
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


async def test_pause_abort_continue_and_a_partial_rollout_resubmitted(
        http: httpx.AsyncClient) -> None:
    """AReaL's SGLang backend: ``/pause_generation`` (mode abort), then partial rollouts
    resubmitted with their tokens (``areal/infra/remote_inf_engine.py``), then
    ``/continue_generation``."""
    async def attempt() -> dict | None:
        [running] = await held(http, ["areal-1"])
        paused = await http.post("/pause_generation", json={"mode": "abort"})  # aborts the held
        assert paused.json()["status"] == "ok"
        try:
            cut = await running.last()
        finally:
            assert (await http.post("/continue_generation", json={})).status_code == 200
        return None if cut["meta_info"]["finish_reason"]["type"] == "length" else cut

    cut = await first_caught(attempt, attempts=5,
                             what="the request finished in the engine first")
    assert cut["meta_info"]["finish_reason"]["type"] == "abort"
    done = len(cut["output_ids"])
    assert 0 < done < LONG
    resumed = await http.post("/generate", json={
        "input_ids": PROMPT_IDS + cut["output_ids"],
        "sampling_params": {"max_new_tokens": LONG - done, "ignore_eos": True}})
    out = resumed.json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG - done}


async def test_abort_one_by_rid_or_all_and_poll_loads_until_idle(
        http: httpx.AsyncClient) -> None:
    """slime ``slime/backends/sglang_utils/server_control.py``: ``/abort_request``
    ``{"abort_all": true}``, then ``/v1/loads?include=core`` until nothing runs."""
    async def attempt() -> float | None:
        aborted = sample_sum((await http.get("/metrics")).text,
                             "rollout_aborted_requests_total")
        one, two, three = await held(http, ["one", "two", "three"])
        try:
            assert (await http.post("/abort_request", json={"rid": "one"})).status_code == 200
            first = (await one.last())["meta_info"]["finish_reason"]["type"]
            loads = (await http.get("/v1/loads", params={"include": "core"})).json()
            num_left = sum(load["num_running_reqs"] for load in loads["loads"])
            assert (await http.post("/abort_request",
                                    json={"abort_all": True})).status_code == 200
            await until(lambda: http.get("/v1/loads"),
                        lambda r: all(load["num_running_reqs"] == 0
                                      for load in r.json()["loads"]), timeout_s=60)
        finally:
            await http.post("/continue_generation", json={})
        endings = [first] + [(await s.last())["meta_info"]["finish_reason"]["type"]
                             for s in (two, three)]
        if "length" in endings:
            return None   # one had ended in the engine before the pause
        assert num_left == 2
        return aborted

    aborted = await first_caught(attempt, what="a request finished in the engine first")
    text = (await http.get("/metrics")).text
    assert sample_sum(text, "rollout_aborted_requests_total") == aborted + 3


async def test_flush_health_and_weight_version(http: httpx.AsyncClient) -> None:
    flushed = await http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    assert (await http.get("/flush_cache")).status_code == 200
    assert (await http.get("/health_generate")).status_code == 200
    version = (await http.get("/get_weight_version")).json()["weight_version"]
    main = (await http.get("/health")).json()["weights"]["main_version"]
    assert version == ("default" if main is None else str(main))
    # the label every answer's meta_info carries (slime compares the two)
    out = (await http.post("/generate", json={"input_ids": PROMPT_IDS,
                                              "sampling_params": {"max_new_tokens": 2}})).json()
    assert out["meta_info"]["weight_version"] == version


async def test_server_and_model_info_as_slime_reads_them(http: httpx.AsyncClient) -> None:
    """slime ``slime/backends/sglang_utils/external.py`` (``get_server_info``,
    ``discover_external_engines``): ``/server_info`` or ``/get_server_info``, read for
    ``tp_size``, ``pp_size``, ``dp_size``, ``ep_size``."""
    for path in ("/server_info", "/get_server_info"):
        info = (await http.get(path)).json()
        assert (info["tp_size"], info["pp_size"], info["dp_size"], info["ep_size"]) == (
            1, 1, 1, 1)
        assert info["speculative_num_draft_tokens"] == NUM_SPECULATIVE_TOKENS + 1
        assert info["context_length"] == 1024
    for path in ("/model_info", "/get_model_info"):
        model = (await http.get(path)).json()
        assert model["is_generation"] and model["served_model_name"] == "embedded:tiny"


async def test_custom_params_are_ignored_but_slimes_top_p_replay_is_refused(
        http: httpx.AsyncClient) -> None:
    """SGLang hands ``custom_params`` to a custom logit processor only: ignored. slime sends
    ``{"return_top_p_token_ids": true}`` with ``--rollout-top-p`` below 1
    (``slime/rollout/sglang_rollout.py``, ``GenerateState``) and asserts the replay only its
    patched SGLang returns (``slime/ray/rollout.py``): refused at once, naming it."""
    ignored = await http.post("/generate", json={
        "input_ids": PROMPT_IDS, "sampling_params": {
            "max_new_tokens": 3, "top_p": 0.9, "custom_params": {"some_processor_arg": 1}}})
    assert ignored.status_code == 200, ignored.text
    replay = await http.post("/generate", json={
        "input_ids": PROMPT_IDS, "sampling_params": {
            "max_new_tokens": 3, "top_p": 0.9,
            "custom_params": {"return_top_p_token_ids": True}}})
    assert replay.status_code == 400
    assert "return_top_p_token_ids" in replay.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"text": "a", "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"text": "a", "sampling_params": {"regex": "[a-z]+"}}, "regex"),
    ({"text": "a", "image_data": "cat.png"}, "image_data"),
    ({"text": "a", "lora_path": "/adapters/x"}, "lora_path"),
])
async def test_what_cannot_be_honoured_is_refused_naming_it(
        http: httpx.AsyncClient, body: dict, field: str) -> None:
    response = await http.post("/generate", json=body)
    assert response.status_code == 400 and field in response.json()["error"]["message"]


async def test_the_routes_take_the_api_key(service: ServiceProcess) -> None:
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as anonymous:
        for path, body in (("/generate", {"text": "a"}), ("/pause_generation", {}),
                           ("/abort_request", {"abort_all": True})):
            assert (await anonymous.post(path, json=body)).status_code == 401
