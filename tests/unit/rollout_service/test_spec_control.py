"""The service's speculation control around a fake engine: applies coalesced and never in a
request's way, refusals, pins, the exported state, and the config section.

The real engine (schedules applied in vLLM's engine core, the calibration, a collapse
after a broken drafter push) is in
tests/integration/rollout_service/test_speculation_control.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from rollout_service.config import ServiceConfig, SpeculationControlSettings, load_config
from rollout_service.engines.base import (
    EngineInfo,
    GenerationResult,
    SamplingOptions,
    ScheduleRefusedError,
    StepCostSink,
)
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.spec_calibration import calibration_batch_sizes, synthetic_prompt
from rollout_service.spec_control import REASONS, SpeculationControl, show_fixed_k
from rollout_service.speculation.acceptance import WeightVersions
from rollout_service.speculation.cost import StepCostSample
from rollout_service.telemetry.speculation import SpeculationMetrics
from tests.support.spec_stats import vllm_chain, vllm_stats

K_MAX = 2
BUCKETS = [1, 2, 4, 8, 16]
VERSIONS = WeightVersions(main_version=-1, draft_version=-1)


class FakeScheduleEngine:
    """A fake of the vLLM engine's schedule side: records what it is sent, refuses a K
    above its maximum as vLLM's engine core does, and can hold an apply in flight."""

    def __init__(self) -> None:
        self.info = EngineInfo(model="m", engine="fake", model_path="", max_model_len=1024,
                               vocab_size=128, num_speculative_tokens=K_MAX,
                               speculative_method="mtp", has_pushable_drafter=True)
        self.requested: list[dict[int, int]] = []
        self.applied: list[dict[int, int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.sinks: list[StepCostSink] = []
        self.batch_size = 1
        self.skips_drafter_at_k0 = False

    async def apply_spec_schedule(self, schedule: Mapping[int, int]) -> dict[int, int]:
        self.requested.append(dict(schedule))
        await self.gate.wait()
        if max(schedule.values()) > K_MAX:
            raise ScheduleRefusedError(f"K={max(schedule.values())} exceeds {K_MAX}")
        self.applied.append(dict(schedule))
        return dict(schedule)

    def subscribe_step_costs(self, sink: StepCostSink) -> None:
        self.sinks.append(sink)

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        raise AssertionError("no calibration in these tests")

    def step(self, k: int, batch_size: int, step_s: float) -> None:
        """One clean decode step, as the stat logger reports it."""
        for sink in self.sinks:
            sink(StepCostSample(k=k, batch_size=batch_size, step_s=step_s))


def sequence(rate: float, num_drafts: int = 100) -> GenerationResult:
    accepted = (int(num_drafts * rate), int(num_drafts * rate * rate))
    stats = SpecDecodeStats(num_drafts=num_drafts, num_draft_tokens=K_MAX * num_drafts,
                            num_accepted_tokens=sum(accepted), num_verify_steps=num_drafts,
                            accepted_per_position=accepted)
    return GenerationResult(prompt_token_ids=(1,), token_ids=(2,), text="", finish_reason="stop",
                            logprobs=None, weight_versions=(), spec_decode=stats)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def control(registry: CollectorRegistry) -> SpeculationControl:
    engine = FakeScheduleEngine()
    settings = SpeculationControlSettings(
        enabled=True, batch_size_buckets=BUCKETS, num_steps_per_cost_sample=1,
        calibration={"enabled": False})
    metrics = SpeculationMetrics(registry=registry, model="m", engine="fake", buckets=BUCKETS,
                                 reasons=REASONS)
    ctl = SpeculationControl(engine, settings, lambda: VERSIONS, metrics)
    await ctl.start()
    for k in range(K_MAX + 1):  # measured costs: a draft token is nearly free
        for b in (1, 16):
            engine.step(k, b, 0.02 + 0.001 * k + 0.002 * b * k)
    return ctl


async def in_flight(engine: FakeScheduleEngine, schedule: dict[int, int]) -> None:
    """Let the event loop run until ``schedule`` reached the engine (bounded)."""
    for _ in range(100):
        if engine.requested and engine.requested[-1] == schedule:
            return
        await asyncio.sleep(0)  # a yield to the applier task, not a wait for time
    raise AssertionError(f"{schedule} never reached the engine: {engine.requested}")


def fake(control: SpeculationControl) -> FakeScheduleEngine:
    return control._engine  # type: ignore[return-value]


def k_series(registry: CollectorRegistry, bucket: int) -> float | None:
    return registry.get_sample_value("rollout_speculation_k",
                                     {"model": "m", "engine": "fake", "bucket": str(bucket)})


async def test_observing_never_waits_and_a_burst_of_changes_costs_one_apply(
        control: SpeculationControl) -> None:
    engine = fake(control)
    assert engine.applied == [dict.fromkeys(BUCKETS, 0)]  # before costs: no cost data
    engine.gate.clear()  # the engine core is busy: an apply waits in the background
    control.observe(sequence(0.9))
    first = dict(control._controller.schedule())
    assert first[1] == 1  # probing the drafter
    await in_flight(engine, first)
    wanted = []
    for _ in range(20):
        control.observe(sequence(0.9))  # returns at once, the apply still in flight
        wanted.append(dict(control._controller.schedule()))
    assert len(engine.applied) == 1 and wanted[-1] != first and wanted[-1][1] == K_MAX
    engine.gate.set()
    await control.settle()
    # the change in flight, then only the latest; none of those in between
    assert engine.applied[1:] == [first, wanted[-1]]
    assert control.status().engine_schedule is not None
    assert [b.k for b in control.status().buckets] == [wanted[-1][b] for b in BUCKETS]


async def test_a_refused_pin_leaves_the_schedule_in_force(
        control: SpeculationControl, registry: CollectorRegistry) -> None:
    before = list(fake(control).applied)
    with pytest.raises(ScheduleRefusedError, match="K=3"):
        await control.pin({4: 3})
    status = control.status()
    assert fake(control).applied == before and status.pinned is None
    assert status.num_refused == 1 and "K=3" in (status.last_error or "")
    assert registry.get_sample_value("rollout_speculation_schedule_applies_total", {
        "model": "m", "engine": "fake", "outcome": "refused"}) == 1


async def test_a_schedule_wanted_while_a_refused_one_is_in_flight_is_still_sent(
        control: SpeculationControl, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal marks the schedule the engine refused, not the one wanted by then."""
    engine = fake(control)
    await control.settle()
    engine.gate.clear()
    refused = dict.fromkeys(BUCKETS, K_MAX + 1)  # the engine refuses a K above its maximum
    later = dict.fromkeys(BUCKETS, 1)
    monkeypatch.setattr(control._controller, "schedule", lambda: refused)
    control._schedule_changed()
    await in_flight(engine, refused)
    monkeypatch.setattr(control._controller, "schedule", lambda: later)
    control._schedule_changed()
    engine.gate.set()
    await control.settle()
    assert engine.requested[-2:] == [refused, later] and engine.applied[-1] == later
    assert control.status().num_refused == 1


async def test_a_pin_overrides_the_controller_until_unpinned(
        control: SpeculationControl, registry: CollectorRegistry) -> None:
    status = await control.pin({4: 2, 16: 0})
    assert [(b.batch_size, b.k, b.reason) for b in status.buckets] == [
        (1, 2, "pinned"), (2, 2, "pinned"), (4, 2, "pinned"), (8, 0, "pinned"),
        (16, 0, "pinned")]
    assert k_series(registry, 2) == 2 and k_series(registry, 8) == 0
    applied = len(fake(control).applied)
    for _ in range(10):
        control.observe(sequence(0.9))  # the controller keeps deciding, nothing is sent
    await control.settle()
    assert len(fake(control).applied) == applied
    assert control.status().num_observations == 10
    status = await control.pin(None)
    assert fake(control).applied[-1] == control._controller.schedule()
    assert all(b.reason != "pinned" and b.k == b.controller_k for b in status.buckets)
    assert k_series(registry, 1) == status.buckets[0].k


async def test_a_sequence_is_priced_at_the_k_it_ran_not_at_k_max(
        control: SpeculationControl) -> None:
    """The engine's start-up ratio is for K = k_max (1.9 here); a sequence run at K = 1
    costs c(1, B) / c(0, B) of the measured table, at the engine's batch size when it
    finished. Without per-step counts, or where the table has no measurement, the
    engine's figure stays."""
    engine = fake(control)

    def ratio(stats: SpecDecodeStats) -> float | None:
        start_up = dataclasses.replace(stats, verify_cost_ratio=1.9)
        costed = control.observe(dataclasses.replace(sequence(0.5), spec_decode=start_up))
        assert isinstance(costed.spec_decode, SpecDecodeStats)
        return costed.spec_decode.verify_cost_ratio

    at_k1 = vllm_chain(40, [0.5, 0.5], k=1, k_max=K_MAX, detailed=True)
    assert ratio(at_k1) == pytest.approx(0.023 / 0.020)  # c(1, 1) / c(0, 1)
    mixed = vllm_stats([(1, 1)] * 10 + [(2, 2)] * 10, k_max=K_MAX, detailed=True)
    engine.batch_size = 16
    assert ratio(mixed) == pytest.approx((10 * 0.053 + 10 * 0.086) / 0.020 / 20)
    engine.batch_size = 32  # beyond the measured batch sizes
    assert ratio(at_k1) == 1.9
    engine.batch_size = 1
    assert ratio(vllm_chain(40, [0.5, 0.5], k=1, k_max=K_MAX)) == 1.9  # no per-step counts
    assert control.status().num_observations == 4


async def test_inconsistent_counts_are_skipped_not_raised(control: SpeculationControl) -> None:
    """An observation runs inside a request: it must never fail the request."""
    bad = SpecDecodeStats(num_drafts=10, num_draft_tokens=20, num_accepted_tokens=9,
                          num_verify_steps=10, accepted_per_position=(3, 6))  # not a prefix
    control.observe(dataclasses.replace(sequence(0.5), spec_decode=bad))
    assert control.status().num_observations == 0


async def test_the_status_says_how_the_engine_resolved_drafter_at_k0(
        control: SpeculationControl) -> None:
    """The settings say ``auto``; ``/health`` says what the engine runs."""
    assert control._settings.drafter_at_k0 == "auto"
    assert control.status().drafter_at_k0 == "run"
    fake(control).skips_drafter_at_k0 = True
    assert control.status().drafter_at_k0 == "skip"


async def test_a_collapse_is_logged_and_shown(control: SpeculationControl,
                                             registry: CollectorRegistry,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """K = 0 everywhere is an operator's business: a warning with the pooled rate, the
    gauge at 1, and nothing logged while it stays collapsed."""
    for _ in range(3):
        control.observe(sequence(0.6))
    assert "collapsed" not in caplog.text
    with caplog.at_level("WARNING", logger="rollout_service.spec_control"):
        for _ in range(4):  # 400 drafts of a broken drafter: beyond the 128 of the window
            control.observe(sequence(0.0))
    collapses = [r for r in caplog.records if "acceptance collapsed" in r.getMessage()]
    assert len(collapses) == 1 and "rate 0.000" in collapses[0].getMessage()
    assert registry.get_sample_value("rollout_speculation_collapsed",
                                     {"model": "m", "engine": "fake"}) == 1


def test_a_service_without_the_controller_shows_vllms_fixed_k(
        registry: CollectorRegistry) -> None:
    metrics = SpeculationMetrics(registry=registry, model="m", engine="fake", buckets=BUCKETS,
                                 reasons=REASONS)
    show_fixed_k(metrics, BUCKETS, 2)
    assert [k_series(registry, b) for b in BUCKETS] == [2.0] * len(BUCKETS)
    assert registry.get_sample_value("rollout_speculation_reason", {
        "model": "m", "engine": "fake", "bucket": "8", "reason": "controller off"}) == 1
    with pytest.raises(ValueError, match="reason 'nonsense'"):
        metrics.set_buckets({}, {8: "nonsense"})


def test_the_calibration_grid_and_prompts() -> None:
    assert calibration_batch_sizes(1) == (1,)
    assert calibration_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert calibration_batch_sizes(24) == (1, 2, 4, 8, 16, 24)
    prompts = [synthetic_prompt(i, 64, 128) for i in range(8)]
    assert all(len(p) == 64 and all(0 < t < 128 for t in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8


@pytest.mark.parametrize("fields, message", [
    ({"engine": "sglang"}, "speculation_control.enabled: needs engine 'vllm'"),
    ({"mtp": {"enabled": False}}, "speculation_control.enabled: needs speculative decoding"),
    ({"speculation_control": {"enabled": True, "batch_size_buckets": [4, 2]}},
     "strictly increasing"),
    ({"speculation_control": {"collapse_window_observations": 8}},
     "collapse_window_observations .* replaced by collapse_window_drafts"),
    ({"speculation_control": {"enabled": True, "calibration": {"num_steps": 2}}},
     "num_steps"),
])
def test_bad_speculation_control_configs_name_the_field(fields: dict, message: str) -> None:
    data = {"speculation_control": {"enabled": True}, **fields}
    with pytest.raises(ValueError, match=message):
        load_config(None, **data)


def test_the_controller_is_off_by_default() -> None:
    assert not ServiceConfig().speculation_control.enabled
