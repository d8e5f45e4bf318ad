"""A speculation controller on a model roofline, and finished sequences fed to it in vLLM's
shape: the helpers of the controller's unit tests (``test_speculation*.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.speculation.acceptance import WeightVersions
from rollout_service.speculation.controller import ControllerConfig, SpeculationController
from rollout_service.speculation.cost import CostConfig, StepCostSample, StepCostTable
from tests.support.spec_stats import vllm_chain

K_MAX = 3
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GOOD = (0.7, 0.7, 0.7)
BROKEN = (0.0, 0.0, 0.0)
DEFAULTS = ControllerConfig(k_max=K_MAX, batch_size_buckets=BUCKETS)
WINDOW = DEFAULTS.collapse.window_drafts
DRAFTS = 200
"""Drafts of one fed sequence (:func:`feed`'s default)."""
COLLAPSE_BOUND = -(-WINDOW // DRAFTS)
"""Sequences of :data:`DRAFTS` a broken drafter drafts before K = 0 everywhere."""
CONFIRMATIONS = DEFAULTS.hysteresis.num_confirmations
MARGIN = DEFAULTS.hysteresis.margin


def chain_stats(num_drafts: int, rates: Sequence[float],
                rounding: Callable[[float], int] = int) -> SpecDecodeStats:
    """A sequence drafting ``len(rates)`` tokens per step, position ``i`` accepted at
    ``rates[i]`` among the drafts that accepted every earlier position (the count rounded
    by ``rounding``: down by default, so at most that rate)."""
    per_position, reached = [], num_drafts
    for rate in rates:
        reached = rounding(reached * rate)
        per_position.append(reached)
    return SpecDecodeStats(num_drafts=num_drafts, num_draft_tokens=len(rates) * num_drafts,
                           num_accepted_tokens=sum(per_position), num_verify_steps=num_drafts,
                           accepted_per_position=tuple(per_position))


def roofline_s(k: int, batch_size: int) -> float:
    """A decode step's seconds: reading the weights (20 ms) until verifying ``B * (K + 1)``
    tokens takes longer (0.2 ms each), plus one drafter pass (1 ms) per draft token."""
    return max(0.02, 2e-4 * batch_size * (k + 1)) + 0.001 * k


def roofline_table(max_batch_size: int = 512) -> StepCostTable:
    grid = [2 ** i for i in range(max_batch_size.bit_length()) if 2 ** i <= max_batch_size]
    return StepCostTable(CostConfig(), [
        StepCostSample(k=k, batch_size=b, step_s=roofline_s(k, b))
        for k in range(K_MAX + 1) for b in grid])


def controller(costs: StepCostTable | None = None, **fields: object) -> SpeculationController:
    config = ControllerConfig(k_max=K_MAX, batch_size_buckets=BUCKETS, **fields)
    return SpeculationController(config, roofline_table() if costs is None else costs)


def feed(ctl: SpeculationController, rates: Sequence[float], *, draft_version: int = 0,
         main_version: int | None = None, batch_size: int = 1, num_drafts: int = DRAFTS,
         now: float = 0.0) -> None:
    """One finished sequence that ran with the K the controller has in force, its stats in
    vLLM's shape (``k_max + 1`` histogram buckets whatever K ran)."""
    k = ctl.k_for(batch_size)
    versions = WeightVersions(main_version=draft_version if main_version is None
                              else main_version, draft_version=draft_version)
    ctl.observe(vllm_chain(num_drafts, rates, k=k, k_max=K_MAX), versions, batch_size, now)


def observations_until(ctl: SpeculationController, is_done, rates: Sequence[float],
                       limit: int = 100, **feed_args: object) -> int:
    """Sequences fed until ``is_done(ctl)``."""
    for count in range(1, limit + 1):
        feed(ctl, rates, **feed_args)
        if is_done(ctl):
            return count
    raise AssertionError(f"not done after {limit} observations: {ctl.state()}")


def bucket(ctl: SpeculationController, batch_size: int):
    return next(b for b in ctl.state().buckets if b.batch_size == batch_size)
