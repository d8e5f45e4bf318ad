"""The service around an engine (``local.build_local_service``): what the engine reports
decides what the service accepts and answers.

The engine here is a FAKE (``FakeEngine``): a real one cannot be made to report
counts that contradict themselves, and this machine runs one drafter kind (MTP) in
the integration tests. The real engine with MTP off is
tests/integration/rollout_service/test_no_speculation.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout_service.config import ServiceConfig
from rollout_service.embedded import ensure_model
from rollout_service.engines.base import (
    EngineInfo,
    GenerationDelta,
    GenerationResult,
    PushLoads,
    SamplingOptions,
    StepCostSink,
    WeightUpdate,
)
from rollout_service.local import build_local_service
from rollout_service.protocol import messages
from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from rollout_service.protocol.placement import ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.tensors import checkpoint_tensors
from rollout_service.service import RolloutService
from rollout_service.speculation.cost import StepCostSample
from rollout_service.weights.intake import PushError
from tests.support.spec_stats import vllm_chain
from tests.support.waiting import until
from trainer_client.push import layout

MODEL = str(Path(ensure_model("tiny")))
CHECKPOINT = checkpoint_tensors(MODEL)
NGRAM = EngineInfo(model="tiny", engine="vllm", model_path=MODEL, max_model_len=1024,
                   vocab_size=1024, num_speculative_tokens=2, speculative_method="ngram",
                   has_pushable_drafter=False)
"""Speculative decoding on, with a drafter that holds no checkpoint tensor."""
MTP = replace(NGRAM, speculative_method="mtp", has_pushable_drafter=True)


class FakeEngine:
    """FAKE engine: fixed ``info``; every sequence is ``result``; records the calls that
    would touch weights, so a test sees that a refused push touched none."""

    def __init__(self, info: EngineInfo,
                 spec_decode: SpecDecodeStats | InvalidSpecDecodeStats | None = None) -> None:
        self.info = info
        self.spec_decode = spec_decode
        self.calls: list[str] = []

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        return GenerationResult(prompt_token_ids=(1, 2), token_ids=(3, 4), text="",
                                finish_reason="length", logprobs=None, weight_versions=(),
                                spec_decode=self.spec_decode)

    async def pause(self, mode: messages.PauseMode = "wait") -> int:
        self.calls.append("pause")
        return 0

    async def resume(self) -> None:
        self.calls.append("resume")

    async def load_weights(self, update: WeightUpdate, *, version: str) -> PushLoads:
        self.calls.append(f"load {update.target}")
        return PushLoads()

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def weight_checksums(self) -> dict[str, str]:
        return {}

    async def health(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def local_service(engine: FakeEngine) -> RolloutService:
    service, _ = build_local_service(engine, ServiceConfig())
    return service


@pytest.fixture
def segment() -> Iterator[Segment]:
    _, nbytes = layout([meta.nbytes for meta in CHECKPOINT.values()])
    with Segment.create(f"mtp-rollout-unit-{os.getpid()}", nbytes) as seg:
        yield seg


def begin_request(segment: Segment, target: messages.PushTarget) -> messages.PushBeginRequest:
    """A valid announcement of the whole tiny checkpoint."""
    return messages.PushBeginRequest(
        version=1, target=target, segment=segment.name, segment_bytes=segment.nbytes,
        total_bytes=sum(meta.nbytes for meta in CHECKPOINT.values()),
        params=[messages.ParamSpec(name=name, shape=list(meta.shape), dtype=meta.dtype)
                for name, meta in CHECKPOINT.items()])


@pytest.mark.parametrize("target", ["draft", "both"])
async def test_drafter_push_refused_at_begin_without_a_pushable_drafter(
        segment: Segment, target: messages.PushTarget) -> None:
    """n-gram drafting has num_speculative_tokens > 0 and nothing a push can load: the
    push is refused before any byte loads, naming ``target``, and the engine is never
    paused (before, 'both' loaded the main model and then failed on the drafter)."""
    engine = FakeEngine(NGRAM)
    weights = local_service(engine).weights
    with pytest.raises(PushError) as refused:
        await weights.begin(begin_request(segment, target))
    assert refused.value.status == 400
    assert str(refused.value).startswith(f"target: {target!r} loads the drafter")
    status = weights.status()
    assert (status.main_version, status.draft_version, status.active_push_id) == (None,) * 3
    assert status.last_push.outcome == "rejected" and status.consistent
    assert engine.calls == []


@pytest.mark.parametrize("info, target", [(NGRAM, "main"), (MTP, "both")],
                         ids=["main without a pushable drafter", "both with the MTP drafter"])
async def test_a_push_the_engine_can_load_begins(segment: Segment, info: EngineInfo,
                                                 target: messages.PushTarget) -> None:
    """The counterpart of the refusal above: the push becomes the active one, and its abort
    is recorded with its target, nothing loaded."""
    engine = FakeEngine(info)
    weights = local_service(engine).weights
    begun = await weights.begin(begin_request(segment, target))
    assert weights.status().active_push_id == begun.push_id
    await weights.abort(messages.PushAbortRequest(push_id=begun.push_id))
    status = weights.status()
    assert status.active_push_id is None and status.last_push is not None
    assert (status.last_push.target, status.last_push.outcome) == (target, "aborted")
    assert (status.main_version, status.draft_version) == (None, None)
    assert engine.calls == []


async def test_a_push_times_out_after_the_timeout_its_begin_asked_for(
        segment: Segment) -> None:
    """A begin's ``timeout_s`` replaces the service's ``push_timeout_s`` for that push;
    a call after the push expired says why it ended (the CI of 66ae4e9: a trainer
    starved on a busy machine saw only 'not the active push'), and nothing was loaded."""
    engine = FakeEngine(MTP)
    weights = local_service(engine).weights
    default = await weights.begin(begin_request(segment, "both"))
    assert default.timeout_s == ServiceConfig().push_timeout_s
    await weights.abort(messages.PushAbortRequest(push_id=default.push_id))
    request = begin_request(segment, "both").model_copy(update={"timeout_s": 0.05})
    begun = await weights.begin(request)
    assert begun.timeout_s == 0.05

    async def active_push() -> str | None:
        return weights.status().active_push_id

    await until(active_push, lambda push_id: push_id is None, timeout_s=30, interval_s=0.01)
    with pytest.raises(PushError) as late:
        await weights.update(messages.PushUpdateRequest(push_id=begun.push_id, tensors=[
            TensorPlacement(name=name, dtype=meta.dtype, shape=tuple(meta.shape),
                            location=ShmLocation(segment=segment.name, offset=0))
            for name, meta in list(CHECKPOINT.items())[:1]]))
    assert late.value.status == 404
    assert "it ended: aborted, no call from the trainer for 0.05 s" in str(late.value)
    assert weights.status().last_push.outcome == "aborted" and engine.calls == []


def test_a_begin_refuses_a_timeout_out_of_range(segment: Segment) -> None:
    for timeout_s in (0, -1.0, messages.MAX_PUSH_TIMEOUT_S + 1):
        with pytest.raises(ValidationError, match="timeout_s"):
            begin_request(segment, "both").model_validate(
                {**begin_request(segment, "both").model_dump(), "timeout_s": timeout_s})


async def test_replica_load_refuses_a_drafter_target_before_pausing(segment: Segment) -> None:
    """Under Ray Serve the coordinator validated the push without an engine; the replica
    refuses it before touching anything."""
    engine = FakeEngine(NGRAM)
    weights = local_service(engine).weights
    with pytest.raises(PushError, match="^target: 'both'") as refused:
        await weights.load(begin_request(segment, "both"), [], push_id="p")
    assert refused.value.status == 400 and engine.calls == []
    assert weights.is_consistent and weights.main_version is None


async def test_contradictory_stats_never_fail_a_batch() -> None:
    """The sequence is served without stats; the exporter counts it as invalid."""
    engine = FakeEngine(MTP, spec_decode=InvalidSpecDecodeStats(detail="accepted 5 > drafted 2"))
    service, registry = build_local_service(engine, ServiceConfig())
    request = messages.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2, n=2)
    batch = await service.generate_batch(messages.BatchGenerateRequest(requests=[request] * 2))
    assert [o.spec_decode for r in batch.responses for o in r.outputs] == [None] * 4
    assert batch.acceptance.num_missing_stats == 4 and batch.acceptance.num_sequences == 4
    labels = {"model": "tiny", "engine": "vllm", "category": "none"}
    assert registry.get_sample_value(
        "rollout_spec_decode_invalid_stats_requests_total", labels) == 4
    assert registry.get_sample_value(
        "rollout_spec_decode_missing_stats_requests_total", labels) == 0


@pytest.mark.parametrize("info,expected", [
    (NGRAM, messages.SpeculationInfo(is_enabled=True, method="ngram", num_speculative_tokens=2,
                                     has_pushable_drafter=False)),
    (replace(NGRAM, num_speculative_tokens=0, speculative_method=None),
     messages.SpeculationInfo(is_enabled=False, method=None, num_speculative_tokens=0,
                              has_pushable_drafter=False)),
])
async def test_health_says_what_speculation_the_engine_runs(
        info: EngineInfo, expected: messages.SpeculationInfo) -> None:
    body, status = await local_service(FakeEngine(info)).health()
    assert status == 200 and body.speculation == expected


@pytest.mark.parametrize("info, roles", [(NGRAM, ["main"]), (MTP, ["draft", "main"])],
                         ids=["n-gram", "mtp"])
def test_only_a_pushable_drafter_has_a_version_series(info: EngineInfo,
                                                      roles: list[str]) -> None:
    """The drafter-behind-main alert subtracts the drafter's version from the main model's:
    with a drafter no push can load, a -1 there made it fire after the first main push."""
    _, registry = build_local_service(FakeEngine(info), ServiceConfig())
    exported = sorted(sample.labels["role"] for metric in registry.collect()
                      if metric.name == "rollout_weight_version" for sample in metric.samples)
    assert exported == roles


class ScheduledFakeEngine(FakeEngine):
    """FAKE engine with vLLM's schedule side too: takes every schedule, streams its one
    result, and hands the step costs a test feeds (``step``) to the subscribers as vLLM's
    stat logger does."""

    def __init__(self, info: EngineInfo, spec_decode: SpecDecodeStats) -> None:
        super().__init__(info, spec_decode)
        self.sinks: list[StepCostSink] = []
        self.batch_size = 1
        self.skips_drafter_at_k0 = False

    async def apply_spec_schedule(self, schedule: Mapping[int, int]) -> dict[int, int]:
        return dict(schedule)

    def subscribe_step_costs(self, sink: StepCostSink) -> None:
        self.sinks.append(sink)

    async def stream(self, prompt: str | list[int], sampling: SamplingOptions,
                     request_id: str) -> AsyncIterator[GenerationDelta]:
        result = await self.generate(prompt, sampling, request_id)
        yield GenerationDelta(text="", token_ids=result.token_ids, result=result)

    def step(self, k: int, batch_size: int, step_s: float) -> None:
        for sink in self.sinks:
            sink(StepCostSample(k=k, batch_size=batch_size, step_s=step_s))


async def test_a_sequence_is_answered_and_exported_at_the_cost_of_the_k_it_ran() -> None:
    """vLLM's ratio is measured at start-up at K = k_max (1.9 here). A sequence the
    controller ran at K = 1 costs c(1, 1) / c(0, 1) = 1.2 of its measured steps: net
    speed-up 1.5 / 1.2 = 1.25 in the response, streamed or not, and in the counters the
    slow-down alert reads (at 1.9 it read 0.79: an alert where K = 1 paid)."""
    at_k1 = vllm_chain(40, [0.5, 0.5], k=1, k_max=2, detailed=True)
    engine = ScheduledFakeEngine(replace(MTP, verify_cost_ratio=1.9),
                                 replace(at_k1, verify_cost_ratio=1.9))
    config = ServiceConfig.model_validate({"speculation_control": {
        "enabled": True, "num_steps_per_cost_sample": 1, "calibration": {"enabled": False}}})
    service, registry = build_local_service(engine, config)
    await service.start()
    for k, step_s in enumerate((0.010, 0.012, 0.019)):
        engine.step(k, 1, step_s)
    request = messages.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2)
    response = await service.generate(request)
    spec = response.outputs[0].spec_decode
    assert spec is not None and spec.verify_cost_ratio == pytest.approx(1.2)
    assert spec.net_speedup == pytest.approx(1.25)
    assert response.acceptance.net_speedup == pytest.approx(1.25)
    deltas = [d async for d in service.stream_sequence([1, 2], SamplingOptions(max_tokens=2),
                                                       "streamed")]
    streamed = deltas[-1].result
    assert streamed is not None and isinstance(streamed.spec_decode, SpecDecodeStats)
    assert streamed.spec_decode.net_speedup == pytest.approx(1.25)
    labels = {"model": "tiny", "engine": "vllm", "category": "none"}
    tokens = registry.get_sample_value("rollout_spec_decode_costed_tokens_total", labels)
    cost = registry.get_sample_value("rollout_spec_decode_verify_cost_total", labels)
    assert (tokens, cost) == (2 * 60, pytest.approx(2 * 40 * 1.2))
