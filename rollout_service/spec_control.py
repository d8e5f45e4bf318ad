"""The service's speculation control: the controller fed, its schedule applied, its state shown.

Runs in the rollout service process, in the serving event loop, beside the
:class:`~rollout_service.service.RolloutService` that calls :meth:`SpeculationControl.observe`
with every finished sequence. It owns a
:class:`~rollout_service.speculation.controller.SpeculationController` (the pure decision
core) and talks to the engine through
:class:`~rollout_service.engines.base.SpecScheduleEngine`: the schedule goes to vLLM's
engine-core process as a utility call, the engine's step costs come back through a stat
logger in this process. Nothing here waits on a request or makes one wait:

- ``observe`` is synchronous (the controller is arithmetic); a changed schedule is handed
  to one background task that applies the latest table and drops the ones overtaken on
  the way (coalesced), so a burst of decisions costs one call.
- Step costs: every clean decode step's sample (``engines/vllm/step_costs.py``) folds into
  the median of ``num_steps_per_cost_sample`` steps of its (K, B), which blends into the
  cost table.
- :meth:`SpeculationControl.start`, before serving: the controller's first schedule, then
  the calibration (``spec_calibration.calibrate``), then the schedule it leads to.
- :meth:`SpeculationControl.pin`: an operator's (or a benchmark's) schedule overrides the
  controller, which keeps deciding; unpinned, its schedule returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
import uuid
from collections.abc import Callable

from rollout_service.config import CalibrationSettings, SpeculationControlSettings
from rollout_service.engines.base import (
    EngineUnavailableError,
    GenerationResult,
    SamplingOptions,
    ScheduleRefusedError,
    SpecScheduleEngine,
)
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.protocol.speculation import (
    BucketStatus,
    ScheduleEntry,
    SpeculationControlStatus,
    StepCostPoint,
)
from rollout_service.spec_calibration import calibrate, synthetic_prompt
from rollout_service.speculation.acceptance import WeightVersions
from rollout_service.speculation.controller import (
    ControllerConfig,
    SpeculationController,
    k_at,
)
from rollout_service.speculation.cost import (
    CostConfig,
    StepCostMedians,
    StepCostSample,
    StepCostTable,
)
from rollout_service.speculation.decision import (
    CollapseConfig,
    HysteresisConfig,
    ProbeConfig,
    Reason,
)
from rollout_service.telemetry.speculation import CONTROLLER_OFF, PINNED, SpeculationMetrics
from rollout_service.weights.manager import WeightPushManager

logger = logging.getLogger(__name__)

REASONS = (*(r.value for r in Reason), PINNED, CONTROLLER_OFF)
"""Every reason a bucket can show (the ``reason`` label's values, the dashboard's list)."""


def controller_config(settings: SpeculationControlSettings, k_max: int) -> ControllerConfig:
    """The pure controller's settings from the service config's section."""
    return ControllerConfig(
        k_max=k_max, batch_size_buckets=tuple(settings.batch_size_buckets),
        hysteresis=HysteresisConfig(margin=settings.margin,
                                    num_confirmations=settings.num_confirmations),
        collapse=CollapseConfig(window_drafts=settings.collapse_window_drafts,
                                threshold_rate=settings.collapse_threshold_rate,
                                reprobe_after_s=settings.reprobe_after_s),
        probe=ProbeConfig(max_batch_size=settings.probe_max_batch_size,
                          num_drafts=settings.probe_num_drafts))


def show_fixed_k(metrics: SpeculationMetrics, buckets: list[int], k: int) -> None:
    """A service without the controller: vLLM's fixed ``k`` in every bucket."""
    metrics.set_buckets(dict.fromkeys(buckets, k), dict.fromkeys(buckets, CONTROLLER_OFF))
    metrics.set_collapsed(False)


class SpeculationControl:
    """The controller around one engine (see the module docstring).

    Args:
        engine: the engine, started with a run-time K schedule.
        settings: the service config's ``speculation_control``.
        versions: the weight versions served now (the controller keys acceptance on the
            drafter's): :func:`served_versions` of the service's push manager.
        metrics: the K in force and its reason, per bucket.
    """

    def __init__(self, engine: SpecScheduleEngine, settings: SpeculationControlSettings,
                 versions: Callable[[], WeightVersions], metrics: SpeculationMetrics) -> None:
        self._engine = engine
        self._settings = settings
        self._versions = versions
        self._metrics = metrics
        self._k_max = engine.info.num_speculative_tokens
        self._controller = SpeculationController(controller_config(settings, self._k_max),
                                                 StepCostTable(CostConfig()))
        self._medians = StepCostMedians(settings.num_steps_per_cost_sample)
        self._calibration_steps: list[StepCostSample] | None = None
        self._calibration_s: float | None = None
        self._pinned: dict[int, int] | None = None
        self._wanted: dict[int, int] = {}
        self._sent: dict[int, int] | None = None
        self._refused: dict[int, int] | None = None
        self._engine_schedule: dict[int, int] | None = None
        self._num_applied = self._num_refused = 0
        self._last_error: str | None = None
        self._lock = asyncio.Lock()
        self._applier: asyncio.Task[None] | None = None
        engine.subscribe_step_costs(self._on_step)

    async def start(self) -> None:
        """Before serving: the controller's first schedule, the calibration (if enabled),
        then the schedule the measured costs lead to.

        Raises:
            ScheduleRefusedError: the engine refused a schedule (it cannot change K).
            ValueError: a calibration that cannot fit the model's context.
        """
        async with self._lock:
            await self._apply(self._controller.schedule())
        if self._settings.calibration.enabled:
            started = time.monotonic()
            samples = await calibrate(self, self._settings.calibration)
            self._calibration_s = time.monotonic() - started
            logger.info("speculation control: calibrated %d step costs in %.1f s: %s",
                        len(samples), self._calibration_s,
                        ", ".join(f"c({s.k},{s.batch_size})={s.step_s * 1e3:.1f}ms"
                                  for s in samples))
        self._controller.refresh()
        self._schedule_changed()
        await self.settle()

    def observe(self, result: GenerationResult) -> GenerationResult:
        """Count one finished sequence and decide again; never raises (a sequence with
        inconsistent counts is logged and skipped).

        Returns:
            ``result`` with its verify cost ratio at the K its steps ran (:meth:`costed`).
        """
        stats = result.spec_decode if isinstance(result.spec_decode, SpecDecodeStats) else None
        batch_size = max(1, self._engine.batch_size)
        costed = self.costed(stats, batch_size)
        if costed is not stats:
            result = dataclasses.replace(result, spec_decode=costed)
        was_collapsed = self._controller.is_collapsed
        try:
            self._controller.observe(stats, self._versions(), batch_size=batch_size,
                                     now=time.monotonic())
        except ValueError:
            logger.exception("speculation control: observation skipped")
            return result
        if self._controller.is_collapsed != was_collapsed:
            self._log_collapse()
        self._schedule_changed()
        return result

    def _log_collapse(self) -> None:
        """K = 0 everywhere, or back: in the log beside ``rollout_speculation_collapsed``."""
        state = self._controller.state()
        if state.is_collapsed:
            logger.warning("speculation control: acceptance collapsed (pooled first-position "
                           "rate %.3f): K = 0 everywhere until a drafter push or a re-probe "
                           "(reprobe_after_s %s)", state.collapse_rate or 0.0,
                           self._settings.reprobe_after_s)
        else:
            logger.info("speculation control: collapse ended, probing the drafter again")

    def costed(self, stats: SpecDecodeStats | None, batch_size: int
               ) -> SpecDecodeStats | None:
        """``stats`` with the verify cost ratio of the K its steps ran, from the measured
        step costs at ``batch_size`` (the engine's when the sequence finished: vLLM reports
        no batch size per step); as they are (the engine's start-up figure at ``k_max``)
        without per-step counts or where the table does not cover those K.

        vLLM's start-up figure is measured at ``k_max`` only (model runner V2 has no dummy
        verify step at a smaller K), so a sequence the controller ran at K = 1 would be
        priced as a K = ``k_max`` step: its net speed-up understated, and the slow-down
        alert firing where K = 1 pays.
        """
        if stats is None:
            return None
        ratio = self._controller.verify_cost_ratio(stats.drafts_per_k, batch_size)
        return stats if ratio is None else dataclasses.replace(stats, verify_cost_ratio=ratio)

    async def pin(self, schedule: dict[int, int] | None) -> SpeculationControlStatus:
        """Run ``schedule`` whatever the controller decides; None returns to the
        controller's schedule.

        Raises:
            ScheduleRefusedError: the engine refused it (the schedule in force stays).
            EngineUnavailableError: the engine is dead.
        """
        async with self._lock:
            if schedule is not None:
                await self._apply(schedule)
            self._pinned = schedule
            self._schedule_changed()
        await self.settle()
        return self.status()

    async def settle(self) -> None:
        """Wait until the engine runs the wanted schedule (or refused it)."""
        while self._applier is not None and not self._applier.done():
            await asyncio.shield(self._applier)

    async def run_calibration_batch(self, k: int, batch_size: int,
                                    calibration: CalibrationSettings) -> float | None:
        """Run ``batch_size`` synthetic requests at ``k`` draft tokens and return the median
        step cost of the clean decode steps at the full batch (None: fewer than 2)."""
        info = self._engine.info
        max_tokens = min(calibration.num_steps * (k + 1) + 1,
                         info.max_model_len - calibration.prompt_tokens)
        if max_tokens < calibration.num_steps:
            raise ValueError(f"speculation_control.calibration.prompt_tokens: "
                             f"{calibration.prompt_tokens} prompt tokens leave no room for "
                             f"{calibration.num_steps} steps in {info.max_model_len} tokens")
        sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tag = uuid.uuid4().hex[:8]
        self._calibration_steps = []
        try:
            await asyncio.gather(*(self._engine.generate(
                synthetic_prompt(i, calibration.prompt_tokens, info.vocab_size), sampling,
                f"calibration-{tag}-{k}-{batch_size}-{i}") for i in range(batch_size)))
            steps = [s.step_s for s in self._calibration_steps
                     if (s.k, s.batch_size) == (k, batch_size)]
        finally:
            self._calibration_steps = None
        return statistics.median(steps) if len(steps) >= 2 else None

    async def apply_for_calibration(self, k: int) -> None:
        """Run ``k`` at every batch size (one bucket)."""
        async with self._lock:
            await self._apply({1: k})

    def record_cost(self, sample: StepCostSample) -> None:
        self._controller.record_cost(sample)

    @property
    def k_max(self) -> int:
        return self._k_max

    def status(self) -> SpeculationControlStatus:
        """The state for ``/health``."""
        state = self._controller.state()
        return SpeculationControlStatus(
            k_max=self._k_max,
            drafter_at_k0="skip" if self._engine.skips_drafter_at_k0 else "run",
            buckets=[BucketStatus(batch_size=b.batch_size, k=self._k_in_force(b.batch_size),
                                  reason=PINNED if self._pinned else b.reason.value,
                                  controller_k=b.k, tokens_per_s=list(b.tokens_per_s))
                     for b in state.buckets],
            is_collapsed=state.is_collapsed, is_probing=state.is_probing,
            collapse_rate=state.collapse_rate, acceptance=list(state.acceptance.rates),
            draft_version=state.acceptance.draft_version,
            num_observations=state.num_observations, last_batch_size=state.last_batch_size,
            pinned=_entries(self._pinned), engine_schedule=_entries(self._engine_schedule),
            cost_table=[StepCostPoint.model_validate(p, from_attributes=True)
                        for points in self._controller.cost_points().values() for p in points],
            calibration_s=self._calibration_s, num_applied=self._num_applied,
            num_refused=self._num_refused, last_error=self._last_error)

    # ---- internals -------------------------------------------------------------------

    def _on_step(self, step: StepCostSample) -> None:
        if self._calibration_steps is not None:
            self._calibration_steps.append(step)
            return
        sample = self._medians.add(step)
        if sample is not None:
            self._controller.record_cost(sample)

    def _k_in_force(self, batch_size: int) -> int:
        schedule = self._engine_schedule
        return k_at(schedule, batch_size) if schedule else self._k_max

    def _schedule_changed(self) -> None:
        """Hand the wanted schedule to the applier (if it changed) and show the reasons."""
        wanted = self._pinned or self._controller.schedule()
        if wanted != self._wanted:
            self._wanted = wanted
            if self._applier is None or self._applier.done():
                self._applier = asyncio.get_running_loop().create_task(self._apply_wanted())
        self._show()

    async def _apply_wanted(self) -> None:
        async with self._lock:
            while self._wanted not in (self._sent, self._refused):
                target = self._wanted  # what observe() wants meanwhile goes next round
                try:
                    await self._apply(target)
                except ScheduleRefusedError:
                    self._refused = target
                except EngineUnavailableError:
                    logger.exception("speculation control: the engine is gone")
                    return

    async def _apply(self, schedule: dict[int, int]) -> None:
        """Send ``schedule`` to the engine now (the caller holds the lock)."""
        try:
            self._engine_schedule = await self._engine.apply_spec_schedule(schedule)
        except ScheduleRefusedError as exc:
            self._num_refused += 1
            self._last_error = str(exc)
            self._metrics.count_apply("refused")
            logger.warning("speculation control: the engine refused %s: %s", schedule, exc)
            raise
        self._sent = dict(schedule)
        self._num_applied += 1
        self._metrics.count_apply("applied")
        self._show()

    def _show(self) -> None:
        state = self._controller.state()
        buckets = [b.batch_size for b in state.buckets]
        self._metrics.set_buckets(
            {b: self._k_in_force(b) for b in buckets},
            {b.batch_size: PINNED if self._pinned else b.reason.value for b in state.buckets})
        self._metrics.set_collapsed(state.is_collapsed)


def served_versions(weights: WeightPushManager) -> WeightVersions:
    """The versions ``weights`` serves now; -1 for a model never pushed. A sequence is
    counted under the versions served when it finishes (one that spans a push mixes both,
    once per push)."""
    return WeightVersions(
        main_version=-1 if weights.main_version is None else weights.main_version,
        draft_version=-1 if weights.draft_version is None else weights.draft_version)


def _entries(schedule: dict[int, int] | None) -> list[ScheduleEntry] | None:
    if schedule is None:
        return None
    return [ScheduleEntry(batch_size=b, k=k) for b, k in sorted(schedule.items())]
