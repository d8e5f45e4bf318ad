"""Per-position acceptance of the drafter, smoothed, one epoch per drafter version.

Runs in the rollout service process, inside the speculation controller (``controller``):
the service hands it each finished sequence's
:class:`~rollout_service.protocol.acceptance.SpecDecodeStats`; nothing here does I/O.

It estimates the conditional acceptance ``p_i = P(draft token i accepted | tokens < i
accepted)`` for the 0-based draft positions ``i < num_positions`` (``decision`` writes
them ``p_1 .. p_K``). Acceptance is a prefix, so in a sequence the drafts that reached
position ``i`` are ``num_drafts`` (``i = 0``) or ``accepted_per_position[i - 1]``, and
``accepted_per_position[i]`` of them accepted it. Per position the estimator keeps
decayed sums of accepted (``a_i``) and reached (``r_i``) drafts, and reports

    p_i = (a_i + s * e_i) / (r_i + s),  e_0 = 0,  e_i = p_{i-1} * extrapolation_factor

with ``s = shrinkage_drafts``: with evidence this is ``a_i / r_i``; a position never
reached (K larger than anything that ran) gets ``e_i``, the previous position's rate
decayed geometrically. MTP acceptance falls with depth, so extrapolating the last
observed rate unchanged would be optimistic; with no evidence at all the drafter is
assumed useless (``e_0 = 0``) until probed.

Decisions:

- The half-life is in drafts, not seconds. What ages an estimate is new evidence, not
  the clock: in an RL step's tail a few sequences finish per minute, and a half-life in
  seconds would forget the estimate exactly when speculation matters most, with nothing
  to replace it. In drafts, the effective sample stays ``half_life_drafts / ln 2`` at any
  load. Staleness in time is handled by the epochs below (weights change only at pushes)
  and by the collapse rule (``decision``).
- One epoch per drafter version. When an observation carries a newer drafter version,
  the old estimate becomes a prior of ``prior_drafts`` pseudo-drafts per position (at most
  the evidence it had), at the old ratio ``a_i / r_i``; new drafts then dominate it: the
  gap to the new rate shrinks to a fraction ``f`` after about ``prior_drafts * (1/f - 1)``
  drafts (64 drafts of prior: within 1/8 of the gap after ~450 drafts).
- A push of the main model alone starts no epoch. Acceptance depends on both models, but
  one RL step moves the main model a little and the decay follows that drift; and the
  failure this guards against, a drafter left behind while the main model is pushed, must
  not look like a fresh drafter (which would re-probe a drafter known to be broken).
- Observations of an older drafter version (sequences finished after a push) are ignored.
- The counts assume a chain (vLLM MTP, SGLang ``topk`` 1). The drafts that reached each
  position come from the engine when it reported each step's counts
  (``SpecDecodeStats.reached_per_position``: vLLM at the ``detailed`` level, which the
  speculation control asks for), exact whatever K each step ran. Otherwise K must be
  inferred: vLLM's histogram has ``k_max + 1`` buckets whatever K ran, so its
  ``accepted_per_position`` is always ``k_max`` long and says nothing about the K of a
  step. A sequence with ``num_draft_tokens == K * num_drafts`` ran K at every step if
  it drafted at one K (it could also have mixed, say, K = 1 and K = 3 half the time, and
  its position 1 is then biased low); its positions past K were never reached. A sequence
  whose drafts per step are not a whole number mixed K values, and only its position 0
  (reached by every draft) is counted. (Counting every position up to ``k_max`` for
  every sequence made positions a smaller K never drafted look reached and rejected: a
  drafter accepted at 0.9 everywhere, run at K = 1, was estimated ``[0.9, 0, 0]``, and
  K >= 2 was never chosen.) A sequence whose engine reported no per-position counts
  (SGLang, on an inconsistent histogram) is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from rollout_service.protocol.acceptance import SpecDecodeStats


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceptanceConfig:
    """How per-position acceptance is smoothed (see the module docstring)."""

    half_life_drafts: float = 2000.0
    """Drafts after which an observation weighs half: ~2,900 drafts of effective sample
    (a rate's standard error ~0.01), a few tens of sequences to follow a drift."""
    prior_drafts: float = 64.0
    """Pseudo-drafts per position that a new drafter version inherits from the old
    estimate: about one sequence's drafts, so one sequence moves the estimate halfway."""
    shrinkage_drafts: float = 4.0
    """Pseudo-drafts pulling each position toward its extrapolation ``e_i``; small, so it
    only matters where a position has (almost) no evidence. Must be > 0."""
    extrapolation_factor: float = 0.8
    """``e_i = p_{i-1} * extrapolation_factor`` for a position without evidence."""

    def __post_init__(self) -> None:
        if self.half_life_drafts <= 0:
            raise ValueError(f"half_life_drafts must be > 0, got {self.half_life_drafts}")
        if self.prior_drafts < 0:
            raise ValueError(f"prior_drafts must be >= 0, got {self.prior_drafts}")
        if self.shrinkage_drafts <= 0:
            raise ValueError(f"shrinkage_drafts must be > 0, got {self.shrinkage_drafts}")
        if not 0 <= self.extrapolation_factor <= 1:
            raise ValueError(
                f"extrapolation_factor must be in [0, 1], got {self.extrapolation_factor}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightVersions:
    """The weight versions that served an observed sequence (-1: never pushed)."""

    main_version: int
    """Version of the main (target) model."""
    draft_version: int
    """Version of the drafter (the MTP layers)."""


class Observed(StrEnum):
    """What :meth:`AcceptanceEstimator.observe` did with an observation."""

    COUNTED = "counted"
    """Same drafter version: counted (if it has per-position counts)."""
    NEW_DRAFTER = "new drafter"
    """A newer drafter version: a new epoch began, then it was counted."""
    STALE = "stale"
    """An older drafter version: ignored."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceptanceEstimate:
    """A snapshot of the estimator (for the controller's state, /health, Prometheus)."""

    draft_version: int | None
    """Drafter version of the current epoch; None before the first observation."""
    rates: tuple[float, ...]
    """``p_i`` per 0-based draft position."""
    evidence_drafts: tuple[float, ...]
    """Decayed drafts that reached each position (``r_i``, prior included)."""
    num_epoch_drafts: int
    """Drafts counted since the epoch began (undecayed, prior excluded)."""


class AcceptanceEstimator:
    """Exponentially weighted conditional acceptance per draft position.

    Args:
        config: smoothing settings.
        num_positions: draft positions tracked (the controller's ``k_max``); deeper
            positions of an observation are not tracked.
    """

    def __init__(self, config: AcceptanceConfig, *, num_positions: int) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        self._config = config
        self._accepted = [0.0] * num_positions
        self._reached = [0.0] * num_positions
        self._draft_version: int | None = None
        self._num_epoch_drafts = 0

    @property
    def draft_version(self) -> int | None:
        """Drafter version of the current epoch; None before the first observation."""
        return self._draft_version

    @property
    def has_evidence(self) -> bool:
        """Whether any draft reached position 0, counted or carried as a prior."""
        return self._reached[0] > 0

    @property
    def num_epoch_drafts(self) -> int:
        """Drafts counted since the epoch began."""
        return self._num_epoch_drafts

    def observe(self, stats: SpecDecodeStats | None, versions: WeightVersions) -> Observed:
        """Count one finished sequence (None: the engine gave no stats).

        Returns:
            Whether it was counted, began a new drafter epoch first, or was stale.

        Raises:
            ValueError: ``accepted_per_position`` is not a prefix (it grows with the
                position, or exceeds the drafts). Nothing changes then: a new drafter's
                epoch begins with its next sequence, which the caller is told of.
        """
        outcome = Observed.COUNTED
        if self._draft_version is not None and versions.draft_version < self._draft_version:
            return Observed.STALE
        counted = (stats if stats is not None and stats.has_speculation
                   and stats.has_per_position else None)
        if counted is not None:
            check_prefix(counted)
        if versions.draft_version != self._draft_version:
            self._start_epoch(versions.draft_version)
            outcome = Observed.NEW_DRAFTER
        if counted is not None:
            self._count(counted)
        return outcome

    def restart(self) -> None:
        """Begin a new epoch for the same drafter (the controller's re-probe after a
        collapse), with the old estimate as a prior exactly as after a push."""
        self._start_epoch(self._draft_version)

    def rates(self) -> tuple[float, ...]:
        """``p_i`` per 0-based draft position (see the module docstring)."""
        shrinkage, factor = self._config.shrinkage_drafts, self._config.extrapolation_factor
        rates: list[float] = []
        for accepted, reached in zip(self._accepted, self._reached, strict=True):
            fallback = rates[-1] * factor if rates else 0.0
            rates.append((accepted + shrinkage * fallback) / (reached + shrinkage))
        return tuple(rates)

    def estimate(self) -> AcceptanceEstimate:
        """A frozen snapshot of the estimate."""
        return AcceptanceEstimate(draft_version=self._draft_version, rates=self.rates(),
                                  evidence_drafts=tuple(self._reached),
                                  num_epoch_drafts=self._num_epoch_drafts)

    def _start_epoch(self, draft_version: int | None) -> None:
        for i, (accepted, reached) in enumerate(zip(self._accepted, self._reached)):
            carried = min(self._config.prior_drafts, reached)
            self._accepted[i] = carried * accepted / reached if reached > 0 else 0.0
            self._reached[i] = carried
        self._draft_version = draft_version
        self._num_epoch_drafts = 0

    def _count(self, stats: SpecDecodeStats) -> None:
        per_position = stats.accepted_per_position
        reached = reached_per_position(stats)
        decay = math.exp2(-stats.num_drafts / self._config.half_life_drafts)
        self._accepted = [a * decay for a in self._accepted]
        self._reached = [r * decay for r in self._reached]
        for i in range(min(len(reached), len(self._reached))):
            self._reached[i] += reached[i]
            self._accepted[i] += per_position[i] if i < len(per_position) else 0
        self._num_epoch_drafts += stats.num_drafts


def check_prefix(stats: SpecDecodeStats) -> None:
    """Raise ValueError unless ``stats`` has drafts and ``accepted_per_position`` never grows
    with the position nor exceeds them (a position is reached only through the last)."""
    bounds = (stats.num_drafts, *stats.accepted_per_position)
    if stats.num_drafts == 0 or any(b > a for a, b in zip(bounds, bounds[1:])):
        raise ValueError("drafted tokens need drafts, and accepted_per_position must not "
                         f"grow with the position nor exceed num_drafts: {stats}")


def reached_per_position(stats: SpecDecodeStats) -> tuple[int, ...]:
    """Drafts of ``stats`` that reached each position, as far as they can be known (module
    docstring): the engine's own counts, else those of a uniform K, else position 0."""
    if stats.reached_per_position:
        return stats.reached_per_position
    per_position = stats.accepted_per_position
    k, rest = divmod(stats.num_draft_tokens, stats.num_drafts)
    if rest:  # K changed within the sequence: only position 0 is surely reached
        return (stats.num_drafts,)
    # Past the last listed position nothing was accepted, so nothing reached further.
    bounds = (stats.num_drafts, *per_position)
    return tuple(bounds[i] if i < len(bounds) else 0 for i in range(k))
