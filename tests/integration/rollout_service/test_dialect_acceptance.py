"""One acceptance, whichever dialect served the request: the same greedy requests sent
through the native API, vLLM's OpenAI and token-in/token-out routes and SGLang's
``/generate`` report the same per-request counts in each dialect's own fields, and move
the service's Prometheus series by exactly those counts (read back from a real
Prometheus server).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest

from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import API_KEY, NUM_SPECULATIVE_TOKENS, until

PROMPTS = [[31, 32, 33, 34, 35], [41, 42, 43], [7, 8, 9, 10, 11, 12]]
MAX_TOKENS = 24
SERIES = ("rollout_requests_total", "rollout_spec_decode_drafts_total",
          "rollout_spec_decode_draft_tokens_total", "rollout_spec_decode_accepted_tokens_total")
Counts = tuple[int, int, int]
"""(verify steps with a draft, drafted tokens, accepted tokens) of one sequence."""


async def native(http: httpx.AsyncClient, prompt: list[int]) -> Counts:
    out = (await http.post("/generate", json={
        "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True})).json()["outputs"][0]["spec_decode"]
    return out["num_drafts"], out["num_draft_tokens"], out["num_accepted_tokens"]


async def completions(http: httpx.AsyncClient, prompt: list[int]) -> Counts:
    """vLLM's own field: ``metrics.speculative_decoding`` (one prompt, one choice)."""
    spec = (await http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True})).json()["metrics"]["speculative_decoding"]
    assert len(spec["acceptance_histogram"]) == NUM_SPECULATIVE_TOKENS + 1
    return spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]


async def tokens(http: httpx.AsyncClient, prompt: list[int]) -> Counts:
    spec = (await http.post("/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": {
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    )).json()["metrics"]["speculative_decoding"]
    return spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]


async def sglang(http: httpx.AsyncClient, prompt: list[int]) -> Counts:
    """SGLang's ``meta_info.spec_*``, read as the SGLang engine adapter reads SGLang's."""
    meta = (await http.post("/generate", json={
        "input_ids": prompt, "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    )).json()["meta_info"]
    stats = spec_stats_from_meta_info(meta, NUM_SPECULATIVE_TOKENS + 1)
    assert stats is not None
    assert (meta["spec_accept_token_num"], meta["spec_draft_token_num"]) == (
        stats.num_accepted_tokens, stats.num_draft_tokens)
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


DIALECTS: dict[str, Callable[[httpx.AsyncClient, list[int]], Awaitable[Counts]]] = {
    "native": native, "vllm-completions": completions, "vllm-tokens": tokens,
    "sglang": sglang}


async def totals(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {name: sample_sum(text, name) for name in SERIES}


async def prometheus_value(url: str, query: str) -> float | None:
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"{url}/api/v1/query", params={"query": query})).json()
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


async def test_the_same_requests_give_the_same_acceptance_in_every_dialect(
        service: ServiceProcess, prometheus: str) -> None:
    async with httpx.AsyncClient(base_url=service.url, timeout=120,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as http:
        per_dialect: dict[str, list[Counts]] = {}
        moved: dict[str, dict[str, float]] = {}
        for name, send in DIALECTS.items():
            # Every dialect from the same engine state: no prefix cached, one request at a
            # time (the same batch every step, so greedy verification decides the same).
            assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
            before = await totals(http)
            per_dialect[name] = [await send(http, prompt) for prompt in PROMPTS]
            after = await totals(http)
            moved[name] = {k: after[k] - before[k] for k in SERIES}
        for name, counts in per_dialect.items():
            assert counts == per_dialect["native"], name
            assert moved[name] == {
                "rollout_requests_total": len(PROMPTS),
                "rollout_spec_decode_drafts_total": sum(c[0] for c in counts),
                "rollout_spec_decode_draft_tokens_total": sum(c[1] for c in counts),
                "rollout_spec_decode_accepted_tokens_total": sum(c[2] for c in counts),
            }, name
        assert sum(c[2] for c in per_dialect["native"]) > 0, "nothing accepted: a vacuous test"
        # Prometheus holds what the service exported (it scrapes every second).
        for series in SERIES[2:]:
            want = (await totals(http))[series]
            assert await until(lambda s=series: prometheus_value(prometheus, f"sum({s})"),
                               lambda got, w=want: got == w, timeout_s=30) == pytest.approx(want)
