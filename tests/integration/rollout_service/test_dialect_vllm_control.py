"""vLLM's dialect's generation control on the real service (vLLM CPU engine, MTP on):
``/pause`` in each mode, ``/abort_requests``, AReaL's pause routes, a partial rollout
resubmitted, and a push inside a client's pause, all mid-generation.

A request must still run when a test pauses or aborts it; on the busy 2-core machine it
may have ended first, and each scenario then tries again (``first_caught``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import API_KEY, until
from tests.support.tokens_stream import (
    LONG,
    PROMPT_IDS,
    Streamed,
    frozen,
    num_running,
    tokens_request,
)
from tests.support.waiting import first_caught


@pytest.fixture
async def http(service: ServiceProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=service.url, timeout=120,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as client:
        yield client


async def test_pause_wait_drains_abort_aborts_and_resume_serves_what_queued(
        http: httpx.AsyncClient) -> None:
    """vLLM's ``POST /pause?mode=...`` (``vllm/entrypoints/rl/online/api_router.py``)."""
    draining = await Streamed(http, "drain", 200).started()
    try:
        assert (await http.post("/pause", params={"mode": "wait"})).json() == {
            "status": "paused"}
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
    finally:
        assert (await http.post("/resume")).json() == {"status": "resumed"}
    await draining.finished()
    assert (draining.finish_reason, len(draining.token_ids)) == ("length", 200)

    async def abort_one() -> Streamed | None:
        running = await Streamed(http, "to-abort", LONG).started()
        assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
        await running.finished()
        if running.finish_reason == "length":   # all generated before the pause came
            await http.post("/resume")
            return None
        return running

    running = await first_caught(abort_one, what="the request finished before the pause")
    try:
        queued = asyncio.ensure_future(tokens_request(http, "queued", 4))
        await until(lambda: num_running(http), lambda n: n == 1, timeout_s=30)
    finally:
        await http.post("/resume")
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < LONG
    assert (await queued).json()["choices"][0]["finish_reason"] == "length"
    assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_abort_requests_aborts_those_named_and_only_those(
        http: httpx.AsyncClient) -> None:
    def totals(text: str) -> tuple[float, float]:
        return (sample_sum(text, "rollout_aborted_requests_total"),
                sample_sum(text, "rollout_spec_decode_missing_stats_requests_total"))

    async def attempt() -> tuple[Streamed, Streamed, tuple[float, float]] | None:
        before = totals((await http.get("/metrics")).text)
        kept = await Streamed(http, "kept", 60).started()
        doomed = await frozen(http, "doomed")
        try:
            answer = await http.post("/abort_requests", json={"request_ids": ["doomed"]})
            assert answer.json()["status"] == "aborted"
            await doomed.finished()
        finally:
            await http.post("/resume")
        await kept.finished()
        return None if doomed.finish_reason == "length" else (doomed, kept, before)

    doomed, kept, (aborted, missing) = await first_caught(
        attempt, what="the request finished in the engine before the pause")
    assert doomed.finish_reason == "abort" and len(doomed.token_ids) < LONG
    assert (kept.finish_reason, len(kept.token_ids)) == ("length", 60)
    assert totals((await http.get("/metrics")).text) == (aborted + 1, missing)


async def test_areals_pause_routes_abort_and_hold_until_continue(
        http: httpx.AsyncClient) -> None:
    """AReaL's vLLM backend (``areal/engine/vllm_remote.py``: ``get_pause_request``,
    ``get_resume_request``) calls its patched server's ``/areal_pause_generation`` and
    ``/areal_continue_generation`` (``areal/engine/vllm_ext/areal_vllm_server.py``)."""
    async def attempt() -> Streamed | None:
        running = await frozen(http, "areal-vllm")
        paused = await http.post("/areal_pause_generation", json={})
        assert paused.json()["success"] is True
        try:
            await running.finished()
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
        finally:
            resumed = await http.post("/areal_continue_generation", json={})
        assert resumed.json() == {"success": True, "message": "Generation continued"}
        return None if running.finish_reason == "length" else running

    running = await first_caught(attempt, what="the request finished before the pause")
    assert running.finish_reason == "abort"
    assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_an_aborted_rollout_resubmitted_with_its_tokens_completes(
        http: httpx.AsyncClient) -> None:
    """AReaL's partial rollouts (``areal/infra/remote_inf_engine.py``): on finish reason
    ``abort`` the client sends the prompt plus the tokens so far, for what is left."""
    async def attempt() -> Streamed | None:
        partial = await frozen(http, "partial", temperature=0.0)
        await http.post("/pause", params={"mode": "abort"})   # aborts what the pause kept
        await http.post("/resume")
        await partial.finished()
        return None if partial.finish_reason == "length" else partial

    partial = await first_caught(attempt, what="the request finished before the pause")
    assert partial.finish_reason == "abort"
    rest = LONG - len(partial.token_ids)
    resumed = await http.post("/inference/v1/generate", json={
        "token_ids": PROMPT_IDS + partial.token_ids,
        "sampling_params": {"max_tokens": rest, "ignore_eos": True, "temperature": 0.0}})
    [choice] = resumed.json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == rest


async def test_a_push_inside_a_client_pause_leaves_generation_paused(
        http: httpx.AsyncClient, service: ServiceProcess) -> None:
    """The frameworks' update: ``/pause`` (keep), a push, ``/resume``. The push's own pause
    and resume must not end the client's: the frozen request resumes on the pushed weights
    only at ``/resume``."""
    from safetensors.torch import load_file

    from rollout_service.embedded import ensure_model
    from tests.integration.conftest import TARGET, WEIGHTS_TOKEN, served_version
    from trainer_client.push import WeightPusher

    tensors = load_file(str(ensure_model("tiny") / "model.safetensors"),
                        device=TARGET.tensor_device)

    async def attempt() -> tuple[Streamed, int, bool] | None:
        stream = await frozen(http, "frozen")
        version = served_version(service) + 1
        try:
            def push() -> None:
                with WeightPusher(service.url, WEIGHTS_TOKEN,
                                  transport=TARGET.transport) as pusher:  # type: ignore[arg-type]
                    pusher.push(tensors.items(), version=version, pause_mode="keep")

            await asyncio.to_thread(push)
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            assert (await http.get("/weight_info")).json() == {"weight_version": str(version)}
            assert (await http.get("/get_weight_version")).json() == {
                "weight_version": str(version)}
            done_before_resume = stream.is_done
        finally:
            await http.post("/resume")
        await stream.finished()
        if stream.weight_versions[-1]["version"] != str(version):
            return None   # it ended in the engine before the pause: no token is the push's
        return stream, version, done_before_resume

    stream, version, done_before_resume = await first_caught(
        attempt, what="the request finished in the engine before the pause")
    assert not done_before_resume, "the push's resume ended the client's pause"
    assert (stream.finish_reason, len(stream.token_ids)) == ("length", LONG)
