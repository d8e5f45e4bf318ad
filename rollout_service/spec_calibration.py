"""The speculation control's calibration: the step cost c(K, B) measured on the engine
before serving, for every K and a geometric grid of batch sizes.

The live costs (``engines/vllm/step_costs.py``) only cover the (K, B) the traffic runs;
the calibration gives the controller a cost for every K at every batch size it may meet,
so its first decisions compare measured costs rather than a guess. It drives the engine
through :class:`Calibrated` (``spec_control.SpeculationControl`` in the service).
"""

from __future__ import annotations

import logging
from typing import Protocol

from rollout_service.config import CalibrationSettings
from rollout_service.speculation.cost import StepCostSample

logger = logging.getLogger(__name__)


class Calibrated(Protocol):
    """What the calibration drives: a controlled engine's schedule and its step costs."""

    @property
    def k_max(self) -> int: ...

    async def apply_for_calibration(self, k: int) -> None:
        """Run ``k`` at every batch size."""

    async def run_calibration_batch(self, k: int, batch_size: int,
                                    calibration: CalibrationSettings) -> float | None:
        """The median step cost of ``batch_size`` synthetic requests at ``k`` (None: fewer
        than 2 clean steps)."""

    def record_cost(self, sample: StepCostSample) -> None:
        """Fold a measured cost into the controller's table."""


def calibration_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch_size``, which is included even off the powers of 2
    (the cost table interpolates in ``log B`` between them)."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes if sizes[-1] == max_batch_size else [*sizes, max_batch_size])


def synthetic_prompt(index: int, num_tokens: int, vocab_size: int) -> list[int]:
    """A deterministic prompt, distinct per ``index`` (no shared prefix to cache)."""
    return [(7919 * (index + 1) + 104729 * j) % (vocab_size - 1) + 1 for j in range(num_tokens)]


async def calibrate(control: Calibrated, calibration: CalibrationSettings
                    ) -> list[StepCostSample]:
    """Measure c(K, B) for K in ``0..k_max`` and B on the geometric grid up to
    ``calibration.max_batch_size``, record each point into the controller's table and
    return them.

    Each point runs B synthetic greedy requests (``ignore_eos``) at one K for every batch
    size (every K in turn at one B, then the next B), long enough for ``num_steps`` decode
    steps at the full batch, and takes the median of the clean decode steps at (K, B). A
    first single request warms the engine up and is not counted. A point with fewer than
    2 clean steps (B above the engine's ``max_num_seqs``, or a token budget that splits
    the batch) is skipped with a warning: the table then interpolates around it, or
    reports no cost data beyond.
    """
    sizes = calibration_batch_sizes(calibration.max_batch_size)
    samples = []
    await control.apply_for_calibration(0)
    await control.run_calibration_batch(0, 1, calibration)  # warm-up
    for batch_size in sizes:
        # Every K back to back at one B: the decision reads ratios at equal B, and a
        # machine whose load drifts during the calibration biases them least this way.
        for k in range(control.k_max + 1):
            await control.apply_for_calibration(k)
            step_s = await control.run_calibration_batch(k, batch_size, calibration)
            if step_s is None:
                logger.warning("speculation control: no clean decode steps at K=%d, B=%d; "
                               "point skipped", k, batch_size)
                continue
            sample = StepCostSample(k=k, batch_size=batch_size, step_s=step_s)
            control.record_cost(sample)
            samples.append(sample)
    return samples
