"""Measured cost of one engine step with K draft tokens at batch size B: ``c(K, B)``.

Runs in the rollout service process, inside the speculation controller; the measurements
come from elsewhere (a benchmark on the GPU at startup, or the engine's own step timings
later) as :class:`StepCostSample` values. Nothing here does I/O.

A cost is the wall time of one engine step (drafting and verification together) in
seconds. Only ratios at the same B matter to the decision (``throughput = B * E(K) /
c(K, B)``), so a relative table (``c(0, B) = 1``) works as well; seconds keep samples from
different sources comparable.

Monotone in B: for each K the table prices a step from the closest curve that does not
fall as B grows (:func:`nondecreasing_fit`, pooling adjacent points that violate it),
not from the points as measured. A step with more sequences does the same work and more,
so a cost that falls with B is noise; and where a step is short the noise is large. On an
H100 (embedded 1B, CUDA graphs) steps of 2.4-6.0 ms scattered by a fifth between
neighbouring batch sizes: c(0, 2) measured 3.7 ms and c(0, 3) 2.4 ms, c(1, 16) 3.6 ms
below c(0, 16) 3.9 ms. Taken as measured, those points had neighbouring buckets choose K
= 3, 2, 1 (K = 0 by the model at B = 4), 3, 1, 3 for the same drafter while pinned static
K told K = 1..3 apart by less than their spread; the fitted curves alone chose K = 3, 2,
2, 2, 2, 3 from the same table, and with the ratios below 3, 2, 2, 3, 3, 3
(docs/speculation-control.md). Points that already rise are kept as measured.

Interpolation: for each K, piecewise linear in ``log B`` between the fitted batch
sizes. It never overshoots, so the monotone curve stays monotone, and a step's cost is
roughly affine in B while batch sizes are measured on a geometric grid (1, 2, 4, ...).
Outside the measured range of a K, :meth:`StepCostTable.step_s` raises.

Relative cost (:meth:`StepCostTable.cost_ratio`, for the decision and the verify cost):
``c(K, B) / c(0, B)`` is the median of K's ratios to K = 0 as measured at the batch sizes
B' within a factor ``ratio_window`` of B where both were measured (the calibration
measures such pairs back to back); ``c(K, B)`` is the fitted ``c(0, B)`` times it. The
decision reads only that ratio. Read from the fitted
curves at B alone, one noisy point decides it, and the fit spreads that point to its
neighbours: on an H100 (embedded 1B, a drafter accepting 0.18 at position 0), live
steps raised c(0, 16) and lowered c(1, 16) until the model put K = 1 at 1.15x K = 0 at
B = 16. The pairs at B = 8, 16 and 32 price it at 0.97x (``python -m bench.cost_fit
tests/data/controller-h100-1b-noise0.6-after-c16.json``), and the controller, which ran
K = 1 there, ran at 0.93x pinned K = 0 (docs/speculation-control.md). The ratio moves
slowly with B (drafting costs relatively less as a step grows), so the median over the
neighbours drops such a point and keeps a real trend.

Extrapolation, for the decision only (:meth:`StepCostTable.estimate_s`): where K = 0 is
measured at B but K is not, ``c(K, B)`` is ``c(0, B)`` times K's ratio to K = 0 (as
above) at the nearest batch size B' measured for both, as long as B' is
at least ``reach_from`` (the caller's: the controller allows the bucket below). K = 0 runs
wherever nothing better is known, so its live steps measure it at every batch size the
load reaches, while a K > 0 is measured only where it runs: without this, a bucket beyond
the calibration would stay at K = 0 for good unless something pinned a K > 0 there. Above
B' the held ratio is optimistic (drafting costs relatively more as a step becomes
compute-bound), so a K that looks better is tried, and its own steps in the bucket then
price it. With ``reach_from`` the trial spreads one bucket at a time: a K is tried in a
bucket only once it has run in the one below.

Verify cost: the table also prices a finished sequence's verify steps for the net
speed-up (``protocol/acceptance.py``): :meth:`StepCostTable.verify_cost_ratio` is the mean
of :meth:`StepCostTable.cost_ratio` over its steps, each at the K it ran. The baseline is a step at
K = 0 on the same engine, the one the controller weighs every K against; with
``drafter_at_k0: run`` that step still runs one drafter pass, so the figure says whether
drafting beats K = 0 here, not whether it beats an engine without a drafter.

Refresh: a new sample of an already measured ``(K, B)`` blends in with weight
``blend_weight`` (an exponential moving average, so the table follows slow drift such as
longer contexts late in a step without jumping on one noisy timing); a sample of a new
``(K, B)`` is taken as is.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCostSample:
    """One measurement: an engine step with ``k`` draft tokens at ``batch_size`` took
    ``step_s`` seconds."""

    k: int
    """Draft tokens per sequence in the step (0: speculation off)."""
    batch_size: int
    """Sequences in the step."""
    step_s: float
    """Wall time of the step (drafting and verification), seconds."""

    def __post_init__(self) -> None:
        if self.k < 0 or self.batch_size < 1 or not self.step_s > 0:
            raise ValueError(f"need k >= 0, batch_size >= 1 and step_s > 0, got {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostPoint:
    """One point of the table as measured, with what it was made of: a point blended from
    many samples is the table's settled view; one whose latest sample lies far from it is
    moving (``/speculation`` shows both, to tell a noisy point from a real change)."""

    k: int
    batch_size: int
    step_s: float
    """Seconds per step, blended (what the fit starts from)."""
    num_samples: int
    """Samples blended into it (calibration's and live ones)."""
    last_step_s: float
    """The latest of them, as taken."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostConfig:
    """How the cost table takes in new samples."""

    blend_weight: float = 0.25
    """Weight of a new sample of an already measured ``(K, B)``: 1 replaces the old
    value, 0.25 follows a lasting change within a few samples."""
    ratio_window: float = 2.0
    """The decision prices K > 0 at B from the median of its ratios to K = 0 at the
    batch sizes measured within this factor of B (2: B/2 to 2B, the grid's neighbours);
    1 reads the ratio at B alone (the module docstring says why)."""

    def __post_init__(self) -> None:
        if not 0 < self.blend_weight <= 1:
            raise ValueError(f"blend_weight must be in (0, 1], got {self.blend_weight}")
        if not self.ratio_window >= 1:
            raise ValueError(f"ratio_window must be >= 1, got {self.ratio_window}")


def nondecreasing_fit(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent
    violators): each run of points that falls is replaced by its mean, repeatedly, so a
    sequence that already rises comes back unchanged."""
    blocks: list[tuple[float, int]] = []  # (mean, points pooled)
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            previous, pooled = blocks.pop()
            mean = (previous * pooled + mean * count) / (pooled + count)
            count += pooled
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


class StepCostTable:
    """``c(K, B)`` from samples, fitted non-decreasing in B per K and interpolated in
    ``log B`` (see the module docstring).

    Args:
        config: how samples blend in.
        samples: initial samples, recorded in order.
    """

    def __init__(self, config: CostConfig, samples: Iterable[StepCostSample] = ()) -> None:
        self._config = config
        self._points: dict[int, list[CostPoint]] = {}
        """As measured (blended), per K in ascending B."""
        self._batch_sizes: dict[int, list[int]] = {}
        """The points' batch sizes, per K: what the lookups bisect."""
        self._fitted: dict[int, list[float]] = {}
        """The points' costs fitted non-decreasing in B: what prices a step."""
        self._pairs: dict[int, tuple[list[int], list[float]]] = {}
        """Per K > 0, the batch sizes measured for both K and K = 0 and K's ratio there:
        built on first use after a record (the decision reads them for every bucket and K
        at each finished sequence; samples arrive far less often)."""
        self._estimates: dict[tuple[int, int, int], float | None] = {}
        """:meth:`estimate_s` per ``(k, batch_size, reach_from)`` since the last record:
        the decision asks for every K at every bucket at each finished sequence, and the
        answer changes only with the table."""
        for sample in samples:
            self.record(sample)

    def record(self, sample: StepCostSample) -> None:
        """Blend one measurement into the table."""
        points = self._points.setdefault(sample.k, [])
        batch_sizes = self._batch_sizes.setdefault(sample.k, [])
        at = bisect.bisect_left(batch_sizes, sample.batch_size)
        if at < len(batch_sizes) and batch_sizes[at] == sample.batch_size:
            old, weight = points[at], self._config.blend_weight
            points[at] = dataclasses.replace(
                old, step_s=(1 - weight) * old.step_s + weight * sample.step_s,
                num_samples=old.num_samples + 1, last_step_s=sample.step_s)
        else:
            batch_sizes.insert(at, sample.batch_size)
            points.insert(at, CostPoint(k=sample.k, batch_size=sample.batch_size,
                                        step_s=sample.step_s, num_samples=1,
                                        last_step_s=sample.step_s))
        self._fitted[sample.k] = nondecreasing_fit([p.step_s for p in points])
        self._pairs.clear()
        self._estimates.clear()

    def measured_ks(self) -> tuple[int, ...]:
        """The K values with at least one sample, ascending."""
        return tuple(sorted(self._batch_sizes))

    def covers(self, k: int, batch_size: int) -> bool:
        """Whether ``c(k, batch_size)`` lies within the measurements."""
        batch_sizes = self._batch_sizes.get(k)
        return bool(batch_sizes) and batch_sizes[0] <= batch_size <= batch_sizes[-1]

    def step_s(self, k: int, batch_size: int) -> float:
        """Seconds per engine step with ``k`` draft tokens at ``batch_size``.

        Raises:
            ValueError: ``k`` was never measured, or ``batch_size`` lies outside the
                batch sizes measured for it.
        """
        if k not in self._batch_sizes:
            raise ValueError(f"no step cost measured for K={k}; measured: {self.measured_ks()}")
        batch_sizes, costs = self._batch_sizes[k], self._fitted[k]
        if not self.covers(k, batch_size):
            raise ValueError(f"batch size {batch_size} lies outside the batch sizes measured "
                             f"for K={k}: {batch_sizes[0]}..{batch_sizes[-1]}")
        at = bisect.bisect_left(batch_sizes, batch_size)
        if batch_sizes[at] == batch_size:
            return costs[at]
        low, high = batch_sizes[at - 1], batch_sizes[at]
        t = math.log(batch_size / low) / math.log(high / low)
        return costs[at - 1] + t * (costs[at] - costs[at - 1])

    def estimate_s(self, k: int, batch_size: int, *, reach_from: int = 1) -> float | None:
        """``c(k, batch_size)`` for the decision. Within K's measured batch sizes: K = 0's
        cost times :meth:`cost_ratio` (or :meth:`step_s` where K = 0 is not measured).
        Beyond them, where K = 0 is measured at ``batch_size``: extrapolated from K's
        :meth:`cost_ratio` at the nearest batch size measured for both (the module
        docstring says why). None: K = 0 is not measured at ``batch_size``, K and K = 0
        share no measured range, or that nearest batch size lies below ``reach_from``."""
        key = (k, batch_size, reach_from)
        if key not in self._estimates:
            self._estimates[key] = self._estimate_s(k, batch_size, reach_from)
        return self._estimates[key]

    def _estimate_s(self, k: int, batch_size: int, reach_from: int) -> float | None:
        if self.covers(k, batch_size):
            if not self.covers(0, batch_size):
                return self.step_s(k, batch_size)
            return self.step_s(0, batch_size) * self.cost_ratio(k, batch_size)
        if not self.covers(0, batch_size) or k not in self._batch_sizes:
            return None
        k_sizes, plain_sizes = self._batch_sizes[k], self._batch_sizes[0]
        low, high = max(k_sizes[0], plain_sizes[0]), min(k_sizes[-1], plain_sizes[-1])
        if low > high:
            return None
        nearest = min(max(batch_size, low), high)
        if nearest < reach_from:
            return None
        return self.step_s(0, batch_size) * self.cost_ratio(k, nearest)

    def cost_ratio(self, k: int, batch_size: int) -> float:
        """``c(k, B) / c(0, B)`` as the decision reads it, where both are measured: the
        median of the measured pairs within ``ratio_window`` of B (the module docstring
        says why), or the fitted curves' ratio at B where no pair lies that close.

        Raises:
            ValueError: ``k`` or K = 0 is not measured at ``batch_size`` (:meth:`step_s`).
        """
        if k and self.covers(k, batch_size) and self.covers(0, batch_size):
            window = self._config.ratio_window
            sizes, ratios = self._paired(k)
            nearby = ratios[bisect.bisect_left(sizes, batch_size / window):
                            bisect.bisect_right(sizes, batch_size * window)]
            if nearby:
                return statistics.median(nearby)
        return self.step_s(k, batch_size) / self.step_s(0, batch_size)

    def _paired(self, k: int) -> tuple[list[int], list[float]]:
        """The batch sizes measured for both ``k`` and K = 0, ascending, and K's ratio to
        K = 0 at each, as measured."""
        if k not in self._pairs:
            plain = {p.batch_size: p.step_s for p in self._points[0]}
            pairs = [(p.batch_size, p.step_s / plain[p.batch_size]) for p in self._points[k]
                     if p.batch_size in plain]
            self._pairs[k] = ([b for b, _ in pairs], [r for _, r in pairs])
        return self._pairs[k]

    def verify_cost_ratio(self, drafts_per_k: Sequence[int], batch_size: int
                          ) -> float | None:
        """A sequence's verify steps in steps at K = 0: the mean of :meth:`cost_ratio` over
        its drafts, ``drafts_per_k[K]`` of them at K, at ``batch_size``.

        Returns:
            The ratio; None without drafts or where the table does not cover K = 0 or one
            of those K at ``batch_size`` (nothing is guessed: the caller keeps the engine's
            own figure).
        """
        ks = [k for k, n in enumerate(drafts_per_k) if n]
        if not ks or not all(self.covers(k, batch_size) for k in (0, *ks)):
            return None
        verify = sum(drafts_per_k[k] * self.cost_ratio(k, batch_size) for k in ks)
        return verify / sum(drafts_per_k)

    def points(self) -> dict[int, tuple[CostPoint, ...]]:
        """The table as measured (blended) points, per K, before the fit."""
        return {k: tuple(self._points[k]) for k in self.measured_ks()}


class StepCostMedians:
    """Folds single-step measurements into one sample per ``num_steps`` steps of the same
    K and batch-size band: their median cost, at their median batch size.

    One step's period carries the noise of everything else on the machine (a scheduler
    hiccup, a garbage collection, a pause of the engine between two steps); the median of
    a run of steps does not, and it keeps the table's blending (``blend_weight`` per
    sample) at the pace of runs rather than of single steps.

    Bands: :data:`BANDS_PER_OCTAVE` per doubling of B (about 19% wide), so that batch
    sizes up to 4 keep a band each while steps at 97 and 103 requests fold together. A
    decaying rollout loses requests nearly every step; folding by exact B, no batch size
    above the calibration ever had ``num_steps`` steps, and buckets there stayed without
    cost data. A step's cost is close to affine in B, so the median cost of a band's run
    goes with its median B.

    Args:
        num_steps: steps per sample (1 passes every step through).
    """

    def __init__(self, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._num_steps = num_steps
        self._pending: dict[tuple[int, int], list[StepCostSample]] = {}

    def add(self, step: StepCostSample) -> StepCostSample | None:
        """Take one step; returns the median sample when its K and band have
        ``num_steps``."""
        key = (step.k, batch_size_band(step.batch_size))
        pending = self._pending.setdefault(key, [])
        pending.append(step)
        if len(pending) < self._num_steps:
            return None
        del self._pending[key]
        return StepCostSample(
            k=step.k, batch_size=statistics.median_low(s.batch_size for s in pending),
            step_s=statistics.median(s.step_s for s in pending))


BANDS_PER_OCTAVE = 4
"""Batch-size bands per doubling of B in :class:`StepCostMedians`."""


def batch_size_band(batch_size: int) -> int:
    """The band of ``batch_size``: ``floor(BANDS_PER_OCTAVE * log2(B))``."""
    return math.floor(BANDS_PER_OCTAVE * math.log2(batch_size))
