"""Which engine steps become step-cost samples: vLLM's real per-step stats objects, filled
as vLLM's output processor fills them, through the stat logger's filter.

The running engine (the stat logger inside ``AsyncLLM``, the calibration) is in
tests/integration/rollout_service/test_speculation_control.py.
"""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from rollout_service.engines.vllm.step_costs import StepCostMonitor, decode_step
from rollout_service.speculation.cost import StepCostSample

STEP_S = 0.02


def step(latencies: list[float], *, num_running: int | None = None, k: int = 0,
         num_drafts: int | None = None, num_first_tokens: int = 0, num_prompt_tokens: int = 0,
         num_finished: int = 0) -> tuple[SchedulerStats, IterationStats]:
    """One step's stats: ``latencies`` are the decoding requests' inter-token latencies."""
    iteration = IterationStats()
    iteration.inter_token_latencies_iter = list(latencies)
    iteration.time_to_first_tokens_iter = [0.1] * num_first_tokens
    iteration.prompt_token_stats.total = num_prompt_tokens
    iteration.finished_requests = [FinishedRequestStats(finish_reason=FinishReason.LENGTH)
                                   for _ in range(num_finished)]
    spec = None
    if k:
        spec = SpecDecodingStats.new(num_spec_tokens=2)
        for _ in range(len(latencies) if num_drafts is None else num_drafts):
            spec.observe_draft(num_draft_tokens=k, num_accepted_tokens=0)
    running = len(latencies) - num_finished if num_running is None else num_running
    return SchedulerStats(num_running_reqs=running, spec_decoding_stats=spec), iteration


def test_a_decode_step_is_a_sample_of_its_k_and_batch_size() -> None:
    assert decode_step(*step([STEP_S, STEP_S, 0.03], k=2)) == \
        StepCostSample(k=2, batch_size=3, step_s=STEP_S)
    assert decode_step(*step([STEP_S] * 4)) == StepCostSample(k=0, batch_size=4, step_s=STEP_S)


def test_the_step_a_sequence_finishes_in_still_counts() -> None:
    """vLLM counts running requests after the finished ones have left."""
    assert decode_step(*step([STEP_S] * 3, num_finished=1, k=1)) == \
        StepCostSample(k=1, batch_size=3, step_s=STEP_S)


@pytest.mark.parametrize("stats", [
    step([STEP_S], num_first_tokens=1, num_prompt_tokens=40),  # a prefill shares the step
    step([STEP_S], num_prompt_tokens=40),  # a prefill whose output came later
    step([STEP_S] * 2, num_running=3),  # a running request without output: a prefill chunk
    step([STEP_S] * 3, k=2, num_drafts=2),  # a request without a draft
    step([STEP_S] * 2, k=2, num_drafts=3),  # more drafts than requests
    step([]),  # no decode output at all
], ids=["prefill", "late prefill", "chunk", "missing draft", "extra draft", "empty"])
def test_steps_that_are_not_clean_decode_steps_are_not_samples(stats: tuple) -> None:
    assert decode_step(*stats) is None


def test_a_draft_cut_short_makes_k_non_uniform() -> None:
    """Near ``max_tokens`` vLLM schedules fewer draft tokens for that request."""
    scheduler, iteration = step([STEP_S] * 2, k=2, num_drafts=1)
    scheduler.spec_decoding_stats.observe_draft(num_draft_tokens=1, num_accepted_tokens=0)
    assert decode_step(scheduler, iteration) is None


def test_only_steady_steps_reach_the_subscribers() -> None:
    """A step counts between two clean steps, the next one verifying its own K: its start
    is then the previous step's output, and it drafted the K it verified. A batch that lost
    the requests finished in the previous step still counts, at its own B."""
    monitor = StepCostMonitor()
    seen: list[StepCostSample] = []
    monitor.subscribe(seen.append)
    for stats in [step([STEP_S] * 2, k=2),  # 1: no previous step
                  step([STEP_S] * 2, k=2),  # 2: verifies 2, drafts 1 (3 verifies 1)
                  step([STEP_S] * 2, k=1),  # 3: steady at 1 -> sent at 4
                  step([STEP_S] * 2, k=1),  # 4: what it drafted is unknown (5: prefill)
                  step([STEP_S], num_first_tokens=1, num_prompt_tokens=8),  # 5: prefill
                  step([STEP_S] * 2, k=1),  # 6: after a prefill
                  step([STEP_S] * 2, k=1),  # 7: steady -> sent at 8
                  step([STEP_S], k=1),  # 8: one request finished in 7 -> sent at 9
                  step([STEP_S], k=1)]:  # 9: the last: held until a next step
        monitor.record(*stats)
    assert seen == [StepCostSample(k=1, batch_size=2, step_s=STEP_S),
                    StepCostSample(k=1, batch_size=2, step_s=STEP_S),
                    StepCostSample(k=1, batch_size=1, step_s=STEP_S)]
    assert monitor.batch_size == 1
    assert monitor.num_steps == 9


def test_the_step_that_verifies_the_old_k_and_drafts_the_new_is_no_sample() -> None:
    """After K 2 -> 0 one step still verifies two drafts but drafts none: neither K's
    cost. The first step at K = 0 throughout is a sample."""
    monitor = StepCostMonitor()
    seen: list[StepCostSample] = []
    monitor.subscribe(seen.append)
    for k, step_s in [(2, 0.030), (2, 0.030), (2, 0.024), (0, 0.020), (0, 0.020)]:
        monitor.record(*step([step_s] * 4, k=k))
    assert seen == [StepCostSample(k=2, batch_size=4, step_s=0.030),
                    StepCostSample(k=0, batch_size=4, step_s=0.020)]


def test_steps_without_outputs_are_not_counted() -> None:
    """The step count is what a caller waits on to act every few engine steps."""
    monitor = StepCostMonitor()
    monitor.record(*step([]))  # nothing came out of this step
    monitor.record(None, None)
    assert (monitor.num_steps, monitor.batch_size) == (0, 0)
    monitor.record(*step([], num_first_tokens=3, num_prompt_tokens=24))
    assert (monitor.num_steps, monitor.batch_size) == (1, 3)


def test_a_failing_subscriber_never_reaches_vllm() -> None:
    """An exception out of a stat logger would kill vLLM's output handler, and the engine."""
    monitor = StepCostMonitor()
    seen: list[StepCostSample] = []

    def broken(sample: StepCostSample) -> None:
        raise RuntimeError("bug")

    monitor.subscribe(broken)
    monitor.subscribe(seen.append)
    for _ in range(3):
        monitor.record(*step([STEP_S]))
    assert seen == [StepCostSample(k=0, batch_size=1, step_s=STEP_S)]


def test_the_stat_logger_factory_feeds_the_monitor() -> None:
    monitor = StepCostMonitor()
    seen: list[StepCostSample] = []
    monitor.subscribe(seen.append)
    logger = monitor.logger_factory()(None, 0)  # as vLLM's per-engine adapter calls it
    for _ in range(3):
        logger.record(*step([STEP_S] * 3, k=1), mm_cache_stats=None, engine_idx=0)
    assert seen == [StepCostSample(k=1, batch_size=3, step_s=STEP_S)]
