"""The vLLM engine's run-time K schedule, for the speculation control: the methods of
:class:`~rollout_service.engines.base.SpecScheduleEngine`.

Runs in the service process, as a mixin of ``VLLMEngine`` (``engine.py``) started with
``EngineSpec.runtime_spec_schedule``: the schedule changes through the engine core's
``rollout_set_spec_schedule`` utility (``patches/spec_schedule.py``), and each step's cost
comes from the stat logger ``step_costs.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rollout_service.engines.base import (
    EngineInfo,
    EngineUnavailableError,
    ScheduleRefusedError,
    StepCostSink,
)
from rollout_service.engines.vllm.patches import spec_schedule as schedule_rpc
from rollout_service.engines.vllm.spec_schedule import lookup_to_schedule, schedule_to_ranges
from rollout_service.engines.vllm.step_costs import StepCostMonitor

logger = logging.getLogger(__name__)


class SpecScheduleMethods:
    """K per batch size changed at run time, and the measured step costs (a mixin: the
    engine holds ``_llm``, ``info`` and ``_step_costs``)."""

    _llm: AsyncLLM
    info: EngineInfo
    _step_costs: StepCostMonitor | None
    skips_drafter_at_k0: bool = False
    """Steps at K = 0 run nothing of the drafter (after :meth:`skip_drafter_at_k0`)."""

    async def apply_spec_schedule(self, schedule: Mapping[int, int]) -> dict[int, int]:
        """Run ``schedule`` (bucket upper edge -> K) from the engine core's next step on.

        Raises:
            ScheduleRefusedError: malformed, a K above ``num_speculative_tokens``, or an
                engine that cannot change K (started without a schedule, or the engine-core
                patch is not installed); the previous schedule stays in force.
            EngineUnavailableError: the engine is dead.
        """
        try:
            ranges = schedule_to_ranges(schedule)
        except ValueError as exc:
            raise ScheduleRefusedError(str(exc)) from exc
        lookup = await self._call_core(schedule_rpc.SET_METHOD, ranges)
        return lookup_to_schedule(lookup)

    async def check_spec_schedule(self) -> dict[str, Any]:
        """The engine core's schedule facts (``rollout_get_spec_schedule``), after checking
        that its lookup runs every K in ``0..num_speculative_tokens``.

        Raises:
            ScheduleRefusedError: no lookup, or a K missing from it.
        """
        facts = await self._call_core(schedule_rpc.GET_METHOD)
        lookup, k_max = facts["lookup"], self.info.num_speculative_tokens
        missing = set(range(k_max + 1)) - set(lookup or ())
        if lookup is None or missing:
            raise ScheduleRefusedError(f"the engine's start-up K schedule {lookup} lacks K "
                                       f"{sorted(missing)}: those would run without graphs")
        logger.info("run-time K schedule: model runner %s, K 0..%d, max_num_seqs %d%s",
                    "V2" if facts["use_v2_model_runner"] else "V1", k_max,
                    facts["max_num_seqs"], "" if facts["use_v2_model_runner"] else
                    " (V1 follows the scheduler's K every step; on CPU every K runs eager)")
        return facts

    async def skip_drafter_at_k0(self, *, required: bool = True) -> bool:
        """Every worker's speculator skips the drafter on steps at K = 0
        (``drafter_at_k0.py``); ``required=False`` (``auto``): a worker's refusal is
        logged, and the drafter keeps running at K = 0.

        Returns:
            Whether steps at K = 0 skip the drafter now (:attr:`skips_drafter_at_k0`).

        Raises:
            ValueError: ``required``, naming ``speculation_control.drafter_at_k0`` and why
                this engine cannot (a CPU engine, another vLLM, another speculator).
        """
        try:
            names = await self._llm.collective_rpc("rollout_skip_drafter_at_k0")
        except Exception as exc:
            if required:
                raise ValueError(f"speculation_control.drafter_at_k0: 'skip' is not "
                                 f"possible on this engine: {exc}") from exc
            logger.warning("speculation control: steps at K = 0 run the drafter "
                           "(drafter_at_k0: auto; a worker refused to skip it): %s", exc)
            return False
        self.skips_drafter_at_k0 = True
        logger.info("speculation control: steps at K = 0 skip the drafter (%s)", names[0])
        return True

    async def _call_core(self, method: str, *args: Any) -> Any:
        try:
            return await self._llm.engine_core.call_utility_async(method, *args)
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"vLLM engine died: {exc}") from exc
        except Exception as exc:
            # vLLM sends the engine core's exception back as text; the core serves on.
            unsupported = " (is the rollout_weight_transfer plugin loaded?)" \
                if "has no attribute" in str(exc) else ""
            raise ScheduleRefusedError(f"{exc}{unsupported}") from exc

    def subscribe_step_costs(self, sink: StepCostSink) -> None:
        if self._step_costs is None:
            raise RuntimeError("the engine was started without step-cost measurement "
                               "(EngineSpec.runtime_spec_schedule)")
        self._step_costs.subscribe(sink)

    @property
    def batch_size(self) -> int:
        return 0 if self._step_costs is None else self._step_costs.batch_size
