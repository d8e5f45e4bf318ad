"""The speculation controller: per batch-size bucket, the number of draft tokens K to run.

Runs in the rollout service process. The service calls :meth:`SpeculationController.observe`
once per finished sequence (its stats and the weight versions that served it) and
:meth:`~SpeculationController.record_cost` with step-time measurements; it applies
:meth:`~SpeculationController.schedule` to the engine (vLLM takes a batch size -> K table)
and shows :meth:`~SpeculationController.state` on /health and in Prometheus. No I/O, no
clock: the caller passes ``now``.

Buckets: ``batch_size_buckets`` ``(b_1 < b_2 < ...)``; bucket ``b_j`` covers the batch
sizes ``(b_{j-1}, b_j]``, larger ones use the last. A bucket is decided at its upper
edge, the largest batch size it covers, where speculation pays least.

One decision per observation, in every bucket, in this order:

1. collapsed (``decision.CollapseDetector``): K = 0, "acceptance collapsed";
2. the cost table does not cover K = 0 at the bucket: K = 0, "no cost data";
3. otherwise the throughput model with hysteresis (``decision.Hysteresis``): "best
   expected throughput" or "hysteresis hold"; "step cost extrapolated" where the K in
   force is priced from another batch size (``cost.py``: from the bucket below at the
   farthest), until its steps measure it;
4. while probing, buckets up to ``probe.max_batch_size`` run at least ``probe.k``:
   "probing the drafter"; after ``probe.widen_after_observations`` sequences without a
   draft, the buckets up to the load's too (the last observed batch size's bucket).

Probing starts with the controller, with every new drafter version and with a re-probe
(``collapse.reprobe_after_s`` after a collapse); it ends once the drafter has
``probe.num_drafts`` drafts. A collapse puts K = 0 in force in every bucket's hysteresis,
so after recovery each bucket climbs back through the hysteresis. Bounds (default
configs): K = 0 everywhere within ``collapse.window_drafts`` = 128 drafts of a drafter
whose acceptance fell below ``collapse.threshold_rate``; after a push of a working
drafter, K >= 1 in the probed buckets from its first observation on (until the new
drafter has ``probe.num_drafts`` drafts), and the model's own K > 0 after
``hysteresis.num_confirmations`` = 4 observations once the estimate shows a gain above the
margin (one sequence of ~64 drafts moves it halfway from the old estimate).
Cost samples take effect at the next observation.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.speculation.acceptance import (
    AcceptanceConfig,
    AcceptanceEstimate,
    AcceptanceEstimator,
    Observed,
    WeightVersions,
)
from rollout_service.speculation.cost import CostPoint, StepCostSample, StepCostTable
from rollout_service.speculation.decision import (
    CollapseConfig,
    CollapseDetector,
    Hysteresis,
    HysteresisConfig,
    ProbeConfig,
    Reason,
    throughputs,
)


def k_at(schedule: Mapping[int, int], batch_size: int) -> int:
    """The K a schedule (bucket upper edge -> K) gives a batch of ``batch_size``: the first
    edge at or above it; past the last edge, the last K."""
    edges = sorted(schedule)
    return schedule[edges[min(bisect.bisect_left(edges, batch_size), len(edges) - 1)]]


def extrapolation_reach(buckets: Sequence[int]) -> dict[int, int]:
    """Per bucket edge, the first batch size of the bucket below: the nearest a K's
    measured cost may be extrapolated from (``cost.py``, ``reach_from``)."""
    edges = (0, 0, *buckets)
    return {b: edges[i] + 1 for i, b in enumerate(buckets)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerConfig:
    """The speculation controller's settings (see the module docstring)."""

    k_max: int
    """Most draft tokens per step; the checkpoint's MTP depth or vLLM's
    ``num_speculative_tokens``."""
    batch_size_buckets: tuple[int, ...]
    """Upper edges of the batch-size buckets, strictly increasing: the keys of
    :meth:`SpeculationController.schedule`."""
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    """Smoothing of the per-position acceptance."""
    hysteresis: HysteresisConfig = field(default_factory=HysteresisConfig)
    """When the K in force gives way to a better one."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """When acceptance has collapsed and when to look again."""
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """How a drafter of unknown acceptance is probed."""

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        buckets = self.batch_size_buckets
        if not buckets or buckets[0] < 1 or any(b <= a for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"batch_size_buckets must be >= 1 and strictly increasing, "
                             f"got {buckets}")
        if self.probe.k > self.k_max:
            raise ValueError(f"probe.k={self.probe.k} exceeds k_max={self.k_max}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketState:
    """What one bucket runs, and why."""

    batch_size: int
    """The bucket's upper edge."""
    k: int
    """Draft tokens in force."""
    reason: Reason
    """Why this K."""
    tokens_per_s: tuple[float | None, ...]
    """Expected throughput by K = 0..k_max at ``batch_size``; None without cost data."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculationState:
    """A snapshot of the controller (for /health and Prometheus)."""

    buckets: tuple[BucketState, ...]
    """Per bucket, in increasing batch size."""
    acceptance: AcceptanceEstimate
    """The acceptance estimate the decisions used."""
    versions: WeightVersions | None
    """Weight versions of the last counted observation; None before the first."""
    is_collapsed: bool
    """Acceptance collapsed: K = 0 everywhere."""
    is_probing: bool
    """The small buckets (and, once widened, those up to the load's) run at least
    ``probe.k`` to measure the drafter."""
    collapse_rate: float | None
    """Pooled position-0 acceptance of the collapse window; None while it is empty."""
    collapsed_at_s: float | None
    """``now`` of the observation that collapsed it, while collapsed."""
    num_observations: int
    """Observations counted (stale versions excluded)."""
    last_batch_size: int | None
    """Batch size passed with the last observation."""


class SpeculationController:
    """Chooses K per batch-size bucket from live acceptance and measured step costs.

    Args:
        config: the controller's settings.
        costs: the step-cost table; the controller records samples into it.
    """

    def __init__(self, config: ControllerConfig, costs: StepCostTable) -> None:
        self._config = config
        self._costs = costs
        self._acceptance = AcceptanceEstimator(config.acceptance, num_positions=config.k_max)
        self._collapse = CollapseDetector(config.collapse)
        self._hysteresis = {b: Hysteresis(config.hysteresis) for b in config.batch_size_buckets}
        self._reach_from = extrapolation_reach(config.batch_size_buckets)
        self._is_probing = True
        self._probe_reach = config.probe.max_batch_size
        """Buckets up to this edge are probed while probing (widened to the load's)."""
        self._probe_observations = 0
        """Sequences observed since the probe began."""
        self._collapsed_at_s: float | None = None
        self._versions: WeightVersions | None = None
        self._num_observations = 0
        self._last_batch_size: int | None = None
        self._buckets: tuple[BucketState, ...] = ()
        self._decide()

    def observe(self, stats: SpecDecodeStats | None, weight_version: WeightVersions,
                batch_size: int, now: float) -> None:
        """Take in one finished sequence and decide again.

        Args:
            stats: its counts; None when the engine gave none.
            weight_version: the versions that served it (a drafter version older than the
                current one: ignored).
            batch_size: the engine's batch size when it finished (shown in the state).
            now: a monotonic clock, seconds (for the re-probe after a collapse).

        Raises:
            ValueError: ``batch_size < 1``, or inconsistent per-position counts.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._is_reprobe_due(now):
            self._acceptance.restart()
            self._start_probe()
        observed = self._acceptance.observe(stats, weight_version)
        if observed is Observed.STALE:
            return
        if observed is Observed.NEW_DRAFTER:
            self._start_probe()
        if not self._collapse.is_collapsed and self._collapse.observe(stats):
            self._collapse_now(now)
        self._versions, self._last_batch_size = weight_version, batch_size
        self._num_observations += 1
        self._probe_observations += 1
        self._widen_probe(batch_size)
        self._decide()

    def record_cost(self, sample: StepCostSample) -> None:
        """Blend one step-time measurement into the cost table (used from the next
        observation on)."""
        self._costs.record(sample)

    def refresh(self) -> None:
        """Decide again now, on the estimates as they are: after a batch of cost samples
        (the service's start-up calibration), so the schedule need not wait for the first
        finished sequence."""
        self._decide()

    def verify_cost_ratio(self, drafts_per_k: Sequence[int], batch_size: int
                          ) -> float | None:
        """A sequence's verify steps priced by the cost table
        (:meth:`StepCostTable.verify_cost_ratio`); None where it has no measurement."""
        return self._costs.verify_cost_ratio(drafts_per_k, batch_size)

    def cost_points(self) -> dict[int, tuple[CostPoint, ...]]:
        """The step-cost table as measured (blended) points, per K."""
        return self._costs.points()

    def schedule(self) -> dict[int, int]:
        """K in force per bucket upper edge: the engine's batch size -> K table."""
        return {bucket.batch_size: bucket.k for bucket in self._buckets}

    def k_for(self, batch_size: int) -> int:
        """K in force for a batch of ``batch_size`` sequences."""
        return self._buckets[self._bucket_index(batch_size)].k

    def _bucket_index(self, batch_size: int) -> int:
        edges = self._config.batch_size_buckets
        return min(bisect.bisect_left(edges, batch_size), len(edges) - 1)

    @property
    def is_collapsed(self) -> bool:
        """Acceptance collapsed: K = 0 everywhere (as in :meth:`state`, without its copy)."""
        return self._collapse.is_collapsed

    def state(self) -> SpeculationState:
        """A frozen snapshot: K and reason per bucket, and the estimates."""
        return SpeculationState(
            buckets=self._buckets, acceptance=self._acceptance.estimate(),
            versions=self._versions, is_collapsed=self._collapse.is_collapsed,
            is_probing=self._is_probing, collapse_rate=self._collapse.pooled_rate(),
            collapsed_at_s=self._collapsed_at_s, num_observations=self._num_observations,
            last_batch_size=self._last_batch_size)

    def _is_reprobe_due(self, now: float) -> bool:
        after_s = self._config.collapse.reprobe_after_s
        return (self._collapsed_at_s is not None and after_s is not None
                and now - self._collapsed_at_s >= after_s)

    def _start_probe(self) -> None:
        self._collapse.reset()
        self._collapsed_at_s = None
        self._is_probing = True
        self._probe_reach = self._config.probe.max_batch_size
        self._probe_observations = 0

    def _widen_probe(self, batch_size: int) -> None:
        """Probe up to the load's bucket once enough sequences finished without a draft
        while the drafter's acceptance has no evidence at all: a new version after one
        that drafted starts from that one's estimate (its prior) and is probed where
        drafts are cheap only, as the large buckets of every RL step's start would
        otherwise draft after each drafter push."""
        probe = self._config.probe
        if (self._is_probing and not self._acceptance.has_evidence
                and self._probe_observations >= probe.widen_after_observations):
            edge = self._config.batch_size_buckets[self._bucket_index(batch_size)]
            self._probe_reach = max(self._probe_reach, edge)

    def _collapse_now(self, now: float) -> None:
        self._collapsed_at_s = now
        self._is_probing = False
        for hysteresis in self._hysteresis.values():
            hysteresis.force(0)

    def _decide(self) -> None:
        if self._acceptance.num_epoch_drafts >= self._config.probe.num_drafts:
            self._is_probing = False
        rates = self._acceptance.rates()
        self._buckets = tuple(self._decide_bucket(bucket, hysteresis, rates)
                              for bucket, hysteresis in self._hysteresis.items())

    def _decide_bucket(self, batch_size: int, hysteresis: Hysteresis,
                       rates: tuple[float, ...]) -> BucketState:
        throughput = throughputs(rates, self._costs, batch_size=batch_size,
                                 k_max=self._config.k_max,
                                 reach_from=self._reach_from[batch_size])
        if self._collapse.is_collapsed:
            k, reason = 0, Reason.COLLAPSED
        elif 0 not in throughput:
            k, reason = 0, Reason.NO_COST_DATA
        else:
            reason = hysteresis.decide(throughput)
            k = hysteresis.k
            if not self._costs.covers(k, batch_size):
                reason = Reason.EXTRAPOLATED
            if self._is_probing and batch_size <= self._probe_reach and (
                    k < self._config.probe.k):
                k, reason = self._config.probe.k, Reason.PROBING
        return BucketState(batch_size=batch_size, k=k, reason=reason,
                           tokens_per_s=tuple(throughput.get(k_) for k_ in
                                              range(self._config.k_max + 1)))
