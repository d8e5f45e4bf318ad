"""Which K to run at a batch size: the throughput model, hysteresis, and the collapse rule.

Runs in the rollout service process, inside the speculation controller; pure arithmetic.

The model. With conditional acceptance ``p_1 .. p_K`` (``acceptance``; 0-based there),
one verify step emits ``E(K) = 1 + sum_{i=1..K} prod_{j<=i} p_j`` tokens per sequence
(the bonus token included: ``E(0) = 1``, ``E(K) = K + 1`` when every draft is
accepted), so a step of ``c(K, B)`` seconds (``cost``) at batch size B yields
``throughput(K, B) = B * E(K) / c(K, B)`` tokens per second. The best K maximizes it;
ties go to the smaller K (the same tokens for fewer drafted ones).

Hysteresis (:class:`Hysteresis`, one per batch-size bucket): the K in force changes only
when the best K beats it by more than ``margin`` (relative throughput) in
``num_confirmations`` consecutive decisions; a decision where it does not resets the
count. Two exceptions switch at once: the K in force lost its cost data, or it is slower
than K = 0 by more than the margin. So in every decision the K in force satisfies
``throughput(K) * (1 + margin) >= throughput(0)``: never slower than speculation off by
more than the margin, within the model.

Collapse (:class:`CollapseDetector`): a drafter that no longer matches the main model
(left behind by a push, or broken) must not wait for the smoothed estimate and the
hysteresis. The detector pools the position-0 acceptance of the last sequences that
drafted, as many as hold ``window_drafts`` drafts; once it holds that many and the
pooled rate is below ``threshold_rate``, it collapses: the controller runs K = 0
everywhere. The window counts drafts, not sequences: where sequences draft a few times
each (a rollout's tail, the K > 0 steps after a run at K = 0), a window of 8 sequences
holds a handful of drafts. On an H100 (commit 91b7212) such a window pooled 0.0 for a
working drafter, estimated at 0.33-0.39 at position 0, and switched it off for
``reprobe_after_s``. Bound: if
acceptance drops below the threshold, the controller reaches K = 0 once the broken
drafter has drafted ``window_drafts`` times (128 by default: at K >= 1 a sequence drafts
about once per generated token, so one or two sequences; at the start of a rollout step,
with hundreds of sequences in flight, that is seconds; stats arrive per finished
sequence). A sequence without drafts ran with K = 0 and lost nothing to the drafter, so
it does not count. The state is sticky: only the controller clears it, on a new drafter
version or a re-probe.

Recovery (:class:`ProbeConfig`): with K = 0 nothing is drafted, so nothing could show
that acceptance is back. After a new drafter version (and after ``reprobe_after_s`` in
collapse), the controller probes: buckets up to ``max_batch_size`` run at least
``probe.k`` draft tokens until the drafter has ``num_drafts`` drafts, whatever the model
says; the other buckets follow the model. The probe costs at most ``num_drafts`` drafts at
small batch sizes, where a draft is nearly free. A load that never reaches those buckets
(requests of one length that finish together) would never draft; while nothing at all
is known of the drafter's acceptance, after ``widen_after_observations`` sequences
without a draft the probe also takes the buckets up to the load's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.speculation.cost import StepCostTable


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """``E(K)``: tokens emitted per sequence and verify step, the bonus token included.

    Args:
        rates: conditional acceptance per 0-based draft position.
        k: draft tokens per step.

    Raises:
        ValueError: ``k`` is negative or exceeds ``len(rates)``.
    """
    if not 0 <= k <= len(rates):
        raise ValueError(f"K={k} needs 0 <= K <= {len(rates)} (the positions estimated)")
    total, reach = 1.0, 1.0
    for rate in rates[:k]:
        reach *= rate
        total += reach
    return total


def throughputs(rates: Sequence[float], costs: StepCostTable, *, batch_size: int,
                k_max: int, reach_from: int = 1) -> dict[int, float]:
    """Expected tokens per second, ``B * E(K) / c(K, B)``, for every ``K <= k_max`` that
    the cost table measures or extrapolates (from ``reach_from`` up) at ``batch_size``
    (:meth:`StepCostTable.estimate_s`; no entry: no cost data)."""
    estimates = {k: costs.estimate_s(k, batch_size, reach_from=reach_from)
                 for k in costs.measured_ks() if k <= k_max}
    return {k: batch_size * expected_tokens(rates, k) / step_s
            for k, step_s in estimates.items() if step_s is not None}


def best_k(throughput: Mapping[int, float]) -> int:
    """The K of the highest throughput; the smallest such K on a tie."""
    return min(throughput, key=lambda k: (-throughput[k], k))


class Reason(StrEnum):
    """Why a bucket runs the K it runs."""

    BEST = "best expected throughput"
    HOLD = "hysteresis hold"
    COLLAPSED = "acceptance collapsed"
    NO_COST_DATA = "no cost data"
    EXTRAPOLATED = "step cost extrapolated"
    """The model's K, priced from its cost at a smaller (or larger) batch size until its
    own steps measure it here (``cost.py``, extrapolation)."""
    PROBING = "probing the drafter"


@dataclass(frozen=True, kw_only=True, slots=True)
class HysteresisConfig:
    """When the K in force gives way to a better one (see the module docstring)."""

    margin: float = 0.05
    """Relative throughput the best K must win by: 0.05 is 5%, above the noise of a
    smoothed estimate and of a step-time measurement."""
    num_confirmations: int = 4
    """Consecutive decisions (one per observed sequence) the win must last."""

    def __post_init__(self) -> None:
        if self.margin < 0 or self.num_confirmations < 1:
            raise ValueError(f"need margin >= 0 and num_confirmations >= 1, got {self}")


class Hysteresis:
    """The K in force at one batch-size bucket; starts at K = 0."""

    def __init__(self, config: HysteresisConfig) -> None:
        self._config = config
        self.k = 0
        self._num_pending = 0

    def decide(self, throughput: Mapping[int, float]) -> Reason:
        """One decision on this bucket's throughput per K (which must include K = 0);
        updates :attr:`k` and says why it holds the value it holds."""
        assert 0 in throughput, "the caller reports no cost data without K = 0"
        best, margin = best_k(throughput), self._config.margin
        if best == self.k:
            self._num_pending = 0
            return Reason.BEST
        if self.k not in throughput or throughput[self.k] * (1 + margin) < throughput[0]:
            self.force(best)
            return Reason.BEST
        if throughput[best] > throughput[self.k] * (1 + margin):
            self._num_pending += 1
            if self._num_pending >= self._config.num_confirmations:
                self.force(best)
                return Reason.BEST
        else:
            self._num_pending = 0
        return Reason.HOLD

    def force(self, k: int) -> None:
        """Put ``k`` in force now and forget any pending switch."""
        self.k = k
        self._num_pending = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CollapseConfig:
    """When acceptance has collapsed, and when to look again (see the module docstring)."""

    window_drafts: int = 128
    """Drafts pooled (the last drafted sequences that hold this many); also the bound, in
    drafts of a broken drafter, on reaching K = 0. Few drafts misjudge a working drafter:
    a first-position rate of 0.35 reads 0 in 8 drafts now and then."""
    threshold_rate: float = 0.1
    """Pooled position-0 acceptance below which the drafter counts as broken: a drafter
    whose first token is accepted less than 1 time in 10 adds under 0.1 token per K=1
    step. A weak but working drafter is the throughput model's business, not this rule's."""
    reprobe_after_s: float | None = 300.0
    """Seconds in collapse after which the same drafter is probed again (a collapse may
    be transient, e.g. a burst of prompts the drafter cannot follow); None: only a new
    drafter version ends a collapse."""

    def __post_init__(self) -> None:
        if self.window_drafts < 1 or not 0 < self.threshold_rate < 1:
            raise ValueError(
                f"need window_drafts >= 1 and 0 < threshold_rate < 1, got {self}")
        if self.reprobe_after_s is not None and self.reprobe_after_s <= 0:
            raise ValueError(f"reprobe_after_s must be > 0 or None, got {self.reprobe_after_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    """How a drafter of unknown acceptance is probed (see the module docstring)."""

    k: int = 1
    """Least K the probed buckets run; 1 measures position 0, deeper positions follow
    once the model picks a larger K."""
    max_batch_size: int = 4
    """Buckets up to this batch size are probed; drafts cost little there."""
    num_drafts: int = 256
    """Drafts of the drafter after which probing ends (a sequence or two)."""
    widen_after_observations: int = 8
    """Sequences finished while probing, with no evidence of acceptance at all (no draft
    yet, nor a previous drafter version's estimate), after which the probe also takes
    the buckets up to the one of the load (the last observed batch size): a load that
    never falls into the small buckets never drafts there, and the drafter's acceptance,
    unknown, would keep K = 0 for good (on an H100, 16 requests of one length finished
    together round after round, and acceptance stayed at its prior 0)."""

    def __post_init__(self) -> None:
        if min(self.k, self.max_batch_size, self.num_drafts,
               self.widen_after_observations) < 1:
            raise ValueError("need k, max_batch_size, num_drafts and "
                             f"widen_after_observations >= 1, got {self}")


class CollapseDetector:
    """Pools position-0 acceptance of the last drafted sequences that hold
    ``window_drafts`` drafts; sticky once collapsed."""

    def __init__(self, config: CollapseConfig) -> None:
        self._config = config
        self._window: deque[tuple[int, int]] = deque()
        self._num_accepted = self._num_drafts = 0
        self.is_collapsed = False

    def observe(self, stats: SpecDecodeStats | None) -> bool:
        """Count one sequence (only those that drafted, with per-position counts); returns
        whether acceptance has collapsed."""
        if stats is not None and stats.has_speculation and stats.has_per_position:
            self._push(stats.accepted_per_position[0], stats.num_drafts)
            if self._num_drafts >= self._config.window_drafts and not self.is_collapsed:
                self.is_collapsed = self._num_accepted < (
                    self._config.threshold_rate * self._num_drafts)
        return self.is_collapsed

    def _push(self, accepted: int, drafts: int) -> None:
        """Add a sequence; the oldest leave while the rest still hold the window's drafts."""
        self._window.append((accepted, drafts))
        self._num_accepted += accepted
        self._num_drafts += drafts
        while self._num_drafts - self._window[0][1] >= self._config.window_drafts:
            old_accepted, old_drafts = self._window.popleft()
            self._num_accepted -= old_accepted
            self._num_drafts -= old_drafts

    def pooled_rate(self) -> float | None:
        """Position-0 acceptance pooled over the window; None while it is empty."""
        return self._num_accepted / self._num_drafts if self._num_drafts else None

    def reset(self) -> None:
        """Forget the window and the collapse (a new drafter, or a re-probe)."""
        self._window.clear()
        self._num_accepted = self._num_drafts = 0
        self.is_collapsed = False
