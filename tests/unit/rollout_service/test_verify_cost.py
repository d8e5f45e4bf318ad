"""The verify-cost measurement on vLLM's V2 model runner, through a fake of that runner.

FAKE: vLLM's V2 model runner runs on CUDA only. ``FakeV2Runner`` mirrors what
``verify_cost.py`` uses of it in vLLM 0.32: ``_dummy_run(num_tokens, uniform_decode)``
(which drafts after the target's forward, as a real step does) and the step timer
``step_timing.collect()`` (``vllm/v1/worker/gpu/async_utils.py``: one sample per step
that drafted, in issue order, filled when the block exits). The V1 path runs for real
on the CPU engine in the integration tests; the V2 path against vLLM in the GPU tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from rollout_service.engines.vllm.verify_cost import measure_verify_cost

K = 2


@dataclass(frozen=True)
class Sample:  # vllm.v1.worker.gpu.async_utils.StepTimingSample's fields used here
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int


@dataclass
class FakeStepTiming:
    pending: list[Sample] = field(default_factory=list)
    collecting: bool = False

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[Sample]]:
        samples: list[Sample] = []
        self.collecting = True
        try:
            yield samples
        finally:
            self.collecting = False
        samples.extend(self.pending)
        self.pending.clear()


class FakeV2Runner:
    """Forward cost ``base + per_token * tokens``; drafting ``draft_ms``; the n-th step
    of its kind slowed by ``slow[n]`` ms (a busy host), so only the fastest may count."""

    def __init__(self, *, base: float = 4.0, per_token: float = 0.01, draft_ms: float = 1.0,
                 slow: tuple[float, ...] = (), drop_step: int | None = None,
                 fail: bool = False) -> None:
        self.speculator = object()
        self.decode_query_len = 1 + K
        self.scheduler_config = SimpleNamespace(max_num_seqs=256)
        self.max_num_tokens = 2048
        self.step_timing = FakeStepTiming()
        self._cost = (base, per_token, draft_ms)
        self._slow, self._drop_step, self._fail = slow, drop_step, fail
        self._steps = {False: 0, True: 0}

    def _dummy_run(self, num_tokens: int, uniform_decode: bool = False) -> None:
        if self._fail:
            raise AssertionError("a dummy-run precondition of a future vLLM")
        base, per_token, draft_ms = self._cost
        n = self._steps[uniform_decode]
        self._steps[uniform_decode] += 1
        slow = self._slow[n] if n < len(self._slow) else 0.0
        timing = self.step_timing
        if timing.collecting and len(timing.pending) != self._drop_step:
            timing.pending.append(Sample(base + per_token * num_tokens + slow, draft_ms,
                                         num_tokens, num_tokens // (1 + K * uniform_decode)))


def measure(runner: FakeV2Runner, repeats: int = 4) -> dict[str, float] | None:
    return measure_verify_cost(runner, batch_size=8, num_speculative_tokens=K,
                               repeats=repeats)


def test_plain_is_the_target_forward_and_verify_adds_the_drafting() -> None:
    # The warm-up run of each kind is untimed; then the first timed ones are slowed.
    result = measure(FakeV2Runner(slow=(0.0, 50.0, 30.0)))
    assert result is not None
    plain_ms, verify_ms = 4.0 + 0.01 * 8, 4.0 + 0.01 * 8 * (1 + K) + 1.0
    assert result["batch_size"] == 8
    assert abs(result["plain_s"] - plain_ms / 1e3) < 1e-12
    assert abs(result["verify_s"] - verify_ms / 1e3) < 1e-12
    assert abs(result["verify_cost_ratio"] - verify_ms / plain_ms) < 1e-9


def test_a_step_the_timer_did_not_record_leaves_the_ratio_unknown() -> None:
    # Pairs would shift: a plain step read as a verify one. Better no ratio than a wrong one.
    assert measure(FakeV2Runner(drop_step=3)) is None


def test_a_failing_dummy_run_leaves_the_ratio_unknown_and_the_engine_serving() -> None:
    assert measure(FakeV2Runner(fail=True)) is None


def test_a_runner_without_a_drafter_is_not_the_v2_path() -> None:
    runner = FakeV2Runner()
    runner.speculator = None  # and it has no V1 drafter either: nothing to time
    assert measure(runner) is None
