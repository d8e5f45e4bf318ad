"""SGLang engine against the FAKE SGLang server (``fake_sglang``): SGLang cannot serve here.

Everything below runs against the fake, in this process, over httpx's ASGI transport;
nothing here has run against a live SGLang server. Opt-in checks tie the fake to real
SGLang: ``SGLANG_SOURCES`` (unpacked wheels, e.g. ``pip install --no-deps --target
/tmp/sglang-0.5.23 sglang==0.5.23``, joined with ``:``) compares the fake's request fields,
``meta_info`` keys and launch flags with SGLang's sources and checks ``/generate`` traffic
with 0.5.23's JSON contract; ``SGLANG_PYTHONPATH`` (a path on which ``import sglang``
works) round-trips a real weight payload through SGLang's own deserializer.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from rollout_service.embedded import ensure_model
from rollout_service.engines.base import (
    ChatTurn,
    EngineSpec,
    EngineUnavailableError,
    InvalidRequestError,
    SamplingOptions,
    WeightUpdate,
)
from rollout_service.engines.sglang import engine as sglang_engine
from rollout_service.engines.sglang.engine import SGLangEngine, has_pushable_drafter
from rollout_service.engines.sglang.features import ServerFeatures
from rollout_service.engines.sglang.launch import build_launch_command
from rollout_service.engines.sglang.payload import push_segment
from rollout_service.engines.sglang.stats import SPEC_KEY_GENERATIONS, spec_stats_from_meta_info
from rollout_service.engines.speculative import MTPSettings, build_sglang_server_args
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.tensors import TensorMeta
from rollout_service.telemetry.weights import WeightMetrics
from rollout_service.weights.manager import WeightPushManager
from tests.support.fake_sglang import PROFILES, FakeSGLang
from tests.support.waiting import until

VERSIONS = ("0.5.10", "0.5.11", "0.5.12", "0.5.23")
MTP = MTPSettings(num_speculative_tokens=3)
SPEC_ARGS = build_sglang_server_args(MTP, {})  # EAGLE, 3 steps, topk 1, 4 draft tokens


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64,
                                                      "num_nextn_predict_layers": 1}))
    return str(tmp_path)


def placed(name: str, dtype: str, shape: tuple[int, ...], offset: int,
           segment: str = "rollout-sglang-unit") -> TensorPlacement:
    return TensorPlacement(name=name, dtype=dtype, shape=shape,
                           location=ShmLocation(segment=segment, offset=offset))


def shm_update(*tensors: TensorPlacement) -> WeightUpdate:
    return WeightUpdate(push_id="push-1", target="main", transport="shm", tensors=tensors)


class PayloadRecorder:
    """Stands in for SGLang's serializer (not importable here): JSON of our own data,
    after the same segment check as the real builder."""

    def __init__(self) -> None:
        self.calls: list[tuple[WeightUpdate, int]] = []

    def __call__(self, update: WeightUpdate, num_ranks: int) -> tuple[list[str], object]:
        self.calls.append((update, num_ranks))
        payload = json.dumps({"segment": push_segment(update),
                              "tensors": [p.model_dump() for p in update.tensors]})
        return [payload] * num_ranks, None


async def connect(fake: FakeSGLang, **kwargs: object) -> SGLangEngine:
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app), base_url="http://fake")
    return await SGLangEngine.connect("http://fake", served_model_name="tiny", client=client,
                                      payload_builder=kwargs.pop("payload_builder",
                                                                 PayloadRecorder()), **kwargs)


def make_fake(version: str, checkpoint: str, **kwargs: object) -> FakeSGLang:
    return FakeSGLang(version, model_path=checkpoint, speculative=SPEC_ARGS, **kwargs)


def greedy(max_tokens: int, **kwargs: object) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, **kwargs)


def sent(fake: FakeSGLang, route: str) -> list[dict]:
    return [body for path, body in fake.calls if path == route]


async def until_sent(fake: FakeSGLang, route: str, count: int = 1) -> None:
    """Until the fake has received ``count`` requests on ``route``."""
    async def calls() -> int:
        return len(sent(fake, route))

    await until(calls, lambda n: n >= count, timeout_s=30, interval_s=0.01)


# --- info and generation ---


@pytest.mark.parametrize("version", VERSIONS)
async def test_info_from_model_info_server_info_and_models(version: str, checkpoint: str) -> None:
    engine = await connect(make_fake(version, checkpoint, context_length=200))
    info = engine.info
    assert (info.engine, info.model, info.model_path) == ("sglang", "tiny", checkpoint)
    assert (info.max_model_len, info.vocab_size, info.num_speculative_tokens) == (200, 64, 3)
    assert info.speculative_method == "EAGLE" and info.has_pushable_drafter


@pytest.mark.parametrize("server_info,is_pushable", [
    ({"speculative_algorithm": "EAGLE"}, True),  # the checkpoint's MTP layers
    ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "/ckpt"}, True),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/eagle-head"}, False),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/eagle3"}, False),
    ({"speculative_algorithm": None}, False),
])
def test_pushable_drafter_is_the_checkpoints_own(server_info: dict, is_pushable: bool) -> None:
    assert has_pushable_drafter(server_info, {"/ckpt", "org/ckpt"}) == is_pushable


async def test_no_speculation_reports_zero_tokens_and_no_stats(checkpoint: str) -> None:
    engine = await connect(FakeSGLang("0.5.23", model_path=checkpoint))
    assert engine.info.num_speculative_tokens == 0
    assert engine.info.speculative_method is None and not engine.info.has_pushable_drafter
    result = await engine.generate([1, 2], greedy(8), "r0")
    assert result.spec_decode is None


@pytest.mark.parametrize("version", VERSIONS)
async def test_generate_with_token_ids(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    result = await engine.generate([5, 6, 7], greedy(4, seed=3, stop=("zz",), logprobs=0),
                                   "req-1")
    assert result.prompt_token_ids == (5, 6, 7)
    assert result.token_ids == (8, 9, 10, 11)
    assert result.text == "ijkl"
    assert result.finish_reason == "length"
    assert [p.token.logprob for p in result.logprobs] == [-0.25, -0.5, -0.75, -1.0]
    assert [p.token.token_id for p in result.logprobs] == [8, 9, 10, 11]
    [body] = sent(fake, "/generate")
    assert body == {"rid": "req-1", "input_ids": [5, 6, 7], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0,
                                        "top_k": -1, "ignore_eos": False, "stop": ["zz"],
                                        "sampling_seed": 3}}


@pytest.mark.parametrize(("version", "route"), [("0.5.23", "/generate"),
                                                ("0.5.10", "/v1/tokenize")])
async def test_generate_with_text(version: str, route: str, checkpoint: str) -> None:
    """0.5.23 takes the text and returns its ids; older servers get /v1/tokenize'd ids."""
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    result = await engine.generate("abc", greedy(2), "req-t")
    assert result.prompt_token_ids == tuple(fake.encode("abc"))
    assert result.token_ids == (result.prompt_token_ids[-1] + 1, result.prompt_token_ids[-1] + 2)
    [body] = sent(fake, "/generate")
    if version == "0.5.23":
        assert (body["text"], body["return_prompt_token_ids"]) == ("abc", True)
        assert "input_ids" not in body
    else:
        assert sent(fake, route) == [{"prompt": "abc"}]
        assert body["input_ids"] == fake.encode("abc") and "text" not in body


async def test_finish_reasons(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    by_eos = await engine.generate([60], greedy(10), "eos")
    assert (by_eos.finish_reason, by_eos.token_ids) == ("stop", (61, 62, 63))
    past_eos = await engine.generate([60], greedy(5, ignore_eos=True), "ignore-eos")
    assert (past_eos.finish_reason, past_eos.token_ids) == ("length", (61, 62, 63, 0, 1))
    by_stop = await engine.generate([0], greedy(10, stop=("de",)), "stop-str")
    assert (by_stop.finish_reason, by_stop.text, by_stop.token_ids) == ("stop", "bc", (1, 2, 3, 4))


async def generating(checkpoint: str, delay_s: float, request_id: str
                     ) -> tuple[FakeSGLang, SGLangEngine, asyncio.Task]:
    """An adapter on a fake 0.5.23 server whose generate answers after ``delay_s``, with
    one request that has reached the server."""
    fake = make_fake("0.5.23", checkpoint)
    fake.generate_delay_s = delay_s
    engine = await connect(fake)
    running = asyncio.create_task(engine.generate([1], greedy(4), request_id))
    await until_sent(fake, "/generate")
    return fake, engine, running


async def test_abort_pause_aborts_running_requests(checkpoint: str) -> None:
    fake, engine, running = await generating(checkpoint, 10.0, "aborted")
    await engine.pause("abort")
    result = await asyncio.wait_for(running, 5)
    assert (result.finish_reason, result.token_ids) == ("abort", ())
    assert sent(fake, "/pause_generation") == [{"mode": "abort"}]
    await engine.resume()


async def test_wait_pause_drains_and_holds_new_requests(checkpoint: str) -> None:
    fake, engine, running = await generating(checkpoint, 0.3, "drained")
    assert await engine.pause("wait") == 0  # drained: nothing held across the load
    assert running.done() and running.result().finish_reason == "length"
    assert sent(fake, "/pause_generation") == [{"mode": "retract"}]
    held = asyncio.create_task(engine.generate([1], greedy(4), "held"))
    await asyncio.sleep(0.05)  # a negative (nothing reaches the fake while paused): a slow
    # machine can only let this pass wrongly, never fail it
    assert not held.done() and len(sent(fake, "/generate")) == 1
    await engine.resume()
    assert (await asyncio.wait_for(held, 5)).finish_reason == "length"


async def test_keep_pause_holds_the_requests_in_flight(checkpoint: str) -> None:
    _, engine, running = await generating(checkpoint, 0.5, "held")
    assert await engine.pause("keep") == 1
    await engine.resume()
    assert (await asyncio.wait_for(running, 5)).finish_reason == "length"


async def test_keep_pause_retracts(checkpoint: str) -> None:
    fake = make_fake("0.5.10", checkpoint)
    engine = await connect(fake)
    await engine.pause("keep")
    await engine.resume()
    assert fake.routes_called()[-2:] == ["/pause_generation", "/continue_generation"]
    assert sent(fake, "/pause_generation") == [{"mode": "retract"}]


async def test_invalid_prompts(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint, context_length=16)
    engine = await connect(fake)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await engine.generate([64], greedy(1), "bad-id")
    with pytest.raises(InvalidRequestError, match="exceed the model's context length"):
        await engine.generate([1] * 10, greedy(7), "too-long")
    assert sent(fake, "/generate") == []
    with pytest.raises(InvalidRequestError, match="longer than the model's context length"):
        await engine.generate("a" * 20, greedy(1), "long-text")  # SGLang's own 400


# --- acceptance stats ---

# One request's counts as each SGLang generation names them: 4 verify steps accepting
# 2, 2, 2 and 1 tokens of 3 proposed each (12 completion tokens, the first from prefill).
META_INFO_BY_VERSION = {
    "0.5.10": {"spec_accept_token_num": 7, "spec_draft_token_num": 12,
               "spec_accept_histogram": [0, 1, 3]},
    "0.5.11": {"spec_accepted_drafts": 7, "spec_proposed_drafts": 12,
               "spec_accept_histogram": [0, 1, 3]},
    "0.5.12": {"spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 12,
               "spec_accepted_drafts": 7, "spec_proposed_drafts": 12,
               "spec_correct_drafts_histogram": [0, 1, 3]},
    "0.5.23": {"spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 12,
               "spec_correct_drafts_histogram": [0, 1, 3]},
}
EXPECTED_STATS = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7,
                                 num_verify_steps=4, accepted_per_position=(4, 3))


@pytest.mark.parametrize("version", VERSIONS)
def test_stats_from_each_meta_info_generation(version: str) -> None:
    meta = {**META_INFO_BY_VERSION[version], "spec_verify_ct": 4, "completion_tokens": 12,
            "spec_accept_rate": 7 / 12, "spec_accept_length": 3.0}
    assert spec_stats_from_meta_info(meta, num_draft_tokens=4) == EXPECTED_STATS


@pytest.mark.parametrize("version", VERSIONS)
async def test_stats_end_to_end(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    fake.accept_per_step = 2
    engine = await connect(fake)
    result = await engine.generate([1], greedy(12), "spec")
    assert len(result.token_ids) == 12
    # No step accepted all 3 drafts, so SGLang's histogram stops at 2: position 3 is 0.
    assert result.spec_decode == replace(EXPECTED_STATS, accepted_per_position=(4, 3, 0))
    assert result.spec_decode.accept_length == 1 + 7 / 4


def test_a_short_histogram_is_padded_to_the_servers_steps() -> None:
    """SGLang grows a request's histogram only as far as its steps accepted."""
    meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 12,
            "spec_correct_drafts_histogram": [2, 2], "completion_tokens": 7}
    assert spec_stats_from_meta_info(meta, 4, num_positions=3).accepted_per_position == \
        (2, 0, 0)
    assert spec_stats_from_meta_info(meta, 4).accepted_per_position == (2,)
    longer = {**meta, "spec_num_correct_drafts": 6, "spec_correct_drafts_histogram": [0, 2, 2]}
    assert spec_stats_from_meta_info(longer, 4, num_positions=1).accepted_per_position == ()


def test_proposed_derived_when_absent() -> None:
    meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 7, "completion_tokens": 12}
    stats = spec_stats_from_meta_info(meta, num_draft_tokens=4)
    assert (stats.num_draft_tokens, stats.accepted_per_position) == (12, ())


def test_missing_stats() -> None:
    assert spec_stats_from_meta_info({"completion_tokens": 9}, num_draft_tokens=4) is None
    assert spec_stats_from_meta_info({"completion_tokens": 1}, num_draft_tokens=0) is None
    # With speculation on, one token came from prefill: no verify step, nothing drafted.
    only_prefill = spec_stats_from_meta_info({"completion_tokens": 1}, num_draft_tokens=4)
    assert only_prefill == SpecDecodeStats(num_drafts=0, num_draft_tokens=0,
                                           num_accepted_tokens=0, num_verify_steps=0)
    assert only_prefill.accept_length == 1.0 and only_prefill.accept_rate is None


def test_inconsistent_counts() -> None:
    bad_histogram = {"spec_verify_ct": 4, "spec_num_correct_drafts": 7,
                     "spec_num_proposed_drafts": 12, "spec_correct_drafts_histogram": [3, 1]}
    assert spec_stats_from_meta_info(bad_histogram, 4).accepted_per_position == ()
    too_many = {"spec_verify_ct": 1, "spec_num_correct_drafts": 5, "spec_num_proposed_drafts": 3}
    # Dropped from every figure as before, and now told apart from missing stats (the
    # exporter counts it as invalid and warns once; vLLM's contradictions go the same way).
    invalid = spec_stats_from_meta_info(too_many, 4)
    assert isinstance(invalid, InvalidSpecDecodeStats)
    assert "num_accepted_tokens > num_draft_tokens" in invalid.detail
    assert "spec_num_correct_drafts" in invalid.detail


async def test_missing_stats_end_to_end(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    one = await engine.generate([1], greedy(1), "one-token")
    assert one.spec_decode is not None and one.spec_decode.num_verify_steps == 0
    fake.is_reporting_spec = False
    assert (await engine.generate([1], greedy(5), "silent")).spec_decode is None


# --- weight versions ---


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
async def test_weight_version_span(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    fake.weight_version = "7"
    result = await engine.generate([1], greedy(3), "versioned")
    [span] = result.weight_versions
    assert (span.version, span.start, span.end) == ("7", 0, 3)


# --- launch command ---


def test_launch_command_carries_the_speculative_server_args() -> None:
    command = build_launch_command(
        "/ckpt", {"tp_size": 2, "enable_draft_weights_cpu_backup": True, "disable_radix_cache":
                  False, "speculative_eagle_topk": None, "cuda_graph_bs": [1, 2]},
        MTP, host="127.0.0.1", port=30123, python="python")
    assert command == [
        "python", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1",
        "--port", "30123", "--tp-size", "2", "--enable-draft-weights-cpu-backup",
        "--cuda-graph-bs", "1", "2", "--speculative-algorithm", "EAGLE",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]
    tree = build_launch_command("/ckpt", {"speculative_eagle_topk": 2}, MTP, host="h", port=1)
    assert tree[tree.index("--speculative-num-draft-tokens") + 1] == "7"  # steps * topk + 1
    no_mtp = build_launch_command("/ckpt", {}, MTPSettings(enabled=False), host="h", port=1)
    assert not any(arg.startswith("--speculative") for arg in no_mtp)


def test_launch_command_refuses_bad_kwargs() -> None:
    with pytest.raises(ValueError, match=r"\['port'\] are set by the service"):
        build_launch_command("/ckpt", {"port": 1}, MTP, host="h", port=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        build_launch_command("/ckpt", {"speculative_num_draft_tokens": 9}, MTP, host="h", port=2)


# --- feature detection ---


@pytest.mark.parametrize("is_openapi_enabled", [True, False])
async def test_features_by_route_and_field(is_openapi_enabled: bool, checkpoint: str) -> None:
    new = await connect(make_fake("0.5.23", checkpoint, is_openapi_enabled=is_openapi_enabled))
    old = await connect(make_fake("0.5.12", checkpoint, is_openapi_enabled=is_openapi_enabled))
    route = "/update_weights_from_tensor"
    assert new.features.has_weight_update_session and not old.features.has_weight_update_session
    assert new.features.accepts(route, "selector") and not old.features.accepts(route, "selector")
    assert old.features.accepts(route, "disable_draft_model")
    assert not new.features.accepts(route, "disable_draft_model")
    assert not old.features.accepts("/generate", "disable_draft_model")  # tensor route only
    assert new.features.accepts("/generate", "return_prompt_token_ids") == is_openapi_enabled


# --- weight pushes ---

EXPECTED_PUSH_CALLS = {
    "0.5.23": [
        ("/pause_generation", {"mode": "retract"}),
        ("/begin_weight_update", {"selector": "target"}),
        ("/update_weights_from_tensor", {"selector": "target", "weight_version": "7"}),
        ("/end_weight_update", {}),
        ("/begin_weight_update", {"selector": "draft"}),
        ("/update_weights_from_tensor", {"selector": "draft", "weight_version": None}),
        ("/end_weight_update", {}),
        ("/flush_cache", None),
        ("/continue_generation", {}),
    ],
    "0.5.10": [
        ("/pause_generation", {"mode": "retract"}),
        ("/update_weights_from_tensor", {"disable_draft_model": True, "weight_version": "7"}),
        ("/update_weights_from_tensor", {"disable_draft_model": False, "weight_version": None}),
        ("/flush_cache", None),
        ("/continue_generation", {}),
    ],
}


@pytest.mark.parametrize("version", sorted(EXPECTED_PUSH_CALLS))
async def test_weight_push_through_the_push_manager(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint, tp_size=2)
    payloads = PayloadRecorder()
    engine = await connect(fake, payload_builder=payloads)
    tensors = {"model.embed_tokens.weight": TensorMeta(shape=(64, 8), dtype="bfloat16"),
               "model.mtp_layers.0.input_proj.weight": TensorMeta(shape=(8, 16), dtype="float32")}
    manager = WeightPushManager(engine, tensors, WeightMetrics(
        registry=CollectorRegistry(), model="tiny", engine="sglang"), timeout_s=30, has_draft=True)
    offsets = {"model.embed_tokens.weight": 0, "model.mtp_layers.0.input_proj.weight": 1024}
    name = f"rollout-sglang-test-{os.getpid()}-{version}"
    with Segment.create(name, 2048):
        begin = await manager.begin(messages.PushBeginRequest(
            version=7, target="both", segment=name, segment_bytes=2048, total_bytes=1536,
            params=[messages.ParamSpec(name=n, shape=list(m.shape), dtype=m.dtype)
                    for n, m in tensors.items()]))
        await manager.update(messages.PushUpdateRequest(push_id=begin.push_id, tensors=[
            placed(n, m.dtype, m.shape, offsets[n], segment=name) for n, m in tensors.items()]))
        fake.calls.clear()
        await manager.finish(messages.PushFinishRequest(push_id=begin.push_id))
    expected = EXPECTED_PUSH_CALLS[version]
    assert fake.routes_called() == [route for route, _ in expected]
    for (route, body), (_, want) in zip(fake.calls, expected):
        assert body == want or {key: body[key] for key in want or ()} == want, route
    update = payloads.calls[0][0]
    assert [num_ranks for _, num_ranks in payloads.calls] == [2, 2]
    assert sorted((p.name, p.dtype, p.shape, p.location.offset) for p in update.tensors) == [
        ("model.embed_tokens.weight", "bfloat16", (64, 8), 0),
        ("model.mtp_layers.0.input_proj.weight", "float32", (8, 16), 1024)]
    for body in sent(fake, "/update_weights_from_tensor"):
        assert (body["load_format"], body["flush_cache"]) == ("flattened_bucket", False)
        assert [json.loads(p)["segment"] for p in body["serialized_named_tensors"]] == [name] * 2
    assert manager.status().main_version == 7 and manager.status().consistent
    assert fake.weight_version == "7"


async def test_failed_load_closes_the_session(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint, tp_size=2)
    engine = await connect(fake)
    engine._num_tp_ranks = 1  # one payload for two TP ranks: the fake refuses
    update = shm_update(placed("w", "float32", (2,), 0))
    with pytest.raises(RuntimeError, match="one payload per TP rank"):
        await engine.load_weights(update, draft=False, version="1")
    assert fake.routes_called()[-1] == "/end_weight_update"


async def test_drafter_load_needs_a_target_field(checkpoint: str) -> None:
    """A server whose tensor route has neither selector nor disable_draft_model loads
    the main model only; a drafter load is refused before anything is sent."""
    fake = make_fake("0.5.10", checkpoint)
    engine = await connect(fake)
    route = "/update_weights_from_tensor"
    engine.features = ServerFeatures(routes=engine.features.routes, fields={
        route: engine.features.fields[route] - {"disable_draft_model"}})
    update = shm_update(placed("w", "float32", (2,), 0))
    await engine.load_weights(update, draft=False, version="3")
    assert "disable_draft_model" not in sent(fake, route)[0]
    fake.calls.clear()
    with pytest.raises(NotImplementedError, match="cannot target the drafter"):
        await engine.load_weights(update, draft=True, version=None)
    assert fake.calls == []


def test_a_push_to_sglang_lies_in_one_segment() -> None:
    assert push_segment(shm_update(placed("a", "float32", (2,), 0, segment="seg-1"),
                                   placed("b", "float32", (2,), 64, segment="seg-1"))) == "seg-1"
    with pytest.raises(ValueError, match=r"segments \['seg-1', 'seg-2'\]"):
        push_segment(shm_update(placed("a", "float32", (2,), 0, segment="seg-1"),
                                placed("b", "float32", (2,), 64, segment="seg-2")))
    with pytest.raises(ValueError, match="no tensors"):
        push_segment(shm_update())
    handle = CudaIpcHandle(
        gpu_uuid="GPU-0", shape=[2], stride=[1], storage_offset=0, dtype="float32",
        storage_handle=base64.b64encode(bytes(64)).decode(), storage_size_bytes=8,
        storage_offset_bytes=0, ref_counter_handle=base64.b64encode(b"/torch_1_2_0").decode(),
        ref_counter_offset=0, event_handle=base64.b64encode(bytes(64)).decode(),
        event_sync_required=False)
    on_gpu = TensorPlacement(name="c", dtype="float32", shape=(2,),
                             location=CudaIpcLocation(handle=handle))
    with pytest.raises(ValueError, match="'c' travels by 'cuda_ipc'"):
        push_segment(shm_update(placed("a", "float32", (2,), 0), on_gpu))


async def test_start_refuses_a_transport_sglang_cannot_load(checkpoint: str) -> None:
    spec = EngineSpec(model_path=checkpoint, served_model_name="tiny",
                      weights_transport="cuda_ipc", engine_url="http://unused")
    with pytest.raises(ValueError, match="weights_transport: 'cuda_ipc'"):
        await sglang_engine.start(spec)


async def test_weight_checksums(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    before = await engine.weight_checksums()
    assert set(before) == {"main", "draft"}
    await engine.load_weights(shm_update(placed("w", "float32", (2,), 0)), draft=False,
                              version="2")
    after = await engine.weight_checksums()
    assert after["main"] != before["main"] and after["draft"] == before["draft"]
    assert sent(fake, "/weights_checker")[0] == {"action": "checksum", "selector": "target"}
    assert await (await connect(make_fake("0.5.10", checkpoint))).weight_checksums() == {}


# --- health ---


async def test_health(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    await engine.health()
    fake.is_healthy = False
    with pytest.raises(EngineUnavailableError, match="503"):
        await engine.health()


async def test_unreachable_server(checkpoint: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed once the block ends
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await SGLangEngine.connect(url, served_model_name="tiny", model_path=checkpoint)
    engine = await connect(make_fake("0.5.23", checkpoint))
    engine._client = httpx.AsyncClient(base_url=url)  # the server went away
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await engine.health()
    with pytest.raises(EngineUnavailableError, match="unreachable"):
        await engine.generate([1], greedy(1), "gone")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="sglang is installed: the launch would start a real server")
async def test_launch_reports_a_server_that_exits(checkpoint: str) -> None:
    """``python -m sglang.launch_server`` without sglang exits at once; launch says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineUnavailableError, match="SGLang exited with code 1"):
        await SGLangEngine.launch(checkpoint, {}, MTP, served_model_name="tiny", port=port,
                                  startup_timeout_s=60)


# --- opt-in: the fake against SGLang's own sources ---


def _sglang_sources() -> dict[str, Path]:
    dirs = [Path(d) for d in os.environ.get("SGLANG_SOURCES", "").split(os.pathsep) if d]
    return {next(d.glob("sglang-*.dist-info")).name.removeprefix("sglang-")
            .removesuffix(".dist-info"): d for d in dirs}


SOURCES = _sglang_sources()
needs_sources = pytest.mark.skipif(not SOURCES, reason="set SGLANG_SOURCES to unpacked wheels")


def _class_fields(path: Path) -> dict[str, set[str]]:
    """Annotated field names declared in each class body of a source file."""
    return {node.name: {stmt.target.id for stmt in node.body
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_fake_request_fields_match_sglang(version: str) -> None:
    root = SOURCES[version] / "sglang" / "srt"
    real = _class_fields(root / "managers" / "io_struct.py")
    profile = PROFILES[version]
    for name, fields in profile.models.items():
        own = set(fields)
        if name == "GenerateReqInput":
            assert own <= real[name], name  # the fake declares the fields it uses
        else:
            assert own == real[name], name
    assert ("/begin_weight_update" in (root / "entrypoints" / "http_server.py").read_text()
            ) == profile.has_weight_update_session


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_meta_info_keys_match_sglang(version: str) -> None:
    source = (SOURCES[version] / "sglang/srt/managers/tokenizer_manager.py").read_text()
    real = set(re.findall(r'meta_info\["(spec_[a-z_]+)"\]', source))
    profile = PROFILES[version]
    emitted = {key for pair in profile.spec_keys for key in pair}
    assert emitted | {"spec_verify_ct", profile.histogram_key} <= real
    accepted, proposed = profile.spec_keys[0]
    assert (accepted, proposed, profile.histogram_key) in SPEC_KEY_GENERATIONS
    # The engine reads the newest names a server emits, and no stale ones remain unread.
    assert {k for generation in SPEC_KEY_GENERATIONS for k in generation[:2]} & real == emitted


@needs_sources
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_launch_flags_are_sglang_server_args(version: str) -> None:
    root = SOURCES[version] / "sglang" / "srt"
    fields = set().union(*_class_fields(root / "server_args.py").values())
    for path in (root / "arg_groups" / "fields").glob("*.py"):  # 0.5.23 splits ServerArgs
        fields |= set().union(*_class_fields(path).values())
    command = build_launch_command("/ckpt", {"tp_size": 2, "enable_draft_weights_cpu_backup":
                                             True}, MTP, host="h", port=1)
    flags = {arg[2:].replace("-", "_") for arg in command if arg.startswith("--")}
    assert flags <= fields


@pytest.mark.skipif("0.5.23" not in SOURCES, reason="set SGLANG_SOURCES to include 0.5.23")
async def test_generate_traffic_meets_sglang_json_contract(checkpoint: str) -> None:
    """Requests and responses decode with 0.5.23's generated /generate contract."""
    path = SOURCES["0.5.23"] / "sglang" / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_api_types", path)
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    await engine.generate("abc", greedy(3, stop=("x",), seed=1, logprobs=0), "text")
    await engine.generate([1, 2], greedy(3, ignore_eos=True), "ids")
    for body in sent(fake, "/generate"):
        api.GenerateRequest.from_json_value(body)
    for out in fake.responses:
        response = api.GenerateResponse.from_json_value(out)
        assert response.meta_info.finish_reason is not None


@pytest.mark.skipif(not os.environ.get("SGLANG_PYTHONPATH"),
                    reason="set SGLANG_PYTHONPATH to where `import sglang` works")
def test_payload_round_trips_through_sglang_deserializer(tmp_path: Path) -> None:
    """Our process pickles; another, unrelated process unpickles with SGLang's own
    SafeUnpickler and rebuilds the tensors with its FlattenedTensorBucket."""
    name = f"rollout-sglang-payload-{os.getpid()}"
    sender = f"""
import sys, torch
from rollout_service.engines.base import WeightUpdate
from rollout_service.engines.sglang.payload import build_flattened_bucket_payloads
from rollout_service.protocol.placement import ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
def placed(tensor, dtype, shape, offset):
    return TensorPlacement(name=tensor, dtype=dtype, shape=shape,
                           location=ShmLocation(segment={name!r}, offset=offset))
with Segment.create({name!r}, 256) as seg:
    seg.tensor(0, torch.bfloat16, (2, 3)).copy_(torch.arange(6.).view(2, 3))
    seg.tensor(64, torch.int32, (4,)).copy_(torch.tensor([7, 8, 9, 10]))
    update = WeightUpdate(push_id="p", target="main", transport="shm", tensors=(
        placed("a", "bfloat16", (2, 3), 0), placed("b", "int32", (4,), 64)))
    payloads, keep = build_flattened_bucket_payloads(update, 2)
print(payloads[1], flush=True)
sys.stdin.readline()
"""
    receiver = """
import sys
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
data = MultiprocessingSerializer.deserialize(sys.stdin.readline().strip())
bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
print({n: t.tolist() for n, t in bucket.reconstruct_tensors()})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["SGLANG_PYTHONPATH"], "."])}
    send = subprocess.Popen([sys.executable, "-c", sender], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        payload = send.stdout.readline()
        base64.b64decode(payload)  # a base64 string, as SGLang's HTTP API takes it
        received = subprocess.run([sys.executable, "-c", receiver], input=payload, env=env,
                                  capture_output=True, text=True, timeout=300, check=False)
    finally:
        send.communicate("\n", timeout=60)
    assert received.returncode == 0, received.stderr[-3000:]
    assert received.stdout.strip() == str({"a": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                                           "b": [7, 8, 9, 10]})


# --- streaming and chat ---


async def streamed(engine: SGLangEngine, prompt: str | list[int], sampling: SamplingOptions,
                   rid: str) -> list:
    return [delta async for delta in engine.stream(prompt, sampling, rid)]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("is_incremental", [False, True])
async def test_a_stream_merges_into_the_whole_answer(version: str, is_incremental: bool,
                                                     checkpoint: str) -> None:
    """Cumulative events (SGLang's default) and deltas (incremental_streaming_output) alike."""
    fake = make_fake(version, checkpoint, incremental_streaming_output=is_incremental)
    fake.accept_per_step = 2
    engine = await connect(fake)
    sampling = greedy(10, seed=3, logprobs=0, ignore_eos=True)
    whole = await engine.generate([5, 6, 7], sampling, "whole")
    deltas = await streamed(engine, [5, 6, 7], sampling, "streamed")
    assert len(deltas) == 4  # prefill's token, then verify steps of 3 tokens
    assert [d.result is not None for d in deltas] == [False, False, False, True]
    assert "".join(d.text for d in deltas) == whole.text
    assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
    assert deltas[-1].result == whole
    [body] = [b for b in sent(fake, "/generate") if b.get("stream")]
    assert body["input_ids"] == [5, 6, 7] and body["rid"] == "streamed"


async def test_a_stream_of_text_sends_its_tokens(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    deltas = await streamed(engine, "abc", greedy(2), "r")
    assert deltas[-1].result.prompt_token_ids == tuple(fake.encode("abc"))
    assert sent(fake, "/v1/tokenize") == [{"prompt": "abc"}]


async def test_a_refusal_inside_a_stream_is_an_invalid_request(checkpoint: str) -> None:
    """SGLang reports it as an error event under status 200."""
    engine = await connect(make_fake("0.5.23", checkpoint, context_length=8))
    engine.info = replace(engine.info, max_model_len=1000)  # past our own check
    with pytest.raises(InvalidRequestError, match="longer than the model's context length"):
        await streamed(engine, list(range(20)), greedy(2), "r")


async def test_chat_prompt_is_the_checkpoints_template(checkpoint: str) -> None:
    from transformers import AutoTokenizer

    model = str(ensure_model("tiny"))
    engine = await connect(FakeSGLang("0.5.23", model_path=model, speculative=SPEC_ARGS))
    ids = await engine.chat_prompt([ChatTurn(role="user", content="1 + 1 =")])
    assert AutoTokenizer.from_pretrained(model).decode(ids) == "user: 1 + 1 =\nassistant:"
    without = await connect(make_fake("0.5.23", checkpoint))  # config.json alone
    with pytest.raises(InvalidRequestError, match="^messages: .*no chat template"):
        await without.chat_prompt([ChatTurn(role="user", content="hi")])
